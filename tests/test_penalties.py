"""Penalties, logit_bias, min_tokens and bad_words: against transformers' logits processors
on the same logits, batched, within the sampler's planned peak, and end to end against
transformers ``generate`` with the same processors (async scheduling on and off)."""
import pytest
import torch
from transformers import (LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor)

from mempath import LLM, SamplingParams
from mempath.engine.penalties import PENALTY_BYTES_PER_ENTRY, build_adjustments
from mempath.engine.request import Request
from mempath.engine.sampler import Sampler
from mempath.memory.formulas import sampler_peak_bytes
from mempath.tools.diagnose.meters import TensorBytesTracker

CPU = torch.device("cpu")


class PresenceFrequency(LogitsProcessor):
    """OpenAI's formula as vLLM applies it, written directly in PyTorch: transformers has no
    processor for presence or frequency penalties. Counts are over the generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        generated = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class Bias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]):
        self.bias = bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for token_id, value in self.bias.items():
            scores[:, token_id] += value
        return scores


def request_with(prompt, generated, **params) -> Request:
    request = Request("r", None, prompt, SamplingParams(**params))
    request.token_ids += generated
    return request


def adjust_rows(requests, logits, tokens_on_device=False):
    """Apply one step's adjustments as the runner does; the last tokens come from token_ids."""
    last = torch.tensor([r.token_ids[-1] for r in requests])
    if tokens_on_device:  # the newest token is not on the host yet
        for r in requests:
            r.token_ids.pop()
    adjust = build_adjustments(requests, tokens_on_device, lambda: last, logits.shape[1], CPU)
    scores = logits.clone()
    if adjust is not None:
        adjust.apply(scores)
    return scores


@pytest.mark.parametrize("tokens_on_device", [False, True])
def test_penalties_match_transformers_processors_batched(tokens_on_device):
    torch.manual_seed(0)
    vocab = 300
    logits = torch.randn(20, vocab) * 3
    requests, expected = [], []
    for row in range(20):
        prompt = torch.randint(0, vocab, (5 + row,)).tolist()
        generated = torch.randint(0, vocab, (row % 7 + 1,)).tolist() + [prompt[0], prompt[0]]
        if row % 4 == 3:  # a row without penalties in the same batch is left alone
            params = {}
        else:
            params = dict(repetition_penalty=[1.0, 1.3, 0.7][row % 3], presence_penalty=0.5 * (row % 3 - 1),
                          frequency_penalty=[0.3, -0.2, 1.5][row % 3])
        requests.append(request_with(prompt, generated, **params))
        ids = torch.tensor([prompt + generated])
        ref = logits[row:row + 1].clone()
        if params:
            ref = RepetitionPenaltyLogitsProcessor(params["repetition_penalty"])(ids, ref)
            ref = PresenceFrequency(len(prompt), params["presence_penalty"], params["frequency_penalty"])(ids, ref)
        expected.append(ref)
    got = adjust_rows(requests, logits, tokens_on_device)
    # Repetition is exact; frequency and presence are one fused multiply-add against two ops.
    torch.testing.assert_close(got, torch.cat(expected), rtol=0, atol=1e-5)
    assert torch.equal(got[3::4], logits[3::4])


def test_repetition_alone_is_bit_identical_to_transformers():
    torch.manual_seed(1)
    logits = torch.randn(3, 100) * 4
    prompt, generated = [5, 6, 7, 5], [9, 9, 50]
    got = adjust_rows([request_with(prompt, generated, repetition_penalty=1.7)], logits[:1])
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + generated]), logits[:1].clone())
    assert torch.equal(got, ref)


def test_min_tokens_matches_transformers_and_masks_stop_ids():
    logits = torch.randn(3, 50)
    rows = []
    for generated in ([], [4, 4], [4, 4, 4]):
        request = request_with([1, 2, 3], generated, min_tokens=3, max_tokens=10, stop_token_ids=[7])
        request.min_tokens_stop_ids = [2, 7]
        rows.append(request)
    got = adjust_rows(rows, logits)
    for row, request in enumerate(rows):
        ids = torch.tensor([request.token_ids])
        ref = MinNewTokensLengthLogitsProcessor(3, 3, [2, 7])(ids, logits[row:row + 1].clone())
        assert torch.equal(got[row:row + 1], ref)
    assert torch.isinf(got[0, [2, 7]]).all() and not torch.isinf(got[2]).any()


def test_logit_bias_and_bad_words_prefix_matching():
    logits = torch.zeros(3, 40)
    bias = request_with([1], [3], logit_bias={5: 2.5, 6: -100})
    matched = request_with([10, 11], [20, 21], bad_words=["x"])
    matched.params.bad_words_token_ids = [[20, 21, 22], [30]]  # prefix 20 21 ends the output: ban 22
    prompt_only = request_with([20, 21], [9], bad_words=["x"])
    prompt_only.params.bad_words_token_ids = [[9, 22], [21, 9, 23]]  # the prompt is not matched
    for r in (bias, matched, prompt_only):
        r.adjusts_logits = True
    got = adjust_rows([bias, matched, prompt_only], logits)
    assert got[0, 5] == 2.5 and got[0, 6] == -100 and (got[0, :5] == 0).all()
    assert torch.isinf(got[1, [22, 30]]).all() and torch.isfinite(got[1]).sum() == 38
    assert torch.isinf(got[2, 22]) and torch.isfinite(got[2, 23])


def test_rows_without_parameters_build_nothing():
    requests = [request_with([1, 2], [3]) for _ in range(4)]
    assert build_adjustments(requests, False, lambda: pytest.fail("no history needed"), 10, CPU) is None


@pytest.mark.parametrize("rows,vocab", [(64, 8_000), (7, 30_000), (1, 50_000)])
def test_penalty_peak_within_the_plan(rows, vocab):
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16)
    requests = [request_with(list(range(300)), list(range(200)), repetition_penalty=1.2,
                             presence_penalty=0.1, frequency_penalty=0.1, temperature=0) for _ in range(rows)]
    last = torch.tensor([r.token_ids[-1] for r in requests])
    adjust = build_adjustments(requests, False, lambda: last, vocab, CPU)
    tracker = TensorBytesTracker()
    with tracker:
        Sampler(CPU, 0)(logits, [r.params for r in requests], [None] * rows, adjust)
    assert tracker.peak <= sampler_peak_bytes(vocab, rows)
    assert tracker.peak <= vocab * (4 * rows + PENALTY_BYTES_PER_ENTRY * min(rows, 16)) * 1.03


# ----------------------------------------------------------------- end to end
PROMPTS = [[1, 5, 9, 33, 7], list(range(10, 47)), [3] * 20 + [8, 9]]


def hf_generate(model, prompt, max_new, processors, min_new=None):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, pad_token_id=0,
                         eos_token_id=model.config.eos_token_id if min_new is not None else None,
                         logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_with_penalties_matches_transformers_generate(model_factory, async_scheduling):
    path, hf = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, async_scheduling=async_scheduling)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.5,
                             presence_penalty=0.4, frequency_penalty=0.6),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),  # a plain row beside them
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=0.8,
                             frequency_penalty=-0.5)]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, p, output in zip(PROMPTS, params, outputs):
        processors = [RepetitionPenaltyLogitsProcessor(p.repetition_penalty),
                      PresenceFrequency(len(prompt), p.presence_penalty, p.frequency_penalty)]
        assert output.token_ids == hf_generate(hf, prompt, 24, processors)
    if async_scheduling:
        assert llm.stats()["steps_launched_ahead"] > 0  # the penalties ran on in-flight tokens


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_min_tokens_and_logit_bias_match_transformers(model_factory, async_scheduling):
    path, hf = model_factory("llama")  # eos_token_id 2
    llm = LLM(path, dtype="float32", show_progress=False, async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=20, temperature=0, min_tokens=6, logit_bias={2: 30.0, 40: 5.0})
    out = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    ref = hf_generate(hf, PROMPTS[1], 20, [MinNewTokensLengthLogitsProcessor(len(PROMPTS[1]), 6, 2),
                                           Bias({2: 30.0, 40: 5.0})], min_new=6)
    assert out.token_ids == ref and len(ref) == 7 and ref[-1] == 2
    assert out.finish_reason == "stop"


def test_stop_strings_do_not_end_a_request_before_min_tokens(model_factory):
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False)
    free = llm.generate("def read", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0]
    stop = free.text[:2] if free.text[:2].strip() else free.text[:3]
    early = llm.generate("def read", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]),
                         use_tqdm=False)[0]
    late = llm.generate("def read", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop],
                                                   min_tokens=12), use_tqdm=False)[0]
    assert early.finish_reason == "stop" and len(early.text) < len(free.text)
    assert late.finish_reason == "length" and late.token_ids == free.token_ids


@pytest.mark.parametrize("length", [1, 2])
def test_bad_words_are_never_generated(model_factory, length):
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False)
    plain = llm.generate("def read", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                         use_tqdm=False)[0].token_ids
    tokenizer = llm.engine.tokenizer
    # A word the greedy output contains, whose text tokenizes back to the same tokens.
    word = next(tokenizer.decode(plain[i:i + length]) for i in range(len(plain))
                if tokenizer.encode(tokenizer.decode(plain[i:i + length]).lstrip(), add_special_tokens=False)
                == plain[i:i + length])
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, bad_words=[word])
    banned = llm.generate("def read", params, use_tqdm=False)[0].token_ids
    assert banned != plain and params.bad_words_token_ids
    for sequence in params.bad_words_token_ids:
        n = len(sequence)
        assert all(banned[i:i + n] != sequence for i in range(len(banned)))


def test_skip_special_tokens_off_keeps_them_in_the_text(model_factory):
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False)
    common = dict(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={2: 100.0})
    kept = llm.generate("def", SamplingParams(**common, skip_special_tokens=False), use_tqdm=False)[0]
    skipped = llm.generate("def", SamplingParams(**common), use_tqdm=False)[0]
    assert kept.token_ids == [2, 2, 2] and kept.text == "</s></s></s>" and skipped.text == ""


@pytest.mark.parametrize("params,message", [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be a finite number"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens must be an integer in [0, max_tokens=10]"),
    (dict(logit_bias={"5": 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={999: 1.0}), "logit_bias token id(s) [999] are outside the vocabulary"),
    (dict(prompt_logprobs=21), "prompt_logprobs must be in [0, 20]"),
    (dict(bad_words=[""]), "bad_words must be non-empty strings"),
    (dict(best_of=2, n=2), "best_of is not supported"),
])
def test_bad_values_are_one_line_naming_the_field(model_factory, params, message):
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False)
    with pytest.raises(ValueError) as error:
        llm.generate([1, 2, 3], SamplingParams(**params), use_tqdm=False)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_max_model_len_still_ends_a_request_before_min_tokens(model_factory):
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, max_model_len=16)
    out = llm.generate([1, 2, 3, 4], SamplingParams(max_tokens=20, min_tokens=20, temperature=0),
                       use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
