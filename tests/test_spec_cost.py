"""The cost model's draft length on given timings, and n-gram lookup."""
import pytest

from mempath.engine.spec.cost import SpecCostModel, bucket, expected_tokens
from mempath.engine.spec.ngram import propose_ngram


def model_with(draft: float, verify: dict[int, float], batch: int = 1, max_k: int = 8) -> SpecCostModel:
    cost = SpecCostModel(max_k)
    cost.observe_draft(batch, draft)
    for q, seconds in verify.items():
        cost.observe_verify(batch, q, seconds)
    return cost


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_cheap_draft_and_flat_verify_speculate_deep():
    # Memory-bound verify (9 tokens cost what 1 does), a draft at 5% of a step.
    cost = model_with(0.05, {1: 1.0, 9: 1.0})
    assert cost.choose([0.9]) == 8
    # At K = 4: 4.0951 tokens for 1.2 steps' time.
    assert cost.predicted_speedup(1, 4, [0.9]) == pytest.approx(4.0951 / 1.2)


def test_low_acceptance_or_costly_draft_choose_zero():
    cost = model_with(0.05, {1: 1.0, 9: 1.0})
    assert cost.choose([0.02]) == 0
    expensive = model_with(0.6, {1: 1.0, 9: 1.1})
    assert expensive.choose([0.6]) == 0


def test_the_choice_maximises_expected_throughput():
    # Verify time linear in tokens: 1 + 0.1 per extra token; draft 0.1 per step; acceptance 0.7.
    cost = model_with(0.1, {1: 1.0, 9: 1.8})
    gains = {k: expected_tokens(0.7, k) / (1.0 + 0.1 * k + 0.1 * k) for k in range(1, 9)}
    best = max(gains, key=gains.get)
    assert cost.choose([0.7]) == best == 3
    assert cost.verify_time(1, 4) == pytest.approx(1.3)  # interpolated between 1 and 9 tokens


def test_measurements_move_the_choice_and_buckets_are_separate():
    cost = model_with(0.05, {1: 1.0, 9: 1.0})
    assert cost.choose([0.8]) > 0
    for _ in range(40):  # at batch 64 verifying is compute-bound: 9x the tokens, 9x the time
        cost.observe_verify(64, 1, 1.0)
        cost.observe_verify(64, 9, 9.0)
        cost.observe_draft(64, 0.3)
    assert cost.choose([0.8] * 64) == 0
    assert cost.choose([0.8]) > 0
    assert bucket(33) == bucket(64) == 64 and bucket(1) == 1


def test_ngram_lookup():
    tokens = [5, 6, 7, 8, 1, 2, 5, 6, 7]
    assert propose_ngram(tokens, 3, 1, 3) == [8, 1, 2]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([9, 9, 9], 2, 1, 2) == [9]  # the latest match: its continuation is one token


def test_could_pay_is_choose_with_every_proposal_kept():
    """could_pay answers without a pass over the rows; on random timing tables it agrees with
    choose() over all-ones acceptances (the definition), with and without a draft and an overhead."""
    import random
    rng = random.Random(0)
    for _ in range(500):
        model = SpecCostModel(4)
        for b in (1, 2, 4, 8):
            model.draft[b] = rng.uniform(1e-4, 1e-2)
            lengths = rng.sample([1, 2, 3, 5], rng.randint(1, 4))
            model.verify[b] = {q: rng.uniform(1e-3, 1e-2) for q in lengths}
        batch, free, overhead = rng.choice([1, 3, 4, 8, 16]), rng.random() < 0.3, rng.choice([0.0, 1e-3])
        assert model.could_pay(batch, free, overhead) == (model.choose([1.0] * batch, free, overhead) > 0)
