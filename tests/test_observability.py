"""What an operator watches: /metrics (vLLM's histograms, cache_config_info, process
metrics, the tiers), the Grafana dashboard's queries against a live server, the
periodic stats line, the start-up capacity line, and the port check of `serve`."""
import json
import logging
import re
import socket
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mempath import LLM, SamplingParams
from mempath.server.cli import build_server_app
from mempath.server.metrics import E2E_BUCKETS, ServerMetrics, build_1_2_5_buckets
from mempath.server.stats_log import STATS_LOGGER, StatsLog
from tests.test_server import ENGINE_OPTIONS, RunningServer

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "mempath.json"
MAX_MODEL_LEN = ENGINE_OPTIONS["max_model_len"]
TIER_BLOCK_NBYTES = 2 * 2 * 16 * 2 * 16 * 4  # tests/conftest.py's llama: layers, K/V, tokens, kv heads, head_dim, f32
STATS_INTERVAL = 0.2


def tier_gb(blocks: int) -> float:
    return blocks * (TIER_BLOCK_NBYTES + 256) / (1 << 30)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from tests.conftest import make_model
    path = tmp_path_factory.mktemp("observed-model")
    make_model(path, "llama")
    return str(path)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    """A server with both KV tiers, so that every family the dashboard reads exists."""
    options = dict(ENGINE_OPTIONS, cpu_kv_gb=tier_gb(32), disk_kv_path=str(tmp_path_factory.mktemp("disk-kv")),
                   disk_kv_gb=tier_gb(64))
    logging.getLogger(STATS_LOGGER).setLevel(logging.INFO)
    app, name = build_server_app(model_path, options, served_model_name="tiny", show_progress=False,
                                 log_stats_interval=STATS_INTERVAL)
    running = RunningServer(app, name)
    yield running
    running.stop()


def scrape(server) -> list:
    return list(text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text))


def samples(server) -> dict[tuple, float]:
    """{(sample name, sorted labels without model_name): value}"""
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in scrape(server) for s in family.samples}


def complete(server, prompt: str, max_tokens: int = 8) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


# ----------------------------------------------------------------- the dashboard
def dashboard_queries(node) -> list[str]:
    """Every PromQL expression in the dashboard: panel targets and template variable queries."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            else:
                found += dashboard_queries(value)
    elif isinstance(node, list):
        for item in node:
            found += dashboard_queries(item)
    return found


METRIC_NAME = re.compile(r"\b((?:mempath:|process_|python_)[A-Za-z0-9_:]*)")
CUDA_ONLY = {"mempath:memory_budget_bytes", "mempath:device_memory_used_bytes"}


def test_every_metric_the_dashboard_reads_is_served(server):
    complete(server, "def read_config(path):")
    served = {s.name for family in scrape(server) for s in family.samples}
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    used = {name for query in queries for name in METRIC_NAME.findall(query)}
    assert len(used) > 30
    missing = used - served - CUDA_ONLY
    assert not missing, f"the dashboard reads metrics /metrics does not serve: {sorted(missing)}"
    titles = [p["title"] for p in dashboard["panels"]]
    for title in ("Memory ledger per pathway", "Device budget", "KV tier use", "KV loads and write-backs",
                  "Time to first token", "Prefix cache hit rate"):
        assert title in titles


# ----------------------------------------------------------------- per-request histograms
def histogram(m: dict, name: str) -> tuple[float, float]:
    return m[(f"{name}_count", ())], m[(f"{name}_sum", ())]


def test_request_phases_come_from_the_engine_timestamps(server):
    names = ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
             "request_inference_time_seconds", "time_to_first_token_seconds", "e2e_request_latency_seconds",
             "request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens")
    before = samples(server)
    bodies = [complete(server, prompt, max_tokens) for prompt, max_tokens in (("import os", 5), ("class A:", 9))]
    time.sleep(0.1)  # the last request's histograms are observed by the engine thread as it finishes
    after = samples(server)
    delta = {}
    for name in names:
        (c0, s0), (c1, s1) = histogram(before, f"mempath:{name}"), histogram(after, f"mempath:{name}")
        assert c1 - c0 == 2, name
        delta[name] = s1 - s0
    # One request's phases add up exactly: they are differences of the same timestamps.
    assert delta["request_queue_time_seconds"] + delta["request_prefill_time_seconds"] == pytest.approx(
        delta["time_to_first_token_seconds"], rel=1e-6, abs=1e-9)
    assert delta["request_prefill_time_seconds"] + delta["request_decode_time_seconds"] == pytest.approx(
        delta["request_inference_time_seconds"], rel=1e-6, abs=1e-9)
    assert delta["request_queue_time_seconds"] + delta["request_inference_time_seconds"] <= \
        delta["e2e_request_latency_seconds"] + 1e-9
    assert delta["request_prompt_tokens"] == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert delta["request_generation_tokens"] == 5 + 9
    assert delta["request_params_max_tokens"] == 5 + 9
    assert after[("mempath:iteration_tokens_total_count", ())] > before[("mempath:iteration_tokens_total_count", ())]


def test_histograms_have_vllms_buckets(server):
    m = samples(server)
    bounds = sorted(float(dict(labels)["le"]) for name, labels in m if name == "mempath:request_queue_time_seconds_bucket")
    assert bounds == sorted([*E2E_BUCKETS, float("inf")])
    bounds = sorted(float(dict(labels)["le"]) for name, labels in m if name == "mempath:request_prompt_tokens_bucket")
    assert bounds == [1, 2, 5, 10, 20, 50, 100, 200, float("inf")]  # 1-2-5 up to max_model_len 256
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


def test_cache_config_info_process_metrics_and_tiers(server):
    tiers = server.engine.kv.tiers
    families = {family.name: family for family in scrape(server)}
    (info,) = families["mempath:cache_config_info"].samples
    assert info.value == 1
    assert {k: info.labels[k] for k in ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching",
                                        "num_cpu_blocks", "num_disk_blocks")} == {
        "block_size": "16", "num_gpu_blocks": "256", "cache_dtype": "float32", "enable_prefix_caching": "True",
        "num_cpu_blocks": str(tiers.host.num_blocks), "num_disk_blocks": str(tiers.disk.capacity_bytes // tiers.block_nbytes)}
    assert tiers.host.num_blocks >= 32
    m = samples(server)
    assert m[("process_resident_memory_bytes", ())] > 0
    assert m[("process_open_fds", ())] > 0
    capacity = {dict(labels)["tier"]: v for (name, labels), v in m.items() if name == "mempath:kv_tier_capacity_bytes"}
    assert set(capacity) == {"cpu", "disk"} and all(v > 0 for v in capacity.values())
    directions = {dict(labels)["direction"] for name, labels in m if name == "mempath:kv_blocks_moved_total"}
    assert directions == {"gpu_to_cpu", "cpu_to_gpu", "cpu_to_disk", "disk_to_cpu"}


def test_paused_requests_are_a_gauge(model_path):
    llm = LLM(model_path, show_progress=False, **ENGINE_OPTIONS)
    engine = llm.engine
    request_id = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.pause_request(request_id)
    metrics = ServerMetrics.for_engine("tiny", engine)
    text = metrics.render(engine.stats()).decode()
    assert 'mempath:num_requests_paused{model_name="tiny"} 1.0' in text
    assert 'mempath:num_requests_loading{model_name="tiny"} 0.0' in text


# ----------------------------------------------------------------- the stats line
STATS_LINE = re.compile(r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
                        r"Running: \d+ reqs, Waiting: \d+ reqs, CPU KV cache usage: [\d.]+%, "
                        r"Prefix cache hit rate: [\d.]+%, CPU KV tier: [\d.]+% used, \d+ blocks loaded, "
                        r"\d+ written back, Disk KV tier: [\d.]+% used, \d+ blocks loaded, \d+ written back$")


def stats_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == STATS_LOGGER and "throughput" in r.getMessage()]


def test_the_stats_line_is_written_while_serving_and_quiet_when_idle(server, caplog):
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    time.sleep(3 * STATS_INTERVAL)  # earlier tests' trailing line
    caplog.clear()
    complete(server, "def fib(n):", max_tokens=20)
    time.sleep(3 * STATS_INTERVAL)
    lines = stats_lines(caplog)
    assert lines, "no stats line after a request"
    assert all(STATS_LINE.match(line) for line in lines), lines
    assert any(not line.startswith("Avg prompt throughput: 0.0") for line in lines), lines
    assert lines[-1].startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s")
    caplog.clear()
    time.sleep(4 * STATS_INTERVAL)
    assert stats_lines(caplog) == [], "an idle server keeps logging"


def tier_snapshot(prompt, generation, hits, queries, cpu_used, loaded, written) -> dict:
    moved = {d: {"blocks": 0, "bytes": 0} for d in ("gpu_to_cpu", "cpu_to_gpu", "cpu_to_disk", "disk_to_cpu")}
    moved["cpu_to_gpu"]["blocks"], moved["gpu_to_cpu"]["blocks"] = loaded, written
    return {"prompt_tokens": prompt, "generation_tokens": generation, "prefix_cache_hits": hits,
            "prefix_cache_queries": queries, "num_running": 3, "num_waiting": 1, "num_paused": 0, "kv_usage": 0.25,
            "tiers": {"enabled": True, "cpu": {"used_bytes": cpu_used, "capacity_bytes": 1000}, "disk": None,
                      "moved": moved}}


def test_the_stats_line_reads_differences_of_the_engine_counters():
    before = tier_snapshot(100, 50, 2, 10, 0, 0, 3)
    after = tier_snapshot(1100, 250, 5, 16, 125, 4, 10)
    line, busy = StatsLog(10.0).line(before, after, seconds=10.0)
    assert busy
    assert line == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 50.0%, "
                    "CPU KV tier: 12.5% used, 4 blocks loaded, 7 written back")


def test_stats_flags_follow_vllm():
    from mempath.cli import build_parser
    from mempath.server.stats_log import enable_stats_logging
    args = build_parser().parse_args(["serve"])
    assert (args.disable_log_stats, args.log_stats_interval) == (False, 10.0)
    assert enable_stats_logging(args) == 10.0
    args = build_parser().parse_args(["serve", "--disable-log-stats", "--log-stats-interval", "2"])
    assert enable_stats_logging(args) is None
    for bad in ("0", "inf", "nan"):
        args = build_parser().parse_args(["serve", "--log-stats-interval", bad])
        with pytest.raises(ValueError, match="--log-stats-interval must be a number of seconds > 0"):
            enable_stats_logging(args)


# ----------------------------------------------------------------- start-up and the port
def test_the_startup_line_gives_kv_tokens_and_concurrency(model_path, caplog):
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    LLM(model_path, show_progress=False, **dict(ENGINE_OPTIONS, num_gpu_blocks_override=100))
    lines = [r.getMessage() for r in caplog.records if r.name == STATS_LOGGER]
    assert "CPU KV cache size: 1,600 tokens (100 blocks of 16)" in lines
    # 256 tokens per request take 16 blocks: 100 / 16 of them at once.
    assert f"Maximum concurrency for {MAX_MODEL_LEN:,} tokens per request: 6.25x" in lines


def test_serve_refuses_a_busy_port_before_loading_the_model(monkeypatch, capsys):
    import mempath.server.cli as server_cli
    from mempath.cli import main

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(server_cli, "build_server_app", load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["serve", "--device", "cpu", "--port", str(port)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == (f"mempath: error: port {port} is already in use on 127.0.0.1 (another server?): "
                   f"stop that process or choose another --port")


def test_serve_names_a_host_that_is_not_this_machines(monkeypatch, capsys):
    from mempath.server.port import check_port_free
    with pytest.raises(ValueError, match="--host 192.0.2.1 is not an address of this machine"):
        check_port_free("192.0.2.1", 8000)  # TEST-NET-1: never a local address
    check_port_free("127.0.0.1", 0)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_dashboard_reads_the_budget_too(model_path):
    """The CUDA-only families the dashboard's budget panel reads, and the promise they show."""
    app, name = build_server_app(model_path, dict(device="cuda", max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                                  max_num_batched_tokens=256, gpu_memory_utilization=0.5),
                                 served_model_name="tiny", show_progress=False)
    running = RunningServer(app, name)
    try:
        complete(running, "def read_config(path):")
        served = {s.name for family in scrape(running) for s in family.samples}
        used = {n for q in dashboard_queries(json.loads(DASHBOARD.read_text())) for n in METRIC_NAME.findall(q)}
        assert not used - served, sorted(used - served)
        m = samples(running)
        budget = m[("mempath:memory_budget_bytes", (("device", "cuda"),))]
        granted = sum(v for (n, labels), v in m.items()
                      if n == "mempath:memory_bytes" and dict(labels)["device"] == "cuda")
        device_used = m[("mempath:device_memory_used_bytes", (("device", "cuda"),))]
        assert 0 < granted <= budget
        assert 0 < device_used
        lines = [line for line in httpx.get(f"{running.url}/metrics").text.splitlines()
                 if line.startswith("mempath:cache_config_info")]
        assert 'cache_dtype="float32"' in lines[0] or 'cache_dtype="bfloat16"' in lines[0]
    finally:
        running.stop()
