"""The engine on CUDA: Triton kernels and CUDA graphs against the PyTorch path and
transformers, and no device allocation in the steady state. Skipped without CUDA."""
import pytest
import torch

from mempath import LLM, SamplingParams
from mempath.kernels import common as kernels_common
from tests.conftest import ARCHS, make_model, release_cuda

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[1, 5, 9, 33, 7], list(range(10, 47)), [3] * 20 + [8, 9], [100 + i % 50 for i in range(70)]]


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_float32_matches_cpu_path(arch, tmp_path):
    make_model(tmp_path, arch)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    cpu = LLM(str(tmp_path), dtype="float32", device="cpu", show_progress=False)
    ref = [o.token_ids for o in cpu.generate(PROMPTS, params, use_tqdm=False)]
    for eager in (True, False):
        gpu = LLM(str(tmp_path), dtype="float32", device="cuda", show_progress=False, enforce_eager=eager,
                  max_num_seqs=8, max_num_batched_tokens=64)
        assert bool(gpu.engine.runner.graphs) == (not eager)
        assert gpu.engine.runner.use_triton
        out = [o.token_ids for o in gpu.generate(PROMPTS, params, use_tqdm=False)]
        assert out == ref, f"eager={eager}"
        del gpu
        torch.cuda.empty_cache()


def test_longest_first_decode_order_changes_no_token(tmp_path, monkeypatch):
    """Steps ordered longest first (the threshold lowered so a small batch reaches it), eager and replayed
    from graphs captured with the order, padded rows included, give the unordered engine's float32 tokens
    bit for bit. (Against the CPU path this many random-weight sequences meet near-ties: the order's claim
    is that it changes nothing, and the unordered GPU path is held to the CPU by the test above.)"""
    from mempath.engine import runner as runner_module
    make_model(tmp_path, "llama")
    prompts = [[(7 * i + j) % 90 + 3 for j in range(3 + 11 * i % 61)] for i in range(13)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for eager in (True, False):
        outs = {}
        for min_seqs in (8, 10 ** 6):
            monkeypatch.setattr(runner_module, "DECODE_ORDER_MIN_SEQS", min_seqs)
            gpu = LLM(str(tmp_path), dtype="float32", device="cuda", show_progress=False, enforce_eager=eager,
                      max_num_seqs=16)
            runner = gpu.engine.runner
            assert runner.decode_order_on(16) == (min_seqs == 8) and not runner.decode_order_on(4)
            assert bool(runner.graphs) == (not eager)
            outs[min_seqs] = [o.token_ids for o in gpu.generate(prompts, params, use_tqdm=False)]
            # The runner holds the KV cache (most of the device): a name left bound to it starves the next engine.
            del gpu, runner
            release_cuda()
        assert outs[8] == outs[10 ** 6], f"eager={eager}"


@pytest.mark.skipif(not torch.cuda.is_available() or not kernels_common.use_pdl(torch.device("cuda")),
                    reason="programmatic dependent launch needs Hopper or later and Triton >= 3.4")
def test_programmatic_dependent_launch_changes_no_token(tmp_path, monkeypatch):
    """Kernels that start before their predecessor ends must still read its finished output:
    the same bf16 tokens, graphs and eager, with and without programmatic dependent launch
    (tests/test_pdl.py checks the rule in every kernel's source and that the overlap is real)."""
    make_model(tmp_path, "llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS * 4  # 16 sequences: several decode splits and batch buckets
    outs = {}
    for pdl in (True, False):
        monkeypatch.setattr(kernels_common, "USE_PDL", pdl)
        assert kernels_common.use_pdl(torch.device("cuda")) == pdl
        for eager in (True, False):
            llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", show_progress=False, enforce_eager=eager,
                      max_num_seqs=16, max_num_batched_tokens=128)
            outs[pdl, eager] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            del llm
            torch.cuda.empty_cache()
    assert outs[True, False] == outs[False, False] and outs[True, True] == outs[False, True]


def test_bf16_matches_transformers_first_32_tokens():
    from transformers import AutoModelForCausalLM
    from mempath.assets import default_model_path
    try:
        path = default_model_path()
    except ValueError:
        pytest.skip("the shipped model is not present")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    llm = LLM(path, dtype="bfloat16", device="cuda", show_progress=False, max_num_seqs=8)
    prompts = ["def read_config(path):", "import os\nimport sys\n", "class Scheduler:\n    def",
               "The module provides"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    mismatches = []
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                          do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
        if out.token_ids != ref:
            first = next(i for i, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b)
            with torch.no_grad():
                logits = hf(torch.tensor([ids[0].tolist() + ref[:first]], device="cuda")).logits[0, -1].float()
            gap = (logits[ref[first]] - logits[out.token_ids[first]]).item()
            mismatches.append((prompt, first, gap))
    print("bf16 divergences (prompt, first differing token, HF logit gap):", mismatches)
    # A divergence is only acceptable where transformers itself sees a near tie.
    assert all(gap < 0.1 for _, _, gap in mismatches), mismatches


def test_no_device_allocation_in_steady_state(tmp_path):
    make_model(tmp_path, "qwen3", hidden_size=128, num_hidden_layers=2)
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", show_progress=False, max_num_seqs=16,
              max_num_batched_tokens=256, num_gpu_blocks_override=256)
    engine = llm.engine
    rng = torch.Generator().manual_seed(0)
    counter = [0]

    def top_up():
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < 12:
            n = int(torch.randint(8, 200, (1,), generator=rng))
            prompt = torch.randint(3, 300, (n,), generator=rng).tolist()
            params = SamplingParams(max_tokens=int(torch.randint(4, 64, (1,), generator=rng)),
                                    temperature=0.8, top_p=0.9, top_k=20, seed=counter[0], ignore_eos=True)
            engine.add_request(prompt, params, f"r{counter[0]}")
            counter[0] += 1

    for _ in range(300):  # warm-up: every shape class and the allocator's pools
        top_up()
        engine.step()
    before = torch.cuda.memory_stats()["num_device_alloc"]
    for _ in range(1000):
        top_up()
        engine.step()
    after = torch.cuda.memory_stats()["num_device_alloc"]
    print(f"num_device_alloc before {before}, after 1000 steps {after}; requests {counter[0]}")
    assert after == before


def test_the_allocator_cap_goes_with_the_last_engine(tmp_path):
    """An engine caps PyTorch's allocator for its budget; once it is closed or collected, code
    that runs after it in the process (transformers beside a benchmark) gets the device's whole
    memory back, as it had it before."""
    import gc
    make_model(tmp_path, "llama", hidden_size=64, num_hidden_layers=1)
    before = torch.cuda.get_per_process_memory_fraction(0)
    options = dict(dtype="bfloat16", device="cuda", show_progress=False, enforce_eager=True)
    first = LLM(str(tmp_path), gpu_memory_utilization=0.2, **options)
    second = LLM(str(tmp_path), gpu_memory_utilization=0.5, **options)  # its budget counts the first's use
    assert torch.cuda.get_per_process_memory_fraction(0) < before
    second.engine.close()
    assert torch.cuda.get_per_process_memory_fraction(0) < before  # the first engine still holds it
    assert first.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids
    del first, second
    gc.collect()
    assert torch.cuda.get_per_process_memory_fraction(0) == before
