"""A draft that speculation cannot pay for does nothing: no forward while the cost model keeps
K = 0 (no prefill, no catch-up, no probing), and the prefix cache serves as it does without
a draft. Its KV is built when a request starts speculating."""
import pytest

from mempath import LLM, SamplingParams
from mempath.engine.spec.cost import bucket
from tests.test_correctness import PROMPTS

LONG = SamplingParams(max_tokens=140, temperature=0.0, ignore_eos=True)  # past 2 x PROBE_EVERY steps
SHORT = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def count_forwards(runner) -> list[int]:
    calls = [0]
    forward = runner.model.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    runner.model.forward = counted
    return calls


def idle_draft_engine(path: str, draft: str, **kwargs) -> LLM:
    """An adaptive engine whose measured draft step costs more than any gain: K = 0 always pays best."""
    llm = LLM(path, dtype="float32", show_progress=False,
              speculative_config={"model": draft, "num_speculative_tokens": 4}, **kwargs)
    cost = llm.engine.spec_decoder.cost
    for b in range(0, 9):
        cost.draft[bucket(1 << b)] = 10.0
        cost.verify.setdefault(bucket(1 << b), {}).update({1: 0.01, 5: 0.01})
    return llm


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_draft_runs_no_forward_while_the_cost_model_keeps_k_zero(async_scheduling, model_factory):
    path, _ = model_factory("llama")
    draft, _ = model_factory("llama", seed=7, num_hidden_layers=1)
    prompts = PROMPTS[:2]
    plain = LLM(path, dtype="float32", show_progress=False).generate(prompts, LONG, use_tqdm=False)
    llm = idle_draft_engine(path, draft, async_scheduling=async_scheduling)
    calls = count_forwards(llm.engine.spec_decoder.draft)
    outputs = llm.generate(prompts, LONG, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    stats = llm.stats()["spec_decode"]
    assert stats["num_drafts"] == 0 and stats["chosen_k_counts"][0] > 0
    assert calls[0] == 0


def test_speculation_turns_on_when_it_pays_again_on_steps_scheduled_ahead(model_factory):
    # Every step scheduled ahead chooses K afresh: an earlier K = 0 is not carried forward.
    path, _ = model_factory("llama")
    llm = idle_draft_engine(path, path)
    llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert llm.stats()["spec_decode"]["num_drafts"] == 0
    cost = llm.engine.spec_decoder.cost
    cost.draft = {b: 1e-6 for b in cost.draft}
    cost.smoothing = 0.0  # keep these timings whatever the CPU measures
    llm.generate(PROMPTS, SHORT, use_tqdm=False)
    assert llm.stats()["spec_decode"]["num_drafts"] > 0


def test_the_prefix_cache_serves_while_the_draft_is_idle(model_factory):
    path, _ = model_factory("llama")
    draft, _ = model_factory("llama", seed=7, num_hidden_layers=1)
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = LLM(path, dtype="float32", show_progress=False)
    plain.generate(PROMPTS, short, use_tqdm=False)
    want = [o.num_cached_tokens for o in plain.generate(PROMPTS, short, use_tqdm=False)]
    llm = idle_draft_engine(path, draft)
    llm.generate(PROMPTS, short, use_tqdm=False)
    got = [o.num_cached_tokens for o in llm.generate(PROMPTS, short, use_tqdm=False)]
    assert sum(want) > 0 and got == want


def test_a_request_whose_cached_prefix_has_no_draft_kv_catches_the_draft_up(model_factory):
    # The prompts' blocks are published while the draft is idle; speculation then turns on
    # and the draft builds its KV over those shared blocks: output stays plain decoding's.
    path, _ = model_factory("llama")
    plain = LLM(path, dtype="float32", show_progress=False).generate(PROMPTS, SHORT, use_tqdm=False)
    llm = idle_draft_engine(path, path)  # the target as its own draft: every proposal kept
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    decoder = llm.engine.spec_decoder
    decoder.config = type(decoder.config)(**{**decoder.config.__dict__, "adaptive": False})
    outputs = llm.generate(PROMPTS, SHORT, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in outputs) > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    stats = llm.stats()
    assert stats["spec_decode"]["acceptance_rate"] > 0.9
    assert stats["kv_blocks_used"] == 0


def probing_engine(path: str, draft: str, draft_step: float, verify: dict, **kwargs) -> LLM:
    """An adaptive engine on these step times (seconds) whose proposals are never kept: K = 0
    is always chosen, so only probes speculate."""
    llm = LLM(path, dtype="float32", show_progress=False,
              speculative_config={"model": draft, "num_speculative_tokens": 4}, **kwargs)
    decoder = llm.engine.spec_decoder
    decoder.kept_sum = 0.0
    decoder.cost.smoothing = 0.0
    for b in range(0, 9):
        decoder.cost.draft[bucket(1 << b)] = draft_step
        decoder.cost.verify.setdefault(bucket(1 << b), {}).update(verify)
    return llm


@pytest.mark.parametrize("draft_step,probes", [(4e-3, 0), (1e-5, 1)])
def test_a_probe_waits_until_the_time_at_k_zero_pays_for_it(draft_step, probes, model_factory):
    """A probe (one row at K = 1) costs its catch-up, a draft step and a wider verify: it runs
    only once PROBE_BUDGET of the time decoded at K = 0 covers that. 10 ms plain steps: a probe
    of about 8.5 ms needs 1.7 s (170 steps, more than this request has), one of 20 us waits
    only for PROBE_EVERY steps."""
    from mempath.engine.spec.decoder import PROBE_BUDGET, PROBE_EVERY
    path, _ = model_factory("llama")
    draft, _ = model_factory("llama", seed=7, num_hidden_layers=1)
    llm = probing_engine(path, draft, draft_step, {1: 0.01, 2: 0.0105, 5: 0.012})
    cost = llm.engine.spec_decoder.cost
    assert cost.could_pay(1, overhead=draft_step)
    assert LONG.max_tokens > PROBE_EVERY and (draft_step < 1e-4 or 0.0085 > PROBE_BUDGET * 0.01 * LONG.max_tokens)
    llm.generate(PROMPTS[:1], LONG, use_tqdm=False)
    assert llm.stats()["spec_decode"]["num_probes"] == probes


def test_a_k_zero_choice_stands_while_the_rows_and_their_rates_are_unchanged(model_factory):
    """Every step scheduled ahead asks whether to speculate; the cost model's pass over every row
    took 0.28 ms a step at batch 64 (CPU host, tiny shapes), where adaptive speculation ran 2.9%
    behind plain decoding on the H200. A K = 0 choice is re-made only every RECHOOSE_EVERY
    steps, or at once when a row or a rate changes."""
    from mempath.engine.spec.decoder import RECHOOSE_EVERY
    path, _ = model_factory("llama")
    draft, _ = model_factory("llama", seed=7, num_hidden_layers=1)
    llm = idle_draft_engine(path, draft)
    cost = llm.engine.spec_decoder.cost
    choose, calls = cost.choose, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return choose(*args, **kwargs)

    cost.choose = counted
    llm.generate(PROMPTS[:4], LONG, use_tqdm=False)
    steps = LONG.max_tokens
    assert 0 < calls[0] <= steps // RECHOOSE_EVERY + 4
    assert llm.stats()["spec_decode"]["num_drafts"] == 0


def test_rejected_proposals_lower_a_new_requests_prior_at_once(model_factory):
    """A request's rate starts at the global rate. After two rows whose 8 proposals were all
    rejected, a new request must not start at a rate near the first guess (0.6): the global rate
    counts proposals, not steps (an average moving 20% a step left 0.38, enough to speculate
    a step or two on every new request at batch 1)."""
    from mempath.engine.request import Request
    path, _ = model_factory("llama")
    draft, _ = model_factory("llama", seed=7, num_hidden_layers=1)
    llm = idle_draft_engine(path, draft)
    decoder = llm.engine.spec_decoder
    first, second, fresh = (Request(f"r{i}", None, [1, 2, 3], SamplingParams(max_tokens=4)) for i in range(3))
    decoder._record(first, 0, 4)
    decoder._record(second, 0, 4)
    assert decoder.rate(fresh) < 0.25
    decoder._record(first, 4, 4)
    assert decoder.rate(fresh) > decoder.rate(second)


def test_a_probe_that_cost_more_than_predicted_makes_the_next_wait_longer(model_factory):
    """A probe's predicted cost can be far off (one row speculating runs the whole batch's verify
    eagerly): each probe's measured cost then sets the budget the next must fit."""
    import time as _time
    from mempath.engine.spec.decoder import MAX_PROBE_EVERY, PROBE_EVERY
    path, _ = model_factory("llama")
    draft, _ = model_factory("llama", seed=7, num_hidden_layers=1)
    long = SamplingParams(max_tokens=PROBE_EVERY * 6, temperature=0.0, ignore_eos=True)
    counts = []
    for slow in (False, True):
        # 200 ms plain steps: a probe's measured cost is its wall time less that, 0 on any CPU short of a probe
        # step taking 456 ms (the second probe's budget, below, plus the step), as under a loaded machine it can
        # take over 100.
        llm = probing_engine(path, draft, 1e-5, {1: 0.2, 2: 0.202, 5: 0.202}, max_model_len=long.max_tokens + 64)
        decoder = llm.engine.spec_decoder
        if slow:
            propose = decoder._propose_with_draft

            def slow_propose(*args, **kwargs):
                _time.sleep(0.8)
                return propose(*args, **kwargs)

            decoder._propose_with_draft = slow_propose
        llm.generate(PROMPTS[:1], long, use_tqdm=False)
        counts.append(llm.stats()["spec_decode"]["num_probes"])
    assert MAX_PROBE_EVERY > 4 * PROBE_EVERY
    # Predicted cost: probes after 64 and 64 + 256 steps. Measured 600 ms or more: 0.5% of 51.2 s of
    # decoding at K = 0 (256 ms) does not cover it, so no second probe in this request.
    assert counts == [2, 1]
