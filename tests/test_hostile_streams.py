"""Streams whose clients read slowly or not at all, and shutdown with streams open.

A stream's undelivered updates are coalesced into one per request; once that backlog
reaches a bound the engine stops scheduling the request until the client reads, and
aborts it (freeing its blocks) after --stream-stall-timeout. On SIGTERM or SIGINT the
server stops admitting, lets running requests finish within --shutdown-timeout, ends
the rest with an error event and [DONE], flushes the disk tier and exits with 0.
"""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import h11
import httpx
import pytest

from mempath import LLM, SamplingParams
from mempath.config import EngineConfig
from mempath.engine.engine import LLMEngine
from mempath.server.async_engine import AsyncEngine, EngineDeadError, UpdateQueue
from mempath.server.cli import build_server_app

BACKLOG = 8  # tokens a stream may have undelivered before its request is paused
BLOCK = 16
WAIT_S = 60  # the most any explicit wait below waits before failing


@pytest.fixture(scope="module")
def tiny(model_factory):
    return model_factory("llama")[0]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def prompt_of(seed: int, length: int) -> list[int]:
    return [10 + (7 * seed + 3 * i) % 300 for i in range(length)]


def make_async_engine(path, stall_timeout=60.0, **engine_kw) -> AsyncEngine:
    options = dict(device="cpu", dtype="float32", block_size=BLOCK, num_gpu_blocks_override=64)
    options.update(engine_kw)
    engine = LLMEngine(EngineConfig.from_kwargs(path, **options), show_progress=False)
    client = AsyncEngine(engine, stream_stall_timeout=stall_timeout, backlog_tokens=BACKLOG)
    client.start()
    return client


def reference_tokens(path, prompts, params, **engine_kw) -> list[list[int]]:
    llm = LLM(path, dtype="float32", device="cpu", block_size=BLOCK, show_progress=False, **engine_kw)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


async def wait_for(client: AsyncEngine, predicate, what: str) -> dict:
    """The engine's stats once `predicate(stats)` holds; fails after WAIT_S seconds."""
    deadline = time.monotonic() + WAIT_S
    while True:
        stats = await client.stats()
        if predicate(stats):
            return stats
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {stats}"
        await asyncio.sleep(0.01)


async def read_to_end(queue: UpdateQueue) -> list:
    updates = []
    while not (updates and updates[-1].finished):
        updates.append(await queue.get())
    return updates


def tokens_of(updates) -> list[int]:
    return [t for u in updates for t in u.new_token_ids]


def idle(stats: dict) -> bool:
    return stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0


# ----------------------------------------------------------------- backpressure in the engine
def test_an_unread_stream_is_coalesced_and_paused_until_read(tiny):
    prompt = prompt_of(1, 20)
    expected = reference_tokens(tiny, [prompt], greedy(60))[0]
    client = make_async_engine(tiny)

    async def scenario():
        queue = UpdateQueue()
        await client.add_request(prompt, greedy(60, logprobs=3), "unread", queue)
        paused = await wait_for(client, lambda s: s["num_paused"] == 1, "the unread stream to pause")
        # Not scheduled once its backlog is full (one more token may have been in flight).
        assert BACKLOG <= paused["generation_tokens"] <= BACKLOG + 1
        assert paused["num_running"] == 1 and paused["kv_blocks_used"] > 0  # it keeps its blocks
        backlog = await queue.get()  # everything so far, as one update
        assert len(backlog.new_token_ids) >= BACKLOG and len(backlog.new_logprobs) == len(backlog.new_token_ids)
        assert backlog.new_text == backlog.text and not backlog.finished
        rest = await read_to_end(queue)  # reading resumes it
        updates = [backlog] + rest
        assert tokens_of(updates) == expected
        assert "".join(u.new_text for u in updates) == updates[-1].text
        assert updates[-1].finish_reason == "length"
        return await wait_for(client, idle, "the engine to be idle")

    try:
        stats = asyncio.run(scenario())
    finally:
        client.shutdown()
    assert stats["num_paused"] == 0 and stats["generation_tokens"] == 60


def test_a_stream_unread_past_the_stall_timeout_is_aborted_and_frees_its_blocks(tiny):
    client = make_async_engine(tiny, stall_timeout=0.0)

    async def scenario():
        queue = UpdateQueue()
        await client.add_request(prompt_of(2, 20), greedy(200), "stalled", queue)
        stats = await wait_for(client, idle, "the stalled stream to be aborted")
        updates = await read_to_end(queue)
        return stats, updates

    try:
        stats, updates = asyncio.run(scenario())
    finally:
        client.shutdown()
    assert stats["num_paused"] == 0 and stats["generation_tokens"] <= BACKLOG + 1
    final = updates[-1]
    assert final.finish_reason == "error" and "--stream-stall-timeout" in final.error
    assert tokens_of(updates) and len(tokens_of(updates)) <= BACKLOG + 1  # what it had, still delivered


@pytest.mark.parametrize("needs", ["admission", "decode"])
def test_a_paused_stream_gives_its_blocks_to_others_and_resumes_later(tiny, needs):
    """A pool of 12 blocks: the paused stream holds 4; the other request needs more than
    the 8 left, at admission (a 150-token prompt) or while decoding (48 + 90 tokens). It
    takes the paused stream's blocks; the paused stream, read later, recomputes and ends
    as it would have alone."""
    paused_prompt = prompt_of(3, 48)
    other_prompt, other_tokens = (prompt_of(4, 150), 16) if needs == "admission" else (prompt_of(4, 48), 90)
    expected = reference_tokens(tiny, [paused_prompt, other_prompt], [greedy(100), greedy(other_tokens)],
                                num_gpu_blocks_override=64)
    client = make_async_engine(tiny, num_gpu_blocks_override=12)

    async def scenario():
        unread, eager = UpdateQueue(), UpdateQueue()
        await client.add_request(paused_prompt, greedy(100), "paused", unread)
        await wait_for(client, lambda s: s["num_paused"] == 1, "the unread stream to pause")
        await client.add_request(other_prompt, greedy(other_tokens), "other", eager)
        other = await read_to_end(eager)
        after_other = await wait_for(client, lambda s: s["num_running"] == 0, "the paused stream to be preempted")
        paused = await read_to_end(unread)
        return other, paused, after_other, await wait_for(client, idle, "the engine to be idle")

    try:
        other, paused, after_other, final = asyncio.run(scenario())
    finally:
        client.shutdown()
    assert tokens_of(other) == expected[1]
    assert after_other["num_paused"] == 1 and after_other["num_preemptions"] >= 1
    assert after_other["kv_blocks_used"] == 0  # preempted while paused: it holds nothing
    assert tokens_of(paused) == expected[0]
    assert final["num_paused"] == 0


# ----------------------------------------------------------------- draining for shutdown
def test_drain_lets_running_requests_finish_and_stops_admitting(tiny):
    client = make_async_engine(tiny)

    async def scenario():
        queue = UpdateQueue()
        await client.add_request(prompt_of(5, 20), greedy(30), "running", queue)
        reader = asyncio.ensure_future(read_to_end(queue))
        drained = client.drain(timeout=WAIT_S)
        with pytest.raises(EngineDeadError, match="shutting down"):
            await client.add_request(prompt_of(6, 20), greedy(4), "late", UpdateQueue())
        await drained
        return await reader

    try:
        updates = asyncio.run(scenario())
    finally:
        client.shutdown()
    assert updates[-1].finish_reason == "length" and len(tokens_of(updates)) == 30


def test_drain_ends_what_is_left_with_an_error(tiny):
    client = make_async_engine(tiny)

    async def scenario():
        queue = UpdateQueue()
        await client.add_request(prompt_of(7, 20), greedy(200), "unread", queue)
        await wait_for(client, lambda s: s["num_paused"] == 1, "the unread stream to pause")
        await client.drain(timeout=0.0)
        stats = await client.stats()
        return stats, await read_to_end(queue)

    try:
        stats, updates = asyncio.run(scenario())
    finally:
        client.shutdown()
    assert idle(stats) and stats["num_paused"] == 0
    assert updates[-1].finish_reason == "error" and "shutting down" in updates[-1].error


def test_shutdown_flushes_and_closes_the_disk_tier(tiny, tmp_path):
    client = make_async_engine(tiny, num_gpu_blocks_override=8, cpu_kv_gb=0.001,
                               disk_kv_path=str(tmp_path / "kv"), disk_kv_gb=0.01,
                               disk_write_policy="write-through")
    disk = client.engine.kv.tiers.disk
    calls = []
    flush, close = disk.flush, disk.close
    disk.flush = lambda: (calls.append("flush"), flush())[1]
    disk.close = lambda: (calls.append("close"), close())[1]

    async def scenario():
        for i in range(3):
            queue = UpdateQueue()
            await client.add_request(prompt_of(8 + i, 40), greedy(8), f"r{i}", queue)
            await read_to_end(queue)

    try:
        asyncio.run(scenario())
    finally:
        client.shutdown()
    assert not client.is_alive
    assert calls[-2:] == ["flush", "close"] and calls.count("close") == 1  # persisting at close flushes first


# ----------------------------------------------------------------- through the real server
class ThreadServer:
    """uvicorn on a free loopback port in a thread of this process.

    Its connections have a send buffer of a few KB (inherited from the listening socket):
    a loopback socket otherwise grows its own to MBs, which would take whole answers in
    before anything waited on a client that does not read.
    """

    def __init__(self, app):
        import uvicorn
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)


def raw_stream(port: int, body: dict) -> socket.socket:
    """A streaming request on a socket with a tiny receive buffer, not read."""
    payload = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def read_events(sock: socket.socket) -> list[str]:
    """The SSE `data:` payloads of the whole response on `sock`."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")]))
    conn.send(h11.EndOfMessage())
    body = bytearray()
    sock.settimeout(WAIT_S)
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(65536))
        elif isinstance(event, h11.Response):
            assert event.status_code == 200
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            break
    sock.close()
    return [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]


def metric(url: str, name: str, **labels) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=WAIT_S).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name} {labels}")


def test_a_client_that_never_reads_is_cut_with_an_error_event_and_frees_its_blocks(tiny):
    app, name = build_server_app(tiny, dict(device="cpu", dtype="float32", block_size=BLOCK,
                                            num_gpu_blocks_override=64), show_progress=False,
                                 stream_stall_timeout=0.2)
    server = ThreadServer(app)
    try:
        sock = raw_stream(server.port, {"model": name, "prompt": prompt_of(9, 20), "max_tokens": 400,
                                        "logprobs": 20, "ignore_eos": True, "stream": True})
        deadline = time.monotonic() + WAIT_S
        while not (metric(server.url, "mempath:request_success_total", finished_reason="abort")
                   and metric(server.url, "mempath:kv_blocks", state="used") == 0):
            assert time.monotonic() < deadline, "the stalled stream was not aborted"
            time.sleep(0.02)
        generated = metric(server.url, "mempath:generation_tokens_total")
        events = read_events(sock)
    finally:
        server.stop()
    assert generated < 400  # cut: the client never read, so it could not have been sent more
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert events[-1] == "[DONE]" and len(errors) == 1 and "--stream-stall-timeout" in errors[0]["message"]
    assert errors[0]["type"] == "server_error"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if "error" not in json.loads(e))
    assert text  # what was generated before the cut still arrived


def stream_until_first_chunk(port: int, body: dict) -> tuple[socket.socket, bytes]:
    """Open a stream and read until its first `data:` line; (socket, bytes read so far)."""
    sock = raw_stream(port, body)
    sock.settimeout(WAIT_S)
    seen = b""
    while b"data: " not in seen:
        chunk = sock.recv(65536)
        assert chunk, "the stream closed before its first chunk"
        seen += chunk
    return sock, seen


def outcome(events: list[str]) -> str:
    """'complete' (a finish_reason, then [DONE]), 'error' (an error event, then [DONE]), or what went wrong."""
    if not events or events[-1] != "[DONE]":
        return f"no [DONE]: {events[-2:]}"
    payloads = [json.loads(e) for e in events[:-1]]
    if any("error" in p for p in payloads):
        return "error" if "error" in payloads[-1] else f"events after the error: {payloads[-1]}"
    finishes = [c["finish_reason"] for p in payloads for c in p["choices"] if c["finish_reason"]]
    return "complete" if finishes == ["length"] else f"finish reasons {finishes}"


@pytest.mark.parametrize("sig, num_streams", [(signal.SIGTERM, 32), (signal.SIGINT, 4)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_streams_ends_each_with_an_answer_or_an_error_and_exits_0(tiny, sig, num_streams):
    """Every stream has sent its first chunk when the signal comes. One client reads nothing,
    so its stream cannot finish within --shutdown-timeout: it must end with the error event.
    Its answer (16 choices x 480 tokens with 20 logprobs, ~10 MB) is more than a loopback
    socket's buffers hold (tcp_wmem's maximum: 4 MiB by default)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "mempath", "serve", tiny, "--port", str(port),
                               "--device", "cpu", "--dtype", "float32", "--num-gpu-blocks-override", "256",
                               "--shutdown-timeout", "0.5", "--uvicorn-log-level", "warning"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            assert server.poll() is None, server.stdout.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        body = {"prompt": prompt_of(10, 20), "max_tokens": 400, "ignore_eos": True, "stream": True}
        unread = raw_stream(port, {**body, "max_tokens": 480, "n": 16, "logprobs": 20})
        streams = [stream_until_first_chunk(port, {**body, "prompt": prompt_of(11 + i, 20)})
                   for i in range(num_streams)]
        server.send_signal(sig)
        outcomes = [outcome(read_events_after(sock, seen)) for sock, seen in streams]
        unread_events = read_events(unread)
        code = server.wait(WAIT_S)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    log = server.stdout.read().decode()
    assert code == 0, log
    assert all(o in ("complete", "error") for o in outcomes), outcomes
    # Error events name no choice: of the unread stream's 16 there is at least one, then [DONE].
    assert unread_events[-1] == "[DONE]"
    assert any("shutting down" in json.loads(e).get("error", {}).get("message", "") for e in unread_events[:-1])
    assert "Traceback" not in log, log


def read_events_after(sock: socket.socket, seen: bytes) -> list[str]:
    """read_events for a socket whose first `seen` bytes were already read."""
    class Replay:
        def __init__(self):
            self.pending = seen

        def recv(self, n):
            if self.pending:
                data, self.pending = self.pending, b""
                return data
            return sock.recv(n)

        def settimeout(self, t):
            sock.settimeout(t)

        def close(self):
            sock.close()

    return read_events(Replay())


@pytest.mark.parametrize("interval", [1e10, 1e300])
def test_a_far_deadline_does_not_stop_the_engine_thread(tiny, interval):
    """A wait past threading's limit (--log-stats-interval 1e10, --sleep-after 1e10) raised OverflowError in the
    engine thread: the server came up answering 503 to every request."""
    engine = LLMEngine(EngineConfig.from_kwargs(tiny, device="cpu", dtype="float32"), show_progress=False)
    client = AsyncEngine(engine, log_stats_interval=interval)
    client.start()
    try:
        async def one_request():
            queue = UpdateQueue()
            await client.add_request("x", greedy(2), "far", queue)
            return await asyncio.wait_for(read_to_end(queue), WAIT_S)
        assert asyncio.run(one_request())[-1].finish_reason == "length"
        assert client.is_alive
    finally:
        client.shutdown()
