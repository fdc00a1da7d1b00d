"""Input processing: a prompt and its sampling parameters become a validated Request.

Every refusal is a ValueError that names the problem and the fix; nothing is
allocated or scheduled before a request passes.
"""
import itertools
import operator
from collections.abc import Callable, Container
from dataclasses import dataclass, field

import torch

from mempath.engine.request import Request
from mempath.kv.manager import blocks_for
from mempath.sampling import SamplingParams


def join_text_parts(texts: list[str]) -> str:
    """A chat message's text content parts as one text, each after a newline but the first, as vLLM joins them."""
    return "\n".join(texts)


def check_text(text: str, what: str) -> None:
    """ValueError in one line for text no tokenizer takes: a lone surrogate, which is how Python holds a
    byte the shell could not decode as UTF-8, or a JSON ``\\udXXX`` escape left unpaired."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{what} is not valid UTF-8 text: {text[error.start]!r} at character {error.start}; "
                         "re-encode it as UTF-8") from None


@dataclass
class InputProcessor:
    model: str
    tokenizer: object  # a transformers tokenizer, or None when the checkpoint has none
    vocab_size: int
    max_model_len: int
    max_logprobs: int
    block_size: int
    num_kv_blocks: int  # the most a request may need: the pool, or this model's share of a shared one
    make_generator: Callable[[int], torch.Generator]  # the sampler's: seeded draws on the device that samples
    eos_token_ids: frozenset[int] = frozenset()  # masked with stop_token_ids until min_tokens are out
    grammars: object = None  # a mempath.structured.grammar.GrammarCompiler, for structured_outputs
    model_positions: int | None = None  # the most max_model_len may be (startup.resolve_max_model_len)
    pool_blocks: int | None = None  # the whole pool's blocks, where several models share it (None: num_kv_blocks)
    _ids: itertools.count = field(default_factory=itertools.count)

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                f"{self.model} has no tokenizer files (tokenizer.json / tokenizer.model); give a tokenizer's "
                f"directory (--tokenizer DIR, tokenizer=DIR), or pass prompts as lists of token ids")
        check_text(prompt, "the prompt")
        return self.tokenizer.encode(prompt)

    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None,
                     live: Container[str], arrival_time: float | None = None) -> Request:
        """Validate and build a request; ``live`` holds the ids of requests not finished yet.
        ``arrival_time``: when it arrived (time.perf_counter), if before this call; None: now."""
        params.validate(self.max_logprobs)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none: use stop_token_ids")
        if params.n != 1:
            raise ValueError("the engine runs one sample per request; LLM.generate expands n > 1")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer; this model has none: use logit_bias "
                                 "with -100 on the token ids instead")
            params.set_bad_words_token_ids(
                lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        params.check_vocabulary(self.vocab_size)
        text, token_ids = self._prompt_tokens(prompt)
        self._check_fits(token_ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in live:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, text, token_ids, params, arrival_time)  # after set_bad_words_token_ids
        if params.min_tokens:
            request.min_tokens_stop_ids = sorted(
                {t for t in (*self.eos_token_ids, *params.stop_token_ids) if 0 <= t < self.vocab_size})
        if params.seed is not None:
            request.generator = self.make_generator(params.seed)
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("structured outputs need a tokenizer; this model has none")
            request.grammar = self.grammars.matcher(params.structured_outputs)
        return request

    def _prompt_tokens(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        prompt = unwrap_prompt(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give at least one token of text")
            text, token_ids = prompt, self.tokenize(prompt)
        else:
            text, token_ids = None, token_id_list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return text, token_ids

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        if len(token_ids) > self.max_model_len:
            at_limit = self.model_positions is not None and self.max_model_len >= self.model_positions
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_model_len {self.max_model_len}"
                + (f", the model's limit ({self.model_positions} positions); shorten it" if at_limit
                   else "; shorten it or raise --max-model-len"))
        kv_tokens = min(len(token_ids) + params.max_tokens - 1, self.max_model_len)
        needed = blocks_for(kv_tokens, self.block_size)
        if needed > self.num_kv_blocks:
            room = self.num_kv_blocks * self.block_size
            held = (f"the whole KV pool has {self.num_kv_blocks} ({room} tokens)"
                    if self.pool_blocks in (None, self.num_kv_blocks) else
                    f"this model may hold {self.num_kv_blocks} blocks of the shared pool's {self.pool_blocks} "
                    f"({room} tokens; the other models are guaranteed the rest: --kv-min-share)")
            raise ValueError(
                f"the prompt plus max_tokens needs {needed} KV blocks ({kv_tokens} tokens) but {held}; "
                f"lower max_tokens, shorten the prompt, or give the KV cache more memory "
                f"(--gpu-memory-utilization, num_gpu_blocks_override)")


PROMPT_FIELDS = ("prompt", "prompt_token_ids")


def unwrap_prompt(prompt):
    """vLLM's prompt dicts (TextPrompt ``{"prompt": str}``, TokensPrompt ``{"prompt_token_ids": [...]}``)
    as the text or ids they hold; a string or an id list as it is."""
    if not isinstance(prompt, dict):
        return prompt
    unknown = sorted(set(prompt) - set(PROMPT_FIELDS))
    if unknown:
        raise ValueError(f"prompt field(s) {unknown} are not supported; give only 'prompt' (text) or "
                         f"'prompt_token_ids' (token ids)")
    given = [k for k in PROMPT_FIELDS if k in prompt]
    if len(given) != 1:
        raise ValueError(f"a prompt dict needs exactly one of 'prompt' (text) or 'prompt_token_ids', got {given}")
    value = prompt[given[0]]
    if given == ["prompt"] and not isinstance(value, str):
        raise ValueError(f"'prompt' must be text, got {type(value).__name__}; give token ids as 'prompt_token_ids'")
    if given == ["prompt_token_ids"] and not isinstance(value, (list, tuple)):
        raise ValueError(f"'prompt_token_ids' must be a list of integers, got {type(value).__name__}")
    return value


def token_id_list(prompt) -> list[int]:
    """A prompt of token ids as ints: integers of any kind (numpy's, a tensor's) are taken; a float,
    a bool or anything else is refused in one line, never truncated."""
    try:
        items = list(prompt)
    except TypeError:
        raise ValueError(f"a prompt is text or a list of token ids, got {type(prompt).__name__}") from None
    ids = []
    for t in items:
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt token ids must be integers, got {t!r} ({type(t).__name__}) in the prompt") \
                from None
    return ids
