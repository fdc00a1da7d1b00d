"""Hand-off between served models: model A's answer, through a template, becomes model B's prompt.

A template is text with ``{output}`` (A's answer) and optionally ``{prompt}`` (A's prompt).
When A and B share a tokenizer (the same vocabulary, checked once per pair), B's prompt is
token ids: B's special prefix (its BOS, if its tokenizer adds one), then each piece in
order, the literal text tokenized alone, ``{prompt}`` as A's prompt ids without A's special
prefix, ``{output}`` as A's sampled ids as they are. A's ids are the list the engine already
read back for its stop checks, so the hand-off neither detokenizes, re-tokenizes nor reads
anything from the device (``count_device_reads`` counts what it would). With different
tokenizers, B's prompt is the template filled with A's texts, tokenized by B: exactly what
re-tokenizing A's text gives.
"""
from __future__ import annotations

import contextlib
import string
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mempath.outputs import RequestOutput
from mempath.sampling import SamplingParams


@dataclass(frozen=True)
class Template:
    """A parsed template: its pieces in order, each a literal or one of the two fields."""
    text: str
    pieces: tuple[tuple[str, str], ...]  # ("literal", text) | ("field", "prompt" | "output")

    @classmethod
    def parse(cls, text: str) -> "Template":
        pieces = []
        try:
            parsed = list(string.Formatter().parse(text))
        except ValueError as error:
            raise ValueError(f"pipeline template {text!r}: {error}; write a literal brace as {{{{ or }}}}") from None
        for literal, name, spec, conversion in parsed:
            if literal:
                pieces.append(("literal", literal))
            if name is None:
                continue
            if name not in ("prompt", "output") or spec or conversion:
                raise ValueError(f"pipeline template {text!r}: {{{name}}} is no field; it takes {{output}} "
                                 f"(the first model's answer) and {{prompt}} (its prompt)")
            pieces.append(("field", name))
        if ("field", "output") not in pieces:
            raise ValueError(f"pipeline template {text!r} has no {{output}}: put the first model's answer in it")
        return cls(text, tuple(pieces))

    def fill(self, prompt: str, output: str) -> str:
        return self.text.format(prompt=prompt, output=output)


@dataclass
class Pipeline:
    """One request's hand-off: where it goes next and how B's prompt is made."""
    second: str  # the model that answers
    template: Template
    params: SamplingParams  # B's
    first_output: RequestOutput | None = field(default=None)  # A's, once finished


class SecondModelError(ValueError):
    """The second model refuses a pipeline's request (its parameters, or the prompt the template
    makes of the first's prompt alone), found before the first model runs: the fault is the
    second half's (``then`` over HTTP), not the first's."""

    def __init__(self, model: str, reason: str):
        super().__init__(f"the second model ({model}) refuses its request: {reason}")
        self.model, self.reason = model, reason  # reason: the engine's message, which starts with its field


def failed_output(output: RequestOutput, finish_reason: str, error: str | None,
                  error_param: str | None = None) -> RequestOutput:
    """A pipeline's end before the second model answered. None of the first model's answer is in
    it: that is not the pipeline's answer, and a client would take it for the second's.
    ``error_param``: the request field at fault (a 400 on the server), None for the server's fault."""
    return RequestOutput.of_sample(request_id=output.request_id, prompt=output.prompt,
                                   prompt_token_ids=output.prompt_token_ids, token_ids=[], text="",
                                   finished=True, finish_reason=finish_reason, error=error,
                                   error_param=error_param, total_time=output.total_time)


@dataclass
class PipelineOutput:
    """LLM.pipeline's result for one prompt: the first model's output and the second's answer."""
    first: RequestOutput
    second: RequestOutput

    @property
    def text(self) -> str:
        return self.second.outputs[0].text


def same_vocabulary(a, b) -> bool:
    """Whether two tokenizers map the same strings to the same ids (A's ids then mean the same to B)."""
    if a is None or b is None:
        return False
    return a is b or (a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids)


def special_prefix(tokenizer) -> list[int]:
    """The ids a tokenizer puts before any text (a BOS, or none)."""
    return tokenizer.encode("", add_special_tokens=True) if tokenizer is not None else []


def handoff_token_ids(template: Template, first: RequestOutput, a_prefix: list[int], b_prefix: list[int],
                      encode_literal) -> list[int]:
    """B's prompt ids from A's finished output, for tokenizers with the same vocabulary: the
    special prefixes are A's and B's (``special_prefix``), ``encode_literal`` B's ids of a
    literal piece (cached by the caller: a tokenizer call costs more than the rest)."""
    ids = list(b_prefix)
    for kind, value in template.pieces:
        if kind == "literal":
            ids += encode_literal(value)
        elif value == "output":
            ids += first.outputs[0].token_ids
        else:
            prompt_ids = first.prompt_token_ids
            ids += prompt_ids[len(a_prefix):] if a_prefix and prompt_ids[:len(a_prefix)] == a_prefix else prompt_ids
    return ids


def handoff_text(template: Template, first: RequestOutput, first_tokenizer) -> str:
    """B's prompt text from A's finished output (different tokenizers: B tokenizes it)."""
    prompt = first.prompt
    if prompt is None:
        prompt = first_tokenizer.decode(first.prompt_token_ids, skip_special_tokens=True)
    return template.fill(prompt, first.outputs[0].text)


class _DeviceReads(TorchDispatchMode):
    """Counts operators that bring tensor data to the host: a copy to the CPU from another
    device (a CUDA tensor's ``.cpu()``, ``.tolist()``), or a scalar read (``.item()``). A CPU
    tensor's ``.tolist()`` reads its memory without an operator and is not seen."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.count += 1
        elif name in ("_to_copy", "copy_") and any(
                isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args):
            target = kwargs.get("device")
            if name == "copy_" and isinstance(args[0], torch.Tensor):
                target = args[0].device
            if target is not None and torch.device(target).type == "cpu":
                self.count += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_device_reads():
    """``with count_device_reads() as reads: ...``; ``reads.count`` afterwards."""
    mode = _DeviceReads()
    with mode:
        yield mode
