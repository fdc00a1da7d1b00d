"""Several models on one CUDA device: the shared page pool under Triton kernels and CUDA graphs."""
import pytest
import torch

from mempath import LLM, SamplingParams
from tests.conftest import release_cuda
from tests.test_multi_model import run_all, together

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 9, 101, 7, 64], list(range(20, 90)), [8] * 40, [200, 3, 3, 45, 12]]


def test_greedy_together_equals_alone_with_graphs(two_models):
    """Each model alone at the block size it gets in the pool (the kernels' tiles follow the block size)."""
    llama, qwen = two_models
    llm = together(two_models, gpu_memory_utilization=0.3)
    sizes = {name: e.config.block_size for name, e in llm.engines.items()}
    requests = [(model, prompt) for prompt in PROMPTS for model in ("a", "b")]
    done = run_all(llm.engine, requests, GREEDY)
    assert all(e.runner.graphs for e in llm.engines.values())
    assert llm.engine.pool.pages.num_used == 0
    del llm
    release_cuda()
    for model, path in (("a", llama), ("b", qwen)):
        alone = LLM(path, dtype="float32", show_progress=False, gpu_memory_utilization=0.3, block_size=sizes[model])
        expected = [o.outputs[0].token_ids for o in alone.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert [done[f"r{i}"] for i, (m, _) in enumerate(requests) if m == model] == expected
        del alone
        release_cuda()


def test_no_device_allocation_while_the_split_moves(two_models):
    llm = together(two_models, gpu_memory_utilization=0.3, num_gpu_blocks_override=64)
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)

    def burst(model: str, tag: str) -> int:
        peak = 0
        for i in range(24):
            prompt = torch.randint(3, 300, (int(torch.randint(20, 120, (1,), generator=gen)),), generator=gen).tolist()
            engine.add_request(prompt, SamplingParams(max_tokens=32, temperature=0.8, seed=i, ignore_eos=True),
                               f"{tag}-{i}", model=model)
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.pool.split()[model])
        return peak

    burst("a", "warm-a")
    burst("b", "warm-b")
    before = torch.cuda.memory_stats()["num_device_alloc"]
    peaks = [burst(model, f"{model}{k}") for k, model in enumerate("abab")]
    after = torch.cuda.memory_stats()["num_device_alloc"]
    print(f"num_device_alloc before {before}, after {after}; peaks {peaks} of 64 pages")
    assert after == before
    assert all(p > 32 for p in peaks)
    assert engine.pool.pages.num_used == 0
