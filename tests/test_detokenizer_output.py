"""The output processor hands its detokenizer each new token, never the output so far."""
from pathlib import Path

from transformers import AutoTokenizer

from mempath.engine.output import OutputProcessor
from mempath.engine.request import Request
from mempath.sampling import SamplingParams

TINY = Path(__file__).resolve().parents[1] / "mempath" / "assets" / "mempath-tiny"


class SpyDetokenizer:
    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def delta(self, *args):
        self.calls.append(args)
        return self.inner.delta(*args)

    def flush(self, *args):
        self.calls.append(("flush",) + args)
        return self.inner.flush(*args)


def test_each_step_passes_only_the_new_token_so_a_token_costs_the_same_at_any_length():
    """A slice of the whole output per token made a request's detokenizing quadratic in its length."""
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    text = "Hello world, 中文 😀 and a long enough answer"
    ids = tokenizer.encode(text, add_special_tokens=False)
    processor = OutputProcessor(tokenizer, eos_token_ids=set(), max_model_len=1024, finish=lambda *_: None)
    request = Request("r", None, [1, 2, 3], SamplingParams(max_tokens=len(ids), ignore_eos=True))
    processor.add(request)
    spy = processor.detokenizers["r"] = SpyDetokenizer(processor.detokenizers["r"])
    for token_id in ids:
        processor.emit([request], [token_id], [None])
    assert spy.calls == [(token_id,) for token_id in ids] + [("flush",)]
    assert request.output_text == text


def forced(ids: list[int], params: SamplingParams, eos: set[int] = frozenset()):
    """The finished output of a request whose tokens are ``ids`` (up to where it ends)."""
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    def finish(request, reason):  # the scheduler's part of it
        request.finish_reason = request.finish_reason or reason
    processor = OutputProcessor(tokenizer, eos_token_ids=set(eos), max_model_len=1024, finish=finish)
    request = Request("r", None, [1, 2, 3], params)
    processor.add(request)
    for token_id in ids:
        [output] = processor.emit([request], [token_id], [None])
        if output.finished:
            return output.outputs[0]
    raise AssertionError("the request did not finish")


def words(text: str) -> list[int]:
    return AutoTokenizer.from_pretrained(TINY).encode(text, add_special_tokens=False)


def test_the_token_that_ends_a_request_adds_no_text_as_in_vllm():
    """vLLM does not detokenize the EOS or stop id that ends a request: its text was in ours (with
    skip_special_tokens false, '<|end|>'; a stop id that is a word, the word)."""
    end = 6  # <|end|>, a special token
    out = forced(words("Hello world") + [end], SamplingParams(max_tokens=9, skip_special_tokens=False), eos={end})
    assert (out.text, out.token_ids[-1], out.finish_reason) == ("Hello world", end, "stop")
    world = words(" world")[0]
    out = forced(words("Hello world again"), SamplingParams(max_tokens=9, stop_token_ids=[world]))
    assert (out.text, out.token_ids[-1], out.finish_reason, out.stop_reason) == ("Hello", world, "stop", world)


def test_stop_strings_wait_past_min_tokens_as_in_vllm():
    """vLLM checks stop strings once more than min_tokens tokens are out; ours from the min_tokens-th on."""
    ids = words("Hello world again")
    out = forced(ids, SamplingParams(max_tokens=len(ids), min_tokens=1, stop=["Hello"], ignore_eos=True))
    assert (out.text, out.finish_reason) == ("Hello world again", "length")
    out = forced(ids, SamplingParams(max_tokens=len(ids), min_tokens=2, stop=[" world"], ignore_eos=True))
    assert (out.text, out.finish_reason) == ("Hello world again", "length")
    out = forced(ids, SamplingParams(max_tokens=len(ids), min_tokens=1, stop=[" world"], ignore_eos=True))
    assert (out.text, out.finish_reason, out.stop_reason) == ("Hello", "stop", " world")


def test_a_stop_string_in_the_text_held_back_at_the_length_ends_it():
    """Text held back for an unfinished character is flushed when the length ends the request: a stop string
    it completed stayed in the output."""
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    dash = tokenizer.encode(" —", add_special_tokens=False)
    assert len(dash) == 2  # " " + the dash's first bytes, then the rest: the space is held back with them
    ids = words("Answer:") + dash[:1]
    out = forced(ids, SamplingParams(max_tokens=len(ids), stop=[": "], ignore_eos=True))
    assert (out.text, out.finish_reason, out.stop_reason) == ("Answer", "stop", ": ")
