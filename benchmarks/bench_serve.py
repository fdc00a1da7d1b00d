"""Open-loop load against the OpenAI-compatible server: throughput, TTFT and ITL.

Requests arrive as a Poisson process at each rate (``inf``: all at once) and are
sent whether or not earlier ones have finished, as real users would; each one
streams a completion of a fixed output length (``ignore_eos``) for a prompt of
random token ids. Per rate: completed and failed requests, requests/s, output
tokens/s, time to first token and inter-token latency (gaps between streamed
chunks) at p50 and p99, end-to-end p50.

Targets a running server with ``--url``, or starts one in this process on a
free loopback port with ``--model`` (default: the built-in model).

Prints a table, then one JSON line. Usage:
    PYTHONPATH=. python3 benchmarks/bench_serve.py --rates 1,4,16,inf --num-requests 64
    PYTHONPATH=. python3 benchmarks/bench_serve.py --url http://127.0.0.1:8000 --api-key KEY
"""
import argparse
import asyncio
import json
import math
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

TOKEN_ID_RANGE = (10, 256)  # every vocabulary has these: the prompts work for any model


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str = ""


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def make_workload(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    in_lo, in_hi = parse_range(args.input_len)
    out_lo, out_hi = parse_range(args.output_len)
    return [([rng.randrange(*TOKEN_ID_RANGE) for _ in range(rng.randint(in_lo, in_hi))],
             rng.randint(out_lo, out_hi)) for _ in range(args.num_requests)]


def arrival_offsets(rate: float, count: int, rng: random.Random) -> list[float]:
    if math.isinf(rate):
        return [0.0] * count
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


async def send_one(http: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                   output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = Result(ok=False)
    last = None
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk["choices"]:
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.gaps.append(now - last)
                last = now
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = True
    return result


async def run_rate(url: str, model: str, headers: dict, workload, rate: float, seed: int) -> dict:
    offsets = arrival_offsets(rate, len(workload), random.Random(seed))
    limits = httpx.Limits(max_connections=len(workload), max_keepalive_connections=len(workload))
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as http:
        start = time.perf_counter()

        async def launch(offset, prompt, output_len):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return await send_one(http, url, model, prompt, output_len)

        results = await asyncio.gather(*[launch(o, p, n) for o, (p, n) in zip(offsets, workload)])
        duration = time.perf_counter() - start
    return summarize(rate, results, duration)


def summarize(rate: float, results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.ok]
    gaps = [g for r in done for g in r.gaps]
    tokens = sum(r.output_tokens for r in done)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "rate": "inf" if math.isinf(rate) else rate, "completed": len(done),
        "failed": len(results) - len(done), "duration_s": duration,
        "request_throughput": len(done) / duration, "output_throughput": tokens / duration,
        "ttft_p50_ms": 1e3 * percentile([r.ttft for r in done], 50),
        "ttft_p99_ms": 1e3 * percentile([r.ttft for r in done], 99),
        "itl_p50_ms": 1e3 * percentile(gaps, 50), "itl_p99_ms": 1e3 * percentile(gaps, 99),
        "e2e_p50_ms": 1e3 * percentile([r.e2e for r in done], 50), "errors": errors[:3],
    }


def print_table(rows: list[dict]) -> None:
    columns = [("rate", "rate/s", "{}"), ("completed", "done", "{}"), ("failed", "failed", "{}"),
               ("request_throughput", "req/s", "{:.2f}"), ("output_throughput", "tok/s", "{:.1f}"),
               ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"), ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"),
               ("itl_p50_ms", "ITL p50 ms", "{:.1f}"), ("itl_p99_ms", "ITL p99 ms", "{:.1f}"),
               ("e2e_p50_ms", "E2E p50 ms", "{:.1f}")]
    cells = [[title for _, title, _ in columns]]
    cells += [[fmt.format(row[key]) for key, _, fmt in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for row in rows:
        for error in row["errors"]:
            print(f"rate {row['rate']}: error: {error}", file=sys.stderr)


def start_local_server(args):
    """uvicorn on a free loopback port in a daemon thread; (url, server)."""
    import uvicorn

    from mempath.server.cli import build_server_app
    model = args.model
    if model is None:
        from mempath.assets import default_model_path
        model = default_model_path()
    options = {"device": args.device}
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    app, _ = build_server_app(model, options, max_n=1, show_progress=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one here)")
    parser.add_argument("--model", default=None, help="model directory for the local server")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--served-model-name", default=None, help="default: the server's only model")
    parser.add_argument("--rates", default="1,4,16,inf", help="request rates per second, comma-separated")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per rate")
    parser.add_argument("--input-len", default="32:128", help="prompt tokens, LOW:HIGH")
    parser.add_argument("--output-len", default="16:64", help="generated tokens, LOW:HIGH")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    server = None
    url = args.url.rstrip("/") if args.url else None
    if url is None:
        url, server = start_local_server(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.served_model_name or httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
    workload = make_workload(args)
    rows = [asyncio.run(run_rate(url, model, headers, workload, float(rate), args.seed))
            for rate in args.rates.split(",")]
    print_table(rows)
    print(json.dumps({"benchmark": "serve", "url": url, "model": model,
                      "num_requests": args.num_requests, "input_len": args.input_len,
                      "output_len": args.output_len, "results": rows}))
    if server is not None:
        server.should_exit = True
    return 0 if all(row["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
