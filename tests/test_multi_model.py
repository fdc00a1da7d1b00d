"""Several models in one process over one shared KV page pool (mempath/multi, docs/multi_model.md)."""
import pytest
import torch

from mempath import LLM, SamplingParams
from mempath.multi.engine import MultiEngine, UnknownModelError
from mempath.multi.layout import page_layout
from mempath.multi.names import served_models

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Token ids inside both vocabularies (320 and 384).
PROMPTS = [[5, 17, 33, 9, 101, 7, 64], [200, 3, 3, 45, 12], list(range(20, 60)), [8] * 33]


def alone(path, prompts, **options):
    llm = LLM(path, dtype="float32", show_progress=False, **options)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def together(two_models, **options) -> LLM:
    llama, qwen = two_models
    return LLM([f"a={llama}", f"b={qwen}"], dtype="float32", show_progress=False, **options)


def run_all(engine: MultiEngine, requests: list[tuple[str, list[int]]], params=GREEDY) -> dict[str, list[int]]:
    """Add every (model, prompt) at once and step the models together until all finish."""
    for i, (model, prompt) in enumerate(requests):
        engine.add_request(prompt, params, f"r{i}", model=model)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    return done


def assert_all_free(engine: MultiEngine):
    assert engine.pool.pages.num_used == 0
    assert engine.pool.split() == {"a": 0, "b": 0}
    engine.engines["a"].kv.pool.check_invariants()


def test_page_layout_one_block_per_page():
    page_bytes, sizes = page_layout([512, 1024, 96], 16)
    assert page_bytes == 1024 * 16
    assert sizes == [32, 16, 128]  # 96 x 128 = 12 KiB of the 16 KiB page; 256 would not fit


def test_served_names():
    assert served_models(["/m/llama-1b", "big=/m/llama-8b"]) == [("llama-1b", "/m/llama-1b"), ("big", "/m/llama-8b")]
    assert served_models(["/m/x", "/n/y"], ["p", "q"]) == [("p", "/m/x"), ("q", "/n/y")]
    with pytest.raises(ValueError, match="one name per model"):
        served_models(["/m/x", "/n/y"], ["p"])
    with pytest.raises(ValueError, match="two models are served as 'x'"):
        served_models(["/m/x", "/n/x"])


def test_greedy_together_equals_alone(two_models):
    llama, qwen = two_models
    expected_a, expected_b = alone(llama, PROMPTS), alone(qwen, PROMPTS)
    llm = together(two_models)
    assert [e.config.block_size for e in llm.engines.values()] == [32, 16]
    requests = [(model, p) for p in PROMPTS for model in ("a", "b")]  # interleaved arrivals
    done = run_all(llm.engine, requests)
    assert [done[f"r{i}"] for i in range(0, len(requests), 2)] == expected_a
    assert [done[f"r{i}"] for i in range(1, len(requests), 2)] == expected_b
    assert_all_free(llm.engine)
    # And through generate(model=...), one model at a time; chat() through the named model's template.
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, model="b")] == expected_b
    chat = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, model="b")[0]
    assert chat.prompt_token_ids == llm.engines["b"].tokenizer.encode("<s>user: hi\n<s>assistant:", add_special_tokens=False)


def test_split_moves_under_alternating_load(two_models):
    """A burst on one model takes most of the pool, then a burst on the other does; no allocation, all freed."""
    llm = together(two_models, num_gpu_blocks_override=12, kv_min_share=0.25)
    engine = llm.engine
    pages_tensor = engine.engines["a"].runner.kv_cache
    long_prompts = [list(range(10 + i, 50 + i)) for i in range(6)]  # two pages each on b, one or two on a
    peaks = []
    for model in ("a", "b", "a"):
        peak = 0
        for i, prompt in enumerate(long_prompts):
            engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), f"{model}{len(peaks)}-{i}",
                               model=model)
        while engine.has_unfinished_requests():
            engine.step()
            split = engine.pool.split()
            assert min(split.values()) >= 0 and sum(split.values()) <= 12
            peak = max(peak, split[model])
        peaks.append(peak)
        assert_all_free(engine)
    assert all(p > 12 // 2 for p in peaks)  # each burst took more than a static half
    assert all(p <= 12 - engine.pool.guaranteed() for p in peaks)  # and left the other its guarantee
    assert engine.engines["b"].runner.kv_cache.data_ptr() == pages_tensor.data_ptr()  # one allocation, shared


def test_contention_outputs_match_alone(two_models):
    """Both models bursting over a pool too small for both: preemption across models, same greedy tokens."""
    llama, qwen = two_models
    prompts = [list(range(10 + i, 50 + i)) for i in range(5)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected_a = [o.outputs[0].token_ids for o in LLM(llama, dtype="float32", show_progress=False).generate(
        prompts, params, use_tqdm=False)]
    expected_b = [o.outputs[0].token_ids for o in LLM(qwen, dtype="float32", show_progress=False).generate(
        prompts, params, use_tqdm=False)]
    llm = together(two_models, num_gpu_blocks_override=10, kv_min_share=0.2)
    done = run_all(llm.engine, [(m, p) for m in ("a", "b") for p in prompts], params)
    assert [done[f"r{i}"] for i in range(5)] == expected_a
    assert [done[f"r{i}"] for i in range(5, 10)] == expected_b
    assert llm.engine.num_cross_preemptions > 0
    assert_all_free(llm.engine)


def test_abort_frees_every_page(two_models):
    llm = together(two_models)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, GREEDY, f"x{i}", model="a" if i % 2 else "b")
    engine.step()
    engine.step()
    assert engine.pool.pages.num_used > 0
    for i in range(len(PROMPTS)):
        assert engine.abort_request(f"x{i}") is not None
    assert not engine.has_unfinished_requests()
    assert_all_free(engine)


def test_prefix_cache_keys_include_the_model(two_models):
    llm = together(two_models)
    prompt = list(range(20, 120))
    llm.generate(prompt, GREEDY, use_tqdm=False, model="a")
    out = llm.generate(prompt, GREEDY, use_tqdm=False, model="b")[0]
    assert out.num_cached_tokens == 0  # a's blocks of the same tokens are not b's KV
    assert llm.generate(prompt, GREEDY, use_tqdm=False, model="b")[0].num_cached_tokens > 0


def test_bad_input_one_line(two_models):
    llama, qwen = two_models
    llm = together(two_models, num_gpu_blocks_override=8)
    with pytest.raises(UnknownModelError, match="the model 'c' does not exist; this server serves 'a', 'b'"):
        llm.generate([1, 2, 3], GREEDY, model="c")
    with pytest.raises(ValueError, match="use --kv-min-share 0.50 or less"):
        LLM([llama, qwen], dtype="float32", show_progress=False, kv_min_share=0.6)
    with pytest.raises(ValueError, match="KV tiers .* serve one model"):
        LLM([llama, qwen], dtype="float32", show_progress=False, cpu_kv_gb=0.01)
    with pytest.raises(ValueError, match="each uses the one in its directory"):
        LLM([llama, qwen], dtype="float32", show_progress=False, tokenizer=llama)
    with pytest.raises(ValueError, match="serves one model"):
        LLM(llama, dtype="float32", show_progress=False, num_gpu_blocks_override=8).generate([1], GREEDY, model="a")


def test_fp8_kv_in_shared_pages_equals_alone(two_models):
    """fp8 caches in the shared page pool (a block is a slice of a page, a page apart from the next): the
    same greedy tokens as each model alone over its own fp8 cache."""
    llama, qwen = two_models
    expected_a = alone(llama, PROMPTS, kv_cache_dtype="fp8")
    expected_b = alone(qwen, PROMPTS, kv_cache_dtype="fp8")
    llm = together(two_models, kv_cache_dtype="fp8")
    assert all(layer.k_cache.dtype == torch.float8_e4m3fn
               for engine in llm.engines.values() for layer in engine.model.attention_layers())
    requests = [(model, p) for p in PROMPTS for model in ("a", "b")]
    done = run_all(llm.engine, requests)
    assert [done[f"r{i}"] for i in range(0, len(requests), 2)] == expected_a
    assert [done[f"r{i}"] for i in range(1, len(requests), 2)] == expected_b
    assert_all_free(llm.engine)


def test_a_request_that_fits_the_pool_waits_for_pages_another_model_holds(two_models):
    """docs/multi_model.md: a waiting model is never failed for lack of room another model holds. A model whose
    one running request preempted itself for a page the other model held failed the request instead."""
    llama, qwen = two_models
    prompts = [list(range(10, 26)), list(range(12, 29))]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected_b = [o.outputs[0].token_ids for o in LLM(qwen, dtype="float32", show_progress=False).generate(
        prompts, params, use_tqdm=False)]
    llm = together(two_models, num_gpu_blocks_override=4)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, f"a{i}", model="a")
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, f"b{i}", model="b")
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    assert {r: o.finish_reason for r, o in done.items()} == {"a0": "length", "a1": "length", "b0": "length",
                                                              "b1": "length"}
    assert [done[f"b{i}"].outputs[0].token_ids for i in range(2)] == expected_b
    assert_all_free(engine)


def test_arguments_that_name_the_models_twice_are_refused(two_models):
    """LLM(Q, models=[A, B]) served A and B and dropped Q; NAME= and a served name for one model kept the latter."""
    llama, qwen = two_models
    with pytest.raises(TypeError, match=r"give the models once"):
        LLM(qwen, models=[f"a={llama}", f"b={qwen}"], dtype="float32", show_progress=False)
    with pytest.raises(ValueError, match=r"is named 'a' there and 'x' by --served-model-name: name each model once"):
        served_models([f"a={llama}", f"b={qwen}"], ["x", "y"])
    assert served_models([f"a={llama}", qwen], ["a", "q"]) == [("a", llama), ("q", qwen)]


def test_a_models_own_refusal_names_the_model(model_factory):
    """With several models, "max_model_len 256 exceeds what this model supports (64: ...)" did not say which."""
    llama, _ = model_factory("llama")
    short, _ = model_factory("llama", max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"^model 's': max_model_len 256 exceeds what this model supports \(64"):
        LLM([f"a={llama}", f"s={short}"], dtype="float32", show_progress=False, max_model_len=256)


def test_a_request_beyond_what_the_other_models_guarantees_leave_is_refused_instead_of_waiting(two_models):
    """Waiting for pages another model holds is right only while they can come back: what another awake model
    is guaranteed never does, so a request needing it waited forever behind a busy model (and all after it).
    It is refused when added, as a request larger than a model's own pool is."""
    llm = together(two_models, num_gpu_blocks_override=8, kv_min_share=0.5)
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request(list(range(10, 30)), params, "b0", model="b")
    engine.step()
    block = engine.engines["a"].config.block_size
    with pytest.raises(ValueError, match=r"this model may hold 4 blocks of the shared pool's 8 \(.*the other models "
                                         r"are guaranteed the rest: --kv-min-share\)"):
        engine.add_request(list(range(10, 10 + 5 * block)), SamplingParams(max_tokens=4), "A", model="a")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(engine)


def test_generate_interrupted_with_several_models_leaves_no_request_behind(two_models):
    """Added through the MultiEngine, the requests were aborted in their model alone: its owner map kept them."""
    llm = together(two_models)

    def bar(**kwargs):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate([[10, 11, 12], [13, 14]], SamplingParams(max_tokens=2), use_tqdm=bar, model="b")
    assert llm.engine.owner == {} and not llm.engine.has_unfinished_requests()
    assert_all_free(llm.engine)


def test_two_long_prefills_over_a_small_pool_finish_instead_of_preempting_each_other(model_factory):
    """Each model, running nothing, preempted the other's one request for its first chunk, and each recomputed
    from the start: after 2,000 steps neither had finished. Above its guarantee a model now takes no pages from
    requests that came before its own."""
    (first, _), (second, _) = model_factory("llama"), model_factory("llama", seed=3)
    llm = LLM([f"a={first}", f"b={second}"], dtype="float32", show_progress=False, enable_prefix_caching=False,
              block_size=8, max_num_batched_tokens=8, num_gpu_blocks_override=14)
    engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = [100 + i % 50 for i in range(70)]
    engine.add_request(prompt, params, "ra", model="a")
    engine.add_request(prompt, params, "rb", model="b")
    done = {}
    for _ in range(400):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert {r: o.finish_reason for r, o in done.items()} == {"ra": "length", "rb": "length"}
    assert_all_free(engine)
