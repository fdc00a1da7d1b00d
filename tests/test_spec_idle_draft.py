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


@pytest.mark.parametrize("draft_step,probes", [(4e-3, 0), (1e-5, 1)])
def test_a_probe_waits_until_the_time_at_k_zero_pays_for_it(draft_step, probes, model_factory):
    """A probe (one row at K = 1) costs its catch-up, a draft step and a wider verify: it runs
    only once PROBE_BUDGET of the time decoded at K = 0 covers that. 10 ms plain steps: a probe
    of about 8.5 ms needs 1.7 s (170 steps, more than this request has), one of 20 us waits
    only for PROBE_EVERY steps."""
    from mempath.engine.spec.decoder import PROBE_BUDGET, PROBE_EVERY
    path, _ = model_factory("llama")
    draft, _ = model_factory("llama", seed=7, num_hidden_layers=1)
    llm = LLM(path, dtype="float32", show_progress=False,
              speculative_config={"model": draft, "num_speculative_tokens": 4})
    decoder = llm.engine.spec_decoder
    decoder.global_rate = 0.0  # nothing is ever kept: choose() keeps K = 0, only probes speculate
    cost = decoder.cost
    cost.smoothing = 0.0
    for b in range(0, 9):
        cost.draft[bucket(1 << b)] = draft_step
        cost.verify.setdefault(bucket(1 << b), {}).update({1: 0.01, 2: 0.0105, 5: 0.012})
    assert cost.could_pay(1, overhead=draft_step)
    assert LONG.max_tokens > PROBE_EVERY and (draft_step < 1e-4 or 0.0085 > PROBE_BUDGET * 0.01 * LONG.max_tokens)
    llm.generate(PROMPTS[:1], LONG, use_tqdm=False)
    assert llm.stats()["spec_decode"]["num_probes"] == probes
