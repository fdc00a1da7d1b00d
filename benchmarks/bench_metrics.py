"""/metrics against what a client measures, and what the metrics cost the engine thread.

Starts a server here (bench_serve.py's workload: streaming completions of random
prompts at one arrival rate), then prints, per figure, the client's mean beside the
server's histogram mean over the same requests: TTFT, inter-token latency, e2e
(the client's include HTTP and SSE; the server's start at the engine's arrival),
and the server's queue + prefill (which must equal its TTFT: the same timestamps)
and prefill + decode (= inference). Then the cost on the engine thread: one
finished request's histograms (``ServerMetrics.record_request``), one
``engine.stats()`` (what each stats line and each scrape reads), one scrape.

Prints a table, then one JSON line. Usage:
    PYTHONPATH=. python3 benchmarks/bench_metrics.py --num-requests 256 --rate 32
"""
import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import arrival_offsets, make_workload, send_one, start_local_server, summarize  # noqa: E402

HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_inference_time_seconds")


def histogram_totals(url: str) -> dict[str, tuple[float, float]]:
    """{histogram: (count, sum)} from one scrape."""
    totals = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            for name in HISTOGRAMS:
                if sample.name in (f"mempath:{name}_count", f"mempath:{name}_sum"):
                    count, total = totals.get(name, (0.0, 0.0))
                    totals[name] = (sample.value, total) if sample.name.endswith("_count") else (count, sample.value)
    return totals


async def run_rate(url: str, model: str, workload, rate: float, seed: int):
    """bench_serve's open-loop run, keeping each request's result: (summary row, results)."""
    import random
    offsets = arrival_offsets(rate, len(workload), random.Random(seed))
    limits = httpx.Limits(max_connections=len(workload), max_keepalive_connections=len(workload))
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()

        async def launch(offset, prompt, output_len):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return await send_one(http, url, model, prompt, output_len)

        results = await asyncio.gather(*[launch(o, p, n) for o, (p, n) in zip(offsets, workload)])
        return summarize(rate, results, time.perf_counter() - start), results


def per_call_us(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return 1e6 * (time.perf_counter() - start) / repeat


def engine_thread_costs(server, url: str) -> dict:
    """Microseconds per call of what the metrics add to the engine thread, and per scrape."""
    from mempath.engine.request import Request
    from mempath.sampling import SamplingParams
    client = server.config.app.state.engine_client
    request = Request("r", None, list(range(100)), SamplingParams(max_tokens=64))
    request.status = request.status.RUNNING
    request.token_ids += list(range(64))
    request.first_token_time = request.last_token_time = time.perf_counter()
    return {"record_request_us": per_call_us(lambda: client.metrics.record_request(request), 10000),
            "engine_stats_us": per_call_us(client.engine.stats, 200),  # on this thread: the engine is idle
            "scrape_ms": per_call_us(lambda: httpx.get(f"{url}/metrics"), 50) / 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--rate", type=float, default=32.0)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", default="64:512")
    parser.add_argument("--output-len", default="32:256")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    url, server = start_local_server(args)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    workload = make_workload(args)
    asyncio.run(run_rate(url, model, workload[:8], float("inf"), args.seed))  # warm-up
    before = histogram_totals(url)
    row, results = asyncio.run(run_rate(url, model, workload, args.rate, args.seed))
    time.sleep(0.5)  # the last requests' histograms are observed as they finish
    after = histogram_totals(url)
    server_mean = {name: (after[name][1] - before[name][1]) / max(1.0, after[name][0] - before[name][0])
                   for name in HISTOGRAMS}
    done = [r for r in results if r.ok]
    gaps = [g for r in done for g in r.gaps]
    client_mean = {"time_to_first_token_seconds": sum(r.ttft for r in done) / len(done),
                   "inter_token_latency_seconds": sum(gaps) / max(1, len(gaps)),
                   "e2e_request_latency_seconds": sum(r.e2e for r in done) / len(done)}
    print(f"{'figure':<34} {'client mean ms':>15} {'server mean ms':>15}")
    for name in HISTOGRAMS:
        client = f"{1e3 * client_mean[name]:.2f}" if name in client_mean else "-"
        print(f"{name:<34} {client:>15} {1e3 * server_mean[name]:>15.2f}")
    counts = {name: after[name][0] - before[name][0] for name in HISTOGRAMS}
    queue_plus_prefill = server_mean["request_queue_time_seconds"] + server_mean["request_prefill_time_seconds"]
    print(f"server queue + prefill = {1e3 * queue_plus_prefill:.3f} ms, TTFT {1e3 * server_mean['time_to_first_token_seconds']:.3f} ms; "
          f"requests observed {counts['request_queue_time_seconds']:.0f} of {len(done)}")
    costs = engine_thread_costs(server, url)
    print(f"record_request {costs['record_request_us']:.1f} us/request, engine.stats() {costs['engine_stats_us']:.0f} us, "
          f"one scrape {costs['scrape_ms']:.2f} ms")
    print(json.dumps({"benchmark": "metrics", "rate": args.rate, "num_requests": args.num_requests, "serve": row,
                      "client_mean_s": client_mean, "server_mean_s": server_mean, "counts": counts, "costs": costs}))
    server.should_exit = True
    return 0 if row["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
