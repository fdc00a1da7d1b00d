"""Hostile, careless and broken clients, and a broken engine, against the HTTP server.

Each test sends what a real client or web page could send and checks the answer is
one clear error naming the problem (or the right result), that nothing leaks, and
that the server keeps serving. The server runs on uvicorn on a free loopback port,
as `mempath serve` runs it; a few checks go through the app in-process instead.
"""
import asyncio
import json
import logging
import random
import socket

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from mempath.engine.detokenizer import find_stop
from mempath.sampling import SamplingParams
from mempath.server.app import build_app
from mempath.server.async_engine import AsyncEngine
from mempath.server.cli import build_server_app
from tests.test_server import (API_KEY, ENGINE_OPTIONS, RunningServer, StepGate, assert_error,
                               counter, raw_post, raw_request)

MAX_N = 4
MAX_HEADER_BYTES = 4096
MAX_HEADERS = 30


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from tests.conftest import make_model
    path = tmp_path_factory.mktemp("hostile-model")
    make_model(path, "llama")
    return str(path)


@pytest.fixture(scope="module")
def server(model_path):
    """Served as `mempath serve --host 127.0.0.1` serves it: Host check and header limits on."""
    app, name = build_server_app(model_path, ENGINE_OPTIONS, served_model_name="tiny", api_key=API_KEY,
                                 max_n=MAX_N, show_progress=False, bind_host="127.0.0.1",
                                 max_header_bytes=MAX_HEADER_BYTES, max_headers=MAX_HEADERS)
    running = RunningServer(app, name, max_header_bytes=MAX_HEADER_BYTES)
    yield running
    running.stop()


@pytest.fixture
def idle_after(server):
    """The test leaves the server idle: no request running or waiting, no KV block held."""
    yield
    server.wait_until_idle()


def post(server, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=json.dumps(body).encode(), timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json",
                               **headers})


def wait_for(condition, what: str, timeout: float = 10.0) -> None:
    """Poll `condition` until true; fail naming `what` after `timeout` seconds."""
    import time
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.02)


# ----------------------------------------------------------------- cross-site requests
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_json_endpoints_refuse_other_content_types(server, path, content_type, idle_after):
    """A web page can POST text/plain, form or multipart bodies without a CORS preflight."""
    body = {"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    before = server.metrics()[("mempath:generation_tokens_total", ())]
    response = httpx.post(f"{server.url}{path}", content=json.dumps(body).encode(), headers=headers,
                          timeout=30)
    error = assert_error(response, 415, None, "application/json")
    assert error["code"] == "unsupported_media_type"
    assert server.metrics()[("mempath:generation_tokens_total", ())] == before


def test_json_with_a_charset_is_json(server):
    response = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2},
                    **{"Content-Type": "Application/JSON; charset=utf-8"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.nip.io",
                                  "localhost.evil.example", "[::2]:80", "10.0.0.1", "0.0.0.0"])
def test_a_loopback_server_refuses_other_host_names(server, host):
    """DNS rebinding: a page whose name resolves to 127.0.0.1 sends its own name as Host."""
    before = server.metrics()[("mempath:generation_tokens_total", ())]
    for path in ("/health", "/metrics", "/v1/models"):
        response = httpx.get(f"{server.url}{path}", headers={"Host": host,
                                                              "Authorization": f"Bearer {API_KEY}"})
        error = assert_error(response, 400, None, "Host")
        assert error["code"] == "invalid_host" and "--host" in error["message"]
    assert_error(post(server, "/v1/completions", completion(), Host=host), 400, None, "Host")
    assert server.metrics()[("mempath:generation_tokens_total", ())] == before


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:{port}", "localhost:{port}", "LOCALHOST.",
                                  "[::1]:{port}", "app.localhost:{port}", "127.0.0.2"])
def test_a_loopback_server_answers_loopback_host_names(server, host):
    response = post(server, "/v1/completions", completion(), Host=host.format(port=server.port))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("host, loopback", [
    ("localhost", True), ("a.b.localhost:1", True), ("127.9.9.9", True), ("[::1]", True),
    (None, False), ("", False), ("[::1", False), (":8000", False), ("localhost.example", False),
    ("[::ffff:127.0.0.1]", False),  # an IPv4-mapped address: not what a loopback bind listens on
])
def test_loopback_names(host, loopback):
    from mempath.server.guards import is_loopback_name
    assert is_loopback_name(host) is loopback


@pytest.mark.parametrize("bind_host", [None, "0.0.0.0", "192.168.1.10"])
def test_a_server_bound_elsewhere_takes_any_host(server, bind_host):
    app = build_app(server.app.state.engine_client, "tiny", bind_host=bind_host)
    assert TestClient(app, base_url="http://models.example.com").get("/health").status_code == 200


def test_cors_is_off_by_default(server):
    origin = {"Origin": "https://evil.example"}
    response = httpx.get(f"{server.url}/v1/models", headers={**origin, "Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    preflight = httpx.options(f"{server.url}/v1/completions", headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert not any(h.startswith("access-control-") for h in preflight.headers)


def test_allowed_origins_open_cors_to_those_origins_only(server):
    app = build_app(server.app.state.engine_client, "tiny", api_key=API_KEY,
                    allowed_origins=["https://app.example", "http://localhost:3000"])
    http = TestClient(app)
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = http.options("/v1/completions", headers={"Origin": "https://app.example", **ask})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    refused = http.options("/v1/completions", headers={"Origin": "https://evil.example", **ask})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    answer = http.post("/v1/completions", json=completion(), headers={
        "Origin": "http://localhost:3000", "Authorization": f"Bearer {API_KEY}"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "http://localhost:3000"
    other = http.get("/v1/models", headers={"Origin": "https://evil.example",
                                            "Authorization": f"Bearer {API_KEY}"})
    assert "access-control-allow-origin" not in other.headers


# ----------------------------------------------------------------- headers
def head_answer(server, headers: list[tuple[str, str]]) -> str:
    """The status line the real server answers a GET with these headers, or "closed".

    A raw socket: httpx takes seconds to build a request with 10,000 headers. uvicorn's
    h11 parser answers 400 and closes when it has buffered too much of an unfinished
    head; the close can reset the connection before the answer is read, which is a
    refusal too.
    """
    head = "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(
        f"{name}: {value}\r\n" for name, value in headers) + "\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        try:
            sock.sendall(head.encode())
            answer = sock.recv(4096)
        except (ConnectionResetError, BrokenPipeError):
            return "closed"
    return answer.split(b"\r\n", 1)[0].decode() if answer else "closed"


def test_huge_headers_are_refused_by_the_real_server(server):
    auth = [("Authorization", f"Bearer {API_KEY}")]
    cases = {"one 100 KB header": [("X-Big", "a" * 100_000)],
             "10,000 headers": [(f"X-H{i}", "v") for i in range(10_000)],
             "a few too many": [(f"X-H{i}", "v") for i in range(MAX_HEADERS + 1)]}
    for what, headers in cases.items():
        answer = head_answer(server, auth + headers)
        assert answer in ("HTTP/1.1 400 Bad Request", "HTTP/1.1 431 Request Header Fields Too Large",
                          "closed"), (what, answer)
    response = httpx.get(f"{server.url}/v1/models", headers=auth + cases["a few too many"])
    error = assert_error(response, 431, None, "--max-headers")
    assert error["code"] == "request_header_fields_too_large"
    assert head_answer(server, auth) == "HTTP/1.1 200 OK"


def test_huge_headers_are_refused_by_the_app(server):
    app = build_app(server.app.state.engine_client, "tiny", max_header_bytes=MAX_HEADER_BYTES,
                    max_headers=MAX_HEADERS)
    http = TestClient(app)
    many = http.get("/health", headers=[(f"x-h{i}", "v") for i in range(10_000)])
    assert_error(many, 431, None, f"at most {MAX_HEADERS} (--max-headers)")
    big = http.get("/health", headers={"x-big": "a" * 100_000})
    assert_error(big, 431, None, f"at most {MAX_HEADER_BYTES} bytes (--max-header-bytes)")
    assert http.get("/health", headers={"x-fine": "a" * (MAX_HEADER_BYTES // 2)}).status_code == 200


# ----------------------------------------------------------------- API keys
@pytest.mark.parametrize("key, says", [("", "empty"), (" key", "whitespace"), ("key\n", "whitespace"),
                                       ("k\u00e9y", "ASCII"), ("a b", "whitespace"), ("\x7f", "ASCII")])
def test_api_keys_that_cannot_work_are_refused_at_start_up(server, key, says, capsys, monkeypatch):
    from mempath.cli import main
    with pytest.raises(ValueError, match=says):
        build_app(server.app.state.engine_client, "tiny", api_key=key)
    assert main(["serve", "--api-key", key]) == 2
    message = capsys.readouterr().err
    assert message.startswith("mempath: error: ") and says in message and message.count("\n") == 1
    monkeypatch.setenv("MEMPATH_API_KEY", key)
    assert main(["serve"]) == 2
    assert "MEMPATH_API_KEY" in capsys.readouterr().err


def test_a_padded_token_still_matches_a_clean_key(server):
    response = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer   {API_KEY}"})
    assert response.status_code == 200


# ----------------------------------------------------------------- the command line
@pytest.mark.parametrize("flags, says", [
    (["--max-body-bytes", "0"], "--max-body-bytes"), (["--max-n", "0"], "--max-n"),
    (["--max-tokens-limit", "0"], "--max-tokens-limit"), (["--port", "70000"], "--port"),
    (["--max-header-bytes", "100"], "--max-header-bytes"), (["--max-headers", "0"], "--max-headers"),
    (["--allowed-origins", "ftp://files.example"], "--allowed-origins"),
    (["--allowed-origins", "http://app.example/path"], "--allowed-origins"),
    (["--allowed-origins", "[1, 2]"], "--allowed-origins"),
    (["--allowed-origins", "[nope"], "not a valid JSON list"),
    (["--model", "a", "b"], "either as --model or as the first argument"),
    (["--served-model-name", ""], "--served-model-name"), (["--served-model-name", " "], "--served-model-name"),
    (["--chat-template", "{{ bad"], "--chat-template"),
])
def test_serve_flags_that_cannot_work_are_one_line(flags, says, capsys):
    from mempath.cli import main
    assert main(["serve", *flags]) == 2
    message = capsys.readouterr().err
    assert says in message and message.count("\n") == 1, message


def test_an_unknown_uvicorn_log_level_is_an_argument_error_before_the_model_loads(capsys):
    from mempath.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--uvicorn-log-level", "bogus"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "mempath serve: error: argument --uvicorn-log-level: invalid choice: 'bogus'")


def test_port_0_is_left_to_uvicorn_and_the_banner_says_where_the_port_is_named(monkeypatch, capsys):
    """--port 0 asks for any free port: uvicorn binds it (so nothing can take it while the model loads) and
    names it; the banner does not claim port 0."""
    from mempath.cli import main
    from mempath.server import app as server_app
    from mempath.server import cli
    ran = {}
    monkeypatch.setattr(cli, "build_server_app", lambda *args, **kwargs: ("app", "served"))
    monkeypatch.setattr(server_app, "serve", lambda app, *args, **kwargs: ran.update(kwargs))
    assert main(["serve", "some/model", "--port", "0"]) == 0
    assert ran["port"] == 0
    banner = capsys.readouterr().out
    assert ":0/" not in banner and "the free port uvicorn's next line names" in banner


def test_serve_passes_its_limits_to_the_app_and_to_uvicorn(monkeypatch, caplog):
    from mempath.cli import main
    from mempath.server import app as server_app
    from mempath.server import cli
    built, ran = {}, {}
    monkeypatch.setattr(cli, "build_server_app", lambda *args, **kwargs: built.update(
        args=args, kwargs=kwargs) or ("app", "served"))
    import uvicorn
    for module, name in ((server_app, "serve"), (uvicorn, "run")):  # whichever run_serve calls
        monkeypatch.setattr(module, name, lambda app, *args, **kwargs: ran.update(app=app, **kwargs),
                            raising=False)
    assert main(["serve", "some/model", "--host", "0.0.0.0", "--port", "9999", "--max-headers", "50",
                 "--max-header-bytes", "8192", "--allowed-origins", "http://a.example, https://b.example:8443"]) == 0
    assert built["args"][0] == "some/model"
    assert built["kwargs"]["bind_host"] == "0.0.0.0"
    assert built["kwargs"]["allowed_origins"] == ["http://a.example", "https://b.example:8443"]
    assert (built["kwargs"]["max_headers"], built["kwargs"]["max_header_bytes"]) == (50, 8192)
    assert ran["app"] == "app" and (ran["host"], ran["port"]) == ("0.0.0.0", 9999)
    assert ran["http"] == "h11" and ran["h11_max_incomplete_event_size"] == 8192
    assert any("without --api-key" in r.getMessage() for r in caplog.records)
    built.clear()
    assert main(["serve", "--allowed-origins", '["*"]']) == 0
    assert built["kwargs"]["allowed_origins"] == ["*"] and built["kwargs"]["bind_host"] == "127.0.0.1"
    from mempath.assets import default_model_path
    assert built["args"][0] == default_model_path()


# ----------------------------------------------------------------- numbers
@pytest.mark.parametrize("field, raw", [
    ("temperature", "Infinity"), ("temperature", "1e999"), ("temperature", "NaN"),
    ("top_p", "NaN"), ("min_p", "-Infinity"), ("presence_penalty", "Infinity"),
    ("frequency_penalty", "NaN"),
])
def test_non_finite_numbers_are_400s_naming_the_field(server, field, raw):
    body = f'{{"model": "tiny", "prompt": "hi", "max_tokens": 2, "{field}": {raw}}}'.encode()
    error = assert_error(raw_post(server, "/v1/completions", body), 400, field, "finite")
    assert "got inf" in error["message"] or "got -inf" in error["message"] or "got nan" in error["message"]


def test_sampling_params_refuse_non_finite_numbers():
    for field in ("temperature", "top_p", "min_p"):
        for value in (float("inf"), float("-inf"), float("nan")):
            with pytest.raises(ValueError, match=f"^{field} must be a finite number") as info:
                SamplingParams(**{field: value}).validate(max_logprobs=5)
            assert "\n" not in str(info.value)


def test_a_tiny_temperature_is_greedy(server):
    """1e-40 is a float32 subnormal: dividing the logits by it gave inf - inf = nan scores."""
    base = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "ignore_eos": True}
    greedy = post(server, "/v1/completions", {**base, "temperature": 0}).json()["choices"][0]["text"]
    for temperature in (1e-40, 1e-6, 9.9e-6):
        out = post(server, "/v1/completions", {**base, "temperature": temperature, "seed": 3})
        assert out.json()["choices"][0]["text"] == greedy, temperature
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=1e-4).greedy


def test_the_sampler_treats_a_tiny_temperature_as_greedy():
    from mempath.engine.sampler import Sampler
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=t) for t in (1e-40, 1e-7, 0.0)]
    out = Sampler(torch.device("cpu"), seed=0)(logits, params, [None] * 3)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


# ----------------------------------------------------------------- fields we cannot honour
# response_format, structured_outputs, guided_* and (on chat) tools / tool_choice are honoured:
# tests/test_structured.py and tests/test_tool_calls.py.
UNSUPPORTED = [
    ("use_beam_search", True), ("stop_token_ids", [3]), ("include_stop_str_in_output", True),
    ("spaces_between_special_tokens", False), ("guided_decoding_backend", "outlines"),
    ("guided_whitespace_pattern", " *"),
    ("truncate_prompt_tokens", 4), ("allowed_token_ids", [1, 2]),
    ("length_penalty", 0.5), ("priority", 1), ("cache_salt", "tenant-a"),
    ("stream_options", {"include_usage": True, "continuous_usage_stats": True}),
]
CHAT_UNSUPPORTED = [
    ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}), ("add_generation_prompt", False),
    ("continue_final_message", True), ("chat_template", "{{ messages }}"),
    ("chat_template_kwargs", {"enable_thinking": True}), ("documents", [{"text": "x"}]),
    ("echo", True), ("add_special_tokens", True), ("audio", {"voice": "alloy"}), ("modalities", ["audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("reasoning_effort", "high"),
    ("web_search_options", {}),
]
COMPLETION_UNSUPPORTED = [("echo", True), ("suffix", "x"), ("best_of", 3), ("add_special_tokens", False),
                          ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required")]


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


@pytest.mark.parametrize("field, value", UNSUPPORTED + COMPLETION_UNSUPPORTED)
def test_completion_fields_we_cannot_honour_are_400s(server, field, value):
    body = completion(**{field: value})
    if field == "stream_options":
        body["stream"] = True
    assert_error(post(server, "/v1/completions", body), 400, field, "not supported")


@pytest.mark.parametrize("field, value", UNSUPPORTED + CHAT_UNSUPPORTED)
def test_chat_fields_we_cannot_honour_are_400s(server, field, value):
    body = chat(**{field: value})
    if field == "stream_options":
        body["stream"] = True
    assert_error(post(server, "/v1/chat/completions", body), 400, field, "not supported")


@pytest.mark.parametrize("message, field", [
    ({"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}},
     "messages.1.function_call"),
    ({"role": "assistant", "content": "x", "audio": {"id": "a"}}, "messages.1.audio"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]},
     "messages.1.content"),
])
def test_message_fields_we_cannot_honour_are_400s(server, message, field):
    body = chat(messages=[{"role": "user", "content": "hi"}, message])
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(field)


def test_the_values_that_ask_for_nothing_are_accepted(server):
    neutral = dict(repetition_penalty=1.0, min_tokens=0, presence_penalty=0, frequency_penalty=0.0,
                   logit_bias={}, use_beam_search=False, stop_token_ids=[], skip_special_tokens=True,
                   include_stop_str_in_output=False, user="someone", metadata={"a": "b"}, store=False)
    assert post(server, "/v1/completions", completion(**neutral)).status_code == 200
    chat_neutral = dict(neutral, response_format={"type": "text"}, tools=[], tool_choice="none",
                        add_generation_prompt=True, parallel_tool_calls=True, modalities=["text"])
    response = post(server, "/v1/chat/completions", chat(**chat_neutral))
    assert response.status_code == 200, response.text
    tool_reply = chat(messages=[{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "ok", "tool_calls": []},
                                {"role": "tool", "content": "42", "tool_call_id": "call-1"}])
    assert post(server, "/v1/chat/completions", tool_reply).status_code == 200


# ----------------------------------------------------------------- stop strings
def test_stop_string_limits_are_400s_naming_the_limit(server):
    from mempath.server.protocol import MAX_STOP_LENGTH, MAX_STOP_STRINGS
    many = [f"stop-{i}" for i in range(MAX_STOP_STRINGS + 1)]
    assert_error(post(server, "/v1/completions", completion(stop=many)), 400, "stop",
                 f"at most {MAX_STOP_STRINGS} stop strings")
    long = "x" * (MAX_STOP_LENGTH + 1)
    assert_error(post(server, "/v1/chat/completions", chat(stop=["ok", long])), 400, "stop",
                 f"at most {MAX_STOP_LENGTH} characters")
    most = ["\u2603" + "ab" * ((MAX_STOP_LENGTH - 1) // 2)] * MAX_STOP_STRINGS
    assert post(server, "/v1/completions", completion(stop=most)).status_code == 200


def test_the_longest_stop_strings_allowed_cut_the_stream_like_the_text(server):
    from mempath.server.protocol import MAX_STOP_LENGTH, MAX_STOP_STRINGS
    base = completion(prompt="def read_config(path):", max_tokens=40, temperature=0, ignore_eos=True)
    text = post(server, "/v1/completions", base).json()["choices"][0]["text"]
    rng = random.Random(1)
    # Never complete (a snowman the model never writes) but their prefixes keep matching.
    stops = ["".join(rng.choice(text) for _ in range(MAX_STOP_LENGTH - 1)) + "\u2603"
             for _ in range(MAX_STOP_STRINGS - 1)]
    stops.append(text[20:24])
    expected = text[:text.find(text[20:24])]
    out = post(server, "/v1/completions", {**base, "stop": stops}).json()["choices"][0]
    assert (out["text"], out["finish_reason"]) == (expected, "stop")
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**base, "stop": stops, "stream": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected


def naive_find_stop(text: str, stops: list[str], new_chars: int):
    """The definition: the earliest-starting stop string whose end lies in the new characters."""
    hits = [(text.find(stop, max(0, len(text) - new_chars - len(stop) + 1)), order, stop)
            for order, stop in enumerate(stops)]
    hits = [(index, order, stop) for index, order, stop in hits if index != -1]
    return min(hits)[::2] if hits else None


def naive_partial(text: str, stops: list[str]) -> int:
    """The longest tail of text that is a proper prefix of some stop string."""
    return max([k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])], default=0)


@settings(max_examples=300, deadline=None)
@given(st.text("ab", min_size=0, max_size=30), st.lists(st.text("ab", min_size=1, max_size=6),
                                                       min_size=1, max_size=4),
       st.integers(1, 8))
def test_find_stop_agrees_with_its_definition(text, stops, new_chars):
    new_chars = min(new_chars, len(text))
    assert find_stop(text, stops, new_chars) == naive_find_stop(text, stops, new_chars)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=12),
       st.lists(st.text("abc", min_size=1, max_size=7), min_size=1, max_size=4))
def test_the_held_back_tail_agrees_with_its_definition(pieces, stops):
    from mempath.engine.detokenizer import StopPrefixes
    tracker, text = StopPrefixes(stops), ""
    for piece in pieces:
        text += piece
        assert tracker.feed(piece) == naive_partial(text, stops), (text, stops)


def test_the_stream_reads_each_character_once():
    """The server's hold-back work per update is the new characters, not the text so far."""
    from mempath.server.app import ChoiceText
    from mempath.server.async_engine import Update
    choice = ChoiceText(["abc" * 80 + "!", "ab!"])
    fed = []
    real_feed = choice.stop_prefixes.feed
    choice.stop_prefixes.feed = lambda chars: fed.append(len(chars)) or real_feed(chars)
    text, shown = "", ""
    for i in range(500):
        text += "abc"[i % 3] * 2
        shown += choice.take(Update("r", "", [], None, text, False, None, 0, 0, 0))
    assert sum(fed) == len(text)
    assert text.startswith(shown) and len(text) - len(shown) < 3 * 80 + 1


# ----------------------------------------------------------------- hang-ups
@pytest.fixture
def server_logs():
    """Every record the server's loggers emit during the test, debug included."""
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("mempath", "uvicorn", "uvicorn.error")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
    logging.getLogger("mempath").setLevel(logging.DEBUG)
    yield records
    for logger, level in zip(loggers, levels):
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_client_hanging_up_mid_upload_is_one_quiet_line(server, server_logs, framing):
    name = "mempath:client_disconnects_total"
    before = counter(server.metrics(), name, stage="upload")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\n")
    head += "Content-Length: 100000\r\n\r\n" if framing == "content-length" else \
        "Transfer-Encoding: chunked\r\n\r\n1000\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode() + b'{"model": "tiny", "prompt": "' + b"x" * 100)
    wait_for(lambda: counter(server.metrics(), name, stage="upload") == before + 1,
             "the hang-up being counted")
    loud = [r for r in server_logs if r.levelno >= logging.INFO or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]
    quiet = [r.getMessage() for r in server_logs if "hung up" in r.getMessage()]
    assert len(quiet) == 1 and "upload" in quiet[0]
    assert post(server, "/v1/completions", completion()).status_code == 200


# ----------------------------------------------------------------- a broken engine
def test_a_failing_engine_step_fails_every_request_in_flight_cleanly(server, monkeypatch):
    engine = server.engine
    admitted = []

    def until_all_four_arrive(e) -> bool:  # all four in flight before any of them steps
        if len(e.outputs.requests) == 4:
            admitted.append(True)
        return not admitted

    gate = StepGate(engine, until_all_four_arrive)
    monkeypatch.setattr(engine, "step", gate.step)
    real_execute = engine.runner.execute
    fired = []

    def execute(*args, **kwargs):
        # After the scheduler gave this step its blocks: the failure must free them too.
        if not fired and len(engine.outputs.requests) == 4 and all(r.num_output_tokens >= 1
                                                          for r in engine.outputs.requests.values()):
            fired.append(True)
            raise RuntimeError("injected step failure")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", execute)
    before = counter(server.metrics(), "mempath:request_success_total", finished_reason="error")
    body = completion(prompt="The quick brown fox", max_tokens=200, ignore_eos=True)

    async def stream(http):
        async with http.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            return [line async for line in r.aiter_lines() if line.startswith("data: ")]

    async def run_all():
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            return await asyncio.gather(stream(http), stream(http), stream(http),
                                        http.post(f"{server.url}/v1/completions", json=body))

    *streams, plain = asyncio.run(run_all())
    assert fired and not gate.timed_out
    error = assert_error(plain, 500, None, "injected step failure")
    assert error["code"] == "generation_failed"
    for events in streams:
        assert events[-1] == "data: [DONE]"
        errors = [json.loads(e[6:]) for e in events[:-1] if '"error"' in e]
        assert len(errors) == 1 and "injected step failure" in errors[0]["error"]["message"]
    m = server.wait_until_idle()
    assert counter(m, "mempath:request_success_total", finished_reason="error") == before + 4
    assert post(server, "/v1/completions", completion()).status_code == 200


def test_a_dead_engine_is_a_503(server):
    dead = AsyncEngine(server.engine, server.app.state.engine_client.metrics)  # never started
    http = TestClient(build_app(dead, "tiny"))
    assert_error(http.get("/health"), 503, None, "not running")
    for path, body in (("/v1/completions", completion()), ("/v1/chat/completions", chat())):
        error = assert_error(http.post(path, json=body), 503, None, "not running")
        assert error["code"] == "engine_unavailable"
    assert_error(http.get("/metrics"), 503, None, "not running")


def test_a_missing_chat_template_is_a_400(server, monkeypatch):
    monkeypatch.setattr(server.app.state.engine_client.tokenizer, "chat_template", None)
    assert_error(post(server, "/v1/chat/completions", chat()), 400, "messages", "no chat template")
    assert post(server, "/v1/completions", completion()).status_code == 200


def test_a_chat_template_that_raises_is_a_400(server, monkeypatch):
    template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}" \
               "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    monkeypatch.setattr(server.app.state.engine_client.tokenizer, "chat_template", template)
    body = chat(messages=[{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])
    assert_error(post(server, "/v1/chat/completions", body), 400, "messages", "no system turns")
    assert post(server, "/v1/chat/completions", chat()).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_sibling_sample_rejected_after_the_first_fails_the_call_cleanly(server, monkeypatch, stream):
    engine = server.engine
    real_add = engine.add_request

    def add_request(prompt, params, request_id=None, **options):
        if request_id.endswith("-1"):  # the second sample, added once the first has a token
            raise ValueError("injected: the second sample does not fit")
        return real_add(prompt, params, request_id, **options)

    monkeypatch.setattr(engine, "add_request", add_request)
    body = completion(n=2, max_tokens=8, ignore_eos=True, stream=stream)
    if not stream:
        assert_error(post(server, "/v1/completions", body), 500, None, "second sample does not fit")
    else:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert any("second sample does not fit" in e for e in events)
    server.wait_until_idle()


# ----------------------------------------------------------------- compressed bodies
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("encoding", ["gzip", "deflate, gzip", "br", "x-custom"])
def test_a_compressed_body_is_a_415_naming_content_encoding(server, path, encoding):
    import gzip
    body = {"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(f"{server.url}{path}", content=gzip.compress(json.dumps(body).encode()), timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json",
                                   "Content-Encoding": encoding})
    error = assert_error(response, 415, None, "Content-Encoding")
    assert "uncompressed" in error["message"] and error["code"] == "unsupported_media_type"


def test_an_identity_content_encoding_is_no_encoding(server):
    for encoding in ("identity", "Identity"):
        response = post(server, "/v1/completions", completion(), **{"Content-Encoding": encoding})
        assert response.status_code == 200, response.text
