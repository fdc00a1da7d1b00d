"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p, seeds.

Random rows are drawn with the exponential race (argmax of p / q with
q ~ Exp(1)), which samples exactly from p; p need not be normalised, since a
per-row factor does not move the argmax. A request with its own seed draws its
q row from its own generator, so its tokens do not depend on its batch mates;
the rest share one generator for a single batched draw.

Memory: with a large vocabulary the sampler's [rows, V] float32 tensors are the
biggest temporaries of a step (Qwen3's V = 151,936 at 256 rows: 156 MB each).
The work happens in place on one float32 copy of the logits, plus the noise
tensor; top-k takes only each row's top k, top-p without top-k sorts a bounded
slice of rows at a time. The peak is
``sampler_peak_bytes`` in mempath.memory.formulas (measured in tests/test_sampler.py).
"""
from dataclasses import dataclass

import torch

from mempath.constants import SAMPLER_SORT_ROWS as SORT_ROWS  # the planner counts it
from mempath.engine.penalties import LogitsAdjustments
from mempath.sampling import SamplingParams


# The token id a row gets when its logits are not finite (NaN or +inf): no token can be sampled
# from them, and the output processor fails the row's request (engine/output.py).
NOT_FINITE = -1


@dataclass
class SamplerOutput:
    token_ids: list[int]  # NOT_FINITE for a row whose logits were not
    # Per row: {token_id: logprob} for the sampled token and the top-n, or None.
    logprobs: list[dict[int, float] | None]


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-step tensor on the device without stalling the host.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory, which waits
    for the device's queue to drain; from pinned memory the copy is queued instead
    (PyTorch's pinned-memory cache reuses the buffer once the copy has run).
    """
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def row_argmax(x: torch.Tensor, two_pass: bool | None = None) -> torch.Tensor:
    """``x.argmax(-1)`` for ``x [rows, V]``, in two passes when there are few rows.

    torch reduces one row with one CUDA block: a 128k vocabulary took 29 µs per
    decode step on the H200. Cut into G groups, the first pass has G·rows blocks
    and the second reduces G values. Ties resolve as in torch.argmax (first
    maximum): max(dim) returns the first maximum of each group, and the second
    pass the first group that holds the row's maximum. ``two_pass`` None: on CUDA
    for at most 8 rows.
    """
    rows, v = x.shape
    groups = 1
    while groups < 256 and v % (2 * groups) == 0 and v // (2 * groups) >= 256:
        groups *= 2
    if two_pass is None:
        two_pass = x.is_cuda and rows <= 8
    if not two_pass or groups == 1:
        return x.argmax(dim=-1)
    values, index = x.reshape(rows, groups, v // groups).max(dim=-1)
    group = values.argmax(dim=-1, keepdim=True)
    return (group * (v // groups) + index.gather(1, group)).squeeze(1)


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    @torch.no_grad()
    def sample_tokens(self, logits: torch.Tensor, params: list[SamplingParams],
                      generators: list[torch.Generator | None],
                      adjust: LogitsAdjustments | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled token ids as a device tensor, without waiting for them (no logprobs), and the
        same ids for the host: NOT_FINITE where a row's logits were not finite."""
        tokens, finite = self._tokens(logits, params, generators, adjust=adjust)
        return tokens, marked(tokens, finite)

    @staticmethod
    def _scores(logits: torch.Tensor) -> torch.Tensor:
        scores = logits.float()
        if scores.data_ptr() == logits.data_ptr():
            scores = scores.clone()  # float32 logits: work on a copy, the caller's stay intact
        return scores

    def _tokens(self, logits, params, generators, scores=None, adjust=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens, and per row whether its logits were finite. ``scores``: the float32 copy, when
        the caller already made one; ``adjust``: the penalties, biases and masks applied to it first
        (mempath.engine.penalties).

        A row holding NaN or +inf has no distribution to sample: argmax takes the NaN's (or the
        infinity's) index, or token 0 when every logit is NaN. Such a row's chosen (greedy) or
        largest (sampled) logit is NaN or +inf, which is what the flag reads: a row that the
        masks left all -inf is finite here (its grammar names that conflict).
        """
        if adjust is not None:
            scores = self._scores(logits) if scores is None else scores
            adjust.apply(scores)
        if all(p.greedy for p in params):
            # The model-dtype logits convert to float32 exactly: same argmax, no [rows, V] copy.
            source = logits if scores is None else scores
            tokens = row_argmax(source)
            return tokens, source.gather(1, tokens[:, None]).squeeze(1) < float("inf")
        scores = self._scores(logits) if scores is None else scores
        return self._sample(scores, params, generators, scores.argmax(dim=-1))

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 adjust: LogitsAdjustments | None = None) -> SamplerOutput:
        """Tokens and their logprobs (of the raw logits, as vLLM's default ``raw_logprobs``)."""
        want_logprobs = [p.logprobs for p in params]
        scores = top = None
        if any(n is not None for n in want_logprobs):
            scores = self._scores(logits)
            # log p = logit - logsumexp: keep the row constants and the top-n, not a [rows, V] tensor.
            log_z = torch.logsumexp(scores, dim=-1)
            max_n = max(n or 0 for n in want_logprobs)
            top = scores.topk(max(max_n, 1), dim=-1)
        tokens, finite = self._tokens(logits, params, generators, scores, adjust)
        token_list = marked(tokens, finite).tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(params)
        if top is not None:
            chosen = (logits.gather(1, tokens[:, None]).squeeze(1).float() - log_z).tolist()
            top_values = (top.values - log_z[:, None]).tolist()
            top_ids = top.indices.tolist()
            for row, n in enumerate(want_logprobs):
                if n is None:
                    continue
                entry = {token_list[row]: chosen[row]}
                for token_id, value in zip(top_ids[row][:n], top_values[row][:n]):
                    entry.setdefault(token_id, value)
                logprobs[row] = entry
        return SamplerOutput(token_list, logprobs)

    def _sample(self, scores, params, generators, greedy_tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """Overwrites ``scores`` (float32, [rows, V]); the tokens and the rows' finite flags."""
        device = scores.device
        # Greedy rows (a tiny temperature included) take greedy_tokens below: divide them by 1.
        temperature = to_device([1.0 if p.greedy else p.temperature for p in params],
                                torch.float32, device)
        scores.div_(temperature[:, None])
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            apply_top_k_top_p(scores, top_k, top_p)
        # Unnormalised probabilities in place: exp(x - max), so each row's largest is 1.
        row_max = scores.max(dim=-1, keepdim=True).values
        scores.sub_(row_max).exp_()
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            # p < min_p * p_max  <=>  exp(x - max) < min_p
            threshold = to_device(min_p, torch.float32, device)[:, None]
            scores.masked_fill_(scores < threshold, 0.0)
        noise = torch.empty_like(scores)
        noise.exponential_(generator=self.generator)
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        sampled = scores.div_(noise).argmax(dim=-1)
        greedy = to_device([p.greedy for p in params], torch.bool, device)
        return torch.where(greedy, greedy_tokens, sampled), row_max.squeeze(1) < float("inf")


def marked(tokens: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``tokens`` with NOT_FINITE in the rows whose logits were not finite (a new tensor: the device
    tokens stay valid inputs for the next step)."""
    return torch.where(finite, tokens, NOT_FINITE)


# Above this top-k, or with rows that have no top-k, the rows are sorted instead.
TOPK_LIMIT = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf, in place (k=0, p=1: off).

    When every row has a top-k of at most TOPK_LIMIT, only the top max(k) of each row
    are taken (``topk``: small temporaries, no sort of the vocabulary). Otherwise the
    rows are sorted SORT_ROWS at a time, so the sort's values and indices never cover
    the whole batch.
    """
    rows, vocab = logits.shape
    device = logits.device
    k_list = [kk if 0 < kk < vocab else vocab for kk in top_k]
    k_all = to_device(k_list, torch.int64, device)
    p_all = to_device(top_p, torch.float32, device)
    if all(0 < kk <= TOPK_LIMIT for kk in top_k):
        values, order = logits.topk(max(k_list), dim=-1)
        _mask_sorted(values, k_all, p_all)
        logits.fill_(float("-inf")).scatter_(-1, order, values)
        return logits
    for start in range(0, rows, SORT_ROWS):
        chunk = logits[start:start + SORT_ROWS]
        sorted_logits, order = chunk.sort(dim=-1, descending=True)
        _mask_sorted(sorted_logits, k_all[start:start + SORT_ROWS], p_all[start:start + SORT_ROWS])
        chunk.scatter_(-1, order, sorted_logits)
        del sorted_logits, order  # before the next slice's sort allocates its own
    return logits


def _mask_sorted(sorted_logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> None:
    """On rows sorted in descending order: -inf past rank k and past the top-p nucleus."""
    ranks = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)[None, :]
    remove = ranks >= k[:, None]
    del ranks
    sorted_logits.masked_fill_(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens ranked above it already cover p; the top one always stays.
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    del probs
    remove |= mass_before >= p[:, None]
    del mass_before
    sorted_logits.masked_fill_(remove, float("-inf"))
