"""The expert cache as an engine option: --moe-expert-cache-size / --moe-expert-cache-gb, the
ledger's expert pathways, stats(), /metrics and diagnose's rows (CPU, tiny random models)."""
import json
from pathlib import Path

import pytest
import torch

from mempath import LLM, SamplingParams
from mempath.engine_flags import add_engine_arguments, engine_options
from mempath.memory.formulas import expert_bytes, read_shape, resolve_expert_cache_size
from mempath.memory.ledger import Pathway
from tests.test_moe import GREEDY, PROMPTS, check_caches, generate, references  # noqa: F401 (fixture)


def shape_of(path):
    return read_shape(json.loads((Path(path) / "config.json").read_text()))


def moe_llm(path, **options) -> LLM:
    return LLM(path, dtype="float32", device="cpu", show_progress=False, enable_prefix_caching=False, **options)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_every_engine_cache_size_gives_the_transformers_tokens(size, model_factory, references):
    path, _ = model_factory("mixtral")
    llm = moe_llm(path, moe_expert_cache_size=size)
    assert generate(llm) == references["mixtral"]
    check_caches(llm.engine.model)
    stats = llm.stats()["expert_cache"]
    assert stats["enabled"] and stats["num_slots"] == size and stats["hits"] > 0
    assert (stats["misses"] > 0) == (size < 8)
    block = llm.engine.model.moe_blocks()[0]
    assert stats["bytes_loaded"] == stats["misses"] * block.experts.expert_bytes()


def test_the_slots_are_granted_from_the_budget_and_the_host_store_is_in_the_ledger(model_factory):
    path, _ = model_factory("qwen3_moe")
    full = moe_llm(path).engine.ledger
    cached = moe_llm(path, moe_expert_cache_size=2).engine.ledger
    shape = shape_of(path)
    every, resident = expert_bytes(shape, 4, 2)
    assert cached.get(Pathway.EXPERT_CACHE) == resident
    assert cached.entries[Pathway.EXPERT_CACHE.value].device == "cpu"  # the compute device: the CPU here
    assert cached.get(Pathway.EXPERT_HOST) == every
    assert cached.get(Pathway.WEIGHTS) == full.get(Pathway.WEIGHTS) - every
    assert Pathway.EXPERT_CACHE.value not in full.entries and Pathway.EXPERT_HOST.value not in full.entries


def test_the_byte_form_is_turned_into_experts_per_layer(model_factory, references):
    path, _ = model_factory("mixtral")
    shape = shape_of(path)
    one_expert_everywhere = expert_bytes(shape, 4)[0] // shape.num_experts
    gb = 3.5 * one_expert_everywhere / (1 << 30)  # room for 3 experts per layer, not 4
    llm = moe_llm(path, moe_expert_cache_gb=gb)
    assert llm.stats()["expert_cache"]["num_slots"] == 3
    assert generate(llm) == references["mixtral"]
    assert resolve_expert_cache_size(shape, 4, None, 100.0, "m") is None  # room for all: all resident


@pytest.mark.parametrize("options,match", [
    ({"moe_expert_cache_size": 1}, r"--moe-expert-cache-size 1: must be from 2 \(the experts each token routes to\) to 8"),
    ({"moe_expert_cache_size": 9}, r"--moe-expert-cache-size 9: must be from 2 .* to 8"),
    ({"moe_expert_cache_size": 0}, r"moe_expert_cache_size must be a whole number of experts per layer >= 1, got 0"),
    ({"moe_expert_cache_gb": 1e-7}, r"--moe-expert-cache-gb 1e-07 holds 0 experts per layer, fewer than the 2"),
    ({"moe_expert_cache_gb": -1.0}, r"moe_expert_cache_gb must be > 0 GiB"),
    ({"moe_expert_cache_size": 2, "moe_expert_cache_gb": 1.0}, r"both given"),
])
def test_bad_cache_sizes_are_refused_in_one_line(options, match, model_factory):
    path, _ = model_factory("mixtral")
    with pytest.raises(ValueError, match=match) as error:
        moe_llm(path, **options)
    assert "\n" not in str(error.value)


def test_the_flags_on_a_dense_model_are_refused(model_factory):
    path, _ = model_factory("llama")
    for options, flag in (({"moe_expert_cache_size": 2}, "--moe-expert-cache-size 2"),
                          ({"moe_expert_cache_gb": 1.0}, "--moe-expert-cache-gb 1")):
        with pytest.raises(ValueError, match=f"{flag}: .* describes a dense model .* drop the flag"):
            moe_llm(path, **options)
    assert moe_llm(path).stats()["expert_cache"] == {"enabled": False}


def test_the_flags_reach_the_engine_config():
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    options = engine_options(parser.parse_args(["--moe-expert-cache-size", "4"]))
    assert options["moe_expert_cache_size"] == 4 and options["moe_expert_cache_gb"] is None
    assert engine_options(parser.parse_args(["--moe-expert-cache-gb", "1.5"]))["moe_expert_cache_gb"] == 1.5
    with pytest.raises(SystemExit):  # argparse: not allowed with the other
        parser.parse_args(["--moe-expert-cache-size", "4", "--moe-expert-cache-gb", "1"])


def test_aborts_leave_no_slot_in_use_and_other_requests_match(model_factory, references):
    path, _ = model_factory("mixtral")
    engine = moe_llm(path, moe_expert_cache_size=2).engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    finished = {}
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        if step == 3:
            engine.abort_request(ids[1])
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.token_ids
    check_caches(engine.model)
    assert engine.stats()["kv_blocks_used"] == 0
    for index in (0, 2, 3):
        assert finished[ids[index]] == references["mixtral"][index]


def test_metrics_carry_the_expert_cache(model_factory):
    from prometheus_client.parser import text_string_to_metric_families

    from mempath.server.metrics import ServerMetrics
    path, _ = model_factory("mixtral")
    llm = moe_llm(path, moe_expert_cache_size=2)
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    stats = llm.stats()
    text = ServerMetrics("m", 16).render(stats).decode()
    cache = stats["expert_cache"]
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    for name, value in (("hits_total", cache["hits"]), ("misses_total", cache["misses"]),
                        ("bytes_copied_total", cache["bytes_loaded"]), ("resident_experts", cache["resident_experts"])):
        assert samples[f"mempath:moe_expert_cache_{name}"] == value > 0
    assert 'pathway="expert_cache"' in text and 'pathway="expert_host"' in text
    dense, _ = model_factory("llama")
    assert "moe_expert_cache" not in ServerMetrics("m", 16).render(moe_llm(dense).stats()).decode()


def test_diagnose_rows_compare_the_expert_pathways_with_the_plan(model_factory):
    from mempath.tools.diagnose.rows import expert_cache_rows, weight_rows
    from mempath.tools.plan import plan_memory
    path, _ = model_factory("olmoe")
    engine = moe_llm(path, moe_expert_cache_size=3).engine
    plan = plan_memory(path, dtype="float32", moe_expert_cache_size=3)
    rows = {row.pathway: row for row in expert_cache_rows(engine, plan) + weight_rows(plan, engine.model, None, None)}
    for name in ("expert_cache", "expert_host", "weights.experts", "weights.mlp"):
        assert rows[name].error_pct == 0.0, (name, rows[name])
    assert rows["expert_cache"].measured == plan.resident_expert_bytes
    assert torch.device(engine.device).type == "cpu"
