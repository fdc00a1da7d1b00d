"""An unrelated request's latency while one client streams with the longest stop strings allowed.

Stop strings are matched on every generated token, in the engine (is a stop string
complete?) and on the server's event loop (how much of the text could still be the
start of one and must be held back). If that work grows with the stop strings'
length squared, or with the text's length, one client's stream slows every other
request on the server. This starts `mempath serve` on the shipped model (CPU by
default) in a subprocess on a free loopback port and measures the latency of a
short non-streaming completion

* alone,
* beside a benign stream (the same stream without stop strings: the cost of
  sharing the batch at all),
* beside the hostile stream (``--num-stops`` stop strings of ``--stop-len``
  characters, none of which ever completes but whose prefixes keep matching),

and how many chunks each stream delivered per second, once the stream's text is long
(``--warm-chunks``). Target: hostile / alone <= 1.2. On a CPU, sharing the batch
with any second sequence costs more than that; hostile / benign isolates the stop
strings' share.
A configuration the server refuses (e.g. longer stop strings than its limit) is
reported as refused. Prints one JSON line. Usage:
    PYTHONPATH=. python3 benchmarks/bench_hostile_stops.py
    PYTHONPATH=. python3 benchmarks/bench_hostile_stops.py --num-stops 16 --stop-len 60000
    PYTHONPATH=. python3 benchmarks/bench_hostile_stops.py --device cuda --model DIR --serve-args --load-format dummy
"""
import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx

PROMPT = "def read_config(path):"
STREAM_TOKENS = 1000  # the shipped model's max_model_len is 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "mempath", "serve", "--port", str(port), "--device", args.device,
               "--max-body-bytes", str(args.max_body_bytes), "--uvicorn-log-level", "warning"]
    if args.model:
        command.append(args.model)
    command += args.serve_args
    env = {k: v for k, v in os.environ.items() if k != "MEMPATH_API_KEY"}
    process = subprocess.Popen(command, env=env)
    deadline = time.time() + 120
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit("the server did not start within 120 s")


def hostile_stops(count: int, length: int, seed: int) -> list[str]:
    """Strings of the characters code is made of, so their prefixes keep matching the text's
    tail; each ends in a character the model never writes, so none of them ever completes."""
    rng = random.Random(seed)
    alphabet = " \n\te(_):,.asrtnoi"
    return ["".join(rng.choice(alphabet) for _ in range(length - 1)) + "\u2603" for _ in range(count)]


async def unrelated_latency(http: httpx.AsyncClient, url: str, max_tokens: int) -> float:
    body = {"prompt": "import os", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    response = await http.post(f"{url}/v1/completions", json=body)
    response.raise_for_status()
    return time.perf_counter() - start


async def stream_forever(http: httpx.AsyncClient, url: str, stops: list[str] | None, counts: dict,
                         warm: asyncio.Event, warm_chunks: int) -> None:
    """Restart the stream whenever it ends; count its chunks (raises on a refusal).

    `warm` is set once a stream has sent `warm_chunks` chunks: its text is long by then,
    which is where work that grows with the text shows.
    """
    body = {"prompt": PROMPT, "max_tokens": STREAM_TOKENS, "temperature": 1.0, "seed": 0,
            "ignore_eos": True, "stream": True}
    if stops:
        body["stop"] = stops
    while True:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(response.json()["error"]["message"])
            chunks = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    counts["chunks"] += 1
                    chunks += 1
                    if chunks >= warm_chunks:
                        warm.set()


async def measure_case(http: httpx.AsyncClient, url: str, stops: list[str] | None, args,
                       latencies: list[float], rates: list[float]) -> str | None:
    """Unrelated latencies alone (stops None) or beside a stream; the refusal, if refused."""
    counts = {"chunks": 0}
    warm = asyncio.Event()
    stream = None
    if stops is not None:
        stream = asyncio.ensure_future(stream_forever(http, url, stops, counts, warm, args.warm_chunks))
        waiter = asyncio.ensure_future(warm.wait())
        await asyncio.wait({stream, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if stream.done():
            return str(stream.exception())
    begin, first_chunks = time.perf_counter(), counts["chunks"]
    for _ in range(args.repeats):
        latencies.append(await unrelated_latency(http, url, args.max_tokens))
    rates.append((counts["chunks"] - first_chunks) / (time.perf_counter() - begin))
    if stream is not None:
        stream.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stream
    return None


async def measure(url: str, cases: dict[str, list[str] | None], args) -> dict:
    """The cases in turn, `--rounds` times over, so drift in the machine's load hits each alike."""
    results = {name: ([], []) for name in cases}
    refused = {}
    async with httpx.AsyncClient(timeout=300) as http:
        await unrelated_latency(http, url, args.max_tokens)  # warm-up
        for _ in range(args.rounds):
            for name, stops in cases.items():
                if name not in refused:
                    error = await measure_case(http, url, stops, args, *results[name])
                    if error is not None:
                        refused[name] = error
    out = {}
    for name, (latencies, rates) in results.items():
        if name in refused:
            out[name] = {"refused": refused[name]}
        else:
            out[name] = {"latency_median_s": round(statistics.median(latencies), 4),
                         "latency_p90_s": round(sorted(latencies)[int(0.9 * (len(latencies) - 1))], 4),
                         "stream_chunks_per_s": round(statistics.median(rates), 1)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-stops", type=int, default=16)
    parser.add_argument("--stop-len", type=int, default=256, help="characters per stop string")
    parser.add_argument("--max-tokens", type=int, default=32, help="of the unrelated request")
    parser.add_argument("--repeats", type=int, default=5, help="unrelated requests per case and round")
    parser.add_argument("--rounds", type=int, default=2, help="times each case is measured, in turn")
    parser.add_argument("--warm-chunks", type=int, default=500,
                        help="chunks a stream sends before the unrelated requests start")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20,
                        help="the server's body limit (long stop strings need a large body)")
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                        help="the rest of the line goes to `mempath serve` (e.g. --load-format dummy)")
    args = parser.parse_args()

    port = free_port()
    server = start_server(args, port)
    url = f"http://127.0.0.1:{port}"
    cases = {"alone": None, "beside_benign_stream": [],
             "beside_hostile_stream": hostile_stops(args.num_stops, args.stop_len, seed=0)}
    try:
        figures = asyncio.run(measure(url, cases, args))
    finally:
        server.terminate()
        server.wait(30)
    result = {"benchmark": "hostile_stops", "model": args.model or "mempath-tiny", "num_stops": args.num_stops, "stop_len": args.stop_len,
              "device": args.device, "rounds": args.rounds, "repeats": args.repeats, **figures}
    alone = figures["alone"]["latency_median_s"]
    for name in ("beside_benign_stream", "beside_hostile_stream"):
        if "latency_median_s" in figures[name]:
            result[f"{name}_over_alone"] = round(figures[name]["latency_median_s"] / alone, 3)
    if "latency_median_s" in figures["beside_hostile_stream"]:
        result["hostile_over_benign"] = round(figures["beside_hostile_stream"]["latency_median_s"]
                                              / figures["beside_benign_stream"]["latency_median_s"], 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
