"""--sleep-after: an idle model gives up its KV guarantee; its next request wakes it (mempath/multi/sleep.py)."""
import pytest

from mempath import LLM, SamplingParams
from mempath.multi.engine import MultiEngine
from mempath.server.metrics import ServerMetrics
from tests.test_multi_model import together

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = [list(range(10 + i, 50 + i)) for i in range(6)]  # two pages each on a


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def burst(engine: MultiEngine, model: str, tag: str, clock: FakeClock | None = None) -> int:
    """Run LONG on ``model`` to the end; the most pages it held (the clock moves 50 s a step)."""
    for i, prompt in enumerate(LONG):
        engine.add_request(prompt, PARAMS, f"{tag}{i}", model=model)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.pool.split()[model])
        if clock is not None:
            clock.now += 50
    return peak


@pytest.fixture(scope="module")
def loaded(two_models):  # noqa: F811
    return together(two_models, num_gpu_blocks_override=12, kv_min_share=0.25)


@pytest.fixture
def sleepy(loaded):
    """A MultiEngine over the loaded models that sleeps them after 5 s of a fake clock."""
    clock = FakeClock()
    return MultiEngine(loaded.engines, loaded.engine.pool, sleep_after=5, clock=clock), clock


def test_idle_model_gives_its_guarantee_and_a_request_wakes_it(sleepy):
    engine, clock = sleepy
    guarantee = engine.pool.guaranteed()
    assert guarantee == 3
    awake_peak = burst(engine, "a", "x")
    assert awake_peak <= 12 - guarantee  # b, awake and idle, keeps its 3 pages free
    assert engine.sleep.stats()["sleeps_by_model"] == {"a": 0, "b": 0}

    clock.now = 10  # b idle for 10 s, past sleep_after; a's next burst finds it asleep
    asleep_peak = burst(engine, "a", "y", clock)
    assert asleep_peak > 12 - guarantee  # the whole pool was a's
    stats = engine.stats()
    assert stats["sleep"]["asleep"] == ["b"] and stats["kv_pages"]["guaranteed_by_model"] == {"a": 3, "b": 0}
    assert stats["sleep"]["sleeps_by_model"] == {"a": 0, "b": 1}  # a was busy at every step: never asleep

    # A request to b while a holds every page wakes b: its guarantee holds again, and the victim
    # policy preempts a's newest request to give b its first pages.
    for i, prompt in enumerate(LONG):
        engine.add_request(prompt, PARAMS, f"z{i}", model="a")
    while engine.pool.split()["a"] < 12:
        engine.step()
    preempted = engine.num_cross_preemptions
    engine.add_request(LONG[0], PARAMS, "wake", model="b")
    stats = engine.stats()["sleep"]
    assert stats["asleep"] == [] and stats["wakes_by_model"] == {"a": 0, "b": 1}
    done = set()
    while engine.has_unfinished_requests():
        done |= {o.request_id for o in engine.step() if o.finished}
    assert "wake" in done and engine.num_cross_preemptions > preempted
    assert engine.pool.pages.num_used == 0 and engine.pool.split() == {"a": 0, "b": 0}
    engine.engines["a"].kv.pool.check_invariants()


def test_a_request_is_admitted_to_what_its_model_holds_with_every_model_awake(sleepy):
    """a may hold 9 of the 12 pages while b is awake (b is guaranteed 3). A request sized to the whole pool,
    admitted while b slept, was failed (a 500 mid-stream) when b woke and took its guarantee back."""
    engine, clock = sleepy
    a = engine.engines["a"]
    page = a.config.block_size
    assert a.max_request_tokens == min(a.max_model_len, 9 * page)  # the chat default max_tokens
    clock.now = 10
    engine.tick_idle()
    assert engine.stats()["sleep"]["asleep"] == ["a", "b"]
    prompt = list(range(3, 3 + 8 * page))
    with pytest.raises(ValueError, match=r"this model may hold 9 blocks of the shared pool's 12 .*--kv-min-share"):
        engine.add_request(prompt, SamplingParams(max_tokens=2 * page, ignore_eos=True), "too-long", model="a")
    fits = SamplingParams(max_tokens=page - 4, temperature=0, ignore_eos=True)  # 9 pages at the end
    alone = LLM(a.config.model, dtype="float32", show_progress=False).generate(prompt, fits)[0].token_ids
    engine.add_request(prompt, fits, "long", model="a")  # b asleep: a may take the whole pool
    for _ in range(3):
        engine.step()
    engine.add_request(LONG[0], PARAMS, "wake", model="b")  # b's guarantee is back
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["long"].finish_reason == "length" and done["long"].outputs[0].token_ids == alone
    assert done["wake"].finish_reason == "length"
    assert engine.pool.pages.num_used == 0


def test_a_refused_request_does_not_wake_its_model(sleepy):
    """The wake came before the request's checks: bad traffic kept an asleep model's guarantee (and, with
    --sleep-offload-weights, copied its weights back) for a request that never ran."""
    engine, clock = sleepy
    clock.now = 10
    engine.tick_idle()
    for prompt, params in (([], PARAMS), ([10 ** 6], PARAMS), ([1, 2], SamplingParams(logit_bias={10 ** 6: 1.0}))):
        with pytest.raises(ValueError):
            engine.add_request(prompt, params, "bad", model="b")
    stats = engine.stats()["sleep"]
    assert "b" in stats["asleep"] and stats["wakes_by_model"]["b"] == 0
    engine.add_request([1, 2, 3], PARAMS, "good", model="b")
    assert engine.stats()["sleep"]["wakes_by_model"]["b"] == 1
    engine.abort_request("good")


def test_sleeps_and_wakes_on_metrics(sleepy):
    engine, clock = sleepy
    clock.now = 10
    burst(engine, "a", "x")  # b falls asleep at the first step
    metrics = ServerMetrics.for_models(engine.engines)
    text = metrics.render({**engine.stats(), "device": "cpu"}).decode()
    assert 'mempath:model_sleeps_total{model_name="b"} 1.0' in text
    assert 'mempath:model_asleep{model_name="b"} 1.0' in text
    assert 'mempath:model_asleep{model_name="a"} 0.0' in text
    assert 'mempath:kv_pages_guaranteed{model_name="b"} 0.0' in text
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), "w", model="b")
    text = metrics.render({**engine.stats(), "device": "cpu"}).decode()
    assert 'mempath:model_wakes_total{model_name="b"} 1.0' in text
    engine.abort_request("w")


def test_without_sleep_after_nobody_sleeps(loaded):
    clock = FakeClock()
    engine = MultiEngine(loaded.engines, loaded.engine.pool, clock=clock)
    clock.now = 1e6
    assert burst(engine, "a", "x") <= 9 and engine.stats()["sleep"]["asleep"] == []


def test_bad_sleep_after_one_line(two_models):  # noqa: F811
    llama, qwen = two_models
    for bad in (0, -1, "5", float("inf"), float("nan")):
        with pytest.raises(ValueError, match="sleep_after must be a number of seconds > 0"):
            LLM([llama, qwen], dtype="float32", show_progress=False, sleep_after=bad)
    with pytest.raises(TypeError, match="are for several models"):
        LLM(llama, dtype="float32", show_progress=False, sleep_after=5)


def test_serve_refuses_sleep_after_for_one_model(two_models, capsys):  # noqa: F811
    import socket

    from mempath.cli import main
    llama, qwen = two_models
    with socket.socket() as sock:  # a port free now: serve checks it before anything else
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    assert main(["serve", llama, "--port", port, "--sleep-after", "5"]) != 0
    err = capsys.readouterr().err
    assert "--sleep-after and --sleep-offload-weights are for several models" in err and "Traceback" not in err
    assert main(["serve", llama, qwen, "--port", port, "--sleep-after", "0"]) != 0
    assert "sleep_after must be a number of seconds > 0" in capsys.readouterr().err
