"""Through the engine: tokens sampled with speculation follow the same distribution as plain
sampling (a two-sample chi-square per position over many seeded requests, tiny vocabulary),
and the same check rejects a deliberately wrong acceptance rule."""
import pytest
import torch

from mempath import LLM, SamplingParams
from tests.conftest import make_model

V, N, TOKENS = 8, 1200, 4
ALPHA = 1e-3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    make_model(target, vocab_size=V, tokenizer=False, seed=0)
    make_model(draft, vocab_size=V, tokenizer=False, seed=11, num_hidden_layers=1)
    return str(target), str(draft)


def sampled(target: str, draft: str | None, accept_rule=None) -> list[list[int]]:
    spec = None if draft is None else {"model": draft, "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(target, dtype="float32", show_progress=False, speculative_config=spec, max_num_seqs=64)  # SPEC_MAX_ROWS
    if accept_rule is not None:
        llm.engine.spec_decoder.accept_rule = accept_rule
    # A temperature below 1 spreads the random models' small logits out, so the two models differ.
    params = [SamplingParams(max_tokens=TOKENS, temperature=0.4, top_k=6, seed=i, ignore_eos=True) for i in range(N)]
    outputs = llm.generate([[1, 2, 3]] * N, params, use_tqdm=False)
    if draft is not None:
        assert llm.stats()["spec_decode"]["num_accepted_tokens"] > 0
    return [o.token_ids for o in outputs]


def homogeneity_p(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square p-value: are a and b drawn from one distribution?"""
    counts = torch.stack([torch.bincount(torch.tensor(x), minlength=V) for x in (a, b)]).double()
    counts = counts[:, counts.sum(0) > 0]
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    degrees = counts.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64), statistic / 2))


def test_speculative_sampling_matches_plain_sampling(pair):
    target, draft = pair
    plain, spec = sampled(target, None), sampled(target, draft)
    for j in range(TOKENS):
        assert homogeneity_p([t[j] for t in plain], [t[j] for t in spec]) > ALPHA, f"position {j}"
    always = sampled(target, draft, accept_rule=lambda p, q, u: torch.ones_like(p, dtype=torch.bool))
    # Keeping every proposal emits the draft's tokens at the speculated positions: rejected.
    assert min(homogeneity_p([t[j] for t in plain], [t[j] for t in always]) for j in (1, 2, 3)) < ALPHA
