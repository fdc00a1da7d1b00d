"""A mixture-of-experts model with an expert cache beside a dense one on one CUDA device: the shared page
pool, the cache's slots and their cut decode graphs, each model's greedy tokens those it gives alone."""
import pytest
import torch

from mempath import LLM
from mempath.model.moe import expert_cache_stats
from tests.conftest import release_cuda
from tests.test_multi_model import run_all
from tests.test_multi_model_gpu import GREEDY, PROMPTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def dense_and_moe(model_factory):
    """A dense Llama and a Qwen3-MoE of 8 experts a layer (2 routed), as tests/test_multi_model_moe.py's."""
    return model_factory("llama")[0], model_factory("qwen3_moe")[0]


def test_gpu_moe_with_a_cache_beside_dense_answers_as_each_alone_with_graphs(dense_and_moe):
    llama, moe = dense_and_moe
    llm = LLM([f"dense={llama}", f"moe={moe}"], moe_expert_cache_size=2, dtype="float32", show_progress=False,
              gpu_memory_utilization=0.3)
    engines = llm.engine.engines
    sizes = {name: e.config.block_size for name, e in engines.items()}
    requests = [(model, prompt) for prompt in PROMPTS for model in ("dense", "moe")]
    done = run_all(llm.engine, requests, GREEDY)
    assert all(e.runner.graphs for e in engines.values())
    cache = expert_cache_stats(engines["moe"].model)
    assert cache["num_slots"] == 2 and cache["misses"] > 0
    assert expert_cache_stats(engines["dense"].model) == {"enabled": False}
    assert llm.engine.pool.pages.num_used == 0
    del llm, engines
    release_cuda()
    for model, path, options in (("dense", llama, {}), ("moe", moe, {"moe_expert_cache_size": 2})):
        alone = LLM(path, dtype="float32", show_progress=False, gpu_memory_utilization=0.3,
                    block_size=sizes[model], **options)
        expected = [o.outputs[0].token_ids for o in alone.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert [done[f"r{i}"] for i, (m, _) in enumerate(requests) if m == model] == expected, model
        del alone
        release_cuda()
