"""Rejection sampling keeps the target's distribution exactly: a chi-square test per position
that passes for the real rule and fails for a broken one (seeded, so deterministic)."""
import pytest
import torch

from mempath.engine.sampler import Sampler
from mempath.engine.spec.rejection import filtered_probs, rejection_sample, sample_probs
from mempath.sampling import SamplingParams

V, K, N = 6, 3, 40000
ALPHA = 1e-3


def fixed_distributions(seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, dim=-1)
    return p, q


def emitted_by_position(accept_rule=None, point_mass=False):
    """N rows of one speculation step over fixed p and q; the tokens emitted at each position."""
    p, q = fixed_distributions()
    g = torch.Generator().manual_seed(1)
    if point_mass:
        draft_tokens = p[:K].argmax(-1).expand(N, K)  # likely enough that every position is reached
        draft_probs = None
    else:
        draft_tokens = torch.stack([sample_probs(q[j].expand(N, V), [None] * N, g) for j in range(K)], dim=1)
        draft_probs = q[None].expand(N, K, V)
    target = p[None].expand(N, K + 1, V)
    out = rejection_sample(target, target.argmax(-1), draft_tokens, draft_probs, [K] * N, [False] * N,
                           [None] * N, g, accept_rule=accept_rule)
    return p, [[row[j] for row in out if len(row) > j] for j in range(K + 1)]


def chi_square_p(tokens: list[int], probs: torch.Tensor) -> float:
    observed = torch.bincount(torch.tensor(tokens), minlength=V).double()
    expected = probs.double() * len(tokens)
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token of probability 0 was emitted"
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    degrees = int(keep.sum()) - 1
    # The chi-square survival function: the regularised upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64), statistic / 2))


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-model", "ngram"])
def test_every_position_follows_the_target(point_mass):
    p, emitted = emitted_by_position(point_mass=point_mass)
    for j in range(K + 1):
        assert len(emitted[j]) > 300
        assert chi_square_p(emitted[j], p[j]) > ALPHA, f"position {j}"


def test_the_check_rejects_a_wrong_acceptance_rule():
    # Accepting every proposal emits the draft's distribution: the same check must fail.
    p, emitted = emitted_by_position(accept_rule=lambda p_d, q_d, u: torch.ones_like(p_d, dtype=torch.bool))
    assert chi_square_p(emitted[0], p[0]) < ALPHA
    # Accepting with probability p/q but drawing the replacement from p (not the residual) is wrong too.
    _, emitted = emitted_by_position(accept_rule=lambda p_d, q_d, u: u * q_d < p_d * 0.5)
    assert chi_square_p(emitted[0], p[0]) < ALPHA


def test_greedy_rows_emit_the_target_argmax():
    p, q = fixed_distributions()
    target = p[None]
    argmax = p.argmax(-1)[None]
    proposals = torch.tensor([[int(argmax[0, 0]), int(argmax[0, 1]), (int(argmax[0, 2]) + 1) % V]])
    out = rejection_sample(target, argmax, proposals, q[None], [K], [True], [None], torch.Generator())
    assert out == [[int(argmax[0, 0]), int(argmax[0, 1]), int(argmax[0, 2])]]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=0.9, top_k=4, top_p=0.8, min_p=0.1)])
def test_filtered_probs_are_what_the_sampler_draws(params):
    torch.manual_seed(3)
    logits = (torch.randn(V) * 2).expand(N, V).contiguous()
    sampler = Sampler(torch.device("cpu"), seed=5)
    drawn = sampler.sample_tokens(logits, [params] * N, [None] * N)[0].tolist()
    probs = filtered_probs(logits[:1], [params])[0]
    assert chi_square_p(drawn, probs) > ALPHA
