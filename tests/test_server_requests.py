"""Request bodies at the edges of what the server takes: OpenAI's nulls, malformed tool choices and
logit_bias keys, numbers that are finite as JSON but not as float32, a constraint that meets
min_tokens, max_tokens past the context, and unknown fields. Each bad body is one 400 naming the
field; each valid one is answered (tests/test_hostile_server.py has the hostile clients)."""
import json
import logging
import threading

import httpx
import pytest

from mempath import LLM, SamplingParams
from mempath.structured import StructuredOutputsParams
from tests.test_server import API_KEY, ENGINE_OPTIONS, MAX_MODEL_LEN, assert_error, serving, tiny_llama

COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
MAX_TOKENS_LIMIT = 200
HI = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_llama(tmp_path_factory, "requests-model")


@pytest.fixture(scope="module")
def server(model_path):
    yield from serving(model_path, max_tokens_limit=MAX_TOKENS_LIMIT)


@pytest.fixture
def idle_after(server):
    yield
    server.wait_until_idle()


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=json.dumps(body).encode(), timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": HI, "max_tokens": 2, **fields}


# ----------------------------------------------------------------- tool_choice's shape
@pytest.mark.parametrize("choice, param, says", [
    ({"type": "function", "function": "f"}, "tool_choice.function", "object"),
    ({"type": "function", "function": ["f"]}, "tool_choice.function", "object"),
    ({"type": "function", "function": {"name": ["f"]}}, "tool_choice.function.name", "string"),
    ({"type": "function", "function": {"name": "g"}}, "tool_choice.function.name", "not in tools"),
    ({"type": "function"}, "tool_choice.function", "object"),
    ({"type": "custom"}, "tool_choice.type", "'function'"),
])
def test_a_malformed_named_tool_choice_is_a_400(server, choice, param, says, idle_after):
    assert_error(post(server, CHAT, chat(tools=TOOLS, tool_choice=choice)), 400, param, says)


@pytest.mark.parametrize("parameters", [[], 0, "", False])
def test_tool_parameters_that_are_no_schema_are_a_400(server, parameters):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    assert_error(post(server, CHAT, chat(tools=tools, tool_choice="required")), 400,
                 "tools.0.function.parameters", "JSON schema object")


# ----------------------------------------------------------------- a grammar that can only end
@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, completion(max_tokens=10, min_tokens=5, guided_choice=["a"])),
    (COMPLETIONS, completion(max_tokens=10, min_tokens=5, guided_choice=["a"], stream=True)),
    (CHAT, chat(max_tokens=60, min_tokens=59, tools=TOOLS, tool_choice={"type": "function",
                                                                        "function": {"name": "f"}})),
    (CHAT, chat(max_tokens=60, min_tokens=59, tools=TOOLS, tool_choice="required")),
])
def test_a_finished_grammar_ends_the_output_before_min_tokens(server, path, body, idle_after):
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    assert "error" not in response.text and "a bug in mempath" not in response.text


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, show_progress=False, **ENGINE_OPTIONS)


def test_the_engine_lets_a_grammar_that_can_only_end_end_before_min_tokens(llm):
    choice = SamplingParams(max_tokens=10, min_tokens=5, temperature=0,
                            structured_outputs=StructuredOutputsParams(choice=["a"]))
    out = llm.generate("Hello", choice, use_tqdm=False)[0]
    assert (out.text, out.finish_reason, out.error) == ("a", "stop", None)
    # A grammar that may go on still has EOS masked until min_tokens are out.
    longer = SamplingParams(max_tokens=10, min_tokens=3, temperature=0,
                            structured_outputs=StructuredOutputsParams(regex="a{1,8}"))
    out = llm.generate("Hello", longer, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and len(out.token_ids) >= 3 and set(out.text) == {"a"}, out


def test_bad_words_that_leave_the_grammar_no_token_fail_that_request_naming_bad_words(llm):
    """The token for "x" is both the one the choice allows and a bad word: nothing is left to sample."""
    conflict = SamplingParams(max_tokens=10, temperature=0, bad_words=["x"],
                              structured_outputs=StructuredOutputsParams(choice=["x"]))
    out, beside = llm.generate(["Hello", "Hello"], [conflict, SamplingParams(max_tokens=4, ignore_eos=True)],
                               use_tqdm=False)
    assert out.finish_reason == "error" and out.error_param == "bad_words", out
    assert out.error.startswith("bad_words rule out every token") and "a bug" not in out.error
    assert beside.finish_reason == "length" and len(beside.token_ids) == 4
    assert llm.engine.kv.pool.num_used == 0


def test_bad_words_that_leave_the_grammar_no_token_are_a_400(server, idle_after):
    body = completion(max_tokens=10, bad_words=["x"], guided_choice=["x"])
    assert_error(post(server, COMPLETIONS, body), 400, "bad_words", "structured output allows")
    streamed = post(server, COMPLETIONS, {**body, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert [e["error"]["param"] for e in events if "error" in e] == ["bad_words"]


def grammar_dead_ends(monkeypatch):
    """Every grammar row allows no token from the second mask on: a constraint this vocabulary cannot go on."""
    from mempath.structured.bitmask import GrammarBitmask
    real_fill, fills = GrammarBitmask.fill, []

    def dead_end(self, grammars):
        real_fill(self, grammars)
        if fills:
            for row, grammar in enumerate(grammars):
                if grammar is not None:
                    self.host_np[row] = 0
        fills.append(len(grammars))
    monkeypatch.setattr(GrammarBitmask, "fill", dead_end)


def test_a_grammar_that_dead_ends_fails_that_request_naming_the_constraint(llm, monkeypatch):
    grammar_dead_ends(monkeypatch)
    out, beside = llm.generate(["Hello", "Hello"], [
        SamplingParams(max_tokens=10, temperature=0, structured_outputs=StructuredOutputsParams(regex="a{5}")),
        SamplingParams(max_tokens=4, ignore_eos=True)], use_tqdm=False)
    assert out.finish_reason == "error" and out.error_param == "structured_outputs", out
    assert out.error.startswith("structured_outputs.regex: the grammar allows no next token"), out.error
    assert beside.finish_reason == "length" and len(beside.token_ids) == 4
    assert llm.engine.kv.pool.num_used == 0


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, completion(max_tokens=10, guided_regex="a{5}"), "guided_regex"),
    (CHAT, chat(max_tokens=10, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}),
     "response_format.json_schema.schema"),
])
def test_a_grammar_that_dead_ends_is_a_400_naming_the_field_sent(server, monkeypatch, path, body, param, idle_after):
    """The client's constraint cannot be continued in this vocabulary: its fault, not the server's (a 500)."""
    grammar_dead_ends(monkeypatch)
    assert_error(post(server, path, body), 400, param, "allows no next token")
    streamed = post(server, path, {**body, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    assert [e["param"] for e in errors] == [param] and errors[0]["message"].startswith(param), errors


# ----------------------------------------------------------------- float32's range
@pytest.mark.parametrize("fields, param", [
    ({"temperature": 1e39}, "temperature"),
    ({"temperature": 1e39, "response_format": {"type": "json_object"}}, "temperature"),
    ({"repetition_penalty": 1e-300, "guided_choice": ["a"]}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"top_p": 1e-46}, "top_p"),
])
def test_numbers_float32_cannot_hold_are_400s_naming_the_range(server, fields, param, idle_after):
    path, body = (CHAT, chat(**fields)) if "response_format" in fields else (COMPLETIONS, completion(**fields))
    assert_error(post(server, path, body), 400, param, "float32")


def test_sampling_params_bound_by_float32():
    for name, value in (("temperature", 3.5e38), ("repetition_penalty", 1e-39), ("repetition_penalty", 1e39),
                        ("top_p", 1e-39)):
        with pytest.raises(ValueError, match=f"^{name} must be in .*float32") as info:
            SamplingParams(**{name: value}).validate(max_logprobs=5)
        assert "\n" not in str(info.value)
    SamplingParams(temperature=3e38, repetition_penalty=1e-37, top_p=1e-37).validate(max_logprobs=5)


# ----------------------------------------------------------------- logit_bias keys
@pytest.mark.parametrize("key", ["²", "--5", "5.0", " 5", "+5", "٥", ""])
def test_logit_bias_keys_are_ascii_token_ids(server, key):
    error = assert_error(post(server, COMPLETIONS, completion(logit_bias={key: 1})), 400, "logit_bias",
                         "logit_bias")
    assert repr(key) in error["message"] and "None" not in error["message"]


def test_logit_bias_naming_one_token_twice_is_a_400(server):
    assert_error(post(server, COMPLETIONS, completion(logit_bias={"5": 1, "05": -1})), 400, "logit_bias",
                 "twice")


# ----------------------------------------------------------------- max_tokens past the context
@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, completion(prompt=[5] * 250, max_tokens=100, ignore_eos=True), "max_tokens"),
    (CHAT, chat(messages=[{"role": "user", "content": "x " * 110}], max_tokens=200), "max_tokens"),
    (CHAT, chat(messages=[{"role": "user", "content": "x " * 110}], max_tokens=None, max_completion_tokens=200),
     "max_completion_tokens"),
    (RESPONSES, {"model": "tiny", "input": "x " * 110, "max_output_tokens": 200}, "max_output_tokens"),
])
def test_max_tokens_past_the_context_is_a_400_as_in_vllm(server, path, body, param, idle_after):
    error = assert_error(post(server, path, body), 400, param, f"'{param}' is too large")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]


def test_a_text_prompt_is_counted_in_tokens(server, idle_after):
    error = assert_error(post(server, COMPLETIONS, completion(prompt="x " * 110, max_tokens=200)), 400,
                         "max_tokens", "input tokens")
    assert f"(200 > {MAX_MODEL_LEN} - " in error["message"]
    fits = post(server, COMPLETIONS, completion(prompt=[5] * 250, max_tokens=6, ignore_eos=True))
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 6
    unasked = post(server, COMPLETIONS, completion(prompt=[5] * 250, max_tokens=None, ignore_eos=True))
    assert unasked.status_code == 200 and unasked.json()["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("path, body, param", [
    (CHAT, chat(messages=[{"role": "user", "content": "hello " * 400}], max_tokens=None), "messages"),
    (RESPONSES, {"model": "tiny", "input": "hello " * 400}, "input"),
])
def test_a_chat_or_responses_prompt_too_long_names_its_field(server, path, body, param):
    assert_error(post(server, path, body), 400, param, "maximum context length")


def test_the_limit_names_the_field_the_client_sent(server):
    assert_error(post(server, CHAT, chat(max_tokens=None, max_completion_tokens=10 ** 6)), 400,
                 "max_completion_tokens", "--max-tokens-limit")
    assert_error(post(server, RESPONSES, {"model": "tiny", "input": "hi", "max_output_tokens": 10 ** 6}), 400,
                 "max_output_tokens", "--max-tokens-limit")


def test_the_offline_llm_still_caps_max_tokens_at_the_context(llm):
    out = llm.generate([5] * 250, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == MAX_MODEL_LEN - 250


# ----------------------------------------------------------------- null is the default
@pytest.mark.parametrize("path, fields", [
    (COMPLETIONS, {"n": None}), (COMPLETIONS, {"temperature": None}), (COMPLETIONS, {"echo": None}),
    (COMPLETIONS, {"stream": None}), (COMPLETIONS, {"top_p": None, "seed": None, "stop": None, "user": None}),
    (COMPLETIONS, {"presence_penalty": None, "frequency_penalty": None, "logit_bias": None, "logprobs": None}),
    (COMPLETIONS, {"best_of": None, "suffix": None, "max_tokens": None, "stream_options": None}),
    (CHAT, {"top_p": None}), (CHAT, {"stream": None}), (CHAT, {"logprobs": None}),
    (CHAT, {"parallel_tool_calls": None}), (CHAT, {"top_logprobs": None, "max_completion_tokens": None}),
    (CHAT, {"tools": None, "tool_choice": None, "response_format": None, "n": None, "temperature": None}),
    (RESPONSES, {"temperature": None, "top_p": None, "stream": None, "max_output_tokens": None}),
])
def test_null_is_the_default(server, path, fields, idle_after):
    body = {"model": "tiny", "input": "Hi"} if path == RESPONSES else (
        completion(**fields) if path == COMPLETIONS else chat(**fields))
    body.update(fields)
    response = post(server, path, body)
    assert response.status_code == 200, response.text


def test_null_include_usage_is_the_default(server, idle_after):
    response = post(server, COMPLETIONS, completion(stream=True, stream_options={"include_usage": None}))
    assert response.status_code == 200 and "[DONE]" in response.text and '"usage"' not in response.text


def test_null_in_a_required_field_is_still_a_400(server):
    assert_error(post(server, COMPLETIONS, completion(prompt=None)), 400, "prompt")
    assert_error(post(server, CHAT, chat(messages=None)), 400, "messages")


# ----------------------------------------------------------------- naming the right field
def test_top_logprobs_over_the_limit_names_top_logprobs(server):
    assert_error(post(server, CHAT, chat(logprobs=True, top_logprobs=100)), 400, "top_logprobs",
                 "top_logprobs must be in [0, 20]")


@pytest.mark.parametrize("fields, param, says", [
    ({"json_object": "yes"}, "structured_outputs.json_object", "boolean"),
    ({"json_object": 1}, "structured_outputs.json_object", "boolean"),
    ({"regex": "a+", "disable_any_whitespace": "no"}, "structured_outputs.disable_any_whitespace", "boolean"),
])
def test_structured_outputs_flags_must_be_booleans(server, fields, param, says):
    assert_error(post(server, COMPLETIONS, completion(structured_outputs=fields)), 400, param, says)


def test_a_bad_structured_outputs_field_is_named_once(server):
    error = assert_error(post(server, COMPLETIONS, completion(structured_outputs={"json": 5})), 400,
                         "structured_outputs.json", "structured_outputs.json must be")
    assert "json.json" not in error["message"]


@pytest.mark.parametrize("part, kind", [
    ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "image_url"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio"),
])
def test_image_and_audio_parts_are_refused_by_name(server, part, kind):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]
    error = assert_error(post(server, CHAT, chat(messages=messages)), 400, "messages.0.content.1.type",
                         f"{kind} content parts are not supported by this server")
    assert "valid string" not in error["message"]


def test_an_image_input_part_is_refused_by_name(server):
    body = {"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}
    assert_error(post(server, RESPONSES, body), 400, "input.0.content.0.type",
                 "input_image content parts are not supported by this server")


# ----------------------------------------------------------------- unknown fields
def test_unknown_fields_are_ignored_with_one_warning_naming_them(server, caplog, idle_after):
    with caplog.at_level(logging.WARNING, logger="mempath.server.protocol"):
        response = post(server, COMPLETIONS, completion(max_tokenz=5, service_tier="auto", n=1))
        assert response.status_code == 200
        assert post(server, CHAT, chat(stream_options=None)).status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warnings == ["The following fields were present in the request but ignored: "
                        "{'max_tokenz', 'service_tier'}"]


# ----------------------------------------------------------------- tokenizing off the event loop
HELD = "a prompt the test holds in the tokenizer"


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"model": "tiny", "prompt": HELD, "max_tokens": 2}),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": HELD}], "max_tokens": 2}),
    (RESPONSES, {"model": "tiny", "input": HELD, "max_output_tokens": 2}),
    ("/tokenize", {"model": "tiny", "prompt": HELD}),
])
def test_a_prompt_in_the_tokenizer_holds_up_no_other_request(server, monkeypatch, idle_after, path, body):
    """A long prompt's tokenization (hundreds of ms at 100k tokens) must not stop the event loop, which
    streams every other request's tokens: here the tokenizer is held until /health has been answered."""
    tokenizer = server.app.state.engine_client.tokenizer
    entered, release = threading.Event(), threading.Event()
    encode = tokenizer.encode

    def held_encode(text, *args, **kwargs):
        if HELD in text:
            entered.set()
            release.wait(30)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", held_encode)
    answers = []
    thread = threading.Thread(target=lambda: answers.append(post(server, path, body)))
    thread.start()
    try:
        assert entered.wait(30), "the request never reached the tokenizer"
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    finally:
        release.set()
        thread.join(60)
    assert answers and answers[0].status_code == 200, answers and answers[0].text


# ----------------------------------------------------------------- structured-output objects: no key dropped
@pytest.mark.parametrize("fields, param, says", [
    ({"response_format": {"type": "json_object", "schema": {"type": "object", "required": ["zzz"]}}},
     "response_format.schema", "json_object takes no schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
     "response_format.json_schema", "json_object takes no schema"),
    ({"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format.json_schema", "text takes no schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}, "strict": True}},
     "response_format.strict", "json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strickt": True}}},
     "response_format.json_schema.strickt", "'strict'"),
    ({"structured_outputs": {"regex": "ab", "regx": "zz"}}, "structured_outputs.regx", "'regex'"),
    ({"structured_outputs": {"choice": ["yes"], "backend": "outlines"}}, "structured_outputs.backend",
     "disable_any_whitespace"),
])
def test_unknown_keys_of_a_structured_output_object_are_400s(server, fields, param, says):
    error = assert_error(post(server, COMPLETIONS, completion(**fields)), 400, param, says)
    assert param in error["message"]


def test_a_json_schema_without_its_schema_is_a_400(server):
    for spec in ({"name": "x"}, {"name": "x", "schema": None}):
        body = completion(response_format={"type": "json_schema", "json_schema": spec})
        error = assert_error(post(server, COMPLETIONS, body), 400, "response_format.json_schema.schema", "schema")
        assert "{}" in error["message"]  # the fix: {} for any JSON value
    body = completion(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}})
    assert_error(post(server, COMPLETIONS, body), 400, "response_format.json_schema.schema", "object")


def test_an_empty_json_schema_is_any_json_value_not_an_object(server, idle_after):
    from mempath.server.protocol import CompletionRequest, parse_request
    from mempath.server.structured_request import structured_request
    body = completion(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}})
    assert structured_request(parse_request(CompletionRequest, json.dumps(body).encode())).params.json == {}
    response = post(server, COMPLETIONS, {**body, "prompt": "x = ", "max_tokens": 8})
    assert response.status_code == 200, response.text


# ----------------------------------------------------------------- chat messages
@pytest.mark.parametrize("role", ["user", "system", "developer", "tool", "assistant"])
@pytest.mark.parametrize("content", ["missing", None, []])
def test_a_message_without_content_is_a_400(server, role, content):
    message = {"role": role} if content == "missing" else {"role": role, "content": content}
    messages = [{"role": "user", "content": "hi"}, message]
    assert_error(post(server, CHAT, chat(messages=messages)), 400, "messages.1.content", "content")
    assert_error(post(server, "/tokenize", {"model": "tiny", "messages": messages}), 400, "messages.1.content",
                 "content")


def test_an_assistant_message_with_tool_calls_may_leave_content_out(server, idle_after):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for content in ("missing", None, []):
        assistant = {"role": "assistant", "tool_calls": [call]}
        if content != "missing":
            assistant["content"] = content
        messages = HI + [assistant, {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
        response = post(server, CHAT, chat(messages=messages))
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("call, param", [
    ({}, "messages.1.tool_calls.0.function"),
    ("call_1", "messages.1.tool_calls.0"),
    ({"type": "function", "function": "f"}, "messages.1.tool_calls.0.function"),
    ({"type": "custom", "function": {"name": "f", "arguments": "{}"}}, "messages.1.tool_calls.0.type"),
    ({"type": "function", "function": {"arguments": "{}"}}, "messages.1.tool_calls.0.function.name"),
    ({"type": "function", "function": {"name": "f"}}, "messages.1.tool_calls.0.function.arguments"),
    ({"type": "function", "function": {"name": "f", "arguments": [1]}},
     "messages.1.tool_calls.0.function.arguments"),
])
def test_a_malformed_assistant_tool_call_is_a_400_naming_it(server, call, param):
    messages = HI + [{"role": "assistant", "content": "x", "tool_calls": [call]}]
    error = assert_error(post(server, CHAT, chat(messages=messages)), 400, param, param)
    assert "dict object" not in error["message"] and "template" not in error["message"]


@pytest.mark.parametrize("arguments", ["{}", {"a": 1}])
def test_a_replayed_tool_call_may_leave_its_type_out_and_give_its_arguments_as_an_object(server, idle_after,
                                                                                          arguments):
    """function is the only type of tool call, so a client that drops it still means one; the arguments may
    be JSON text (OpenAI's) or their object (vLLM takes it: Hugging Face templates render a dict)."""
    call = {"id": "call_1", "function": {"name": "f", "arguments": arguments}}
    messages = HI + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    response = post(server, CHAT, chat(messages=messages))
    assert response.status_code == 200, response.text


def test_unknown_message_and_part_keys_are_ignored_with_the_warning(server, caplog, idle_after):
    """As unknown top-level fields are (vLLM's rule): ignored, named in the request's one warning."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi", "extra": 1}], "weird": True}]
    with caplog.at_level(logging.WARNING, logger="mempath.server.protocol"):
        assert post(server, CHAT, chat(messages=messages, service_tier="auto")).status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warnings == ["The following fields were present in the request but ignored: "
                        "{'messages.0.content.0.extra', 'messages.0.weird', 'service_tier'}"]


STRICT_ROLES = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                "{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
                "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")


@pytest.mark.parametrize("template, shown", [
    (STRICT_ROLES, "[system] be brief"),  # no developer turns: sent as system
    (STRICT_ROLES.replace("'assistant'", "'assistant', 'developer'"), "[developer] be brief"),
])
def test_a_developer_message_is_a_system_message_where_the_template_has_no_developer_role(
        server, monkeypatch, template, shown, idle_after):
    tokenizer = server.app.state.engine_client.tokenizer
    monkeypatch.setattr(tokenizer, "chat_template", template)
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    tokens = post(server, "/tokenize", {"model": "tiny", "messages": messages})
    assert tokens.status_code == 200, tokens.text
    assert shown in tokenizer.decode(tokens.json()["tokens"])
    assert post(server, CHAT, chat(messages=messages)).status_code == 200
    response = post(server, RESPONSES, {"model": "tiny", "max_output_tokens": 2, "input": messages})
    assert response.status_code == 200, response.text


def test_unknown_input_item_and_part_keys_of_a_response_are_ignored_with_the_warning(server, caplog, idle_after):
    """/v1/responses names them as /v1/chat/completions does: a replayed output item's id and status, a
    part's annotations."""
    item = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": "hello", "annotations": []}]}
    body = {"model": "tiny", "input": [{"role": "user", "content": "hi"}, item], "max_output_tokens": 2}
    with caplog.at_level(logging.WARNING, logger="mempath.server.protocol"):
        response = post(server, RESPONSES, body)
    assert response.status_code == 200, response.text
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warnings == ["The following fields were present in the request but ignored: "
                        "{'input.1.content.0.annotations', 'input.1.id', 'input.1.status'}"]


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, completion(prompt="caf\ud800")),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "caf\ud800"}], "max_tokens": 2}),
    (RESPONSES, {"model": "tiny", "input": "caf\ud800", "max_output_tokens": 2}),
])
def test_an_unpaired_surrogate_escape_is_a_400(server, path, body, idle_after):
    """JSON may escape half of a surrogate pair (\\ud800): Python's json takes it, no tokenizer does; the body's
    parser refuses it."""
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert "not valid JSON" in response.json()["error"]["message"] and "hex escape" in response.json()["error"]["message"]
    assert post(server, COMPLETIONS, completion()).status_code == 200


def test_text_parts_are_joined_by_a_newline_as_vllm_joins_them(server):
    """The server joined a message's text parts with nothing between them ("Hello" + "world" was "Helloworld")."""
    def prompt_tokens(content) -> int:
        response = post(server, CHAT, chat(messages=[{"role": "user", "content": content}], max_tokens=1))
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]
    assert prompt_tokens("Hello\nworld") != prompt_tokens("Helloworld")  # the count tells the two apart
    assert prompt_tokens([{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]) == \
        prompt_tokens("Hello\nworld")


@pytest.mark.parametrize("path, body", [(COMPLETIONS, completion), (CHAT, chat)])
def test_unknown_stream_options_are_named_in_the_ignored_warning(server, caplog, idle_after, path, body):
    """stream_options' unknown keys were dropped without the warning the top level's get."""
    with caplog.at_level(logging.WARNING, logger="mempath.server.protocol"):
        response = post(server, path, body(stream=True, stream_options={"include_usage": True, "foo": 1}))
        assert response.status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warnings == ["The following fields were present in the request but ignored: {'stream_options.foo'}"]


@pytest.mark.parametrize("path, body, param, says", [
    (CHAT, chat(messages=[{"role": "user", "content": [{"text": "hi"}]}]), "messages.0.content.0.type",
     "Field required"),
    (RESPONSES, {"model": "tiny", "input": [{"role": "tool", "content": "x"}]}, "input.0.role", "'tool'"),
    (COMPLETIONS, completion(prompt=[1, "a"]), "prompt.1", "valid integer"),  # not item 0, a valid token id
])
def test_a_list_where_a_string_or_a_list_goes_is_named_by_its_own_error(server, path, body, param, says):
    """A union's first alternative named the error: a list given where str | list goes was told it is no string."""
    error = assert_error(post(server, path, body), 400, param, says)
    assert "valid string" not in error["message"]


# ----------------------------------------------------------------- a prompt that fills the context
def user_message_of(tokenizer, num_tokens: int) -> list[dict]:
    """One user message whose chat-templated prompt is exactly ``num_tokens`` tokens."""
    from mempath.server.calls import render_messages
    for words in range(num_tokens):
        for content in ("x " * words, "x " * words + "x"):
            messages = [{"role": "user", "content": content}]
            if len(render_messages(tokenizer, messages)) == num_tokens:
                return messages
    raise AssertionError(f"no message of {num_tokens} tokens")


def context_bodies(server, num_tokens: int, max_tokens: int | None) -> list[tuple[str, dict, str]]:
    """(path, body, the prompt's field) of a completion, a chat and a response whose prompts are num_tokens long."""
    messages = user_message_of(server.app.state.engine_client.tokenizer, num_tokens)
    return [(COMPLETIONS, completion(prompt=[5] * num_tokens, max_tokens=max_tokens), "prompt"),
            (CHAT, chat(messages=messages, max_tokens=max_tokens), "messages"),
            (RESPONSES, {"model": "tiny", "input": messages[0]["content"], "max_output_tokens": max_tokens}, "input")]


@pytest.mark.parametrize("max_tokens", [None, 1])
def test_a_prompt_of_max_model_len_tokens_is_a_400_naming_its_length_as_vllm_refuses_it(server, max_tokens):
    """It leaves no room for one token: it was taken without max_tokens (and given one token past the
    context), and refused with max_tokens 1 as if max_tokens were the problem."""
    for path, body, param in context_bodies(server, MAX_MODEL_LEN, max_tokens):
        error = assert_error(post(server, path, body), 400, param, f"has {MAX_MODEL_LEN} tokens")
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"], path
        assert "shorten" in error["message"] and "too large" not in error["message"], path


def test_a_prompt_one_token_short_of_the_context_gets_one_token(server, idle_after):
    for path, body, _ in context_bodies(server, MAX_MODEL_LEN - 1, None):
        response = post(server, path, body)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        output = usage["output_tokens"] if path == RESPONSES else usage["completion_tokens"]
        assert output == 1, (path, usage)


# ----------------------------------------------------------------- completions' top_logprobs
def completion_logprobs_of(response: httpx.Response, stream: bool) -> dict:
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"][0]["logprobs"]
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                for key in merged:
                    merged[key] += (choice["logprobs"] or {}).get(key, [])
    return merged


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("num", [0, 2])
def test_completion_top_logprobs_hold_the_sampled_token_as_openai_says(server, stream, num, idle_after):
    """"The API will always return the logprob of the sampled token, so there may be up to logprobs+1 elements"
    (vLLM's too): logprobs 0 gave [{}, {}, ...], and a sampled token outside the top n was left out."""
    body = completion(prompt="Hello", max_tokens=12, logprobs=num, seed=7, ignore_eos=True, stream=stream)
    logprobs = completion_logprobs_of(post(server, COMPLETIONS, body), stream)
    assert len(logprobs["tokens"]) == 12
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert top.get(token) == pytest.approx(value), (token, top)
        assert len(top) <= num + 1
    assert any(len(top) == num + 1 for top in logprobs["top_logprobs"])  # a sampled token outside the top n


def test_chat_top_logprobs_stay_the_top_n(server, idle_after):
    response = post(server, CHAT, chat(max_tokens=6, logprobs=True, top_logprobs=0, seed=7, ignore_eos=True))
    assert response.status_code == 200, response.text
    assert [entry["top_logprobs"] for entry in response.json()["choices"][0]["logprobs"]["content"]] == [[]] * 6


# ----------------------------------------------------------------- fields /v1/responses does not drop
def response_text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["output"][0]["content"][0]["text"]


def chat_text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("fields, param, says", [
    ({"max_tokens": 5}, "max_tokens", "use max_output_tokens"),
    ({"max_completion_tokens": 5}, "max_completion_tokens", "use max_output_tokens"),
    ({"n": 2}, "n", "one output"),
    ({"logprobs": 2}, "logprobs", "/v1/completions"),
    ({"min_p": 0.1}, "min_p", "/v1/chat/completions"),
    ({"presence_penalty": 1.0}, "presence_penalty", "/v1/chat/completions"),
    ({"response_format": {"type": "json_object"}}, "response_format", "/v1/chat/completions"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output", "leave it out"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", "stream is true"),
])
def test_a_field_responses_would_drop_is_a_400_naming_it(server, fields, param, says):
    assert_error(post(server, RESPONSES, {"model": "tiny", "input": "Hi", **fields}), 400, param, says)


def test_responses_honours_vllms_seed_top_k_stop_and_ignore_eos(server, idle_after):
    """vLLM's extensions of /v1/responses were dropped: the seed, top_k, stop, ignore_eos asked for nothing."""
    seeded = dict(seed=11, ignore_eos=True)
    answer = response_text(post(server, RESPONSES, {"model": "tiny", "input": "Hi", "max_output_tokens": 8,
                                                    **seeded}))
    assert answer == chat_text(post(server, CHAT, chat(max_tokens=8, **seeded)))
    greedy = chat_text(post(server, CHAT, chat(max_tokens=8, temperature=0, ignore_eos=True)))
    top_1 = post(server, RESPONSES, {"model": "tiny", "input": "Hi", "max_output_tokens": 8, "top_k": 1,
                                     "ignore_eos": True})
    assert response_text(top_1) == greedy and top_1.json()["usage"]["output_tokens"] == 8
    stop = greedy[3:5]
    cut = greedy[:greedy.index(stop)]
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 8, "temperature": 0, "stop": stop}
    assert response_text(post(server, RESPONSES, body)) == cut
    streamed = post(server, RESPONSES, {**body, "stream": True})
    deltas = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["delta"] for e in deltas if e["type"] == "response.output_text.delta") == cut


def test_responses_takes_stream_options_and_ignores_unknown_fields_with_the_warning(server, caplog, idle_after):
    """stream_options is OpenAI's (include_obfuscation: padding, not the answer); service_tier changes nothing
    here: ignored and named, as on the other routes."""
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 2, "stream": True,
            "stream_options": {"include_obfuscation": False}, "service_tier": "auto"}
    with caplog.at_level(logging.WARNING, logger="mempath.server.protocol"):
        response = post(server, RESPONSES, body)
    assert response.status_code == 200 and "response.completed" in response.text
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warnings == ["The following fields were present in the request but ignored: {'service_tier'}"]


def test_chat_refuses_best_of_as_completions_does(server, idle_after):
    for path, body in ((CHAT, chat(best_of=4)), (COMPLETIONS, completion(best_of=4))):
        assert_error(post(server, path, body), 400, "best_of", "use n")
    assert post(server, CHAT, chat(best_of=1)).status_code == 200


# ----------------------------------------------------------------- a batch with a bad prompt
def test_a_batch_with_a_bad_later_prompt_runs_none_of_its_prompts(server, idle_after):
    """The 400 came, but the earlier prompts had been admitted and had run (prompt and generated tokens, an abort)."""
    before = server.wait_until_idle()
    body = completion(prompt=[[5, 6] * 30, [99999]], max_tokens=100, n=2, ignore_eos=True)
    assert_error(post(server, COMPLETIONS, body), 400, "prompt", "outside the vocabulary")
    after = server.wait_until_idle()
    for name in ("mempath:prompt_tokens_total", "mempath:generation_tokens_total"):
        assert after[(name, ())] == before[(name, ())], name
    aborts = (("finished_reason", "abort"),)
    assert after.get(("mempath:request_success_total", aborts), 0) == before.get(
        ("mempath:request_success_total", aborts), 0)


def test_every_prompt_of_a_valid_batch_still_runs(server, idle_after):
    body = completion(prompt=[[5, 6] * 30, [7, 8]], max_tokens=3, n=2, ignore_eos=True)
    response = post(server, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == [0, 1, 2, 3]
    assert response.json()["usage"]["completion_tokens"] == 12


# ----------------------------------------------------------------- mempath serve NAME=DIR
def served_as(monkeypatch, argv: list[str]) -> dict:
    """What `mempath serve ARGV` passes build_server_app: {"model": ..., "served": ...}, the engine loaded nowhere."""
    from mempath.cli import main
    from mempath.server import app as server_app
    from mempath.server import cli
    built = {}

    def build(model, engine_options, served_model_name=None, *args, **kwargs):
        built.update(model=model, served=served_model_name)
        return "app", served_model_name or "directory name"
    monkeypatch.setattr(cli, "build_server_app", build)
    monkeypatch.setattr(server_app, "serve", lambda app, *args, **kwargs: None)
    built["code"] = main(["serve", *argv, "--port", "0"])
    return built


def test_serve_one_model_as_name_equals_dir_serves_it_under_that_name(monkeypatch, tmp_path):
    assert served_as(monkeypatch, [f"tiny={tmp_path}"]) == {"model": str(tmp_path), "served": "tiny", "code": 0}
    assert served_as(monkeypatch, [f"tiny={tmp_path}", "--served-model-name", "tiny"])["served"] == "tiny"
    assert served_as(monkeypatch, [str(tmp_path)]) == {"model": str(tmp_path), "served": None, "code": 0}
    odd = tmp_path / "a=b"  # an existing directory whose name holds '=' is a path
    odd.mkdir()
    assert served_as(monkeypatch, [str(odd)])["model"] == str(odd)


def test_serve_name_equals_dir_and_another_served_model_name_is_one_line(monkeypatch, tmp_path, capsys):
    assert served_as(monkeypatch, [f"tiny={tmp_path}", "--served-model-name", "other"]) == {"code": 2}
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'tiny'" in err and "'other'" in err and "name each model once" in err


@pytest.fixture(scope="module")
def two_model_server(two_models):
    from mempath.multi.http import build_multi_server_app
    from tests.test_multi_model_server import MultiModelServer
    llama, qwen = two_models
    app, names = build_multi_server_app([f"small={llama}", f"other={qwen}"], {"dtype": "float32",
                                        "num_gpu_blocks_override": 24}, None, 0.25, API_KEY, {}, False, 30.0,
                                        None, None, {"bind_host": "127.0.0.1"})
    running = MultiModelServer(app, names[0])
    yield running
    running.stop()


@pytest.mark.parametrize("path, extra", [(COMPLETIONS, {}),
                                         ("/v1/pipelines", {"then": {"model": "other", "template": "{output}"}})])
def test_a_batch_with_a_bad_later_prompt_runs_none_of_it_among_several_models(two_model_server, path, extra):
    """Each model's requests (and a pipeline's first model's) are checked by that model's engine."""
    before = two_model_server.wait_until_idle()
    body = {"model": "small", "prompt": [[5, 6] * 30, [99999]], "max_tokens": 50, "ignore_eos": True, **extra}
    assert_error(post(two_model_server, path, body), 400, "prompt", "outside the vocabulary")
    after = two_model_server.wait_until_idle()
    for name in ("mempath:prompt_tokens_total", "mempath:generation_tokens_total"):
        assert after[(name, ())] == before[(name, ())], name
    fine = post(two_model_server, path, {**body, "prompt": [[5, 6] * 30, [7, 8]], "max_tokens": 2})
    assert fine.status_code == 200 and len(fine.json()["choices"]) == 2, fine.text


def test_a_pool_smaller_than_max_model_len_caps_the_default_output_and_start_up_says_so(model_path, caplog):
    """Chat and /v1/responses default max_tokens to what max_model_len leaves: with a pool of fewer tokens every
    request that left it out was refused, told to lower a max_tokens it never sent, and start-up said nothing."""
    from fastapi.testclient import TestClient

    from mempath.server.cli import build_server_app
    options = dict(device="cpu", max_model_len=512, num_gpu_blocks_override=8, block_size=16)
    with caplog.at_level(logging.WARNING, logger="mempath"):
        app, _ = build_server_app(model_path, options, served_model_name="tiny", show_progress=False)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("128 tokens" in m and "max_model_len 512" in m and "--max-model-len 128, or raise "
               "num_gpu_blocks_override" in m for m in warned)
    with TestClient(app) as client:
        answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "temperature": 0, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 128  # the whole pool, no more
        answer = client.post("/v1/responses", json={"input": "hi", "temperature": 0, "ignore_eos": True})
        assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_stop_string_that_ended_the_output_is_its_stop_reason(server, path, idle_after):
    """vLLM's choices carry stop_reason: the stop string (or token id) that ended them, null otherwise."""
    fields = dict(max_tokens=12, temperature=0, ignore_eos=True)
    body = completion(**fields) if path == COMPLETIONS else chat(**fields)
    first = post(server, path, body).json()["choices"][0]
    text = first["text"] if path == COMPLETIONS else first["message"]["content"]
    assert first["stop_reason"] is None and first["finish_reason"] == "length" and len(text) > 3
    stop = text[1:3]
    cut = post(server, path, {**body, "stop": [stop]}).json()["choices"][0]
    assert (cut["finish_reason"], cut["stop_reason"]) == ("stop", stop)
    assert (cut["text"] if path == COMPLETIONS else cut["message"]["content"]) == text[:text.find(stop)]
    streamed = post(server, path, {**body, "stop": [stop], "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    last = [c for e in events for c in e["choices"] if c["finish_reason"] is not None]
    assert [(c["finish_reason"], c["stop_reason"]) for c in last] == [("stop", stop)]
