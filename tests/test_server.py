"""The OpenAI-compatible server, end to end: a real uvicorn on loopback, the official client."""
import asyncio
import json
import random
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mempath.sampling import SamplingParams
from mempath.server.cli import build_server_app, uvicorn_options
from mempath.server.settings import DEFAULT_MAX_HEADER_BYTES

API_KEY = "test-key"
MAX_MODEL_LEN = 256
MAX_TOKENS_LIMIT = 200
MAX_N = 8
MAX_BODY_BYTES = 64 * 1024
BLOCK_SIZE = 16
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # several full KV blocks


class RunningServer:
    """The app on uvicorn on a free loopback port, configured as `mempath serve` configures it."""

    def __init__(self, app, name: str, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES):
        self.name = name
        self.app = app
        self.engine = app.state.engine_client.engine  # touch only from the engine thread
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        import uvicorn
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    **uvicorn_options(max_header_bytes)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30)

    def metrics(self) -> dict[tuple, float]:
        """{(name, sorted label items without model_name): value}"""
        text = httpx.get(f"{self.url}/metrics").text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
                values[(sample.name, labels)] = sample.value
        return values

    def wait_until_idle(self, timeout: float = 10.0) -> dict:
        """Metrics once nothing runs, waits or holds a KV block; fails after `timeout`."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            busy = {key: m[key] for key in IDLE_GAUGES if m[key] != 0}
            if not busy:
                return m
            assert time.time() < deadline, f"the server is not idle after {timeout} s: {busy}"
            time.sleep(0.05)


IDLE_GAUGES = (("mempath:kv_blocks", (("state", "used"),)), ("mempath:num_requests_running", ()),
               ("mempath:num_requests_waiting", ()))


class StepGate:
    """Holds the engine between steps while ``hold(engine)`` is true.

    A held engine still runs its inbox (adds, aborts) but computes nothing, so a
    test can make sure something happens before generation moves on. A hold gives
    up after ``timeout`` seconds and says so in ``timed_out``: a condition that
    never comes fails the test instead of hanging it. Install it as
    ``monkeypatch.setattr(engine, "step", gate.step)``.
    """

    POLL_SECONDS = 0.002  # how often a held engine looks at its inbox again

    def __init__(self, engine, hold, timeout: float = 10.0):
        self.engine = engine
        self.hold = hold
        self.timeout = timeout
        self.real_step = engine.step
        self.reached = threading.Event()  # set once the engine has been held
        self.timed_out = False
        self._held_since = None

    def step(self):
        if not self.timed_out and self.hold(self.engine):
            self.reached.set()
            now = time.monotonic()
            self._held_since = self._held_since or now
            self.timed_out = now - self._held_since > self.timeout
            time.sleep(self.POLL_SECONDS)
            return []
        self._held_since = None
        return self.real_step()


ENGINE_OPTIONS = dict(device="cpu", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=256,
                      block_size=BLOCK_SIZE)


def tiny_llama(tmp_path_factory, name: str) -> str:
    """A random-weight Llama checkpoint for one test module's server."""
    from tests.conftest import make_model
    path = tmp_path_factory.mktemp(name)
    make_model(path, "llama")
    return str(path)


def serving(model: str, engine_options: dict = ENGINE_OPTIONS, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
            **build_options):
    """A module fixture's body (``yield from``): the app as `mempath serve` builds it, on uvicorn."""
    app, name = build_server_app(model, engine_options, served_model_name="tiny", api_key=API_KEY,
                                 show_progress=False, max_header_bytes=max_header_bytes, **build_options)
    running = RunningServer(app, name, max_header_bytes=max_header_bytes)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from tests.conftest import make_model
    path = tmp_path_factory.mktemp("served-model")
    make_model(path, "llama")
    return str(path)


@pytest.fixture(scope="module")
def server(model_path):
    app, name = build_server_app(
        model_path, ENGINE_OPTIONS, served_model_name="tiny", api_key=API_KEY,
        max_body_bytes=MAX_BODY_BYTES, max_tokens_limit=MAX_TOKENS_LIMIT, max_n=MAX_N,
        show_progress=False)
    running = RunningServer(app, name)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reference(model_path):
    """The same model in an engine of its own: what the server should have answered."""
    from mempath import LLM
    return LLM(model_path, show_progress=False, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def counter(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


# ----------------------------------------------------------------- happy paths
def test_models_health_and_metrics_are_served(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    m = server.metrics()
    assert m[("mempath:kv_blocks_total", ())] == 256
    assert counter(m, "mempath:memory_bytes", pathway="kv_cache", device="cpu", source="measured") > 0
    assert counter(m, "mempath:memory_bytes", pathway="weights", device="cpu", source="measured") > 0


def test_completion_returns_text_and_usage(client):
    out = client.completions.create(model="tiny", prompt="Hello world", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_uses_the_chat_template(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    out = client.chat.completions.create(model="tiny", messages=messages,
        max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    assert out.usage.completion_tokens == 5
    # "<s>system: Be brief.\n<s>user: Hello\n<s>assistant:" is far longer than "Hello".
    assert out.usage.prompt_tokens > 8
    # The prompt is the template's rendering, encoded without extra special tokens: the same
    # length, and the same greedy answer as the engine gives for exactly those tokens.
    tokenizer = reference.tokenizer
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<s>system: Be brief.")
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert out.usage.prompt_tokens == len(prompt_ids)
    expected = reference.generate(prompt_ids, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                                  use_tqdm=False)[0]
    assert out.choices[0].message.content == expected.text


def test_completion_stream_equals_non_stream_for_a_seed(client):
    kwargs = dict(model="tiny", prompt="def read_config(path):", max_tokens=12, temperature=1.0,
                  seed=1234, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_equals_non_stream_for_a_seed(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "The quick brown fox"}],
                  max_tokens=10, temperature=0.8, seed=7)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_sse_wire_format_ends_with_done(server):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def visible_window(text: str) -> str | None:
    """A two-character piece of text with no replacement character (a whole decoded char)."""
    for i in range(2, len(text) - 1):
        piece = text[i:i + 2]
        if "\ufffd" not in piece and piece.strip():
            return piece
    return None


def test_stop_strings_cut_the_text_streaming_or_not(client):
    base = dict(model="tiny", prompt="The quick brown fox", max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True})
    text = client.completions.create(**base).choices[0].text
    stop = visible_window(text)
    assert stop is not None, f"no usable stop string in {text!r}"
    expected = text[:text.find(stop)]
    out = client.completions.create(stop=[stop, "never-generated"], **base)
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True,
                                                                            **base))
    assert streamed == expected


def test_n_samples_share_the_prompt_blocks(server, client):
    before = server.metrics()
    out = client.completions.create(model="tiny", prompt="n-test: " + LONG_PROMPT, n=3, max_tokens=4,
                                    temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    after = server.metrics()
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 3 * 4
    full_blocks = (out.usage.prompt_tokens - 1) // BLOCK_SIZE
    hits = (counter(after, "mempath:prefix_cache_hits_total")
            - counter(before, "mempath:prefix_cache_hits_total"))
    assert full_blocks >= 2 and hits >= 2 * full_blocks * BLOCK_SIZE
    # Different seeds per sample: the three samples are not all the same text.
    assert len({c.text for c in out.choices}) > 1


def test_n_samples_stream_every_choice(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, seed=5,
        stream=True, extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_repeated_prefix_reports_cached_tokens(client):
    prompt = "cached-test: " + LONG_PROMPT  # a fresh first block: nothing cached yet
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (second.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE and cached >= 32


def engine_logprobs(reference, prompt, num_tokens: int, top: int, seed: int):
    """(token ids, per-token {id: logprob}) of the engine's own run of the same request."""
    params = SamplingParams(max_tokens=num_tokens, seed=seed, logprobs=top, ignore_eos=True)
    out = reference.generate(prompt, params, use_tqdm=False)[0]
    return out.token_ids, out.logprobs


def assert_logprobs_match(tokenizer, token_ids, engine_entries, tokens, logprobs, tops, top: int,
                          with_sampled: bool = False):
    """``with_sampled``: the top entries hold the sampled token beside the top n (completions', as OpenAI's)."""
    assert tokens == [tokenizer.decode([t]) for t in token_ids]
    for token_id, entry, value, top_entry in zip(token_ids, engine_entries, logprobs, tops):
        assert value == pytest.approx(entry[token_id], abs=1e-5)
        best = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top]
        expected = {tokenizer.decode([t]): v for t, v in best}
        if with_sampled:
            expected[tokenizer.decode([token_id])] = entry[token_id]
        assert top_entry == pytest.approx(expected, abs=1e-5)


def test_logprobs_come_back_per_token(client, reference):
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, logprobs=2, seed=21,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    tokenizer = reference.tokenizer
    token_ids, entries = engine_logprobs(reference, "Hello", 4, 2, seed=21)
    assert_logprobs_match(tokenizer, token_ids, entries, lp.tokens, lp.token_logprobs, lp.top_logprobs, 2,
                          with_sampled=True)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]

    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, seed=22,
                                          max_tokens=3, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    token_ids, entries = engine_logprobs(reference, tokenizer.encode(rendered, add_special_tokens=False),
                                         3, 2, seed=22)
    assert_logprobs_match(tokenizer, token_ids, entries, [t.token for t in content],
                          [t.logprob for t in content],
                          [{e.token: e.logprob for e in t.top_logprobs} for t in content], 2)
    assert [t.bytes for t in content] == [list(t.token.encode()) for t in content]


# ----------------------------------------------------------------- bad requests
def raw_post(server, path: str, content: bytes, key: str = API_KEY) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=content, timeout=30,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def assert_error(response: httpx.Response, status: int, param=None, says: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert says.lower() in error["message"].lower()
    return error


def test_invalid_json_is_a_400(server):
    error = assert_error(raw_post(server, "/v1/completions", b'{"model": "tiny", "prompt": '), 400,
                         None, "not valid JSON")
    assert error["code"] == "invalid_json"
    assert_error(raw_post(server, "/v1/chat/completions", b"[1, 2]"), 400, None, "JSON object")


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": "hi", "max_tokens": "five"}, "max_tokens", "valid integer"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature", "valid number"),
    ({"prompt": 3}, "prompt", "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"prompt": "hi", "max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens", "--max-tokens-limit"),
    ({"prompt": "hi", "n": MAX_N + 1}, "n", "--max-n"),
    ({"prompt": "hello " * (MAX_MODEL_LEN + 10)}, "prompt", "max_model_len"),
    ({"prompt": "hi", "stop": [""]}, "stop", "non-empty"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
])
def test_bad_completion_fields_are_400s_naming_the_field(server, body, param, says):
    response = raw_post(server, "/v1/completions", json.dumps({"model": "tiny", **body}).encode())
    assert_error(response, 400, param, says)


def test_bad_chat_fields_are_400s(server):
    bad_role = {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}
    assert_error(raw_post(server, "/v1/chat/completions", json.dumps(bad_role).encode()), 400,
                 "messages.0.role")
    empty = {"model": "tiny", "messages": []}
    assert_error(raw_post(server, "/v1/chat/completions", json.dumps(empty).encode()), 400,
                 "messages")


def test_the_openai_client_sees_each_error_class(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="/etc/passwd", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and "tiny" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hi", n=MAX_N + 1, max_tokens=2)
    assert info.value.body["param"] == "n"


def test_a_body_over_the_limit_is_a_413(server):
    huge = json.dumps({"model": "tiny", "prompt": "x" * (MAX_BODY_BYTES + 1)}).encode()
    error = assert_error(raw_post(server, "/v1/completions", huge), 413, None, "--max-body-bytes")
    assert error["code"] == "request_too_large"


def test_a_chunked_body_over_the_limit_is_a_413(server):
    """A body sent without Content-Length is counted as it arrives, against the same limit."""
    body = json.dumps({"model": "tiny", "prompt": "x" * MAX_BODY_BYTES, "max_tokens": 1}).encode()
    assert MAX_BODY_BYTES < len(body) < 2 * MAX_BODY_BYTES

    def chunks():  # a generator: httpx sends it with Transfer-Encoding: chunked
        for start in range(0, len(body), 4096):
            yield body[start:start + 4096]

    response = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in response.request.headers
    error = assert_error(response, 413, None, "--max-body-bytes")
    assert error["code"] == "request_too_large"
    small = json.dumps({"model": "tiny", "prompt": "chunked", "max_tokens": 2}).encode()
    response = httpx.post(f"{server.url}/v1/completions", content=iter([small[:5], small[5:]]),
                          timeout=30, headers={"Authorization": f"Bearer {API_KEY}",
                                               "Content-Type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("prompt", [
    ["one", "two", "three"],             # 3 prompts x n=3 = 9 choices
    [[5, 6, 7], [8, 9], [10, 11, 12]],   # the same, as token ids
])
def test_the_n_limit_counts_every_prompt(server, prompt):
    body = {"model": "tiny", "prompt": prompt, "n": 3, "max_tokens": 2}
    assert len(prompt) * 3 > MAX_N >= 3
    response = raw_post(server, "/v1/completions", json.dumps(body).encode())
    assert_error(response, 400, "n", "3 prompts x n=3 asks for 9 choices")


def test_several_prompts_and_token_id_prompts_over_http(client, reference):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    out = client.completions.create(model="tiny", prompt=["one", "two"], n=2, max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    expected = [o.text for o in reference.generate(["one", "two"], params, use_tqdm=False)]
    assert [c.text for c in out.choices] == [expected[0], expected[0], expected[1], expected[1]]
    assert out.usage.completion_tokens == 4 * 3
    # Each prompt counted once in the usage, whatever n is.
    assert out.usage.prompt_tokens == sum(len(reference.tokenizer.encode(p)) for p in ("one", "two"))

    ids = [[5, 6, 7], [8, 9, 10, 11]]
    expected = [o.text for o in reference.generate(ids, params, use_tqdm=False)]
    one = client.completions.create(model="tiny", prompt=ids[0], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in one.choices] == expected[:1] and one.usage.prompt_tokens == 3
    both = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in both.choices] == expected and both.usage.prompt_tokens == 7


def test_unknown_route_is_an_openai_style_404(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing-here",
                           headers={"Authorization": f"Bearer {API_KEY}"}), 404)


def test_the_api_key_is_required_on_v1_only(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert_error(httpx.get(f"{server.url}/v1/models"), 401, None, "API key")
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_the_server_keeps_serving_after_bad_requests(server, client):
    raw_post(server, "/v1/completions", b"{nope")
    raw_post(server, "/v1/completions", json.dumps({"model": "tiny", "prompt": "hi", "n": 99}).encode())
    out = client.completions.create(model="tiny", prompt="still here?", max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert server.wait_until_idle()[("mempath:kv_blocks", (("state", "used"),))] == 0


# ----------------------------------------------------------------- load and disconnects
def raw_request(path: str, body: dict, key: str = API_KEY) -> bytes:
    """One HTTP/1.1 request as bytes, for a client that hangs up when the test says so."""
    content = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(content)}\r\n\r\n").encode() + content


def test_a_non_streaming_client_that_hangs_up_is_aborted(server, monkeypatch):
    before = counter(server.metrics(), "mempath:request_success_total", finished_reason="abort")
    # Once the request has its first token the engine holds it: it cannot finish before the
    # client hangs up, however fast the machine.
    gate = StepGate(server.engine, lambda engine: any(r.num_output_tokens >= 1
                                                      for r in engine.outputs.requests.values()))
    monkeypatch.setattr(server.engine, "step", gate.step)
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": MAX_TOKENS_LIMIT, "ignore_eos": True}
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(raw_request("/v1/completions", body))
        assert gate.reached.wait(30), "the request never produced a token"
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # no answer before the hang-up
            sock.recv(1)
    m = server.wait_until_idle()
    assert not gate.timed_out, "the server did not notice the hang-up"
    assert m[("mempath:kv_blocks", (("state", "used"),))] == 0
    assert counter(m, "mempath:request_success_total", finished_reason="abort") == before + 1


async def stream_one(http: httpx.AsyncClient, url: str, prompt: str, hang_up: bool) -> str | None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text = []
    async with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "".join(text)
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text.append(chunk["choices"][0]["text"])
            if hang_up and len(text) >= 2:
                return None  # leaving the block closes the connection mid-stream
    raise AssertionError("the stream ended without [DONE]")


HANG_UP = "Hang up: "  # the prompts of the streams that hang up start with this


def test_64_streams_with_a_third_hanging_up_leak_nothing(server, client, monkeypatch):
    prompts = [f"The quick brown fox {i}" for i in range(4)]
    expected = {p: client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
                for p in prompts}
    # A hanging-up stream reads two chunks of text, which these prompts give within the 12
    # tokens after which the engine holds it until its hang-up is noticed: every hang-up
    # really cuts a generation short, however fast the machine.
    for p in prompts:
        chunks = list(client.completions.create(model="tiny", prompt=HANG_UP + p, max_tokens=12,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert sum(1 for c in chunks[:-1] if c.choices[0].text) >= 2, p
    gate = StepGate(server.engine, lambda engine: any(
        (r.prompt or "").startswith(HANG_UP) and r.num_output_tokens >= 12
        for r in engine.outputs.requests.values()))
    monkeypatch.setattr(server.engine, "step", gate.step)
    rng = random.Random(0)
    hang_ups = set(rng.sample(range(64), 64 // 3))
    before = server.metrics()

    async def run_all():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            return await asyncio.gather(*[
                stream_one(http, f"{server.url}/v1/completions",
                           (HANG_UP if i in hang_ups else "") + prompts[i % 4], i in hang_ups)
                for i in range(64)])

    results = asyncio.run(run_all())
    for i, text in enumerate(results):
        if i not in hang_ups:
            assert text == expected[prompts[i % 4]], f"stream {i}"
    after = server.wait_until_idle()
    assert after[("mempath:kv_blocks", (("state", "used"),))] == 0
    assert after[("mempath:num_requests_running", ())] == 0
    assert after[("mempath:num_requests_waiting", ())] == 0
    finished = {reason: counter(after, "mempath:request_success_total", finished_reason=reason)
                - counter(before, "mempath:request_success_total", finished_reason=reason)
                for reason in ("stop", "length", "abort")}
    assert sum(finished.values()) == 64
    assert finished["length"] >= 64 - len(hang_ups)
    assert finished["abort"] > 0  # the hang-ups really cut generations short
    assert finished["abort"] == len(hang_ups) and finished["length"] == 64 - len(hang_ups)
    assert not gate.timed_out
    assert after[("mempath:generation_tokens_total", ())] > before[("mempath:generation_tokens_total", ())]
