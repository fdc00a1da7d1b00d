"""The host-path benchmarks of #21 run on the CPU (--tiny): the next GPU session's A/B must not have rotted."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def results(*argv: str) -> list[dict]:
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]


def test_bench_host_expert_times_every_condition():
    [line] = results("benchmarks/bench_host_expert.py", "--tiny")
    for key in ("bare_us", "hot_us", "sleep_us", "device_wait_us", "copies_us", "layer_serial_us", "load_into_slot_us",
                "load_into_slot_s37_us"):
        assert line[key] > 0, key


def test_bench_moe_runs_both_variants_of_each_ab():
    """Only that each runs and decodes: on the CPU auto runs no pair on the host (no link to save), so neither
    variant's host pairs are exercised here; the GPU run is the measurement."""
    lines = results("benchmarks/bench_moe.py", "--tiny", "--parts", "offload", "--cpu-experts", "auto",
                    "--routers", "model", "--host-path-ab", "1", "--row-learning-ab", "1")
    host_path = [r for r in lines if r["part"] == "host-path-ab"]
    learning = [r for r in lines if r["part"] == "row-learning-ab"]
    assert [r["variant"] for r in host_path] == ["this tree", "s37 host path"]
    assert [r["variant"] for r in learning] == ["rows learned", "start-up rows"]
    assert all(r["decode_tok_s"] > 0 for r in host_path + learning)


def test_start_up_rows_measures_a_cost_that_learns_nothing(model_factory, monkeypatch):
    """The row-learning A/B's held variant: a cost measured inside start_up_rows keeps start-up's row time."""
    from mempath import LLM
    from mempath.model import moe_host
    from mempath.model.moe import set_expert_cache_size
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.syspath_prepend(str(ROOT))
    from bench_moe import start_up_rows
    path, _ = model_factory("mixtral")
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, enable_prefix_caching=False)
    set_expert_cache_size(llm.engine.model, 2)
    experts = llm.engine.model.moe_blocks()[0].experts
    with start_up_rows():
        held = moe_host.measure_host_cost(experts)
    learned = moe_host.measure_host_cost(experts)
    assert held.row_weight == 0 and learned.row_weight == moe_host.ROW_WEIGHT > 0
    held.observe_host_rows(1, 1.0)
    assert held.host_row_seconds == held.start_row_seconds
