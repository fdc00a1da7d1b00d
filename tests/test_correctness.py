"""Greedy mempath output is token-identical to transformers generate() on the CPU."""
import copy

import pytest
import torch

from mempath import LLM, SamplingParams
from tests.conftest import ARCHS, hf_greedy

PROMPTS = [
    [1, 5, 9, 33, 7],
    list(range(10, 47)),  # crosses two block boundaries at block size 16
    [3] * 20 + [8, 9],
    [100 + i % 50 for i in range(70)],
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def references(model_factory):
    refs = {}
    for arch in ARCHS:
        _, hf = model_factory(arch)
        refs[arch] = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    return refs


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, model_factory, references):
    path, _ = model_factory(arch)
    llm = LLM(path, dtype="float32", show_progress=False)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for output, ref in zip(outputs, references[arch]):
        assert output.token_ids == ref
        assert output.finish_reason == "length"


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_preemption_match(arch, model_factory, references):
    path, _ = model_factory(arch)
    # 8-token chunks, and a pool of 12 blocks of 8 tokens: the 4 requests need up to
    # 13 blocks each at the end, so the scheduler must preempt and resume.
    llm = LLM(path, dtype="float32", show_progress=False, block_size=8, max_num_batched_tokens=8,
              num_gpu_blocks_override=14)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == references[arch]
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_close_to_transformers(dtype, model_factory):
    path, hf = model_factory("llama")
    hf = copy.deepcopy(hf).to(dtype)  # the fixture's float32 model is shared
    llm = LLM(path, dtype=str(dtype).replace("torch.", ""), show_progress=False)
    prompt = PROMPTS[1]
    out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=5), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
    for token_id, logprob in out.logprobs[0].items():
        assert abs(logprob - ref[token_id].item()) < 0.05
    assert out.token_ids[0] == int(ref.argmax())
