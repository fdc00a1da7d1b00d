"""A mixture-of-experts model with an expert cache beside a dense one on one device (docs/multi_model.md,
"Mixture-of-experts models among them"): --moe-expert-cache-size / -gb and --moe-cpu-experts are the MoE
models' options, a dense model gets its EngineConfig without them; the plan counts the resident experts."""
import json
import logging
import socket

import pytest

from mempath import LLM
from mempath.cli import main
from mempath.model.moe import expert_cache_stats
from mempath.multi.experts import options_by_model
from mempath.tools.plan import plan_memory
from mempath.tools.plan_multi import plan_models
from tests.test_multi_model import PROMPTS, alone, run_all

OPTIONS = {"dtype": "float32", "show_progress": False}


@pytest.fixture(scope="module")
def dense_and_moe(model_factory):
    """A dense Llama and a Qwen3-MoE of 8 experts a layer (2 routed, 2 MoE layers), both of vocabulary 320."""
    llama, _ = model_factory("llama")
    moe, _ = model_factory("qwen3_moe")
    return llama, moe


@pytest.fixture(scope="module")
def small_mixtral(model_factory):
    """A Mixtral of 4 experts a layer: --moe-expert-cache-size 4 is all of its experts."""
    path, _ = model_factory("mixtral", num_local_experts=4)
    return path


def free_port() -> str:
    with socket.socket() as sock:  # serve checks the port before anything else
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# ---------------------------------------------------------------- serving


def test_moe_with_a_cache_beside_dense_answers_as_each_alone(dense_and_moe, caplog):
    """Both models step together; each one's greedy tokens are those it gives alone (the MoE one with the
    same cache size); the MoE model's cache holds 2 slots a layer, the dense one has none."""
    llama, moe = dense_and_moe
    expected_dense = alone(llama, PROMPTS)
    expected_moe = alone(moe, PROMPTS, moe_expert_cache_size=2)
    with caplog.at_level(logging.INFO, logger="mempath.multi.startup"):
        llm = LLM([f"dense={llama}", f"moe={moe}"], moe_expert_cache_size=2, **OPTIONS)
    engine = llm.engine
    done = run_all(engine, [("dense", p) for p in PROMPTS] + [("moe", p) for p in PROMPTS])
    assert [done[f"r{i}"] for i in range(4)] == expected_dense
    assert [done[f"r{i}"] for i in range(4, 8)] == expected_moe

    dense, experts = engine.engines["dense"], engine.engines["moe"]
    assert dense.config.moe_expert_cache_size is None and experts.config.moe_expert_cache_size == 2
    cache = expert_cache_stats(experts.model)
    assert cache["num_slots"] == 2 and [layer["num_slots"] for layer in cache["layers"]] == [2, 2]
    assert cache["misses"] > 0 and cache["host_bytes"] > 0
    assert expert_cache_stats(dense.model) == {"enabled": False}
    stats = llm.stats()["models"]
    assert stats["moe"]["expert_cache"]["num_slots"] == 2 and stats["dense"]["expert_cache"] == {"enabled": False}

    ledgers = engine.first.budget.ledgers
    slots, host = ledgers["moe"].get("expert_cache"), ledgers["moe"].get("expert_host")
    assert slots > 0 and host == 4 * slots  # 2 of 8 experts on the device, all 8 in host memory
    assert ledgers["dense"].get("expert_cache") == ledgers["dense"].get("expert_host") == 0

    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("expert cache:")]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    line = lines[0]
    assert "moe keeps 2 of 8 experts per MoE layer on the device" in line
    assert f"2 MoE layers, {slots:,} B of slots" in line and f"all 8 in host memory, {host:,} B" in line
    assert "dense: a dense model, no experts" in line


def test_the_dense_model_never_gets_the_miss_policy(dense_and_moe):
    """--moe-cpu-experts always goes with the cache to the MoE model; the dense one runs as it would alone."""
    llama, moe = dense_and_moe
    llm = LLM([f"a={llama}", f"b={moe}"], moe_expert_cache_size=2, moe_cpu_experts="always", **OPTIONS)
    a, b = llm.engine.engines["a"], llm.engine.engines["b"]
    assert a.config.moe_cpu_experts == "never" and b.config.moe_cpu_experts == "always"
    done = run_all(llm.engine, [("a", PROMPTS[0]), ("b", PROMPTS[0])])
    assert done["r0"] == alone(llama, PROMPTS[:1])[0]
    assert done["r1"] == alone(moe, PROMPTS[:1], moe_expert_cache_size=2, moe_cpu_experts="always")[0]
    assert expert_cache_stats(b.model)["host_experts"] > 0


def test_several_moe_models_each_get_the_size(dense_and_moe, small_mixtral):
    """N experts a layer for each MoE model: 4 of the Qwen3-MoE's 8, all 4 of the Mixtral's (no cache, and so
    no miss policy for it)."""
    llama, moe = dense_and_moe
    llm = LLM([f"q={moe}", f"m={small_mixtral}", f"d={llama}"], moe_expert_cache_size=4,
              moe_cpu_experts="always", **OPTIONS)
    q, m, d = (llm.engine.engines[name] for name in "qmd")
    assert expert_cache_stats(q.model)["num_slots"] == 4 and q.config.moe_cpu_experts == "always"
    assert expert_cache_stats(q.model)["host_bytes"] > 0
    mixtral = expert_cache_stats(m.model)
    assert mixtral["num_slots"] == mixtral["num_experts"] == 4 and mixtral["host_bytes"] == 0
    assert m.config.moe_cpu_experts == "never" and d.config.moe_cpu_experts == "never"
    assert d.config.moe_expert_cache_size is None
    done = run_all(llm.engine, [("q", PROMPTS[1]), ("m", PROMPTS[1]), ("d", PROMPTS[1])])
    assert done["r0"] == alone(moe, PROMPTS[1:2], moe_expert_cache_size=4, moe_cpu_experts="always")[0]
    assert done["r1"] == alone(small_mixtral, PROMPTS[1:2])[0]
    assert done["r2"] == alone(llama, PROMPTS[1:2])[0]


def test_one_moe_model_takes_the_gib(dense_and_moe):
    """--moe-expert-cache-gb with one MoE model among several is that model's: the size start-up turns it into."""
    llama, moe = dense_and_moe
    slots = LLM(moe, moe_expert_cache_size=3, **OPTIONS).engine.ledger.get("expert_cache")
    gib = slots * 7 / 6 / (1 << 30)  # 3.5 experts' bytes a layer: start-up keeps 3
    llm = LLM([f"a={llama}", f"b={moe}"], moe_expert_cache_gb=gib, **OPTIONS)
    assert expert_cache_stats(llm.engine.engines["b"].model)["num_slots"] == 3
    assert llm.engine.engines["a"].config.moe_expert_cache_gb is None


# ---------------------------------------------------------------- refusals, one line each


def test_no_moe_model_is_refused(two_models, capsys):
    llama, qwen = two_models
    for options, flag in (({"moe_expert_cache_size": 2}, "--moe-expert-cache-size 2"),
                          ({"moe_expert_cache_gb": 0.5}, "--moe-expert-cache-gb 0.5"),
                          ({"moe_cpu_experts": "auto"}, "--moe-cpu-experts auto")):
        with pytest.raises(ValueError, match=f"^{flag} is for mixture-of-experts models, and none of the models "
                                             f"served .'a' LlamaForCausalLM, 'b' Qwen3ForCausalLM. has experts: "
                                             f"drop the flag$"):
            LLM([f"a={llama}", f"b={qwen}"], **options, **OPTIONS)
    err = one_line_error(capsys, ["serve", llama, qwen, "--port", free_port(), "--moe-expert-cache-size", "2"])
    assert "--moe-expert-cache-size 2 is for mixture-of-experts models, and none of the models served" in err
    err = one_line_error(capsys, ["plan", llama, qwen, "--gpu-mem", "1GiB", "--moe-expert-cache-gb", "1"])
    assert "--moe-expert-cache-gb 1 is for mixture-of-experts models" in err


def test_gib_with_several_moe_models_is_refused(dense_and_moe, small_mixtral, capsys):
    llama, moe = dense_and_moe
    message = ("--moe-expert-cache-gb 0.5 with several mixture-of-experts models ('q', 'm'): one GiB figure does "
               "not say how to split it between them; give --moe-expert-cache-size N, the experts per MoE layer "
               "each of them keeps on the device")
    with pytest.raises(ValueError) as error:
        LLM([f"q={moe}", f"d={llama}", f"m={small_mixtral}"], moe_expert_cache_gb=0.5, **OPTIONS)
    assert str(error.value) == message
    err = one_line_error(capsys, ["serve", f"q={moe}", f"m={small_mixtral}", "--port", free_port(),
                                  "--moe-expert-cache-gb", "0.5"])
    assert message in err
    assert message in one_line_error(capsys, ["plan", f"q={moe}", f"m={small_mixtral}", "--gpu-mem", "1GiB",
                                              "--moe-expert-cache-gb", "0.5"])


def test_a_size_out_of_range_for_one_model_names_it(dense_and_moe, small_mixtral, capsys):
    llama, moe = dense_and_moe
    with pytest.raises(ValueError, match=r"^model 'm': --moe-expert-cache-size 6: must be from 2 .* to 4 \(the "
                                         r"experts per layer in .*config.json\)$"):
        LLM([f"q={moe}", f"m={small_mixtral}", f"d={llama}"], moe_expert_cache_size=6, **OPTIONS)
    with pytest.raises(ValueError, match=r"^model 'q': --moe-expert-cache-size 1: must be from 2 "):
        LLM([f"d={llama}", f"q={moe}"], moe_expert_cache_size=1, **OPTIONS)
    err = one_line_error(capsys, ["serve", f"q={moe}", f"m={small_mixtral}", "--port", free_port(),
                                  "--moe-expert-cache-size", "6"])
    assert "model 'm': --moe-expert-cache-size 6: must be from 2" in err
    err = one_line_error(capsys, ["plan", f"q={moe}", f"m={small_mixtral}", "--gpu-mem", "1GiB",
                                  "--moe-expert-cache-size", "6"])
    assert "model 'm': --moe-expert-cache-size 6: must be from 2" in err


def test_the_option_checks_come_before_any_config_is_read(tmp_path):
    """A bad value is refused as EngineConfig refuses it, whatever the models are (none is read)."""
    missing = [("a", str(tmp_path / "a")), ("b", str(tmp_path / "b"))]
    for options, message in (({"moe_expert_cache_size": 0}, "moe_expert_cache_size must be a whole number"),
                             ({"moe_expert_cache_gb": -1.0}, "moe_expert_cache_gb must be > 0 GiB"),
                             ({"moe_cpu_experts": "sometimes"}, "moe_cpu_experts must be never, auto or always"),
                             ({"moe_expert_cache_size": 2, "moe_expert_cache_gb": 1.0}, "both given")):
        with pytest.raises(ValueError, match=message):
            options_by_model(missing, options, shape_of=lambda path: pytest.fail(f"read {path}"))
    options = {"dtype": "float32", "moe_cpu_experts": "never"}  # no expert option given: nothing is read
    assert options_by_model(missing, options, shape_of=lambda path: pytest.fail(f"read {path}")) == {
        "a": options, "b": options}


def test_sleep_offload_weights_with_the_cache_is_still_refused(dense_and_moe):
    llama, moe = dense_and_moe
    with pytest.raises(ValueError, match="--sleep-offload-weights moves whole models. weights; with experts"):
        LLM([llama, moe], moe_expert_cache_size=2, sleep_after=5, sleep_offload_weights=True, **OPTIONS)


# ---------------------------------------------------------------- the plan counts the resident experts


def test_plan_counts_the_resident_experts(dense_and_moe):
    """The MoE model's device bytes are its resident weights at its cache size, the dense one's are as alone;
    the pool gets the experts that stay in host memory. Checked against the CPU engine's ledger."""
    llama, moe = dense_and_moe
    settings = dict(dtype="float32", max_model_len=256)
    pairs = [f"dense={llama}", f"moe={moe}"]
    cached = plan_models(pairs, gpu_mem_bytes=1 << 30, moe_expert_cache_size=2, **settings)
    full = plan_models(pairs, gpu_mem_bytes=1 << 30, **settings)
    dense, experts = cached.models
    block = experts.plan.block_size
    assert experts.plan.expert_cache_size == 2 and dense.plan.num_experts == 0
    alone_cached = plan_memory(moe, block_size=block, moe_expert_cache_size=2, max_num_seqs=256, **settings)
    alone_full = plan_memory(moe, block_size=block, max_num_seqs=256, **settings)
    assert experts.plan.resident_weight_bytes == alone_cached.resident_weight_bytes < alone_full.resident_weight_bytes
    assert dense.device_bytes == full.models[0].device_bytes
    assert cached.pool_bytes - full.pool_bytes == full.models[1].device_bytes - experts.device_bytes > 0

    llm = LLM(pairs, moe_expert_cache_size=2, num_gpu_blocks_override=20, **OPTIONS, max_model_len=256)
    ledgers = llm.engine.first.budget.ledgers
    assert experts.plan.resident_weight_bytes == ledgers["moe"].get("weights") + ledgers["moe"].get("expert_cache")
    assert experts.plan.host_expert_bytes == ledgers["moe"].get("expert_host")
    assert dense.plan.weight_bytes == ledgers["dense"].get("weights")


def test_plan_cli_with_a_cache(dense_and_moe, capsys):
    llama, moe = dense_and_moe
    assert main(["plan", f"dense={llama}", f"moe={moe}", "--gpu-mem", "1GiB", "--max-model-len", "256",
                 "--moe-expert-cache-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [m["plan"]["expert_cache_size"] for m in data["models"]] == [0, 2]
    assert main(["plan", f"dense={llama}", f"moe={moe}", "--gpu-mem", "1GiB", "--moe-expert-cache-size", "2"]) == 0
    text = capsys.readouterr().out
    assert "weights (resident: 2 of 8 experts/layer)" in text and "dense: LlamaForCausalLM" in text


def test_diagnose_plans_the_pool_with_the_cache(dense_and_moe):
    """`mempath diagnose A B --moe-expert-cache-size N`: the shared section's plan and the MoE model's rows
    are of its N resident experts, the dense model's have none."""
    pytest.importorskip("matplotlib", reason="diagnose's report module imports matplotlib")
    from mempath.tools.diagnose.multi import diagnose_models
    llama, moe = dense_and_moe
    report = diagnose_models([f"dense={llama}", f"moe={moe}"], device="cpu", dtype="float32", probe_tokens=64,
                             probe_seqs=4, leak_requests=2, growth_requests=2, split_requests=2, out_dir=None,
                             cpu_kv_cache_bytes=2 << 20, max_model_len=96, moe_expert_cache_size=2)
    planned = report["shared_kv_pages"]["plan"]["models"]
    assert [m["plan"]["expert_cache_size"] for m in planned] == [0, 2]
    rows = {section["name"]: {r["pathway"]: r for r in section["pathways"]} for section in report["models"]}
    for pathway in ("weights", "expert_cache", "expert_host"):
        assert rows["moe"][pathway]["error_pct"] == 0.0, rows["moe"][pathway]
    assert "expert_cache" not in rows["dense"] and rows["dense"]["weights"]["error_pct"] == 0.0


def test_plan_cli_passes_the_miss_policy_to_the_moe_model(dense_and_moe, capsys):
    """`mempath plan A B --moe-cpu-experts auto`: the MoE model's plan is of that policy, the dense one's of
    none; a policy no model can use is refused in one line, as start-up refuses it."""
    llama, moe = dense_and_moe
    argv = ["plan", f"dense={llama}", f"moe={moe}", "--gpu-mem", "1GiB", "--max-model-len", "256", "--json"]
    assert main(argv + ["--moe-expert-cache-size", "2", "--moe-cpu-experts", "auto"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [m["plan"]["moe_cpu_experts"] for m in data["models"]] == ["never", "auto"]
    err = one_line_error(capsys, argv + ["--moe-cpu-experts", "always"])
    assert "--moe-cpu-experts" in err
