"""Engine behaviour: prefix caching, sampling, stops, bad input, chat, CLI."""
import json
import re

import numpy as np
import pytest
import torch

from mempath import LLM, SamplingParams
from mempath.assets import default_model_path
from mempath.cli import main as cli_main


@pytest.fixture(scope="module")
def llm(model_factory):
    path, _ = model_factory("llama")
    return LLM(path, dtype="float32", show_progress=False, num_gpu_blocks_override=24)


def greedy(n=16, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_prefix_cache_hit_gives_same_tokens(model_factory):
    path, _ = model_factory("llama")
    shared = [7 + i % 90 for i in range(50)]
    prompts = [shared + [1, 2, 3], shared + [4, 5]]
    cached = LLM(path, dtype="float32", show_progress=False)
    first = cached.generate(prompts[0], greedy())[0]
    second = cached.generate(prompts[1], greedy())[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48  # three full blocks of 16
    uncached = LLM(path, dtype="float32", show_progress=False, enable_prefix_caching=False)
    ref = uncached.generate(prompts, greedy(), use_tqdm=False)
    assert [first.token_ids, second.token_ids] == [o.token_ids for o in ref]
    assert all(o.num_cached_tokens == 0 for o in ref)
    stats = cached.stats()
    # In tokens, as vLLM counts them: each prompt queried, its cached blocks' tokens hit.
    assert stats["prefix_cache_queries"] == 53 + 52 and stats["prefix_cache_hits"] == 48
    assert stats["kv_blocks_used"] == 0


def test_prefix_cache_counters_count_each_request_once(model_factory):
    """Each admission attempt counted: a request waiting for room queried the cache every step, so a pool under
    pressure reported hundreds of times the prompt tokens it was sent, and a hit rate from nothing."""
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, num_gpu_blocks_override=20, max_model_len=256)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[10 + i] * 20 for i in range(4)], params, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0  # too few blocks for four: requests waited and were preempted
    assert stats["prefix_cache_queries"] == 4 * 20
    assert stats["prefix_cache_hits"] == sum(o.num_cached_tokens for o in outs) == 0
    short = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate([99] * 20, short, use_tqdm=False)
    again = llm.generate([99] * 20, short, use_tqdm=False)[0]
    assert again.num_cached_tokens == 16
    assert llm.stats()["prefix_cache_queries"] == 6 * 20 and llm.stats()["prefix_cache_hits"] == 16


def test_repeated_prompt_reuses_all_but_last_block(llm):
    prompt = list(range(20, 52))  # exactly two blocks
    llm.generate(prompt, greedy(4))
    again = llm.generate(prompt, greedy(4))[0]
    assert again.num_cached_tokens == 16  # the block holding the last token is recomputed


def test_seeded_sampling_is_independent_of_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([5, 6, 7], params)[0].token_ids
    noisy = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    batch = llm.generate([[9, 9, 9, 9], [5, 6, 7], list(range(40))], [noisy, params, noisy], use_tqdm=False)
    assert batch[1].token_ids == alone
    other_seed = llm.generate([5, 6, 7], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95,
                                                         seed=99, ignore_eos=True))[0]
    assert other_seed.token_ids != alone


def _seeded(seed, n=24):
    return SamplingParams(max_tokens=n, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)


SEEDED_PROMPTS = {"s1": [5, 6, 7], "s2": list(range(30, 50))}


@pytest.fixture(scope="module")
def seeded_alone(model_factory):
    """Each seeded request's tokens when it runs alone: sync, a pool with room to spare."""
    path, _ = model_factory("llama")
    alone = LLM(path, dtype="float32", show_progress=False, async_scheduling=False)
    return {rid: alone.generate(prompt, _seeded(seed))[0].token_ids
            for (rid, prompt), seed in zip(SEEDED_PROMPTS.items(), (1, 2))}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("num_blocks", [None, 6], ids=["room", "preempted"])
def test_seeded_requests_are_independent_of_batch_preemption_and_async(model_factory, seeded_alone,
                                                                       async_scheduling, num_blocks):
    """Two seeded requests in one batch with an unseeded one give the tokens each gives alone,
    with steps launched ahead or not, and when the pool is too small for all three: the newest
    are preempted, recompute their prompt and generated tokens, and draw on from their own
    generator."""
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, async_scheduling=async_scheduling,
              num_gpu_blocks_override=num_blocks)
    engine = llm.engine
    engine.add_request(list(range(60, 100)), SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True), "u")
    requests = {}
    for (rid, prompt), seed in zip(SEEDED_PROMPTS.items(), (1, 2)):
        engine.add_request(prompt, _seeded(seed), rid)
        requests[rid] = engine.outputs.requests[rid]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert {rid: done[rid].token_ids for rid in SEEDED_PROMPTS} == seeded_alone
    assert done["u"].finish_reason == "length" and len(done["u"].token_ids) == 40
    if num_blocks is not None:
        assert requests["s2"].num_preemptions > 0  # the newest: preempted and recomputed
    if async_scheduling:
        assert engine.stats()["steps_launched_ahead"] > 0
    assert engine.stats()["kv_blocks_used"] == 0


def test_two_requests_with_the_same_seed_in_one_batch_draw_the_same_tokens(llm):
    outs = llm.generate([[5, 6, 7], [5, 6, 7]], [_seeded(3), _seeded(3)], use_tqdm=False)
    assert outs[0].token_ids == outs[1].token_ids
    assert len(set(outs[0].token_ids)) > 1  # really sampled, not a constant


@pytest.mark.parametrize("chunk", [512, 32], ids=["whole prompt", "chunked"])
def test_a_waiting_request_that_can_never_fit_fails_alone(model_factory, chunk):
    """A request bigger than the whole pool (admission checks this; here it is queued past
    the check, as if the pool had shrunk) ends with an error once nothing else runs, and the
    request behind it runs normally: no endless loop, no block left behind."""
    from mempath.engine.request import Request
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, num_gpu_blocks_override=8,
              max_num_batched_tokens=chunk)
    expected = llm.generate([5, 6, 7], greedy(4))[0].token_ids
    engine = llm.engine
    big = Request("big", None, [5 + i % 50 for i in range(200)], greedy(4))  # 13 blocks of 8
    engine.outputs.requests["big"] = big
    engine.scheduler.add(big)
    engine.add_request([5, 6, 7], greedy(4), "ok")
    done = {}
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.has_unfinished_requests()
    assert done["big"].finish_reason == "error" and "does not fit in the KV pool" in done["big"].error
    assert "needs 13 blocks (200 tokens), the pool has 8" in done["big"].error  # and the fix follows
    assert done["ok"].finish_reason == "length" and done["ok"].token_ids == expected
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_truncation_to_one_token_equals_greedy(llm, kw):
    ref = llm.generate([3, 1, 4, 1, 5], greedy(10))[0].token_ids
    out = llm.generate([3, 1, 4, 1, 5], SamplingParams(max_tokens=10, temperature=1.5, ignore_eos=True, **kw))[0]
    assert out.token_ids == ref


def test_top_k_restricts_support(llm):
    """At a high temperature, 48 seeded draws with top-k 3 land on exactly the top 3: none
    outside, and not fewer (a top-k that kept one token would draw one)."""
    prompt = [11, 12, 13]
    lp = llm.generate(prompt, greedy(1, logprobs=3))[0].logprobs[0]
    top3 = set(sorted(lp, key=lp.get, reverse=True)[:3])
    params = [SamplingParams(max_tokens=1, temperature=5.0, top_k=3, seed=seed) for seed in range(48)]
    drawn = {o.token_ids[0] for o in llm.generate([prompt] * 48, params, use_tqdm=False)}
    assert drawn == top3


def test_logprobs_match_model_distribution(model_factory, llm):
    _, hf = model_factory("llama")
    prompt = [2, 40, 41, 42]
    out = llm.generate(prompt, greedy(1, logprobs=5))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
    entry = out.logprobs[0]
    assert len(entry) == 5
    top = ref.topk(5)
    assert set(entry) == set(top.indices.tolist())
    for token_id, value in entry.items():
        assert value == pytest.approx(ref[token_id].item(), abs=1e-4)


def test_stop_token_and_stop_string(llm):
    base = llm.generate([5, 6, 7, 8], greedy(12))[0]
    stop_id = base.token_ids[3]
    first_at = base.token_ids.index(stop_id)
    out = llm.generate([5, 6, 7, 8], greedy(12, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == base.token_ids[:first_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    text = llm.generate("def read_config(path):", greedy(24))[0].text
    stop = text[5:8]
    assert stop
    cut = llm.generate("def read_config(path):", greedy(24, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.index(stop)]


def test_eos_stops_unless_ignored(model_factory):
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False)
    free = llm.generate([9, 8, 7], greedy(8))[0].token_ids
    llm.engine.outputs.eos_token_ids = {free[2]}
    stopped = llm.generate([9, 8, 7], SamplingParams(max_tokens=8, temperature=0))[0]
    assert stopped.token_ids == free[:free.index(free[2]) + 1] and stopped.finish_reason == "stop"
    ignored = llm.generate([9, 8, 7], greedy(8))[0]
    assert ignored.token_ids == free and ignored.finish_reason == "length"


def test_string_prompt_text_and_timings(llm):
    out = llm.generate("class Engine:", greedy(8))[0]
    assert out.prompt == "class Engine:"
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert 0 < out.time_to_first_token <= out.total_time


def test_n_samples(llm):
    outs = llm.generate([1, 2, 3], SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=5, ignore_eos=True))
    assert len(outs) == 1 and outs[0].finished  # one output per prompt, holding its n samples (vLLM's shape)
    samples = outs[0].outputs
    assert [s.index for s in samples] == [0, 1, 2] and all(len(s.token_ids) == 6 for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) > 1
    assert outs[0].text == samples[0].text and all(s.finish_reason == "length" for s in samples)


def test_outputs_have_vllms_fields(llm):
    out = llm.generate([1, 2, 3], greedy(4, logprobs=2))[0]
    sample = out.outputs[0]
    assert out.prompt_token_ids == [1, 2, 3] and out.request_id and out.finished
    assert sample.token_ids == out.token_ids and len(sample.logprobs) == 4
    expected = sum(entry[t] for t, entry in zip(sample.token_ids, sample.logprobs))
    assert sample.cumulative_logprob == pytest.approx(expected) and expected < 0
    assert out.metrics.time_to_first_token <= out.metrics.total_time
    assert llm.generate([1, 2, 3], sampling_params=greedy(4))[0].outputs[0].cumulative_logprob is None  # as vLLM


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hello"}], greedy(5))[0]
    assert out.prompt.startswith("<s>user: hello") and out.prompt.endswith("assistant:")
    assert len(out.token_ids) == 5


@pytest.mark.parametrize("prompt, params, message", [
    ("", greedy(), "prompt is empty"),
    ([1] * 600, greedy(), "max_model_len"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, 2], SamplingParams(temperature=-1), "temperature"),
    ([1, 2], SamplingParams(top_p=0), "top_p"),
    ([1, 99999], greedy(), "outside the vocabulary"),
    ([1] * 400, greedy(16), "KV blocks"),
    ([1, 2], SamplingParams(n=0), "n must be >= 1"),
    ([1, 2], SamplingParams(n=1.5), "n must be a whole number"),
    ([1, 2], SamplingParams(seed="x"), "seed must be a whole number"),
    ([1, 2], SamplingParams(stop=5), "stop must be a string or a list of strings"),
    ([1, 2], SamplingParams(stop=["a", 5]), "stop must be a string or a list of strings"),
    ([1, 2], SamplingParams(stop_token_ids=[1, "2"]), "stop_token_ids must be a list of token ids"),
    ([1, 2], SamplingParams(top_k=2.5), "top_k must be a whole number"),
    ([1, 2], SamplingParams(logit_bias=5), "logit_bias must be a dict"),
    ([1, 2], SamplingParams(bad_words=7), "bad_words must be non-empty strings"),
])
def test_bad_single_request_raises(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, params)
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_bad_n_in_a_batch_is_that_prompts_error_and_the_others_run(llm):
    good = [4, 5, 6]
    outs = llm.generate([good, good], [greedy(4), SamplingParams(n=0)], use_tqdm=False)
    assert len(outs[0].token_ids) == 4
    assert outs[1].finish_reason == "error" and "n must be >= 1" in outs[1].error
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("params, says", [({"max_tokens": 2}, "use SamplingParams(**...)"), (3, "got int")])
def test_sampling_params_of_another_type_are_one_line(llm, params, says):
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams or a list of them") as error:
        llm.generate([1, 2], params)
    assert says in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("messages", [[], "hi", [[]], [{"role": "user", "content": "hi"}, "x"], None])
def test_chat_refuses_what_is_not_a_conversation_in_one_line(llm, messages):
    with pytest.raises(ValueError, match=r"messages must be a conversation"):
        llm.chat(messages, greedy(2))
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("messages, template, says", [
    ([{"foo": "bar"}], None, "message 0 has no role"),
    ([{"role": "user"}], None, "message 0 (user) needs 'content'"),
    ([{"role": "user", "content": 5}], None, "needs 'content'"),
    ([{"role": "user", "content": "hi"}], 5, "chat_template must be the template's text"),
    ([{"role": "user", "content": "hi"}], "{{ bad", "chat_template failed on these messages"),
    ([{"role": "user", "content": "hi"}], "{{ messages[5].content }}", "chat_template failed on these messages"),
    ([{"role": "user", "content": "hi"}], "", "rendered a conversation as empty text"),
])
def test_chat_refuses_bad_messages_and_templates_in_one_line(llm, messages, template, says):
    with pytest.raises(ValueError, match=re.escape(says)) as error:
        llm.chat(messages, greedy(2), chat_template=template)
    assert "\n" not in str(error.value)
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("prompt", [np.array([1, 2, 3]), torch.tensor([1, 2, 3]), (1, 2, 3)])
def test_a_token_id_array_or_tuple_is_one_prompt(llm, prompt):
    [out] = llm.generate(prompt, greedy(3))
    assert out.prompt_token_ids == [1, 2, 3] and out.token_ids == llm.generate([1, 2, 3], greedy(3))[0].token_ids


@pytest.mark.parametrize("prompt", [None, 5, b"hello"])
def test_what_is_no_prompt_is_refused_in_one_line(llm, prompt):
    with pytest.raises(ValueError, match="prompts must be a string, a list of token ids"):
        llm.generate(prompt, greedy(2))


def test_engine_rejects_empty_token_list(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.engine.add_request([], greedy())


def test_bad_request_in_batch_does_not_stop_others(llm):
    good = [4, 5, 6]
    ref = llm.generate(good, greedy(8))[0].token_ids
    outs = llm.generate([good, [], [1] * 600, good], greedy(8), use_tqdm=False)
    assert outs[0].token_ids == ref and outs[3].token_ids == ref
    for bad in outs[1:3]:
        assert bad.finish_reason == "error" and bad.error and bad.token_ids == []
    assert llm.stats()["kv_blocks_used"] == 0


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request(list(range(40)), greedy(50), "abort-me")
    engine.add_request(list(range(30)), greedy(5), "keep")
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    aborted = engine.abort_request("abort-me")
    assert aborted.finished and aborted.finish_reason == "abort"
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["keep"]
    assert engine.stats()["kv_blocks_used"] == 0
    assert engine.abort_request("abort-me") is None


def test_unsupported_architecture_is_clear(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        LLM(str(tmp_path), show_progress=False)


def test_unknown_engine_option_is_clear(model_factory):
    path, _ = model_factory("llama")
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(path, max_num_seq=4)


def test_cli_generate_json(model_factory, capsys):
    path, _ = model_factory("llama")
    code = cli_main(["generate", path, "def f(x):", "--max-tokens", "6", "--json", "--quiet",
                     "--ignore-eos", "--dtype", "float32"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["token_ids"]) == 6 and result["finish_reason"] == "length"


def test_cli_reports_bad_input(model_factory, capsys):
    path, _ = model_factory("llama")
    code = cli_main(["generate", path, "x", "--max-tokens", "0", "--quiet"])
    assert code == 2
    assert "max_tokens" in capsys.readouterr().err


def test_step_out_of_memory_fails_one_request_and_keeps_serving(model_factory):
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False)
    ref = llm.generate([[4, 5, 6], [7, 8, 9]], greedy(8), use_tqdm=False)
    runner = llm.engine.runner
    real_execute = runner.execute
    calls = [0]

    def flaky(batch, sampling, **kwargs):
        calls[0] += 1
        if calls[0] == 3:  # a decode step with both requests in it
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return real_execute(batch, sampling, **kwargs)

    runner.execute = flaky
    outs = llm.generate([[4, 5, 6], [7, 8, 9]], greedy(8), use_tqdm=False)
    runner.execute = real_execute
    assert outs[0].token_ids == ref[0].token_ids and outs[0].finish_reason == "length"
    assert outs[1].finish_reason == "error" and "step" in outs[1].error
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_failed_steps_tensors_are_freed_before_its_victim_is_chosen(model_factory):
    """The error of a step that ran out of memory must not keep the step's tensors (its frames, through the
    tracebacks) alive past the cache emptied after it: on CUDA their segments would stay reserved, and the
    next steps, under the allocator's cap, would have that much less."""
    import weakref
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False)
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    real_execute, real_fail = runner.execute, scheduler.fail_newest
    held, alive_then = [], []

    def out_of_memory(batch, sampling, **kwargs):
        activations = torch.ones(1 << 16)  # a tensor of the step, held by this frame only
        held.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    def fail_newest(*args, **kwargs):
        alive_then.append(held[-1]() is not None)
        return real_fail(*args, **kwargs)

    runner.execute, scheduler.fail_newest = out_of_memory, fail_newest
    outs = llm.generate([[4, 5, 6]], greedy(4), use_tqdm=False)
    runner.execute, scheduler.fail_newest = real_execute, real_fail
    assert outs[0].finish_reason == "error" and alive_then == [False]


# ---------------------------------------------------------------- async scheduling


def _mixed_params(stop_token: int) -> list[SamplingParams]:
    return [greedy(12), greedy(3), greedy(20, stop_token_ids=[stop_token]),
            SamplingParams(max_tokens=15, temperature=0.8, top_p=0.9, seed=7), greedy(1), greedy(9)]


def test_async_scheduling_gives_the_same_outputs(model_factory):
    """Launching each decode step before reading the previous one's tokens changes nothing visible:
    same tokens and finish reasons (stop ids found a step late included), no block left behind."""
    path, _ = model_factory("llama")
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 9, 30, 4, 12)]
    sync = LLM(path, dtype="float32", show_progress=False, async_scheduling=False)
    probe = sync.generate(prompts[2:3], greedy(20), use_tqdm=False)[0].token_ids
    params = _mixed_params(stop_token=probe[5])
    expected = sync.generate(prompts, params, use_tqdm=False)
    assert sync.stats()["steps_launched_ahead"] == 0
    fast = LLM(path, dtype="float32", show_progress=False)
    got = fast.generate(prompts, params, use_tqdm=False)
    for e, g in zip(expected, got):
        assert (g.token_ids, g.finish_reason, g.stop_reason) == (e.token_ids, e.finish_reason, e.stop_reason)
    assert got[2].finish_reason == "stop" and len(got[2].token_ids) == 6
    stats = fast.stats()
    assert stats["steps_launched_ahead"] > 5
    assert stats["kv_blocks_used"] == 0 and not fast.engine.has_unfinished_requests()


def test_async_scheduling_abort_while_a_step_is_in_flight(model_factory):
    path, _ = model_factory("llama")
    reference = LLM(path, dtype="float32", show_progress=False, async_scheduling=False)
    expected = reference.generate([list(range(30))], greedy(12), use_tqdm=False)[0].token_ids
    llm = LLM(path, dtype="float32", show_progress=False)
    engine = llm.engine
    engine.add_request(list(range(40)), greedy(50), "abort-me")
    engine.add_request(list(range(30)), greedy(12), "keep")
    while engine.num_steps_ahead < 2:
        engine.step()
    assert engine.in_flight is not None
    assert engine.abort_request("abort-me").finish_reason == "abort"
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["keep"] and done[0].token_ids == expected
    assert engine.stats()["kv_blocks_used"] == 0


def test_async_scheduling_yields_to_new_requests(model_factory):
    """A request arriving while steps run ahead is admitted at the next step, as without them."""
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False)
    engine = llm.engine
    engine.add_request(list(range(20)), greedy(30), "first")
    while engine.num_steps_ahead < 2:
        engine.step()
    engine.add_request(list(range(10)), greedy(4), "second")
    engine.step()  # reads the in-flight tokens; the waiting request must not be held back by another step ahead
    engine.step()
    assert engine.outputs.requests["second"].num_computed_tokens > 0
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("max_num_seqs,max_tokens", [(1, 8), (2, 2), (4, 64)])
def test_kernel_warm_up_probes_stay_inside_the_step_buffers(model_factory, max_num_seqs, max_tokens):
    """The start-up probes (run on CUDA to compile every kernel variant) fit any configuration."""
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_tokens, max_model_len=64)
    engine = llm.engine
    engine.probes.compile_kernels(engine.kv.num_blocks)
    out = llm.generate([[5, 6, 7]], greedy(4), use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and engine.stats()["kv_blocks_used"] == 0


def test_block_size_auto_and_bad_block_sizes(model_factory):
    path, _ = model_factory("llama")
    assert LLM(path, dtype="float32", show_progress=False, block_size="auto").engine.config.block_size == 16
    for bad in ("big", 12, 0):
        with pytest.raises(ValueError, match="block_size must be a power of two"):
            LLM(path, dtype="float32", show_progress=False, block_size=bad)


def test_async_scheduling_survives_an_error_in_the_step_launched_ahead(model_factory):
    """An exception while launching ahead must not lose the in-flight tokens: the engine
    goes on and the request's output equals a run without the error."""
    path, _ = model_factory("llama")
    expected = LLM(path, dtype="float32", show_progress=False).generate([[4, 5, 6]], greedy(8),
                                                                        use_tqdm=False)[0].token_ids
    llm = LLM(path, dtype="float32", show_progress=False)
    engine, real, calls = llm.engine, llm.engine.runner.execute, [0]

    def flaky(batch, sampling, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            assert kwargs.get("tokens_from") is not None  # a step launched ahead
            raise RuntimeError("transient")
        return real(batch, sampling, **kwargs)

    engine.runner.execute = flaky
    engine.add_request([4, 5, 6], greedy(8), "a")
    with pytest.raises(RuntimeError, match="transient"):
        while engine.has_unfinished_requests():
            engine.step()
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.token_ids for o in done] == [expected]
    assert engine.stats()["kv_blocks_used"] == 0


def test_out_of_memory_ahead_never_fails_a_request_that_just_stopped(model_factory):
    """The OOM victim is chosen after the in-flight tokens are read: a request that stopped on
    its in-flight token finishes once, with its stop, and a live request takes the error."""
    path, _ = model_factory("llama")
    reference = LLM(path, dtype="float32", show_progress=False, async_scheduling=False)
    ref = reference.generate([[4, 5, 6], [7, 8, 9]], greedy(10), use_tqdm=False)
    stop = ref[1].token_ids[3]
    llm = LLM(path, dtype="float32", show_progress=False)
    engine, real = llm.engine, llm.engine.runner.execute

    def flaky(batch, sampling, **kwargs):
        newest = batch.requests[-1]
        if kwargs.get("tokens_from") is not None and newest.request_id == "b" and newest.num_output_tokens == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return real(batch, sampling, **kwargs)

    engine.runner.execute = flaky
    engine.add_request([4, 5, 6], greedy(10), "a")
    engine.add_request([7, 8, 9], greedy(10, stop_token_ids=[stop]), "b")
    finished = []
    while engine.has_unfinished_requests():
        finished += [(o.request_id, o.finish_reason) for o in engine.step() if o.finished]
    assert sorted(finished) == [("a", "error"), ("b", "stop")]
    assert engine.stats()["kv_blocks_used"] == 0


def test_kernel_warm_up_probes_fit_a_pool_of_one_token_blocks(model_factory):
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, block_size=1, num_gpu_blocks_override=4,
              max_num_seqs=8, max_num_batched_tokens=16, max_model_len=4)
    llm.engine.probes.compile_kernels(llm.engine.kv.num_blocks)
    assert len(llm.generate([[5, 6]], greedy(2), use_tqdm=False)[0].token_ids) == 2


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failure_after_the_step_fails_that_request_alone(async_scheduling):
    """If one request's output handling raises (here its detokenizer), it ends with an error and
    the others finish normally, their tokens intact."""
    from mempath.assets import default_model_path
    llm = LLM(default_model_path(), device="cpu", dtype="float32", show_progress=False,
              async_scheduling=async_scheduling)
    engine = llm.engine
    expected = llm.generate(["def f(x):"], greedy(6), use_tqdm=False)[0].token_ids
    engine.add_request("def f(x):", greedy(6), "ok")
    engine.add_request("import os", greedy(6), "broken")
    calls = [0]
    real_delta = engine.outputs.detokenizers["broken"].delta

    def delta(token_ids):
        calls[0] += 1
        if calls[0] == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
        return real_delta(token_ids)

    engine.outputs.detokenizers["broken"].delta = delta
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["broken"].finish_reason == "error" and "UnicodeDecodeError" in done["broken"].error
    assert done["ok"].finish_reason == "length" and done["ok"].token_ids == expected
    assert engine.stats()["kv_blocks_used"] == 0


def test_vllm_prompt_dicts_are_prompts_and_other_fields_are_refused(llm):
    """vLLM's TokensPrompt and TextPrompt ({"prompt_token_ids": ...}, {"prompt": ...}) are what
    its users pass to generate(); a field we do not serve is refused in one line, not ignored."""
    ids = [5, 6, 7, 8]
    text = llm.engine.tokenizer.decode(ids)
    expected = llm.generate(ids, greedy(6))[0].token_ids
    assert llm.generate({"prompt_token_ids": ids}, greedy(6))[0].token_ids == expected
    both = llm.generate([{"prompt_token_ids": ids}, {"prompt": text}, ids], greedy(6), use_tqdm=False)
    assert both[0].token_ids == both[2].token_ids == expected
    assert both[0].prompt_token_ids == ids and both[1].prompt == text
    assert both[1].token_ids == llm.generate(text, greedy(6))[0].token_ids
    with pytest.raises(ValueError, match="multi_modal_data.*not supported.*prompt_token_ids"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {}}, greedy(2))
    with pytest.raises(ValueError, match="one of"):
        llm.generate({"prompt": text, "prompt_token_ids": ids}, greedy(2))
    mixed = llm.generate([{"prompt_token_ids": ids, "mm_processor_kwargs": {}}, ids], greedy(3), use_tqdm=False)
    assert mixed[0].outputs[0].finish_reason == "error" and "mm_processor_kwargs" in mixed[0].error
    assert mixed[0].prompt_token_ids == ids
    assert mixed[1].token_ids == expected[:3]
    for bad, says in (({"prompt_token_ids": 5}, "list of integers"), ({"prompt": ids}, "must be text"),
                      ({"prompt_token_ids": [5, 6.0]}, r"got 6\.0 \(float\)"), ({"prompt_token_ids": [True]}, "bool")):
        with pytest.raises(ValueError, match=says):
            llm.generate(bad, greedy(2))
        assert llm.generate([bad, ids], greedy(2), use_tqdm=False)[0].outputs[0].finish_reason == "error"
    assert llm.stats()["kv_blocks_used"] == 0


def test_token_id_prompts_take_any_integers_and_refuse_the_rest_in_one_line(llm):
    """Plain id lists go through the same check as vLLM's prompt_token_ids: a float was truncated."""
    import numpy as np
    ids = [5, 6, 7, 8]
    expected = llm.generate(ids, greedy(3))[0].token_ids
    assert llm.generate(np.array(ids).tolist(), greedy(3))[0].token_ids == expected
    assert llm.generate([list(np.array(ids))], greedy(3), use_tqdm=False)[0].token_ids == expected
    for bad, says in (([5, 6.5], r"got 6\.5 \(float\)"), ([5, True], "bool"), ([5, "6"], "str")):
        with pytest.raises(ValueError, match=says):
            llm.generate(bad, greedy(2))
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("min_seqs", [1, 6])
def test_wide_steps_order_their_sequences_longest_first(model_factory, monkeypatch, min_seqs):
    """From DECODE_ORDER_MIN_SEQS sequences, the runner hands the decode kernel the step's sequences by
    descending context (stable among equals), a permutation uploaded beside seq_lens, in mixed steps and
    decode steps; narrower steps keep batch order (no seq_order)."""
    from mempath.engine import runner as runner_module
    monkeypatch.setattr(runner_module, "DECODE_ORDER_MIN_SEQS", min_seqs)
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False)
    runner = llm.engine.runner
    seen = []
    prepare = runner.prepare

    def recording(batch, *args, **kwargs):
        out = prepare(batch, *args, **kwargs)
        meta = out[2]
        n = meta.seq_lens.shape[0]
        order = None if meta.seq_order is None else meta.seq_order.cpu().numpy().copy()
        seen.append((runner.buffers.seq_lens[:n].copy(), order, max(batch.num_new_tokens)))
        return out

    runner.prepare = recording
    prompts = [[5] * 3, [6] * 40, [7] * 17, [8] * 40, [9] * 2]
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert any(q == 1 for *_, q in seen) and any(q > 1 for *_, q in seen)
    if min_seqs > len(prompts):
        assert all(order is None for _, order, _ in seen)
        return
    for seq_lens, order, _ in seen:
        assert sorted(order.tolist()) == list(range(len(seq_lens)))
        assert order.tolist() == sorted(range(len(seq_lens)), key=lambda i: (-int(seq_lens[i]), i))
    assert any(order.tolist() != list(range(len(order))) for _, order, _ in seen)  # not batch order throughout


@pytest.mark.parametrize("bad", [True, 1.5, "2"])
def test_a_logprobs_count_that_is_not_a_whole_number_is_refused_and_the_engine_keeps_serving(llm, bad):
    """It used to pass the range check (True is an int), fail inside the sampler's top-k, and leave the
    request scheduled: every later call raised the same error."""
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, \d+\] \(a whole number\)"):
        llm.generate("def f", SamplingParams(logprobs=bad, max_tokens=4))
    assert llm.generate("def f", greedy(3))[0].token_ids
    assert not llm.engine.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("option, value, says", [
    ("max_num_seqs", "4", "max_num_seqs must be a whole number or None, got '4'"),
    ("max_num_batched_tokens", 2.5, "max_num_batched_tokens must be a whole number, got 2.5"),
    ("max_model_len", True, "max_model_len must be a whole number or None, got True"),
    ("max_model_len", float("nan"), "max_model_len must be a whole number or None, got nan"),
    ("gpu_memory_utilization", True, "gpu_memory_utilization must be a number, got True"),
    ("enable_prefix_caching", "no", "enable_prefix_caching must be true or false, got 'no'"),
    ("async_scheduling", "false", "async_scheduling must be true or false, got 'false'"),
    ("seed", "4", "seed must be a whole number, got '4'"),
    ("cpu_kv_cache_bytes", float("inf"), "cpu_kv_cache_bytes must be a whole number, got inf"),
    ("cpu_kv_gb", "1", "cpu_kv_gb must be a number, got '1'"),
    ("dtype", ["float32"], "dtype must be a string, got ['float32']"),
    ("tokenizer", 5, "tokenizer must be a string or None, got 5"),
    ("max_logprobs", 2.5, "max_logprobs must be a whole number, got 2.5"),
])
def test_an_option_of_the_wrong_type_is_refused_before_the_weights_load(option, value, says, monkeypatch):
    """A value of another type than the option's is refused by name before anything loads: "4" compared with
    a number raised a TypeError, 2.5 reached torch.zeros after the weights loaded, "false" was a true flag."""
    from mempath.engine import engine as engine_module
    monkeypatch.setattr(engine_module, "LLMEngine", lambda *a, **k: pytest.fail("the engine was built"))
    with pytest.raises(ValueError) as error:
        LLM(default_model_path(), device="cpu", **{option: value})
    assert str(error.value) == says


def test_a_path_is_a_model_directory_and_cpu_n_is_the_cpu():
    from pathlib import Path
    llm = LLM(Path(default_model_path()), device="cpu:0", show_progress=False)
    assert llm.config.model == default_model_path() and llm.engine.device.type == "cpu"
    assert len(llm.generate([1, 2, 3], greedy(2))[0].token_ids) == 2


@pytest.mark.parametrize("options, says", [
    (dict(kv_min_share=float("nan")), "kv_min_share must be a fraction of the KV pool in [0, 1], got nan"),
    (dict(kv_min_share=-0.5), "kv_min_share must be a fraction of the KV pool in [0, 1], got -0.5"),
    (dict(kv_min_share="x"), "kv_min_share must be a fraction of the KV pool in [0, 1], got 'x'"),
    (dict(kv_min_share=0.6), "kv_min_share 0.6 guarantees 2 models 120% of the KV pool; use --kv-min-share 0.50"),
    (dict(served_model_name=[1, 2]), "served_model_name: each name must be a non-empty string"),
    (dict(show_progress="x"), "show_progress must be true or false, got 'x'"),
])
def test_several_models_options_of_the_wrong_kind_are_refused_before_loading(options, says, monkeypatch):
    from mempath.multi import startup
    monkeypatch.setattr(startup, "build_engines", lambda *a, **k: pytest.fail("the engines were built"))
    with pytest.raises(ValueError, match=re.escape(says)):
        LLM([default_model_path(), f"b={default_model_path()}"], device="cpu", **options)


def test_one_served_name_string_is_not_split_into_letters():
    from mempath.multi.names import served_models
    tiny = default_model_path()
    with pytest.raises(ValueError, match="one name per model"):
        served_models([tiny, tiny], "ab")
    assert served_models([tiny], "ab") == [("ab", tiny)]
    with pytest.raises(ValueError, match="each model is a directory or NAME=DIR, got 5"):
        served_models([tiny, 5])


def test_numpy_scalars_sets_and_generators_are_taken_as_python_values(llm):
    """What used to run keeps running: numpy's integers and bools as options and sampling fields, sets of
    stop strings or ids, a list of (id, bias) pairs, a generator of prompts, a tuple conversation."""
    from mempath.config import EngineConfig
    config = EngineConfig(model=default_model_path(), device="cpu", max_num_seqs=np.int64(4),
                          gpu_memory_utilization=np.float32(0.5), enable_prefix_caching=np.bool_(False))
    assert (config.max_num_seqs, config.enable_prefix_caching) == (4, False) and type(config.max_num_seqs) is int
    params = SamplingParams(max_tokens=3, temperature=0, n=np.int64(1), top_k=np.int64(5), stop={"x"},
                            stop_token_ids=[np.int64(2)], logit_bias=[(np.int64(5), 1.0)])
    assert (params.stop, params.stop_token_ids, params.logit_bias) == (["x"], [2], {5: 1.0})
    assert type(next(iter(params.logit_bias))) is int
    assert type(params.stop_token_ids[0]) is int and type(params.n) is int
    outs = llm.generate((p for p in [[1, 2, 3], [4, 5]]), params)
    assert len(outs) == 2 and all(o.error is None for o in outs)
    assert llm.chat(({"role": "user", "content": "hi"},), greedy(2))[0].error is None



@pytest.mark.parametrize("call, says", [
    (lambda llm: llm.generate([1, 2, 3], greedy(2), use_tqdm="no"), "use_tqdm must be true, false or a callable"),
    (lambda llm: llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=None),
     "use_tqdm must be true, false or a callable that makes the progress bar (e.g. functools.partial(tqdm, "
     "leave=False)), got None"),
    (lambda llm: llm.chat([{"role": "user", "content": "hi"}], greedy(2), add_generation_prompt="false"),
     "add_generation_prompt must be true or false, got 'false'"),
])
def test_a_flag_that_is_not_a_bool_is_refused(llm, call, says):
    """A truthy string used to switch the bar or the generation prompt on, whatever it said."""
    with pytest.raises(ValueError, match=re.escape(says)):
        call(llm)
    assert not llm.engine.has_unfinished_requests()


def test_numpy_bools_are_flags(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=np.bool_(False),
                   add_generation_prompt=np.bool_(True))
    assert out[0].error is None and out[0].prompt.endswith(
        llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False)[0].prompt[-20:])


def test_use_tqdm_takes_a_callable_that_makes_the_bar(llm):
    """vLLM's use_tqdm also takes a factory (e.g. functools.partial(tqdm, leave=False)): it makes the bar."""
    from tqdm.auto import tqdm
    made = []

    def factory(**kwargs):
        made.append(kwargs)
        return tqdm(**{**kwargs, "disable": True})
    outs = llm.generate([[1, 2, 3], [4, 5]], greedy(2), use_tqdm=factory)
    assert [o.error for o in outs] == [None, None]
    assert len(made) == 1 and made[0]["total"] == 2
    llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]], greedy(2), use_tqdm=factory)
    assert len(made) == 2


def test_a_tokenizer_directory_without_a_tokenizer_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    from mempath.engine import startup
    monkeypatch.setattr(startup.Startup, "load_weights", lambda *a, **k: pytest.fail("the weights loaded"))
    with pytest.raises(ValueError, match=re.escape(f"tokenizer {tmp_path}: no tokenizer.json, tokenizer.model or "
                                                   "vocab.json there")):
        LLM(default_model_path(), device="cpu", tokenizer=str(tmp_path), show_progress=False)


def test_text_that_is_not_utf8_is_refused_in_one_line(llm):
    """A lone surrogate (a shell's undecodable byte, or a JSON escape) used to reach the tokenizer, which raised
    a TypeError naming its own input types."""
    says = "the prompt is not valid UTF-8 text: '\\udce9' at character 3"
    with pytest.raises(ValueError, match=re.escape(says)):
        llm.generate("caf\udce9", greedy(2))
    with pytest.raises(ValueError, match=re.escape("message 0's content is not valid UTF-8 text")):
        llm.chat([{"role": "user", "content": "caf\udce9"}], greedy(2))
    out = llm.generate(["caf\udce9", "cafe"], greedy(2))
    assert out[0].finish_reason == "error" and says in out[0].error and out[1].error is None
    assert not llm.engine.has_unfinished_requests()


def test_a_model_name_too_long_for_a_path_is_refused_in_one_line():
    with pytest.raises(ValueError) as refused:
        LLM("a" * 300, show_progress=False)
    assert "\n" not in str(refused.value) and "config.json" in str(refused.value), str(refused.value)


def test_text_for_a_model_without_a_tokenizer_names_the_tokenizer_flag(tmp_path):
    from tests.conftest import make_model
    make_model(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).unlink()
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", show_progress=False)
    with pytest.raises(ValueError, match=re.escape("give a tokenizer's directory (--tokenizer DIR, tokenizer=DIR)")):
        llm.generate("hello", greedy(2))
    assert len(llm.generate([1, 2, 3], greedy(2))[0].token_ids) == 2


def test_a_prompt_past_the_models_positions_is_not_told_to_raise_max_model_len(llm):
    """max_model_len is already the model's limit: raising it is refused, so the advice was a dead end."""
    limit = llm.engine.spec.max_position_embeddings
    assert llm.engine.max_model_len == limit
    with pytest.raises(ValueError) as refused:
        llm.generate([1] * (limit + 1), greedy(2))
    assert f"the model's limit ({limit} positions); shorten it" in str(refused.value), str(refused.value)
    assert "raise --max-model-len" not in str(refused.value)


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1])
def test_a_seed_beyond_what_a_generator_takes_is_refused_naming_the_range(seed):
    """It used to end in torch's 'Overflow when unpacking long long', naming neither the field nor the range
    (the engine's seed only after the weights had loaded)."""
    from mempath.config import EngineConfig
    says = f"must be from -2**63 to 2**64 - 1, got {seed}"
    with pytest.raises(ValueError, match=re.escape(f"seed {says}")):
        SamplingParams(seed=seed).validate(max_logprobs=0)
    with pytest.raises(ValueError, match=re.escape(f"seed {says}")):
        EngineConfig(model=default_model_path(), device="cpu", seed=seed)
    SamplingParams(seed=2**64 - 1).validate(max_logprobs=0)
    with pytest.raises(ValueError, match=re.escape("seed 18446744073709551615 with n 2: the samples' seeds")):
        SamplingParams(seed=2**64 - 1, n=2).validate(max_logprobs=0)
    EngineConfig(model=default_model_path(), device="cpu", seed=-2**63)


def test_a_model_path_that_is_some_file_says_so(tmp_path):
    """It was told that FILE/config.json was missing."""
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'notes.txt'} is a file, not a model directory")):
        LLM(str(tmp_path / "notes.txt"), show_progress=False)


def test_n_samples_whose_seeds_would_pass_64_bits_are_refused_before_any_is_added(llm):
    with pytest.raises(ValueError, match=re.escape("seed 18446744073709551615 with n 2: the samples' seeds")):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=2, seed=2**64 - 1, n=2, temperature=1.0))
    assert not llm.engine.has_unfinished_requests()


def test_chat_content_parts_are_their_texts_joined_as_vllm_joins_them(llm):
    """Offline chat put the Python repr of a parts list ("[{'type': 'text', ...}]") into the prompt; vLLM joins the
    text parts with a newline, and plain strings in the list are text parts too."""
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, "there"]}], greedy(2))[0]
    joined = llm.chat([{"role": "user", "content": "hi\nthere"}], greedy(2))[0]
    assert parts.error is None and parts.prompt == joined.prompt and "'type'" not in parts.prompt
    assert parts.prompt_token_ids == joined.prompt_token_ids


@pytest.mark.parametrize("content, says", [
    ([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
     "message 0: image_url content parts are not supported (text only: text parts or a string)"),
    ([{"text": "hi"}], "message 0: content part 0 needs \"type\": \"text\" and a string \"text\", got {'text': 'hi'}"),
    ([5], "message 0: content part 0 needs \"type\": \"text\" and a string \"text\", got 5"),
])
def test_chat_content_parts_that_are_not_text_are_refused_by_name(llm, content, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        llm.chat([{"role": "user", "content": content}], greedy(2))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("bad, says", [
    (dict(top_k=None), "top_k must be a whole number, got None"),
    (dict(top_k="5"), "top_k must be a whole number, got '5'"),
    (dict(n=2, seed="1", temperature=1.0), "seed must be a whole number or None, got '1'"),
    (dict(ignore_eos="false"), "ignore_eos must be true or false, got 'false'"),
    (dict(max_tokens=True), "max_tokens must be an integer >= 1, got True"),
    (dict(logit_bias={5: 1e300}), "logit_bias[5] must be in [-100, 100], got 1e+300"),
    (dict(best_of="1"), "best_of is not supported (vLLM removed it too); leave it out and use n (got best_of='1')"),
    (dict(temperature=10**400),
     "temperature must be a finite number, got 100000000000000000000000... (401 characters)"),
    (dict(logit_bias={5: 10**400}), "logit_bias[5] must be a finite number, got 100000000000000000000000... (401 "
                                    "characters)"),
])
def test_a_bad_field_in_a_batch_fails_its_prompt_alone(llm, bad, says):
    """A TypeError part-way through a batch (top_k=None compared with 0) left the prompts added before it in the
    engine, for the next generate() to run; a truthy string switched ignore_eos on; a bias beyond float32 gave
    garbage. Each is now its prompt's one-line error, and the others run."""
    good = SamplingParams(max_tokens=2, temperature=0.0)
    outs = llm.generate([[1, 2, 3], [4, 5]], [good, SamplingParams(**{"max_tokens": 2, **bad})], use_tqdm=False)
    assert outs[0].error is None and outs[1].finish_reason == "error" and outs[1].error == says, outs[1].error
    assert not llm.engine.has_unfinished_requests()


def test_numpy_numbers_are_taken_in_every_numeric_field(llm):
    params = SamplingParams(max_tokens=np.int64(2), temperature=np.float32(0.5), seed=np.int64(2),
                            logprobs=np.int64(1), min_tokens=np.int64(1), top_p=np.float64(0.9),
                            logit_bias={np.int64(5): np.float32(1.0)})
    [out] = llm.generate([1, 2, 3], params, use_tqdm=False)
    assert out.error is None and len(out.token_ids) == 2
    assert (type(params.max_tokens), type(params.temperature), type(params.seed)) == (int, float, int)


def fail_the_second_add(monkeypatch) -> list:
    """LLMEngine.add_request raising on its second call; the calls made, for the test to count."""
    from mempath.engine.engine import LLMEngine
    add = LLMEngine.add_request
    calls = []

    def failing_second(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return add(self, *a, **k)
    monkeypatch.setattr(LLMEngine, "add_request", failing_second)
    return calls


def test_an_exception_while_adding_a_batch_leaves_nothing_in_the_engine(llm, monkeypatch):
    """Whatever escapes part-way through adding a batch, the prompts added before it are aborted."""
    calls = fail_the_second_add(monkeypatch)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert len(calls) == 2 and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("field", ["json_object", "whitespace_flexible"])
def test_structured_flags_that_are_not_bools_are_refused(field):
    """A truthy string switched json_object on; whitespace_flexible="no" reached the grammar compiler's TypeError."""
    from mempath.structured import StructuredOutputsParams
    fields = {"json": {"type": "object"}, field: "no"} if field == "whitespace_flexible" else {field: "yes"}
    with pytest.raises(ValueError, match=re.escape(f"structured_outputs.{field} must be true or false, got ")):
        StructuredOutputsParams(**fields).validate()


def test_a_bar_factory_that_raises_leaves_nothing_in_the_engine(llm):
    def broken(**kwargs):
        raise RuntimeError("no bar")
    with pytest.raises(RuntimeError, match="no bar"):
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=broken)
    assert not llm.engine.has_unfinished_requests()


def test_an_exception_while_adding_a_prompts_later_sample_aborts_its_earlier_ones(llm, monkeypatch):
    calls = fail_the_second_add(monkeypatch)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=50, n=2, temperature=1.0), use_tqdm=False)
    assert len(calls) == 2 and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("whole_row", [False, True], ids=["one-logit", "whole-row"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_logits_that_are_not_finite_fail_their_request_alone(model_factory, async_scheduling, bad_value, whole_row,
                                                             sampled, monkeypatch):
    """A row of NaN or +inf logits (activations that overflowed float16, damaged weights) has no token to
    sample: argmax took the NaN's index, or token 0 for a row all NaN, and served it as text. The request
    fails with a line that names the cause; its batch mate's tokens are the ones it makes alone."""
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, async_scheduling=async_scheduling)
    params = (SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True) if sampled
              else greedy(8))
    prompts = [[7, 8, 9, 10], [20, 21, 22]]
    alone = [llm.generate(p, params, use_tqdm=False)[0].token_ids for p in prompts]
    model, calls = llm.engine.runner.model, []
    real = model.compute_logits

    def poisoned(hidden):
        logits = real(hidden)
        calls.append(len(calls))
        if len(calls) == 4:  # the fourth sampling step: row 0 is the first request's
            logits[0, :] = bad_value if whole_row else logits[0, :]
            logits[0, 5] = bad_value
        return logits
    monkeypatch.setattr(model, "compute_logits", poisoned)
    first, second = llm.generate(prompts, params, use_tqdm=False)
    assert first.finish_reason == "error", first
    assert first.error.startswith("the model's logits at output token 4 are not finite"), first.error
    assert "--dtype bfloat16" in first.error and len(first.token_ids) == 3
    assert first.token_ids == alone[0][:3]
    assert second.finish_reason == "length" and second.token_ids == alone[1]
    assert llm.stats()["kv_blocks_used"] == 0
