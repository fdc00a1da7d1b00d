"""Retrieval through the fp8 KV cache: a needle in a long context, answered by a model built for
it (benchmarks/needle_model.py), with the cache in bf16 and in fp8 (#20). The GPU figures at
4k-32k tokens are benchmarks/bench_fp8_kv.py's."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from needle_model import NeedleSpec, accuracy, build_needle_model, needle_prompts  # noqa: E402

from mempath import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def needle_dir(tmp_path_factory):
    """needle_dir(sharpness) -> the needle model's directory, built once per sharpness."""
    built = {}

    def build(sharpness):
        if sharpness not in built:
            built[sharpness] = str(build_needle_model(tmp_path_factory.mktemp(f"needle-{sharpness}"),
                                                      NeedleSpec(sharpness=sharpness)))
        return built[sharpness]
    return build


def answers(path, prompts, kv, dtype="bfloat16", device="cpu"):
    llm = LLM(path, device=device, dtype=dtype, kv_cache_dtype=kv, max_model_len=max(len(p) for p, _ in prompts) + 8,
              enable_prefix_caching=False, show_progress=False,
              **({"gpu_memory_utilization": 0.3} if device == "cuda" else {}))
    outs = llm.generate([ids for ids, _ in prompts], GREEDY, use_tqdm=False)
    assert llm.stats()["kv_blocks_used"] == 0
    return [o.token_ids[0] for o in outs]


def test_needle_model_answers_as_transformers_does(needle_dir):
    """The engine runs the hand-built model as transformers does, and the model does find the needle."""
    from transformers import AutoModelForCausalLM
    spec = NeedleSpec(sharpness=10.0)
    path = needle_dir(10.0)
    prompts = needle_prompts(spec, 600, 6, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [int(hf(torch.tensor([ids])).logits[0, -1].argmax()) for ids, _ in prompts]
    assert expected == [answer for _, answer in prompts]
    assert answers(path, prompts, "auto", dtype="float32") == expected


def test_fp8_kv_retrieves_within_two_points_of_bf16(needle_dir):
    """Where bf16 finds nearly every needle but not all (sharpness 4.5 at 1k tokens), so a coarser
    cache shows: e5m2 (two mantissa bits) loses 5 points here, e4m3 one."""
    spec = NeedleSpec(sharpness=4.5)
    prompts = needle_prompts(spec, 1024, 100, seed=1)
    bf16 = accuracy(answers(needle_dir(4.5), prompts, "auto"), prompts)
    fp8 = accuracy(answers(needle_dir(4.5), prompts, "fp8"), prompts)
    assert 0.95 <= bf16 < 1.0
    assert abs(fp8 - bf16) <= 0.02


def test_where_retrieval_is_hard_fp8_kv_answers_as_bf16_does(needle_dir):
    """At a sharpness where the needle often loses to a distractor, fp8 must still give the same
    answer as bf16 on nearly every prompt (e5m2 agrees on 74 of these 80, e4m3 on 79)."""
    spec = NeedleSpec(sharpness=4.0)
    prompts = needle_prompts(spec, 1024, 80, seed=2)
    bf16 = answers(needle_dir(4.0), prompts, "auto")
    fp8 = answers(needle_dir(4.0), prompts, "fp8")
    assert 0.5 < accuracy(bf16, prompts) < 0.9
    assert abs(accuracy(fp8, prompts) - accuracy(bf16, prompts)) <= 0.05
    assert sum(a == b for a, b in zip(bf16, fp8)) >= 0.95 * len(prompts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton fp8 KV kernels at 8k-32k need CUDA")
@pytest.mark.parametrize("sharpness, length", [(10.0, 8192), (10.0, 32768), (8.0, 16384)])
def test_gpu_fp8_kv_retrieves_as_bf16_does(needle_dir, sharpness, length):
    """At sharpness 10 both caches find every needle to 32k; at 8 and 16k bf16 misses a few
    (BENCHMARKS.md: 97% of 200), so the answers must agree where they can differ. At most one of
    the 48 answers may differ in accuracy (2.1 points)."""
    spec = NeedleSpec(sharpness=sharpness)
    prompts = needle_prompts(spec, length, 48, seed=length)
    bf16 = answers(needle_dir(sharpness), prompts, "auto", device="cuda")
    fp8 = answers(needle_dir(sharpness), prompts, "fp8", device="cuda")
    assert accuracy(bf16, prompts) >= 0.9
    assert abs(accuracy(fp8, prompts) - accuracy(bf16, prompts)) <= 1 / 48 + 1e-9
    assert sum(a == b for a, b in zip(bf16, fp8)) >= len(prompts) - 2
