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
