"""Grammar compilation happens off the engine thread (issue #19).

A compile takes a median of a few ms, tens of ms for a large schema, and the first one
also sets up xgrammar's view of the tokenizer. On the engine thread that time would stall
every other request's decode; the server compiles in AsyncEngine's small pool before the
request reaches the engine thread, and LLM.generate compiles a batch's grammars in
parallel before adding them. Each compile here is made slow on purpose (SLOW seconds).
"""
import asyncio
import threading
import time

import pytest

from mempath import LLM, SamplingParams
from mempath.assets import ASSETS, DEFAULT_MODEL
from mempath.config import EngineConfig
from mempath.engine.engine import LLMEngine
from mempath.server.async_engine import AsyncEngine, UpdateQueue
from mempath.server.calls import Call
from mempath.server.protocol import APIError
from mempath.server.structured_request import StructuredRequest
from mempath.structured import StructuredOutputsParams as Structured
from mempath.structured.grammar import GrammarCompiler

SLOW = 0.5  # seconds each compile sleeps in these tests
WAIT_S = 60
MODEL = str(ASSETS / DEFAULT_MODEL)


class SlowCompiles:
    """GrammarCompiler._compile made SLOW seconds slower; records which threads compiled what."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, str]] = []  # (thread name, the constraint's value)
        original = GrammarCompiler._compile

        def slow(compiler, kind, value, flexible):
            self.calls.append((threading.current_thread().name, value))
            time.sleep(SLOW)
            return original(compiler, kind, value, flexible)
        monkeypatch.setattr(GrammarCompiler, "_compile", slow)


def make_client() -> AsyncEngine:
    engine = LLMEngine(EngineConfig.from_kwargs(MODEL, device="cpu", dtype="float32"), show_progress=False)
    client = AsyncEngine(engine)
    client.start()
    return client


@pytest.fixture(scope="module")
def client():
    client = make_client()
    yield client
    client.shutdown()


async def settled(client: AsyncEngine) -> None:
    """Wait until the engine thread has run every command submitted before (and no request is left)."""
    deadline = time.monotonic() + WAIT_S
    while client.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests were left running"
        await asyncio.sleep(0.01)
    await client.stats()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_other_streams_keep_decoding_while_a_grammar_compiles(client, monkeypatch):
    # A first grammar request pays the one-time costs (xgrammar's setup, the first masked step).
    asyncio.run(client.add_request("x", greedy(2, structured_outputs=Structured(regex="[a-z]+")), "warm",
                                   UpdateQueue()))
    asyncio.run(settled(client))
    slow = SlowCompiles(monkeypatch)

    async def scenario():
        stream = UpdateQueue()
        await client.add_request([11, 12, 13], greedy(900, ignore_eos=True), "free", stream)
        for _ in range(4):
            await stream.get()  # it is decoding
        arrivals = [time.monotonic()]

        async def read_stream():
            while not (await stream.get()).finished:
                arrivals.append(time.monotonic())

        reader = asyncio.create_task(read_stream())
        began = time.monotonic()
        await client.add_request("x", greedy(6, structured_outputs=Structured(regex="[a-c]{6}")), "grammar",
                                 UpdateQueue())
        added = time.monotonic()
        while arrivals[-1] <= added:
            await asyncio.sleep(0.01)
        client.abort("free")
        await reader
        await settled(client)
        return arrivals, began, added

    arrivals, began, added = asyncio.run(scenario())
    assert slow.calls and added - began >= SLOW  # the compile did take its time...
    # ...and the free stream's tokens kept arriving through it: every gap from the last
    # token before the compile to the first after it is well under the compile's time.
    first = max(i for i, t in enumerate(arrivals) if t <= began)
    last = min(i for i, t in enumerate(arrivals) if t > added)
    gaps = [b - a for a, b in zip(arrivals[first:last], arrivals[first + 1:last + 1])]
    assert len(gaps) >= 3 and max(gaps) < SLOW, f"the free stream stalled while a grammar compiled: {gaps}"


def test_the_compile_runs_in_the_pool_not_on_the_engine_thread(client, monkeypatch):
    slow = SlowCompiles(monkeypatch)
    asyncio.run(client.add_request("x", greedy(2, structured_outputs=Structured(regex="[d-f]+")), "pool",
                                   UpdateQueue()))
    assert [name for name, _ in slow.calls] and all(name.startswith("mempath-grammar") for name, _ in slow.calls)
    asyncio.run(settled(client))


def test_an_invalid_schema_is_one_line_400_and_leaves_nothing(client):
    async def scenario():
        call = Call(client, "cmpl-bad", "tiny", [], 1, None)
        structured = StructuredRequest(Structured(regex="(ab"), "guided_regex")
        with pytest.raises(APIError) as raised:
            await call.start(["x"], greedy(4, structured_outputs=structured.params), structured)
        await settled(client)
        return raised.value

    error = asyncio.run(scenario())
    assert error.status == 400 and error.param == "guided_regex"
    assert error.message.startswith("guided_regex is not a valid regex") and "\n" not in error.message
    assert client.engine.kv.pool.num_used == 0 and not client.engine.has_unfinished_requests()


@pytest.mark.parametrize("how", ["abort", "cancel"])
def test_an_abort_while_compiling_leaves_no_request_behind(client, monkeypatch, how):
    SlowCompiles(monkeypatch)

    async def scenario():
        queue = UpdateQueue()
        params = greedy(800, ignore_eos=True, structured_outputs=Structured(regex=f"[g-i]+{how}"))
        adding = asyncio.create_task(client.add_request("x", params, f"gone-{how}", queue))
        await asyncio.sleep(SLOW / 5)
        if how == "abort":
            client.abort(f"gone-{how}")
            await adding
        else:
            adding.cancel()
            with pytest.raises(asyncio.CancelledError):
                await adding
        await asyncio.sleep(SLOW)  # past the compile's end
        await client.stats()  # after every command submitted before it
        return queue

    queue = asyncio.run(scenario())
    assert not client.engine.has_unfinished_requests() and client.engine.kv.pool.num_used == 0
    assert queue._backlogs == {}  # it never ran


def test_the_same_schema_at_once_compiles_once_and_two_compile_in_parallel(client, monkeypatch):
    slow = SlowCompiles(monkeypatch)
    compiler = client.engine.inputs.grammars
    before = compiler.num_compiled
    same = [Structured(json={"type": "object", "properties": {"same": {"type": "integer"}}}) for _ in range(2)]
    different = [Structured(regex=f"[0-9]{{{n}}}") for n in (3, 4)]
    for batch, compiles in ((same, 1), (different, 2)):
        results = [None] * len(batch)

        def run(i, params):
            results[i] = compiler.compile(params)
        threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(batch)]
        began = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert time.monotonic() - began < 1.8 * SLOW  # in parallel: not one after the other
        assert all(r is not None for r in results)
        if compiles == 1:
            assert results[0] is results[1]
    assert len(slow.calls) == 3 and compiler.num_compiled == before + 3


def test_the_tokenizer_setup_runs_at_start_up_off_the_engine_thread(monkeypatch):
    threads = []
    original = GrammarCompiler.prepare

    def record(compiler):
        threads.append(threading.current_thread().name)
        return original(compiler)
    monkeypatch.setattr(GrammarCompiler, "prepare", record)
    client = make_client()
    try:
        grammars = client.engine.inputs.grammars
        deadline = time.monotonic() + WAIT_S
        while not grammars.ready:
            assert time.monotonic() < deadline, "xgrammar was not set up after the start"
            time.sleep(0.01)
        assert threads and all(name.startswith("mempath-grammar") for name in threads)
    finally:
        client.shutdown()


def test_llm_generate_compiles_a_batch_of_grammars_in_parallel(monkeypatch):
    llm = LLM(MODEL, show_progress=False, device="cpu")
    llm.generate("x", greedy(2, structured_outputs=Structured(regex="[a-z]+")), use_tqdm=False)  # set up xgrammar
    slow = SlowCompiles(monkeypatch)
    params = [greedy(3, structured_outputs=Structured(regex=f"[a-z]{{{n}}}")) for n in (3, 4, 5, 6)]
    began = time.monotonic()
    outputs = llm.generate(["x"] * 4, params, use_tqdm=False)
    assert time.monotonic() - began < 3 * SLOW  # one after the other would take 4 x SLOW
    assert len(slow.calls) == 4 and all(o.error is None for o in outputs)
    assert llm.engine.kv.pool.num_used == 0
