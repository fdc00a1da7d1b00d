"""--sleep-offload-weights: an asleep model's weights wait in host memory and come back where
they were (mempath/multi/sleep.py, mempath/memory/arena.py)."""
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from mempath import LLM, SamplingParams
from mempath.memory.ledger import Pathway
from mempath.multi.engine import MultiEngine
from mempath.server.metrics import ServerMetrics
from tests.test_multi_model import together
from tests.test_multi_model_sleep import FakeClock, burst

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_sleep  # noqa: E402
from bench_sleep import GREEDY, PROMPT, answer  # noqa: E402


def storages(model) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


@pytest.fixture(scope="module")
def offloading(two_models):  # noqa: F811
    # Its own engine never sleeps a model during a test (the tests' engines run on a fake clock).
    return together(two_models, num_gpu_blocks_override=12, sleep_after=1e6, sleep_offload_weights=True)


def test_every_parameter_is_a_view_of_the_arena_and_greedy_output_is_unchanged(two_models, offloading):
    llama, _ = two_models
    b = offloading.engines["a"]
    assert storages(b.model) == {b.model.weights_arena.tensor.untyped_storage().data_ptr()}
    plain = LLM(llama, dtype="float32", show_progress=False).generate([PROMPT], GREEDY, use_tqdm=False)
    arena = offloading.generate([PROMPT], GREEDY, use_tqdm=False, model="a")
    assert arena[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_asleep_weights_leave_the_device_and_a_request_brings_them_back(offloading):
    clock = FakeClock()
    engine = MultiEngine(offloading.engines, offloading.engine.pool, sleep_after=5, clock=clock)
    b = engine.engines["b"]
    arena = b.model.weights_arena
    weights = b.ledger.get(Pathway.WEIGHTS)
    before = answer(engine, "b", "b0")
    a_before = answer(engine, "a", "a0")

    clock.now = 10  # b idle past sleep_after: it falls asleep at a's next step, its weights with it
    burst(engine, "a", "x")
    stats = engine.stats()["sleep"]
    assert stats["asleep"] == ["b"] and stats["weights_offloaded"] == ["b"]
    assert not arena.is_mapped
    if arena.device.type == "cpu":  # the CPU arena's storage is resized to nothing
        assert arena.tensor.untyped_storage().nbytes() == 0
    assert b.ledger.get(Pathway.WEIGHTS) == 0 and b.ledger.get(Pathway.WEIGHTS_HOST) == arena.nbytes
    assert answer(engine, "a", "a1") == a_before  # the awake model is untouched

    assert answer(engine, "b", "b1") == before  # the request woke b: its weights came back unchanged
    stats = engine.stats()["sleep"]
    assert stats["weights_offloaded"] == [] and stats["wakes_by_model"]["b"] == 1
    assert stats["wake_bytes_by_model"] == {"a": 0, "b": arena.nbytes}
    assert stats["last_wake_seconds_by_model"]["b"] > 0
    assert arena.is_mapped and b.ledger.get(Pathway.WEIGHTS) == weights

    text = ServerMetrics.for_models(engine.engines).render({**engine.stats(), "device": "cpu"}).decode()
    assert 'mempath:model_weights_offloaded{model_name="b"} 0.0' in text
    samples = {(s.name, s.labels.get("model_name")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("mempath:model_wake_bytes_total", "b")] == arena.nbytes
    assert samples[("mempath:model_wake_seconds", "b")] == stats["last_wake_seconds_by_model"]["b"]


def test_the_pinned_copies_are_made_at_start_up(offloading):
    for engine in offloading.engines.values():
        assert engine.asleep_weights.host.numel() == engine.model.weights_arena.nbytes
        assert engine.ledger.get(Pathway.WEIGHTS_HOST) == engine.model.weights_arena.nbytes


def test_a_second_sleep_reuses_the_host_copy(offloading):
    clock = FakeClock()
    engine = MultiEngine(offloading.engines, offloading.engine.pool, sleep_after=5, clock=clock)
    for _ in range(2):
        clock.now += 10
        burst(engine, "a", f"x{clock.now}")
        engine.add_request(PROMPT, GREEDY, f"w{clock.now}", model="b")
        while engine.has_unfinished_requests():
            engine.step()
    a, b = engine.engines["a"].asleep_weights, engine.engines["b"].asleep_weights
    host = b.host
    clock.now += 10
    burst(engine, "a", "again")
    assert engine.stats()["sleep"]["weights_offloaded"] == ["b"] and b.host is host  # the same copy
    assert a.host is not b.host and b.host.numel() == engine.engines["b"].model.weights_arena.nbytes
    engine.add_request(PROMPT, GREEDY, "last", model="b")  # leave b awake for the next test
    while engine.has_unfinished_requests():
        engine.step()


def test_an_idle_server_puts_its_models_to_sleep_without_a_step(offloading):
    """No request at all: the server's loop still wakes when a model's --sleep-after is due."""
    import time
    from mempath.server.async_engine import AsyncEngine
    engine = MultiEngine(offloading.engines, offloading.engine.pool, sleep_after=0.2)
    client = AsyncEngine(engine)
    client.start()
    try:
        deadline = time.monotonic() + 10
        while engine.sleep.stats()["weights_offloaded"] != ["a", "b"]:
            assert time.monotonic() < deadline, engine.sleep.stats()
            time.sleep(0.05)
    finally:
        client.shutdown()
    assert engine.stats()["sleep"]["asleep"] == ["a", "b"]
    for name in ("a", "b"):  # awake again for the tests after this one
        engine.sleep.active(name)
    assert engine.sleep.stats()["weights_offloaded"] == []


def test_offload_without_sleep_after_or_with_one_model_is_refused_in_one_line(two_models, capsys):  # noqa: F811
    llama, qwen = two_models
    with pytest.raises(ValueError, match="give --sleep-after S too"):
        LLM([llama, qwen], dtype="float32", show_progress=False, sleep_offload_weights=True)
    with pytest.raises(TypeError, match="are for several models"):
        LLM(llama, dtype="float32", show_progress=False, sleep_offload_weights=True)
    from mempath.cli import main
    assert main(["serve", llama, "--sleep-offload-weights"]) != 0
    err = capsys.readouterr().err
    assert "--sleep-offload-weights are for several models" in err and "Traceback" not in err


def test_an_arena_with_experts_in_host_memory_is_refused_in_one_line(model_factory):
    path, _ = model_factory("qwen3_moe")
    with pytest.raises(ValueError, match="--sleep-offload-weights moves whole models. weights; with experts"):
        LLM(path, dtype="float32", show_progress=False, weights_arena=True, moe_expert_cache_size=2)


def test_the_wake_benchmark_runs_on_tiny_shapes_and_leaves_no_files(monkeypatch, capsys, tmp_path):
    """It writes its two models' configs into a temporary directory of its own, gone when it returns."""
    monkeypatch.setattr(sys, "argv", ["bench_sleep.py", "--tiny", "--repeats", "2"])
    monkeypatch.setattr(__import__("tempfile"), "tempdir", str(tmp_path))
    bench_sleep.main()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("mempath")] == []  # (torch may cache there)
    result = [line for line in capsys.readouterr().out.splitlines() if line.startswith("RESULT ")]
    models = __import__("json").loads(result[0][len("RESULT "):])["models"]
    assert all(m["same_tokens"] and m["same_weights"] and len(m["wake_s"]) == 2 for m in models.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_wake_keeps_the_addresses_the_graphs_read(two_models):  # noqa: F811
    """On CUDA the weights come back at the same addresses (the driver's virtual memory), so the
    decode graphs captured before the sleep decode the same tokens after it, and the device gets
    the weights' bytes back while the model sleeps."""
    from mempath.memory.arena import mapped_bytes
    llama, qwen = two_models
    llm = LLM([f"a={llama}", f"b={qwen}"], dtype="float32", show_progress=False, sleep_after=1e6,
              sleep_offload_weights=True, max_num_seqs=4)
    clock = FakeClock()
    engine = MultiEngine(llm.engines, llm.engine.pool, sleep_after=5, clock=clock)
    b = engine.engines["b"]
    assert b.runner.graphs, "the test needs b's decode graphs"
    for e in engine.engines.values():  # weights outside PyTorch's allocator are not also "outside PyTorch"
        assert all(entry.bytes >= 0 for entry in e.ledger.entries.values()), e.ledger.table()
    budget = engine.first.budget
    assert budget.granted() <= budget.limit
    pointers = {p.data_ptr() for p in b.model.parameters()}
    before = answer(engine, "b", "b0")
    mapped = mapped_bytes()
    clock.now = 10
    burst(engine, "a", "x")
    torch.cuda.synchronize()
    assert mapped_bytes() == mapped - b.model.weights_arena.nbytes
    assert answer(engine, "b", "b1") == before
    assert {p.data_ptr() for p in b.model.parameters()} == pointers and mapped_bytes() == mapped


@pytest.mark.parametrize("ask", ["generate", "chat"])
def test_llm_generate_on_an_asleep_model_wakes_it_and_its_weights(two_models, ask):  # noqa: F811
    """LLM.generate and chat woke no model: an asleep one ran on weights still in host memory (a crash on the
    CPU, unmapped memory on CUDA) and kept no KV guarantee."""
    llm = together(two_models, num_gpu_blocks_override=12, sleep_after=1e6, sleep_offload_weights=True)
    clock = FakeClock()
    llm.engine = MultiEngine(llm.engines, llm.engine.pool, sleep_after=5, clock=clock)

    def run(model):
        if ask == "chat":
            message = [{"role": "user", "content": "def read_config(path):"}]
            return llm.chat(message, GREEDY, use_tqdm=False, model=model,
                            chat_template="{{ messages[0]['content'] }}")[0].outputs[0].token_ids
        return llm.generate([PROMPT], GREEDY, use_tqdm=False, model=model)[0].outputs[0].token_ids

    before = run("b")
    clock.now = 10
    run("a")  # b idle past sleep_after: it falls asleep, its weights leave the device
    assert llm.stats()["sleep"]["asleep"] == ["b"] and not llm.engines["b"].model.weights_arena.is_mapped
    assert run("b") == before
    stats = llm.stats()["sleep"]
    assert stats["asleep"] == [] and stats["wakes_by_model"]["b"] == 1 and llm.engine.owner == {}


def failing_map(arena, monkeypatch) -> list[bool]:
    """The arena's map fails as cuMemCreate does when the device memory the weights left is taken, until the
    returned flag is cleared."""
    from mempath.memory.arena import ArenaError
    fail, real = [True], arena.map

    def map_or_fail():
        if fail[0]:
            raise ArenaError("cuMemCreate failed (CUDA_ERROR_OUT_OF_MEMORY): the device cannot keep weights at "
                             "fixed addresses while they sleep; leave --sleep-offload-weights off",
                             "cuMemCreate failed (CUDA_ERROR_OUT_OF_MEMORY)")
        real()
    monkeypatch.setattr(arena, "map", map_or_fail)
    return fail


def test_a_wake_that_finds_no_room_refuses_its_request_and_the_next_one_wakes(offloading, monkeypatch):
    """It raised the start-up advice (leave --sleep-offload-weights off) as a 500 to the request that woke it."""
    from mempath.multi.sleep import WakeFailed
    clock = FakeClock()
    engine = MultiEngine(offloading.engines, offloading.engine.pool, sleep_after=5, clock=clock)
    before = answer(engine, "b", "b0")
    clock.now = 10
    burst(engine, "a", "x")
    fail = failing_map(engine.engines["b"].model.weights_arena, monkeypatch)
    with pytest.raises(WakeFailed, match=r"model 'b' is asleep and could not wake: its weights \(.*\) found no "
                                         r"room on the device \(cuMemCreate failed \(CUDA_ERROR_OUT_OF_MEMORY\)\);"):
        engine.add_request(PROMPT, GREEDY, "woke", model="b")
    stats = engine.stats()["sleep"]
    assert stats["weights_offloaded"] == ["b"] and "b" in stats["asleep"] and not engine.has_unfinished_requests()
    fail[0] = False
    assert answer(engine, "b", "b1") == before


def test_a_wake_that_finds_no_room_is_a_503_and_other_models_serve_on(two_models, monkeypatch):  # noqa: F811
    from starlette.testclient import TestClient

    from mempath.multi.http import build_multi_server_app
    app, names = build_multi_server_app(list(two_models), {"dtype": "float32", "num_gpu_blocks_override": 12},
                                        None, 0.0, None, {}, False, 30.0, None, None, {}, sleep_after=1e6,
                                        sleep_offload_weights=True)
    engine = app.shared.engine
    asleep = names[1]
    engine.sleep.pool.asleep.add(asleep)
    engine.sleep.weights.offload(asleep)
    fail = failing_map(engine.engines[asleep].model.weights_arena, monkeypatch)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    with TestClient(app) as client:
        refused = client.post("/v1/completions", json={**body, "model": asleep})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "model_unavailable" and "could not wake" in error["message"]
        assert "leave --sleep-offload-weights off" not in error["message"]
        assert client.post("/v1/completions", json={**body, "model": names[0]}).status_code == 200
        fail[0] = False
        assert client.post("/v1/completions", json={**body, "model": asleep}).status_code == 200
