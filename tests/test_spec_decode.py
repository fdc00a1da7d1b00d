"""Speculative decoding end to end: greedy output identical to plain decoding on every
architecture (a random draft that rarely agrees, and the target as its own draft, which
always does), with chunked prefill and preemption; no block leaked after aborts and
preemptions mid-speculation; n-gram hits on repetitive prompts; the shipped pair."""
import pytest

from mempath import LLM, SamplingParams
from mempath.assets import ASSETS
from tests.conftest import ARCHS, release_cuda
from tests.test_correctness import GREEDY, PROMPTS


def spec(draft: str, k: int = 3, adaptive: bool = False) -> dict:
    return {"model": draft, "num_speculative_tokens": k, "adaptive": adaptive}


@pytest.fixture(scope="module")
def plain_outputs(model_factory):
    outs = {}
    for arch in ARCHS:
        path, _ = model_factory(arch)
        llm = LLM(path, dtype="float32", show_progress=False)
        outs[arch] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        del llm
        release_cuda()
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_with_a_draft(arch, model_factory, plain_outputs):
    path, _ = model_factory(arch)
    other, _ = model_factory(arch, seed=7, num_hidden_layers=1)
    for draft in (path, other):
        llm = LLM(path, dtype="float32", show_progress=False, speculative_config=spec(draft))
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outputs] == plain_outputs[arch], draft
        stats = llm.stats()
        assert stats["kv_blocks_used"] == 0
        s = stats["spec_decode"]
        assert s["num_draft_tokens"] > 0
        if draft == path:
            assert s["acceptance_rate"] > 0.9  # the target as its own draft agrees with itself
        del llm
        release_cuda()  # on CUDA an engine left alive leaves the next no room for its KV cache


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_and_preemption_with_speculation(arch, model_factory, plain_outputs):
    path, _ = model_factory(arch)
    llm = LLM(path, dtype="float32", show_progress=False, block_size=8, max_num_batched_tokens=8,
              num_gpu_blocks_override=14, speculative_config=spec(path))
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == plain_outputs[arch]
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["spec_decode"]["num_accepted_tokens"] > 0
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == 14


def test_prefix_cache_hits_match_with_speculation(model_factory, plain_outputs):
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, speculative_config=spec(path))
    first = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # prompts now in the prefix cache
    assert first == [o.token_ids for o in again] == plain_outputs["llama"]
    assert sum(o.num_cached_tokens for o in again) > 0


def test_no_block_leaked_after_aborts_mid_speculation(model_factory):
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, block_size=8, num_gpu_blocks_override=20,
              speculative_config=spec(path, k=4))
    engine = llm.engine
    free_at_start = engine.kv.pool.num_free
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=1, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    for step in range(12):
        engine.step()
        if step == 5:
            engine.abort_request(ids[0])
            engine.abort_request(ids[2])
    assert engine.stats()["spec_decode"]["num_drafts"] > 0
    for request_id in ids:
        engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free == free_at_start
    assert engine.stats()["num_preemptions"] > 0


def test_seeded_sampling_is_reproducible_with_speculation(model_factory):
    path, _ = model_factory("llama")
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(path, dtype="float32", show_progress=False, speculative_config=spec(path))
        runs.append([o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        del llm
        release_cuda()
    assert runs[0] == runs[1]
    assert all(len(t) == 24 for t in runs[0])


def test_ngram_drafting_hits_on_repetitive_prompts(model_factory, plain_outputs):
    path, _ = model_factory("llama")
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
              "adaptive": False}
    llm = LLM(path, dtype="float32", show_progress=False, speculative_config=config)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == plain_outputs["llama"]
    s = llm.stats()["spec_decode"]
    assert s["method"] == "ngram" and s["num_accepted_tokens"] > 0
    assert llm.stats()["draft_ledger"]["step_buffers"]["bytes"] > 0


def test_shipped_pair_greedy_identical():
    target, draft = str(ASSETS / "mempath-tiny"), str(ASSETS / "mempath-tiny-draft")
    prompts = ["def read_config(path):", "class Engine:\n    def step(self):"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(target, show_progress=False).generate(prompts, params, use_tqdm=False)
    llm = LLM(target, show_progress=False, speculative_config=spec(draft, k=4))
    fast = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    stats = llm.stats()
    assert stats["spec_decode"]["acceptance_rate"] > 0.3
    assert stats["draft_ledger"]["weights"]["bytes"] > 0 and stats["draft_ledger"]["kv_cache"]["bytes"] > 0


@pytest.mark.parametrize("config, message", [
    ({"model": "x", "num_speculative_tokens": 4, "typo": 1}, "unknown key"),
    ({"model": "x"}, "num_speculative_tokens is required"),
    ({"model": "x", "num_speculative_tokens": 9}, "integer in [1, 8]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_max"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ("{not json", "not valid JSON"),
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "a draft model proposes without it"),
])
def test_bad_speculative_config_is_refused_in_one_line(config, message, model_factory):
    path, _ = model_factory("llama")
    with pytest.raises(ValueError, match="speculative_config") as error:
        LLM(path, dtype="float32", show_progress=False, speculative_config=config)
    assert message in str(error.value) and "\n" not in str(error.value)


def another_tokenizer(path):
    """A draft of the target's vocabulary size whose tokenizer numbers its tokens otherwise."""
    from tests.conftest import make_model
    make_model(path, "llama", tokenizer=False)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["other text, other merges " * 20],
                            trainers.BpeTrainer(vocab_size=320, special_tokens=["</s>", "<s>", "<pad>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("draft", ["another vocabulary", "fewer positions", "no such directory",
                                   "another tokenizer"])
def test_a_draft_that_cannot_serve_the_target_is_refused_before_any_weights_load(draft, model_factory, tmp_path,
                                                                                  monkeypatch):
    """Read from the draft's config.json, before the target's weights load (minutes on a large target)."""
    from mempath.engine import startup
    path, _ = model_factory("llama")
    other = {"another vocabulary": lambda: model_factory("llama", vocab_size=400)[0],
             "fewer positions": lambda: model_factory("llama", max_position_embeddings=64)[0],
             "no such directory": lambda: str(tmp_path / "missing"),
             "another tokenizer": lambda: another_tokenizer(tmp_path / "other-tokenizer")}[draft]()
    monkeypatch.setattr(startup, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    says = {"another vocabulary": "vocabulary", "fewer positions": "positions", "no such directory": "config.json",
            "another tokenizer": "the draft's tokenizer .* maps text to other token ids"}
    with pytest.raises(ValueError, match=says[draft]) as error:
        LLM(path, dtype="float32", show_progress=False, speculative_config=spec(other), max_model_len=128)
    assert "\n" not in str(error.value)


def test_metrics_carry_vllm_spec_decode_names(model_factory):
    from mempath.server.metrics import ServerMetrics
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, speculative_config=spec(path))
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    text = ServerMetrics("m", 16).render(llm.stats()).decode()
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total",
                 "spec_decode_chosen_k", "spec_decode_draft_seconds_total", "spec_decode_verify_seconds_total"):
        assert f"mempath:{name}" in text
    assert 'pathway="weights"' in text


def test_a_draft_far_behind_catches_up_in_chunks(model_factory, plain_outputs):
    # As after many steps at K = 0: the draft holds no KV for the request at all, and its
    # buffers take 8 tokens a step, so it catches up over several plain steps first.
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False, block_size=8, max_num_batched_tokens=8,
              max_num_seqs=4, speculative_config=spec(path))
    engine = llm.engine
    request_id = engine.add_request(PROMPTS[3], GREEDY)
    request = engine.outputs.requests[request_id]
    tokens = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        if request.num_output_tokens == 4 and request.num_draft_computed > 0:
            engine.kv.advance_draft(request, 0)
        for output in engine.step():
            tokens = output.token_ids if output.finished else tokens
    assert tokens == plain_outputs["llama"][3]
    assert engine.stats()["spec_decode"]["num_accepted_tokens"] > 0
    assert engine.kv.pool.num_used == 0


def test_a_draft_no_smaller_than_the_target_is_warned_about(model_factory, caplog):
    """Accepted (as vLLM does), but never silently: every step runs both models."""
    import logging
    path, _ = model_factory("llama")
    big, _ = model_factory("llama", hidden_size=128, intermediate_size=256)
    small, _ = model_factory("llama", num_hidden_layers=1)
    caplog.set_level(logging.WARNING)
    LLM(path, dtype="float32", show_progress=False, speculative_config=spec(small))
    assert not [r for r in caplog.records if "no smaller than the target" in r.getMessage()]
    LLM(path, dtype="float32", show_progress=False, speculative_config=spec(big))
    assert [r for r in caplog.records if "no smaller than the target" in r.getMessage()]
