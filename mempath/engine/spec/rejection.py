"""Rejection sampling over proposed tokens (Leviathan et al. 2023; vLLM's RejectionSampler).

Both models' logits go through the target sampler's filters (temperature, top-k, top-p,
min-p: ``filtered_probs``), so p and q are the distributions the target's sampler and the
draft's proposals actually draw from. Proposed token d_j is kept with probability
min(1, p_j(d_j) / q_j(d_j)); at the first rejection the step emits a token drawn from the
residual max(0, p_j - q_j) (normalised), and when every proposal is kept it emits a bonus
token drawn from p_{k+1}. The emitted tokens are then distributed exactly as the target's
sampler would draw them one by one. A greedy row keeps proposals while they equal the
target's argmax and emits the argmax where they stop: the plain greedy tokens. An n-gram
proposal has no q: it is a point mass (q(d) = 1), and the residual is p without d.
"""
import torch

from mempath.engine.sampler import apply_top_k_top_p, to_device
from mempath.sampling import SamplingParams


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """float32 [rows, V] probabilities after the sampler's temperature, top-k, top-p and min-p.

    A greedy row is filtered at temperature 1; its probabilities are never drawn from.
    """
    scores = logits.float().clone()
    device = scores.device
    temperature = to_device([1.0 if p.greedy else p.temperature for p in params], torch.float32, device)
    scores.div_(temperature[:, None])
    top_k, top_p = [p.top_k for p in params], [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        apply_top_k_top_p(scores, top_k, top_p)
    probs = torch.softmax(scores, dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0 for m in min_p):
        threshold = to_device(min_p, torch.float32, device)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs.masked_fill_(probs < threshold, 0.0)
        probs.div_(probs.sum(dim=-1, keepdim=True))
    return probs


def _noise(shape, generators: list, default: torch.Generator, device, kind: str) -> torch.Tensor:
    """Per-row random draws: a seeded request's row from its own generator, the rest from ``default``."""
    out = torch.empty(shape, dtype=torch.float32, device=device)
    draw = (lambda t, g: t.exponential_(generator=g)) if kind == "exponential" else \
        (lambda t, g: t.uniform_(generator=g))
    draw(out, default)
    for row, generator in enumerate(generators):
        if generator is not None:
            draw(out[row], generator)
    return out


def sample_probs(probs: torch.Tensor, generators: list, default: torch.Generator) -> torch.Tensor:
    """One token per row drawn from unnormalised probabilities (the exponential race)."""
    noise = _noise(probs.shape, generators, default, probs.device, "exponential")
    return (probs / noise).argmax(dim=-1)


def rejection_sample(target_probs: torch.Tensor, target_argmax: torch.Tensor, draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor | None, num_proposed: list[int], greedy: list[bool],
                     generators: list, default: torch.Generator,
                     accept_rule=None) -> list[list[int]]:
    """The tokens each row emits: its kept proposals, then one corrected or bonus token.

    ``target_probs [R, K+1, V]`` and ``target_argmax [R, K+1]``: the target at each proposed
    position and the one after; ``draft_tokens [R, K]`` the proposals, ``draft_probs [R, K, V]``
    the distributions they were drawn from (None: point masses, n-gram); row r proposed
    ``num_proposed[r]`` <= K tokens. ``accept_rule(p_d, q_d, u) -> bool tensor`` replaces the
    rule ``u < p_d / q_d`` (the tests' broken rule shows the statistical test can fail).
    """
    rows, k1, vocab = target_probs.shape
    k = k1 - 1
    device = target_probs.device
    ar = torch.arange(rows, device=device)
    if k > 0:
        p_d = target_probs[:, :k].gather(2, draft_tokens[:, :, None]).squeeze(2)
        q_d = torch.ones_like(p_d) if draft_probs is None else \
            draft_probs.gather(2, draft_tokens[:, :, None]).squeeze(2)
        u = _noise((rows, k), generators, default, device, "uniform")
        accept = (accept_rule or (lambda p, q, r: r * q < p))(p_d, q_d, u)
        greedy_t = to_device(greedy, torch.bool, device)[:, None]
        accept = torch.where(greedy_t, draft_tokens == target_argmax[:, :k], accept)
        limit = to_device(num_proposed, torch.int64, device)
        accept &= torch.arange(k, device=device)[None, :] < limit[:, None]
        num_accepted = accept.int().cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(rows, dtype=torch.int64, device=device)
        limit = num_accepted
    # Where each row stops: the residual of the rejected position, or p after the last proposal.
    p_stop = target_probs[ar, num_accepted]
    rejected = num_accepted < limit
    if k > 0 and bool(rejected.any()):
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_stop = torch.zeros_like(p_stop).scatter_(1, draft_tokens[ar, at][:, None], 1.0)
        else:
            q_stop = draft_probs[ar, at]
        residual = (p_stop - q_stop).clamp_(min=0)
        empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q there: nothing was rejectable
        residual = torch.where(empty, p_stop, residual)
        p_stop = torch.where(rejected[:, None], residual, p_stop)
    drawn = sample_probs(p_stop, generators, default)
    greedy_stop = target_argmax[ar, num_accepted]
    final = torch.where(to_device(greedy, torch.bool, device), greedy_stop, drawn).tolist()
    n_list = num_accepted.tolist()
    proposals = draft_tokens.tolist() if k > 0 else [[] for _ in range(rows)]
    return [proposals[r][:n_list[r]] + [final[r]] for r in range(rows)]


def greedy_accept(target_argmax: torch.Tensor, draft_tokens: torch.Tensor, num_proposed: list[int]) -> list[list[int]]:
    """All rows greedy: keep proposals while they equal the target's argmax, then its argmax."""
    k1 = target_argmax.shape[1]
    both = torch.cat([target_argmax, draft_tokens], dim=1).tolist()  # one read back of the step's tokens
    argmax, drafts = [row[:k1] for row in both], [row[k1:] for row in both]
    out = []
    for row, k in enumerate(num_proposed):
        n = 0
        while n < k and drafts[row][n] == argmax[row][n]:
            n += 1
        out.append(drafts[row][:n] + [argmax[row][n]])
    return out
