"""The sampler: its memory peak against the planner's formula, and its draws against a plain reference."""
import pytest
import torch

from mempath.engine.sampler import Sampler, apply_top_k_top_p
from mempath.memory.formulas import sampler_peak_bytes
from mempath.tools.diagnose.meters import TensorBytesTracker
from mempath.sampling import SamplingParams

COSTLIEST = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, logprobs=5)
# Top-p without top-k: the rows are sorted, the sampler's costliest path in memory.
SORTED = SamplingParams(temperature=0.9, top_p=0.9, logprobs=5)


@pytest.mark.parametrize("rows,vocab", [(256, 20_000), (64, 8_000), (7, 30_000), (1, 50_000)])
def test_peak_matches_the_plan(rows, vocab):
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16)
    sampler = Sampler(torch.device("cpu"), 0)
    tracker = TensorBytesTracker()
    with tracker:
        sampler(logits, [SORTED] * rows, [None] * rows)
    planned = sampler_peak_bytes(vocab, rows)
    assert abs(tracker.peak - planned) <= 0.05 * planned, (tracker.peak, planned)


def reference_top_k_top_p(logits, top_k, top_p):
    """Row by row, the textbook way: keep the top k, then the smallest prefix reaching p."""
    out = torch.full_like(logits, float("-inf"))
    for row, (k, p) in enumerate(zip(top_k, top_p)):
        values, order = logits[row].sort(descending=True)
        keep = len(values) if k <= 0 else min(k, len(values))
        probs = torch.softmax(values[:keep], dim=-1)
        before = probs.cumsum(0) - probs
        keep = int((before < p).sum())
        out[row, order[:keep]] = values[:keep]
    return out


def test_top_k_top_p_matches_reference_across_sort_slices():
    torch.manual_seed(0)
    rows = 70  # three slices of SAMPLER_SORT_ROWS
    logits = torch.randn(rows, 300)
    top_k = [0, 1, 5, 299, 300, 40, 7] * 10
    top_p = [1.0, 0.5, 0.9, 0.1, 0.99, 1.0, 0.3] * 10
    expected = reference_top_k_top_p(logits, top_k, top_p)
    got = apply_top_k_top_p(logits.clone(), top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.equal(got[~torch.isinf(got)], expected[~torch.isinf(expected)])


def test_sampling_frequencies_follow_the_distribution():
    """min-p, top-k and temperature together: empirical frequencies vs the target distribution."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]]).repeat(20_000, 1)
    params = SamplingParams(temperature=0.7, top_k=4, min_p=0.2)
    tokens = torch.tensor(Sampler(torch.device("cpu"), 1)(logits, [params] * 20_000, [None] * 20_000).token_ids)
    target = torch.softmax(logits[0] / 0.7, dim=-1)
    target[4:] = 0  # top-k 4
    target[target < 0.2 * target.max()] = 0  # min-p
    target /= target.sum()
    freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
    assert torch.allclose(freq, target, atol=0.015), (freq, target)


def test_logprobs_equal_log_softmax_and_inputs_stay_intact():
    torch.manual_seed(1)
    logits = torch.randn(5, 1000, dtype=torch.float32)
    before = logits.clone()
    out = Sampler(torch.device("cpu"), 0)(logits, [COSTLIEST] * 5, [None] * 5)
    assert torch.equal(logits, before)  # float32 input: the sampler worked on a copy
    reference = torch.log_softmax(logits, dim=-1)
    for row, entry in enumerate(out.logprobs):
        assert len(entry) >= 5
        for token, value in entry.items():
            assert value == pytest.approx(reference[row, token].item(), abs=1e-5)
        best = reference[row].topk(5).indices.tolist()
        assert set(best) <= set(entry)


def test_top_k_path_matches_reference():
    """Every row with a top-k: only the top max(k) are taken, same result as sorting everything."""
    torch.manual_seed(2)
    logits = torch.randn(40, 500)
    top_k = [1, 5, 50, 7, 500 - 1] * 8
    top_p = [1.0, 0.5, 0.9, 0.3, 0.95] * 8
    expected = reference_top_k_top_p(logits, top_k, top_p)
    got = apply_top_k_top_p(logits.clone(), top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.equal(got[~torch.isinf(got)], expected[~torch.isinf(expected)])


def test_top_k_path_peak_is_the_noise_phase():
    """With top-k on every row the sampler never holds more than its scores and noise (plus small)."""
    rows, vocab = 48, 20_000
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16)
    tracker = TensorBytesTracker()
    with tracker:
        Sampler(torch.device("cpu"), 0)(logits, [COSTLIEST] * rows, [None] * rows)
    assert tracker.peak <= 8 * rows * vocab * 1.02


@pytest.mark.parametrize("vocab", [128256, 151936, 32064, 1000, 257])
def test_two_pass_argmax_equals_argmax_with_ties(vocab):
    """Values from a small range tie often: the two-pass argmax must still pick the first maximum."""
    from mempath.engine.sampler import row_argmax
    gen = torch.Generator().manual_seed(vocab)
    for rows in (1, 3, 8):
        x = torch.randint(0, 50, (rows, vocab), generator=gen).to(torch.bfloat16)
        assert torch.equal(row_argmax(x, two_pass=True), x.argmax(dim=-1))
        y = torch.randn(rows, vocab, generator=gen)
        y[:, -1] = y.max() + 1  # the maximum in the last group
        assert torch.equal(row_argmax(y, two_pass=True), torch.full((rows,), vocab - 1))


@pytest.mark.parametrize("top_k", [0, 4], ids=["sorted", "top-k"])
def test_top_p_boundary_drops_a_token_once_the_mass_before_it_reaches_p(top_k):
    """Probabilities that are powers of two make the cumulative mass exact in float32: a token
    whose higher-ranked tokens already cover exactly p is dropped (the nucleus is the smallest
    set reaching p; which of the two tied last tokens stays is either's)."""
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    for p, kept in ((0.5, 1), (0.6, 2), (0.75, 2), (0.8, 3), (0.875, 3), (0.9, 4)):
        out = apply_top_k_top_p(logits.clone(), [top_k], [p])[0]
        assert out[torch.isfinite(out)].sort(descending=True).values.tolist() == logits[0, :kept].tolist(), p


def test_top_p_at_the_boundary_samples_only_the_top_token():
    """[0.5, 0.25, 0.25] with p = 0.5: the top token alone covers p, so it is the only draw."""
    rows = 2000
    logits = torch.tensor([[0.5, 0.25, 0.25]]).log().repeat(rows, 1)
    params = SamplingParams(temperature=1.0, top_p=0.5)
    tokens = Sampler(torch.device("cpu"), 0)(logits, [params] * rows, [None] * rows).token_ids
    assert set(tokens) == {0}
