"""The server's resident memory under many requests and under clients that never read.

Each case starts its own `mempath serve` (a subprocess on a free loopback port, the
built-in model on the CPU unless told otherwise) and reads that process's RSS with
psutil:

* requests: after a warm-up, RSS every tenth of ``--requests`` requests of a mix
  (streaming and not, completions and chat, streams that hang up after two chunks,
  logprobs, n=2, stop strings), ``--concurrency`` at a time. Growth is the last
  sample minus the first.
* stalled: ``--streams`` streaming requests (``--choices`` choices each, ``logprobs``
  20, as many tokens as the model allows) sent over raw sockets with a tiny receive
  buffer that are never read. RSS once generation stops (or ends), then after the
  clients hang up and the server is idle again. Growth is against RSS before they came.

Prints one line per measurement, then one JSON line. Usage:
    PYTHONPATH=. python3 benchmarks/bench_server_memory.py --requests 2000
    PYTHONPATH=. python3 benchmarks/bench_server_memory.py --case stalled --server-arg=--stream-stall-timeout=120
"""
import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time

import httpx
import psutil

MIB = 1 << 20
WORDS = ("def", "class", "return", "import", "self", "value", "path", "open", "config", "read",
         "for", "while", "None", "print", "list", "dict", "json", "file", "name", "data")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`python -m mempath serve` in a subprocess, stopped on exit."""

    def __init__(self, args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "mempath", "serve", *([args.model] if args.model else []),
                   "--port", str(self.port), "--device", args.device, "--uvicorn-log-level", "warning",
                   *args.server_arg]
        self.process = subprocess.Popen(command)
        self.ps = psutil.Process(self.process.pid)
        deadline = time.time() + 300
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        self.model = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]
        self.max_model_len = httpx.get(f"{self.url}/v1/models").json()["data"][0].get("max_model_len")

    def rss_mib(self) -> float:
        return self.ps.memory_info().rss / MIB

    def metric(self, name: str, **labels) -> float:
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                if line[len(name)] in " {":
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_idle(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while (self.metric("mempath:num_requests_running") or self.metric("mempath:num_requests_waiting")
               or self.metric("mempath:kv_blocks", state="used")):
            if time.time() > deadline:
                raise SystemExit("the server did not become idle")
            time.sleep(0.2)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


# ----------------------------------------------------------------- many requests
def request_of(i: int, rng: random.Random, model: str) -> tuple[str, dict, bool]:
    """(path, body, hang up after two chunks) of the i-th request of the mix."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    body = {"model": model, "max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.8]),
            "ignore_eos": True}
    kind = i % 8
    if kind in (2, 7):
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}],
                                        "stream": kind == 2}, False
    body["prompt"] = prompt
    if kind == 4:
        body["logprobs"] = 5
    if kind == 5:
        body["n"] = 2
    if kind == 6:
        body["stop"] = ["):", "\n\n"]
    body["stream"] = kind in (1, 3, 5, 6)
    return "/v1/completions", body, kind == 3


async def send(http: httpx.AsyncClient, path: str, body: dict, hang_up: bool) -> bool:
    if not body["stream"]:
        response = await http.post(path, json=body)
        return response.status_code == 200
    chunks = 0
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return True
            if line.startswith("data: "):
                if "error" in json.loads(line[6:]):
                    return False
                chunks += 1
                if hang_up and chunks >= 2:
                    return True  # leaving the block closes the connection mid-stream
    return False


async def run_requests(server: Server, count: int, concurrency: int, seed: int, offset: int = 0) -> int:
    """Send `count` requests of the mix, `concurrency` at a time; how many failed."""
    rng = random.Random(seed)
    jobs = iter(range(offset, offset + count))
    failures = 0
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
        async def worker():
            nonlocal failures
            for i in jobs:
                if not await send(http, *request_of(i, rng, server.model)):
                    failures += 1

        await asyncio.gather(*[worker() for _ in range(concurrency)])
    return failures


def case_requests(args) -> dict:
    with Server(args) as server:
        failures = asyncio.run(run_requests(server, args.warmup, args.concurrency, args.seed))
        server.wait_idle()
        samples = [(0, server.rss_mib())]
        print(f"requests: after {args.warmup} warm-up requests: {samples[0][1]:.1f} MiB", flush=True)
        step = max(1, args.requests // 10)
        done = 0
        start = time.perf_counter()
        while done < args.requests:
            n = min(step, args.requests - done)
            failures += asyncio.run(run_requests(server, n, args.concurrency, args.seed + done + 1,
                                                 args.warmup + done))
            done += n
            server.wait_idle()
            samples.append((done, server.rss_mib()))
            print(f"requests: {done:>6} requests: {samples[-1][1]:.1f} MiB "
                  f"({samples[-1][1] - samples[0][1]:+.1f})", flush=True)
        return {"case": "requests", "warmup": args.warmup, "requests": args.requests,
                "concurrency": args.concurrency, "failed": failures,
                "seconds": time.perf_counter() - start, "rss_mib": samples,
                "growth_mib": samples[-1][1] - samples[0][1]}


# ----------------------------------------------------------------- clients that never read
def stalled_request(server: Server, max_tokens: int, choices: int) -> bytes:
    body = json.dumps({"model": server.model, "prompt": "def read_config(path):", "max_tokens": max_tokens,
                       "n": choices, "temperature": 1.0, "logprobs": 20, "ignore_eos": True,
                       "stream": True}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def wait_generation_settles(server: Server, expected: int, settle: float, timeout: float) -> float:
    """Generated tokens once they stop growing for `settle` seconds or reach `expected`."""
    deadline = time.time() + timeout
    last, since = -1.0, time.time()
    while time.time() < deadline:
        tokens = server.metric("mempath:generation_tokens_total")
        if tokens >= expected:
            return tokens
        if tokens != last:
            last, since = tokens, time.time()
        elif time.time() - since >= settle:
            return tokens
        time.sleep(0.25)
    return last


def case_stalled(args) -> dict:
    with Server(args) as server:
        # Warm every path the stalled streams take (logprobs, n choices, streaming).
        httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": server.model, "prompt": "import os", "max_tokens": 32, "n": 2, "logprobs": 20,
            "ignore_eos": True})
        server.wait_idle()
        before_tokens = server.metric("mempath:generation_tokens_total")
        before = server.rss_mib()
        max_tokens = args.max_tokens or (server.max_model_len or 1024) - 16
        sockets = []
        for _ in range(args.streams):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(stalled_request(server, max_tokens, args.choices))
            sockets.append(sock)
        expected = before_tokens + args.streams * args.choices * max_tokens
        tokens = wait_generation_settles(server, expected, args.settle, args.timeout)
        connected = server.rss_mib()
        print(f"stalled: before {before:.1f} MiB; {tokens - before_tokens:.0f} of "
              f"{expected - before_tokens:.0f} tokens generated, connected {connected:.1f} MiB "
              f"({connected - before:+.1f})", flush=True)
        for sock in sockets:
            sock.close()
        server.wait_idle()
        after = server.rss_mib()
        print(f"stalled: after hang-up {after:.1f} MiB ({after - before:+.1f})", flush=True)
        return {"case": "stalled", "streams": args.streams, "choices": args.choices,
                "max_tokens": max_tokens, "logprobs": 20, "tokens_generated": tokens - before_tokens,
                "rss_before_mib": before, "rss_connected_mib": connected, "rss_after_mib": after,
                "growth_connected_mib": connected - before, "growth_after_mib": after - before}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("requests", "stalled", "both"), default="both")
    parser.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra `mempath serve` argument (repeatable), e.g. --server-arg=--max-num-seqs=64")
    parser.add_argument("--requests", type=int, default=10_000, help="requests measured after the warm-up")
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--streams", type=int, default=4, help="clients that never read")
    parser.add_argument("--choices", type=int, default=16, help="choices (n) per stalled stream")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="per stalled choice (default: all the model allows)")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds without a new token after which the stalled streams count as stopped")
    parser.add_argument("--timeout", type=float, default=900.0, help="longest wait for the stalled streams")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = []
    if args.case in ("requests", "both"):
        results.append(case_requests(args))
    if args.case in ("stalled", "both"):
        results.append(case_stalled(args))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
