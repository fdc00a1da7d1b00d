"""benchmarks/bench_mix.py: the mix it draws and the arithmetic of what it reports (CPU, the shipped model)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_mix  # noqa: E402


def test_the_lognormal_mix_is_seeded_capped_and_near_its_medians():
    mix = bench_mix.MixSpec()
    prompts, outputs = bench_mix.synthetic_mix(1000, 0, 5000, mix)
    again, outputs_again = bench_mix.synthetic_mix(1000, 0, 5000, mix)
    assert prompts == again and outputs == outputs_again
    lengths = [len(p) for p in prompts]
    assert 1 <= min(lengths) and max(lengths) <= 2048 and 1 <= min(outputs) and max(outputs) <= 1024
    assert 170 <= np.median(lengths) <= 230 and 130 <= np.median(outputs) <= 170
    assert all(0 <= t < 5000 for p in prompts[:50] for t in p)


def test_sharegpt_lengths_take_the_first_turn_and_its_reply(tmp_path):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(bench_mix.TINY)
    data = [{"conversations": [{"from": "human", "value": "def f(x):"}]},  # no reply: skipped
            {"conversations": [{"from": "human", "value": "import os"}, {"from": "gpt", "value": "x " * 3000}]},
            {"conversations": [{"from": "human", "value": "print(1)"}, {"from": "gpt", "value": "ok"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    pairs = bench_mix.sharegpt_lengths(str(path), tokenizer, 10, bench_mix.MixSpec())
    assert pairs == [(len(tokenizer("import os")["input_ids"]), 1024),
                     (len(tokenizer("print(1)")["input_ids"]), len(tokenizer("ok")["input_ids"]))]
    path.write_text("[]")
    with pytest.raises(SystemExit, match="no conversation"):
        bench_mix.sharegpt_lengths(str(path), tokenizer, 10, bench_mix.MixSpec())


def test_summarize_arithmetic():
    clock = bench_mix.StepClock(steps=10, mixed_steps=2, host=0.5, schedule=0.1, runner=0.3, outputs=0.05)
    r = bench_mix.summarize(300, 200, 2.0, [0.1, 0.2, 0.3, 0.4], params=1000, rate=1e6, clock=clock,
                            device_seconds=1.5)
    assert r["output_tok_s"] == 100 and r["total_tok_s"] == 250
    assert r["mix_flops"] == 2 * 1000 * 500 and r["compute_limit_s"] == 1.0 and r["mfu"] == 0.5
    assert r["limit_output_tok_s"] == 200
    assert r["host_ms_per_step"] == 50 and r["runner_ms_per_step"] == 30 and r["device_ms_per_step"] == 150
    assert r["gpu_busy"] == 0.75
    assert r["ttft_p50"] == pytest.approx(0.25) and r["ttft_p50"] <= r["ttft_p99"] <= 0.4


def test_tiny_run_reports_what_it_generated(tmp_path):
    out = tmp_path / "mix.jsonl"
    results = bench_mix.main(["--tiny", "--requests", "5", "--max-num-seqs", "2,4", "--out", str(out)])
    prompts, outputs = bench_mix.synthetic_mix(5, 0, 8192, bench_mix.TINY_MIX)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["max_num_seqs"] for r in lines] == [2, 4] and len(results) == 2
    for r in lines:
        assert r["output_tokens"] == sum(outputs) and r["input_tokens"] == sum(map(len, prompts))
        assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["seconds"])
        assert r["compute_limit_s"] == pytest.approx(2 * r["params"] * (r["input_tokens"] + r["output_tokens"])
                                                     / r["matmul_flop_s"])
        assert r["mfu"] == pytest.approx(r["compute_limit_s"] / r["seconds"])
        # Every step goes through the clock, and its parts fit inside the step's host time.
        assert r["steps"] >= max(outputs) and r["mixed_steps"] >= 1
        assert r["schedule_ms_per_step"] + r["runner_ms_per_step"] + r["outputs_ms_per_step"] <= r["host_ms_per_step"]
        assert "gpu_busy" not in r  # no device events on the CPU


def test_tiny_run_sweeps_quantization_and_kv_dtype(tmp_path):
    """Each (weights, KV dtype) pair is its own engine on the same mix, labelled in its result."""
    results = bench_mix.main(["--tiny", "--requests", "3", "--quantization", "none,fp8", "--kv-cache-dtype", "auto,fp8"])
    pairs = [(r["quantization"], r["kv_cache_dtype"]) for r in results]
    assert pairs == [("none", "auto"), ("none", "fp8"), ("fp8", "auto"), ("fp8", "fp8")]
    assert len({r["output_tokens"] for r in results}) == 1
    assert results[1]["kv_blocks"] > results[0]["kv_blocks"]
    assert results[2]["weight_bytes"] < results[0]["weight_bytes"] == results[1]["weight_bytes"]
    with pytest.raises(SystemExit):
        bench_mix.main(["--tiny", "--quantization", "int4"])


def test_another_fp8_gemm_table_is_read_by_its_engine_alone(tmp_path, monkeypatch):
    """--fp8-gemm takes a table file beside table and scaled-mm: its engine reads it through the environment
    variable, which is put back after it; a path that is no file is refused."""
    from mempath.kernels.fp8_gemm_triton import TABLE_ENV
    table = tmp_path / "t.json"
    table.write_text('{"configs": {}}')
    monkeypatch.delenv(TABLE_ENV, raising=False)
    seen = []

    class SpyLLM(bench_mix.LLM):
        def __init__(self, *args, **kwargs):
            seen.append(bench_mix.os.environ.get(TABLE_ENV))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(bench_mix, "LLM", SpyLLM)
    results = bench_mix.main(["--tiny", "--requests", "2", "--quantization", "fp8",
                              "--fp8-gemm", f"table,{table}"])
    assert seen == [None, str(table.resolve())]
    assert [r["fp8_gemm"] for r in results] == ["table", str(table)]
    assert TABLE_ENV not in bench_mix.os.environ
    with pytest.raises(SystemExit):
        bench_mix.main(["--tiny", "--fp8-gemm", str(tmp_path / "missing.json")])


def test_repeat_interleaves_the_configurations_and_prints_their_medians(capsys):
    results = bench_mix.main(["--tiny", "--requests", "3", "--max-num-seqs", "2,4", "--repeat", "2"])
    assert [(r["max_num_seqs"], r["repeat"]) for r in results] == [(2, 0), (4, 0), (2, 1), (4, 1)]
    out = capsys.readouterr().out
    assert "over 2 interleaved rounds (median, min-max)" in out
    for seqs in (2, 4):
        values = [r["output_tok_s"] for r in results if r["max_num_seqs"] == seqs]
        assert f"max_num_seqs={seqs} max_num_batched_tokens" in out
        assert f"{np.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})" in out
    with pytest.raises(SystemExit):
        bench_mix.main(["--tiny", "--repeat", "0"])


def test_step_classes_split_steps_and_bound_each():
    """Each step in its class; its bound the larger of its matmul FLOPs and its bytes, at the run's rates."""
    costs = bench_mix.StepCosts(layer_params=100, lm_head_params=10, weight_bytes=1000, kv_bytes_per_token=2,
                                matmul_rate=1e4, bandwidth=1e4)
    # (tokens, rows, sampled, KV positions): a prefill-carrying step, then decode at 1, 40 and 600 rows.
    shapes = [(300, 3, 2, 500), (1, 1, 1, 100), (40, 40, 40, 4000), (600, 600, 600, 100)]
    times = [10.0, 1.0, 2.0, 20.0]
    out = bench_mix.step_classes(shapes, times, costs)
    classes = out["classes"]
    assert list(classes) == ["prefill", "decode 1-32", "decode 33-128", "decode 513+"]
    # prefill: FLOPs 2 * (100 * 300 + 10 * 2) = 60,040 -> 6.004 s; bytes 1000 + 1000 -> 0.2 s
    assert classes["prefill"]["bound_s"] == pytest.approx(6.004) and classes["prefill"]["of_bound"] == pytest.approx(0.6004)
    assert classes["decode 1-32"]["bound_s"] == pytest.approx(max(2 * 110 / 1e4, 1200 / 1e4))  # bytes-bound
    assert classes["decode 33-128"]["bound_s"] == pytest.approx(max(2 * 110 * 40 / 1e4, 9000 / 1e4))
    assert classes["decode 513+"]["tokens"] == 600 and classes["decode 513+"]["steps"] == 1
    assert out["device_s"] == pytest.approx(33.0)
    assert out["schedule_bound_s"] == pytest.approx(sum(c["bound_s"] for c in classes.values()))
    # serial: the projections' bound, then the KV bytes. The 40-row step: max(0.88, 0.1) + 0.8 s, where the
    # plain bound took only the larger of 0.88 and 0.9.
    assert classes["decode 33-128"]["serial_bound_s"] == pytest.approx(2 * 110 * 40 / 1e4 + 8000 / 1e4)
    assert classes["decode 1-32"]["serial_bound_s"] == pytest.approx(1000 / 1e4 + 200 / 1e4)
    assert classes["decode 33-128"]["kv_s"] == pytest.approx(8000 / 1e4)  # the serial bound's attention part
    assert out["serial_bound_s"] == pytest.approx(sum(c["serial_bound_s"] for c in classes.values()))
    assert out["serial_bound_s"] > out["schedule_bound_s"]
    assert out["of_serial_bound"] == pytest.approx(out["serial_bound_s"] / 33.0)
    with pytest.raises(ValueError):
        bench_mix.step_classes(shapes, times[:3], costs)  # a step without its time is an error, not a skip


def test_step_costs_count_the_layers_and_the_head_of_a_dense_engine():
    from mempath import LLM
    llm = LLM(str(bench_mix.TINY), device="cpu", dtype="float32", max_model_len=256, show_progress=False)
    engine = llm.engine
    costs = bench_mix.step_costs(engine, rate=1e12, bandwidth=1e11)
    model = engine.runner.model
    everything = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    norms = model.model.norm.weight.numel()
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert costs.layer_params + costs.lm_head_params + norms + (0 if tied else embed) == everything
    assert costs.kv_bytes_per_token * engine.runner.block_size == engine.runner.kv_bytes_per_block()
    assert costs.weight_bytes == engine.ledger.get("weights")


def test_step_costs_leave_out_a_mixture_of_experts(model_factory):
    """A MoE step reads only its routed experts: no bytes bound from every weight is claimed for it."""
    from mempath import LLM
    path, _ = model_factory("qwen3_moe")
    llm = LLM(path, device="cpu", dtype="float32", show_progress=False)
    assert bench_mix.step_costs(llm.engine, rate=1e12, bandwidth=1e11) is None


def test_mix_bound_schedules_decode_rows_first_then_prompt_chunks():
    """benchmarks/mix_bound.py's schedule: decoding rows, then prompt chunks in arrival order up to the budget;
    a prompt's last chunk samples its first token."""
    import mix_bound
    # (tokens, rows, sampled rows, KV positions): r0's whole prompt and 5 of r1's; then r0's second token beside
    # the rest of r1's prompt, whose first token is its last.
    assert list(mix_bound.schedule([3, 10], [2, 1], 8)) == [(8, 2, 1, 8), (6, 2, 2, 14)]


def test_mix_bound_serial_bound_adds_the_kv_bytes_to_the_projections():
    import mix_bound
    mix = bench_mix.TINY_MIX
    r = mix_bound.bounds("qwen3-0.6b", 40, 0, mix, 256, rate=1e14, bandwidth=1e12)
    rng = np.random.default_rng(0)
    bench_mix.lognormal_lengths(40, mix.input_median, mix.input_sigma, mix.input_cap, rng)
    outputs = bench_mix.lognormal_lengths(40, mix.output_median, mix.output_sigma, mix.output_cap, rng)
    assert r["output_tokens"] == sum(outputs) and r["steps"] >= max(outputs)  # the longest answer, a step a token
    assert r["flops_s"] < r["bound_s"] < r["serial_bound_s"]
    assert r["serial_bound_output_tok_s"] == pytest.approx(r["output_tokens"] / r["serial_bound_s"])


def test_an_ab_engine_that_fails_to_build_puts_the_switches_back(tmp_path, monkeypatch):
    """The A/B switches (decode order, quant fusion, the fp8 GEMM and its table) are put back when the engine's
    build fails too: a later engine in the same process must not run on the failed one's variant."""
    from mempath.engine import runner as runner_module
    from mempath.kernels.fp8_gemm_triton import TABLE_ENV
    from mempath.model import quant as quant_module
    monkeypatch.delenv(TABLE_ENV, raising=False)
    seen = []

    class FailingLLM:
        def __init__(self, *args, **kwargs):
            seen.append((runner_module.DECODE_LONGEST_FIRST, quant_module.USE_FUSED_QUANT,
                         quant_module.USE_FP8_GEMM, bench_mix.os.environ.get(TABLE_ENV)))
            raise ValueError("no memory is left for the KV cache")

    monkeypatch.setattr(bench_mix, "LLM", FailingLLM)
    args = bench_mix.parse_args(["--tiny"])
    with pytest.raises(ValueError):
        bench_mix.run_mempath(args, [[1, 2]], [2], 1.0, None, None, decode_order="batch", quant_fusion="unfused",
                              fp8_gemm=str(tmp_path / "t.json"))
    assert seen == [(False, False, True, str((tmp_path / "t.json").resolve()))]
    assert runner_module.DECODE_LONGEST_FIRST and quant_module.USE_FUSED_QUANT and quant_module.USE_FP8_GEMM
    assert TABLE_ENV not in bench_mix.os.environ
