"""What a request's sampling parameters do to its logits before a token is drawn.

In vLLM's order, on the sampler's float32 copy of the logits: bad words, min_tokens
(EOS and stop_token_ids at -inf until min_tokens are out), logit_bias, then the
penalties: repetition over prompt + generated tokens (a positive logit divided by
it, a negative one multiplied, as transformers' RepetitionPenaltyLogitsProcessor),
frequency (times each token's count among the generated tokens) and presence (once
per generated token) subtracted, OpenAI's formula.

Batched: one step builds one ``LogitsAdjustments`` for all its sampling rows; rows
that ask for nothing add nothing, and a step where no row asks builds none (no
[rows, V] work). Per-token edits (biases, masks, bans) are one ``index_put_``; the
penalties need each row's token counts, built per step on the device from the
rows' token history (``TokenHistory``) SAMPLER_SORT_ROWS rows at a time, so the
temporaries stay under the sort phase's bytes per entry that the plan counts
(``sampler_peak_bytes``). A row's newest token may still be on the device (async
scheduling): the history takes every row's last token from the step's device
input ids, so the penalties see it. ``apply_penalties`` is a function of (logits
rows, token history) only, for any caller that scores rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mempath.constants import SAMPLER_SORT_ROWS
from mempath.memory.formulas import SAMPLER_PENALTY_BYTES_PER_ENTRY as PENALTY_BYTES_PER_ENTRY  # noqa: F401


@dataclass
class TokenHistory:
    """The tokens of the rows that need them, padded with V (a column that is dropped)."""
    rows: torch.Tensor  # [r] sampling rows
    tokens: torch.Tensor  # [r, L] int64: prompt then generated tokens
    prompt_lens: torch.Tensor  # [r]
    lengths: torch.Tensor  # [r]
    presence: torch.Tensor  # [r] float32
    frequency: torch.Tensor
    repetition: torch.Tensor
    repetition_used: list[bool]  # per row: repetition_penalty != 1 (skips that work per slice)


@dataclass
class BadWordPairs:
    """A banned last token per (row, bad word): -inf when the generated tokens end with its prefix."""
    history_rows: torch.Tensor  # [P] index into TokenHistory
    tokens: torch.Tensor  # [P]
    prefixes: torch.Tensor  # [P, M], padded with -1
    prefix_lens: torch.Tensor  # [P]


@dataclass
class LogitsAdjustments:
    add_rows: torch.Tensor | None = None  # (row, token) += value: logit_bias, -inf masks and bans
    add_tokens: torch.Tensor | None = None
    add_values: torch.Tensor | None = None
    history: TokenHistory | None = None
    bad_words: BadWordPairs | None = None

    @torch.no_grad()
    def apply(self, scores: torch.Tensor) -> None:
        """Edit the float32 scores [rows, V] in place."""
        if self.bad_words is not None:
            apply_bad_words(scores, self.history, self.bad_words)
        if self.add_rows is not None:
            scores.index_put_((self.add_rows, self.add_tokens), self.add_values, accumulate=True)
        if self.history is not None:
            apply_penalties(scores, self.history)


def _upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def build_adjustments(requests: list, tokens_on_device: bool, last_tokens, vocab_size: int,
                      device: torch.device, grammar_only_ends=None) -> LogitsAdjustments | None:
    """This step's adjustments for its sampling rows (``requests``, in row order), or None.

    ``tokens_on_device``: each request's newest token is not in its ``token_ids`` yet
    (async scheduling). ``last_tokens()``: a device tensor of each sampling row's last
    input token, i.e. the newest token of its history; called only when a row needs
    its history. ``grammar_only_ends(row, stop_ids)``: whether that row's grammar allows
    nothing but those tokens now; such a row keeps them although min_tokens are not out,
    since masking them too would leave no token to sample: the finished grammar ends the
    output (docs/structured.md).
    """
    add_rows, add_tokens, add_values = [], [], []
    history_rows, bad = [], []
    for row, request in enumerate(requests):
        if not request.adjusts_logits:
            continue
        params = request.params
        total = len(request.token_ids) + (1 if tokens_on_device else 0)
        num_output = total - request.num_prompt_tokens  # generated before this row's token
        if num_output < params.min_tokens and request.min_tokens_stop_ids and not (
                grammar_only_ends is not None and grammar_only_ends(row, request.min_tokens_stop_ids)):
            add_rows += [row] * len(request.min_tokens_stop_ids)
            add_tokens += request.min_tokens_stop_ids
            add_values += [float("-inf")] * len(request.min_tokens_stop_ids)
        if params.logit_bias:
            add_rows += [row] * len(params.logit_bias)
            add_tokens += list(params.logit_bias)
            add_values += [float(v) for v in params.logit_bias.values()]
        for word in params.bad_words_token_ids:
            if len(word) == 1:
                add_rows.append(row)
                add_tokens.append(word[0])
                add_values.append(float("-inf"))
            else:
                bad.append((len(history_rows), word))
        if params.needs_history:
            history_rows.append((row, request, total))
    if not add_rows and not history_rows:
        return None
    adjust = LogitsAdjustments()
    if add_rows:
        adjust.add_rows = _upload(np.asarray(add_rows, dtype=np.int64), device)
        adjust.add_tokens = _upload(np.asarray(add_tokens, dtype=np.int64), device)
        adjust.add_values = _upload(np.asarray(add_values, dtype=np.float32), device)
    if history_rows:
        adjust.history = _history(history_rows, last_tokens(), vocab_size, device)
    if bad:
        adjust.bad_words = _bad_word_pairs(bad, device)
    return adjust


def host_history(request, n: int) -> np.ndarray:
    """The request's first ``n`` tokens as int64, converting only those added since last time."""
    array = request.token_array
    if array is None or len(array) < n:
        grown = np.empty(max(n, 2 * (0 if array is None else len(array)), 64), dtype=np.int64)
        if array is not None:
            grown[:request.token_array_len] = array[:request.token_array_len]
        array = request.token_array = grown
    if request.token_array_len < n:
        array[request.token_array_len:n] = request.token_ids[request.token_array_len:n]
        request.token_array_len = n
    return array[:n]


def _history(entries: list, last_tokens: torch.Tensor, vocab_size: int, device) -> TokenHistory:
    """Each row's tokens but its last from the host, its last from the device."""
    width = max(total for _, _, total in entries)
    tokens = np.full((len(entries), width), vocab_size, dtype=np.int64)
    for i, (_, request, total) in enumerate(entries):
        tokens[i, :total - 1] = host_history(request, total - 1)
    params = [request.params for _, request, _ in entries]
    rows = _upload(np.asarray([row for row, _, _ in entries], dtype=np.int64), device)
    lengths = _upload(np.asarray([total for _, _, total in entries], dtype=np.int64), device)
    tokens_d = _upload(tokens, device)
    index = torch.arange(len(entries), device=device)
    tokens_d[index, lengths - 1] = last_tokens.index_select(0, rows)
    return TokenHistory(
        rows=rows, tokens=tokens_d, lengths=lengths,
        prompt_lens=_upload(np.asarray([r.num_prompt_tokens for _, r, _ in entries], dtype=np.int64), device),
        presence=_upload(np.asarray([p.presence_penalty for p in params], dtype=np.float32), device),
        frequency=_upload(np.asarray([p.frequency_penalty for p in params], dtype=np.float32), device),
        repetition=_upload(np.asarray([p.repetition_penalty for p in params], dtype=np.float32), device),
        repetition_used=[p.repetition_penalty != 1.0 for p in params])


def _bad_word_pairs(bad: list, device) -> BadWordPairs:
    width = max(len(word) - 1 for _, word in bad)
    prefixes = np.full((len(bad), width), -1, dtype=np.int64)
    for i, (_, word) in enumerate(bad):
        prefixes[i, :len(word) - 1] = word[:-1]
    return BadWordPairs(
        history_rows=_upload(np.asarray([h for h, _ in bad], dtype=np.int64), device),
        tokens=_upload(np.asarray([word[-1] for _, word in bad], dtype=np.int64), device),
        prefixes=_upload(prefixes, device),
        prefix_lens=_upload(np.asarray([len(word) - 1 for _, word in bad], dtype=np.int64), device))


def apply_bad_words(scores: torch.Tensor, history: TokenHistory, pairs: BadWordPairs) -> None:
    """-inf at each pair's banned token where the row's generated tokens end with its prefix."""
    width = pairs.prefixes.shape[1]
    offsets = torch.arange(width, device=scores.device)[None, :]
    lengths = history.lengths.index_select(0, pairs.history_rows)
    valid = offsets < pairs.prefix_lens[:, None]
    positions = (lengths[:, None] - pairs.prefix_lens[:, None] + offsets).clamp_(0, history.tokens.shape[1] - 1)
    tail = history.tokens[pairs.history_rows[:, None], positions]
    generated = lengths - history.prompt_lens.index_select(0, pairs.history_rows)
    match = ((tail == pairs.prefixes) | ~valid).all(dim=1) & (generated >= pairs.prefix_lens)
    values = torch.where(match, float("-inf"), 0.0)
    scores.index_put_((history.rows.index_select(0, pairs.history_rows), pairs.tokens), values, accumulate=True)


def apply_penalties(scores: torch.Tensor, history: TokenHistory) -> None:
    """Repetition, frequency and presence penalties on ``scores[history.rows]``, in place.

    A slice of SAMPLER_SORT_ROWS rows at a time: its counts over the generated tokens and
    its mask of tokens seen anywhere (prompt included) are [slice, V] temporaries.
    """
    vocab = scores.shape[1]
    for start in range(0, history.rows.shape[0], SAMPLER_SORT_ROWS):
        part = slice(start, start + SAMPLER_SORT_ROWS)
        rows, ids = history.rows[part], history.tokens[part]
        positions = torch.arange(ids.shape[1], device=ids.device)[None, :]
        generated_ids = ids.masked_fill(positions < history.prompt_lens[part, None], vocab)
        del positions
        counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
        counts.scatter_add_(1, generated_ids, torch.ones(ids.shape, dtype=torch.float32, device=ids.device))
        seen = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
        seen.scatter_(1, ids, True)
        counts, seen = counts[:, :vocab], seen[:, :vocab]
        x = scores.index_select(0, rows)
        if any(history.repetition_used[part]):
            _repetition(x, seen, history.repetition[part, None])
        del seen
        x.addcmul_(counts, history.frequency[part, None], value=-1.0)
        x.addcmul_(counts.clamp_(max=1.0), history.presence[part, None], value=-1.0)
        del counts
        scores.index_copy_(0, rows, x)


def _repetition(x: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> None:
    """Seen tokens: positive logits divided by the penalty, the others multiplied (exactly
    transformers' where(x < 0, x * p, x / p); dividing or multiplying by 1 elsewhere is exact)."""
    factor = penalty.expand_as(x).clone()
    factor.masked_fill_(~(seen & (x > 0)), 1.0)
    x.div_(factor)
    factor.copy_(penalty.expand_as(x))
    factor.masked_fill_(~(seen & (x <= 0)), 1.0)
    x.mul_(factor)
