"""/metrics beside speculative decoding and structured outputs: the draft's ledger in
``mempath:memory_bytes``, one inter-token interval per request per step (vLLM's), and latency
measured from the server's receipt of a request, grammar compilation included."""
import asyncio
import time
import types

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mempath import LLM, SamplingParams
from mempath.assets import ASSETS
from mempath.config import EngineConfig
from mempath.engine.engine import LLMEngine
from mempath.server import async_engine
from mempath.server.async_engine import AsyncEngine, UpdateQueue, _Route
from mempath.server.metrics import ServerMetrics
from mempath.structured import StructuredOutputsParams
from mempath.structured.grammar import GrammarCompiler

TARGET, DRAFT = str(ASSETS / "mempath-tiny"), str(ASSETS / "mempath-tiny-draft")
# The target drafting for itself: greedy, every draft token is accepted, so every verify step
# emits several tokens for the request.
SELF_DRAFT = {"model": TARGET, "num_speculative_tokens": 3, "adaptive": False}
MAX_TOKENS = 21


def make_engine(**options) -> LLMEngine:
    """An engine as the server builds one (every token reported, not only finished requests)."""
    return LLMEngine(EngineConfig.from_kwargs(TARGET, device="cpu", **options), show_progress=False)


def memory_rows(llm) -> list[tuple[dict, float]]:
    """The ``mempath:memory_bytes`` samples of one scrape: (labels, bytes)."""
    metrics = ServerMetrics.for_engine("tiny", llm.engine)
    text = metrics.render({**llm.engine.stats(), "device": "cpu"}).decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "mempath:memory_bytes")
    return [(s.labels, s.value) for s in family.samples]


def test_memory_bytes_holds_the_drafts_ledger_under_a_tenant_label():
    llm = LLM(TARGET, show_progress=False, num_gpu_blocks_override=16,
              speculative_config={"model": DRAFT, "num_speculative_tokens": 2})
    stats = llm.stats()
    rows = memory_rows(llm)
    target = {labels["pathway"]: (labels, value) for labels, value in rows if "tenant" not in labels}
    draft = {labels["pathway"]: (labels, value) for labels, value in rows if labels.get("tenant") == "draft"}
    assert len(target) + len(draft) == len(rows)  # no row of another kind
    # The target's rows keep their series: the same labels as without a draft.
    assert set(target) == set(stats["ledger"])
    for pathway, (labels, value) in target.items():
        entry = stats["ledger"][pathway]
        assert labels == {"model_name": "tiny", "pathway": pathway, "device": entry["device"],
                          "source": entry["source"]}
        assert value == entry["bytes"]
    # Every pathway the draft holds, with its own bytes (its weights, step buffers, KV share, ...).
    assert set(draft) == set(stats["draft_ledger"]) and {"weights", "kv_cache"} <= set(draft)
    for pathway, (labels, value) in draft.items():
        entry = stats["draft_ledger"][pathway]
        assert labels == {"model_name": "tiny", "pathway": pathway, "device": entry["device"],
                          "source": entry["source"], "tenant": "draft"}
        assert value == entry["bytes"] > 0
    held = sum(e["bytes"] for ledger in (stats["ledger"], stats["draft_ledger"]) for e in ledger.values())
    assert sum(value for _, value in rows) == held


def test_without_a_draft_memory_bytes_has_no_tenant_label():
    llm = LLM(TARGET, show_progress=False, num_gpu_blocks_override=16)
    rows = memory_rows(llm)
    assert rows and all(set(labels) == {"model_name", "pathway", "device", "source"} for labels, _ in rows)


class FakeClock:
    """async_engine's time module, with a perf_counter the test moves."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return time.monotonic()


def sample(metrics: ServerMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "tiny", **labels}) or 0.0


def test_inter_token_latency_is_one_interval_per_request_per_step(monkeypatch):
    engine = make_engine(num_gpu_blocks_override=32, speculative_config=SELF_DRAFT)
    metrics = ServerMetrics.for_engine("tiny", engine)
    client = AsyncEngine(engine, metrics)  # never started: the test runs its steps on this thread
    clock = FakeClock()
    monkeypatch.setattr(async_engine, "time", clock)
    step_times, tokens_per_step = [], []  # the steps that emitted tokens for the request
    real_step = engine.step

    def step():
        outputs = real_step()
        tokens = sum(len(o.new_token_ids) for o in outputs if o.request_id == "r")
        if tokens:
            step_times.append(clock.now)
            tokens_per_step.append(tokens)
        return outputs
    monkeypatch.setattr(engine, "step", step)
    loop = asyncio.new_event_loop()
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        client._add("def read_config(path):", params, "r", _Route(loop, UpdateQueue()), None)
        while engine.has_unfinished_requests():
            clock.now += 0.25 * (len(step_times) + 1)  # steps of different lengths
            client._step()
    finally:
        loop.close()
    assert sum(tokens_per_step) == MAX_TOKENS
    assert max(tokens_per_step) > 1  # precondition: speculation emitted several tokens in a step
    assert sample(metrics, "mempath:generation_tokens_total") == MAX_TOKENS
    # One observation per step after the first token's, each the time since the previous step's tokens.
    intervals = [b - a for a, b in zip(step_times, step_times[1:])]
    assert sample(metrics, "mempath:inter_token_latency_seconds_count") == len(intervals)
    assert sample(metrics, "mempath:inter_token_latency_seconds_sum") == pytest.approx(sum(intervals))
    assert sample(metrics, "mempath:inter_token_latency_seconds_bucket", le="0.01") == 0  # no zero interval
    assert sample(metrics, "mempath:time_to_first_token_seconds_count") == 1


def test_latency_counts_the_grammar_compile_from_the_servers_receipt(monkeypatch):
    """The request's arrival is taken when the server's AsyncEngine receives it, before its
    grammar compiles, as vLLM's front end stamps it before the engine core compiles it."""
    compiles = []  # (start, end) of each compile, on the engines' clock
    original = GrammarCompiler._compile

    def slow(compiler, kind, value, flexible):
        began = time.perf_counter()
        time.sleep(0.05)
        try:
            return original(compiler, kind, value, flexible)
        finally:
            compiles.append((began, time.perf_counter()))
    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    engine = make_engine(num_gpu_blocks_override=16)
    metrics = ServerMetrics.for_engine("tiny", engine)
    finished = []
    record_request = metrics.record_request
    monkeypatch.setattr(metrics, "record_request", lambda request, model=None: (
        finished.append(request), record_request(request, model=model)))
    client = AsyncEngine(engine, metrics)
    client.start()

    async def run():
        queue = UpdateQueue()
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                structured_outputs=StructuredOutputsParams(regex="[a-z]{6}"))
        await client.add_request("def read_config(path):", params, "g", queue)
        while not (await asyncio.wait_for(queue.get(), 60)).finished:
            pass
    try:
        asyncio.run(run())
    finally:
        client.shutdown()
    assert len(compiles) == 1 and len(finished) == 1
    (began, ended), request = compiles[0], finished[0]
    assert request.arrival_time <= began  # stamped before the compile, not after it
    compile_seconds = ended - began
    assert sample(metrics, "mempath:request_queue_time_seconds_sum") >= compile_seconds
    assert sample(metrics, "mempath:time_to_first_token_seconds_sum") >= compile_seconds
    assert sample(metrics, "mempath:e2e_request_latency_seconds_sum") >= compile_seconds
