"""prompt_logprobs: against transformers' logits at every prompt position, across chunked
prefill, prefix-cache hits (not taken) and preemption by recompute, within the planned peak."""
import pytest
import torch

from mempath import LLM, SamplingParams
from mempath.engine.prompt_logprobs import _slice_logprobs
from mempath.memory.formulas import prompt_logprobs_peak_bytes, sampler_peak_bytes
from mempath.tools.diagnose.meters import TensorBytesTracker

PROMPT = list(range(10, 47))  # 37 tokens: three blocks of 16


def reference(hf, prompt, n):
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    entries, ranks = [None], [None]
    for position, token in enumerate(prompt[1:]):
        row = logprobs[position]
        entry = {token: row[token].item()}
        for t in row.topk(n).indices.tolist():
            entry.setdefault(t, row[t].item())
        entries.append(entry)
        ranks.append(int((row > row[token]).sum()) + 1)
    return entries, ranks


def assert_matches(output, expected):
    entries, ranks = expected
    assert len(output.prompt_logprobs) == len(entries)
    assert output.prompt_logprobs[0] is None and output.prompt_logprob_ranks[0] is None
    for got, want in zip(output.prompt_logprobs[1:], entries[1:]):
        assert list(got) == list(want)  # the actual token first, then the top-n in order
        assert got == pytest.approx(want, abs=1e-4)
    assert output.prompt_logprob_ranks == ranks


@pytest.mark.parametrize("chunk", [8192, 8, 5])
def test_prompt_logprobs_match_transformers_across_chunks(model_factory, chunk):
    path, hf = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, max_num_batched_tokens=chunk,
              max_num_seqs=4, block_size=8)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=4)
    outputs = llm.generate([PROMPT, PROMPT[:9]], params, use_tqdm=False)
    assert_matches(outputs[0], reference(hf, PROMPT, 4))
    assert_matches(outputs[1], reference(hf, PROMPT[:9], 4))


def test_prompt_logprobs_zero_gives_the_actual_token_only(model_factory):
    path, hf = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False)
    out = llm.generate(PROMPT[:6], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in PROMPT[1:6]]


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(model_factory):
    path, hf = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False)
    first = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert plain.num_cached_tokens == 32  # the prefix cache serves others
    asking = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2),
                          use_tqdm=False)[0]
    assert asking.num_cached_tokens == 0 and asking.token_ids == first.token_ids
    assert_matches(asking, reference(hf, PROMPT, 2))
    assert llm.stats()["kv_blocks_used"] == 0


def test_preemption_by_recompute_records_each_position_once(model_factory):
    path, hf = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, block_size=8, max_num_batched_tokens=8,
              num_gpu_blocks_override=14)
    prompts = [PROMPT, [3] * 20 + [8, 9], [100 + i % 50 for i in range(40)]]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for prompt, output in zip(prompts, outputs):
        assert_matches(output, reference(hf, prompt, 1))


def test_slice_peak_is_within_the_plan():
    rows, vocab = 16, 40_000
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (rows,))
    tracker = TensorBytesTracker()
    with tracker:
        _slice_logprobs(logits, target, 20)
    assert tracker.peak <= prompt_logprobs_peak_bytes(vocab, rows, 2)
    assert prompt_logprobs_peak_bytes(vocab, rows, 2) <= sampler_peak_bytes(vocab, rows)
