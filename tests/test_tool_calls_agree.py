"""A tool-call answer streamed is the same answer as sent whole: the same content text, the same calls, the
same finish_reason, whatever the model wrote and wherever the stream cut it.

What the model writes is forced with ``guided_choice`` (which tool_choice auto allows), so the shipped
mempath-tiny can write the awkward outputs a tool-trained model writes: text after its calls, a malformed
call after a good one, a JSON answer that has a "name" key, two calls where one was asked for. The
parsers' rules are checked again without a server, over many ways of cutting the text into deltas.
"""
import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from mempath.assets import ASSETS, DEFAULT_MODEL
from mempath.server.cli import build_server_app
from mempath.server.protocol import ChatCompletionRequest
from mempath.server.tool_choice import ToolStream, plan_tools, tool_message
from tests.test_tool_calls import ASK, PERSON, TIME, WEATHER

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
OSLO = ("get_weather", '{"city": "Oslo", "unit": "celsius"}')
CET = ("get_time", '{"zone": "CET"}')
NAMED = {"type": "function", "function": {"name": "get_weather"}}

# (what the model writes, the content and calls both answers must have, their finish_reason)
HERMES_OUTPUTS = [
    ("Sunny in Oslo.", "Sunny in Oslo.", [], "stop"),
    ("Let me check.\n" + CALL, "Let me check.", [OSLO], "tool_calls"),
    (CALL + "\n" + TIME_CALL, None, [OSLO, CET], "tool_calls"),
    # text after the calls is content, the calls kept
    (CALL + "\nLet me know if you need more.", "Let me know if you need more.", [OSLO], "tool_calls"),
    ("Checking.\n" + CALL + "\nDone.", "Checking.\nDone.", [OSLO], "tool_calls"),
    # a malformed call after a good one: the good one kept, the rest content
    (CALL + "\n<tool_call>oops</tool_call>", "<tool_call>oops</tool_call>", [OSLO], "tool_calls"),
    # no call at all: the text exactly as written, spaces included
    ("Hello there  <tool_call>oops</tool_call>  ", "Hello there  <tool_call>oops</tool_call>  ", [], "stop"),
    ("  Indented, then <tool_", "  Indented, then <tool_", [], "stop"),
    # not calls of this request: a function it has no tool for, a call without arguments
    ('<tool_call>{"name": "Bob", "arguments": {}}</tool_call>', '<tool_call>{"name": "Bob", "arguments": {}}'
     "</tool_call>", [], "stop"),
    ('<tool_call>{"name": "get_weather"}</tool_call>', '<tool_call>{"name": "get_weather"}</tool_call>', [],
     "stop"),
]


@pytest.fixture(scope="module")
def hermes():
    app, _ = build_server_app(str(ASSETS / DEFAULT_MODEL), dict(device="cpu", max_num_seqs=16),
                              served_model_name="tiny", show_progress=False, enable_auto_tool_choice=True)
    with TestClient(app) as client:
        yield client


@pytest.fixture(scope="module")
def llama3():
    app, _ = build_server_app(str(ASSETS / DEFAULT_MODEL), dict(device="cpu", max_num_seqs=16),
                              served_model_name="tiny", show_progress=False, enable_auto_tool_choice=True,
                              tool_call_parser="llama3_json")
    with TestClient(app) as client:
        yield client


def whole_and_streamed(client, **body) -> tuple[tuple, tuple]:
    """The choice as (content, [(name, arguments)], finish_reason), sent whole and rebuilt from its stream."""
    body = {"model": "tiny", "messages": ASK, "max_tokens": 100, "temperature": 0, "tools": [WEATHER, TIME],
            **body}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    message = choice["message"]
    whole = (message["content"], [(c["function"]["name"], c["function"]["arguments"])
                                  for c in message.get("tool_calls") or []], choice["finish_reason"])
    stream = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert stream.status_code == 200, stream.text
    content, calls, finish = "", {}, None
    for line in stream.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for streamed_choice in json.loads(line[len("data: "):])["choices"]:
            finish = streamed_choice["finish_reason"] or finish
            delta = streamed_choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                name, arguments = calls.get(call["index"], ("", ""))
                calls[call["index"]] = (name + (call["function"].get("name") or ""),
                                        arguments + (call["function"].get("arguments") or ""))
    return whole, (content or None, [calls[i] for i in sorted(calls)], finish)


@pytest.mark.parametrize("written, content, calls, finish", HERMES_OUTPUTS)
def test_hermes_answers_agree_streamed_or_not(hermes, written, content, calls, finish):
    whole, streamed = whole_and_streamed(hermes, guided_choice=[written])
    assert whole == (content, calls, finish)
    assert streamed == whole


def test_without_parallel_calls_only_the_first_call_comes_back(hermes):
    whole, streamed = whole_and_streamed(hermes, guided_choice=[CALL + "\n" + TIME_CALL], parallel_tool_calls=False)
    assert whole == (None, [OSLO], "tool_calls")
    assert streamed == whole


@pytest.mark.parametrize("body", [dict(tool_choice="required"), dict(guided_choice=["Let me check.\n" + CALL])])
def test_cut_off_by_max_tokens_the_unfinished_call_is_content(hermes, body):
    whole, streamed = whole_and_streamed(hermes, max_tokens=4, **body)
    content, calls, finish = whole
    assert finish == "length" and calls == [] and content
    assert streamed == whole


def test_a_named_call_cut_off_by_max_tokens_is_the_call_so_far(hermes):
    """As in vLLM: the grammar writes only the named function's arguments, streamed as they are written; the
    answer sent whole was content, the streamed one a call."""
    whole, streamed = whole_and_streamed(hermes, max_tokens=4, tool_choice=NAMED)
    content, calls, finish = whole
    assert content is None and finish == "length" and [name for name, _ in calls] == ["get_weather"]
    assert calls[0][1].startswith('{"') and not calls[0][1].endswith('}')  # cut short
    assert streamed == whole


def test_a_complete_call_before_the_cut_is_kept(hermes):
    first = hermes.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, "tools": [WEATHER, TIME],
                                                      "guided_choice": [CALL + "\n"], "max_tokens": 100})
    cut = first.json()["usage"]["completion_tokens"] + 4  # a few tokens into the second call
    whole, streamed = whole_and_streamed(hermes, guided_choice=[CALL + "\n" + TIME_CALL], max_tokens=cut)
    content, calls, finish = whole
    assert calls == [OSLO] and finish == "length" and content and TIME_CALL.startswith(content)
    assert streamed == whole


@pytest.mark.parametrize("written, content, calls", [
    ('{"name": "Bob", "age": 30}', '{"name": "Bob", "age": 30}', []),  # an answer with a "name" key is no call
    ('{"name": "get_weather", "city": "Oslo"}', '{"name": "get_weather", "city": "Oslo"}', []),  # no arguments
    ('{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}', None, [OSLO]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "Bob", "parameters": {}}',
     '{"name": "Bob", "parameters": {}}', [CET]),
])
def test_llama3_json_calls_are_calls_of_the_request_tools(llama3, written, content, calls):
    whole, streamed = whole_and_streamed(llama3, guided_choice=[written])
    assert whole == (content, calls, "tool_calls" if calls else "stop")
    assert streamed == whole


def test_a_structured_answer_with_a_name_key_is_content(llama3):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole, streamed = whole_and_streamed(llama3, response_format=rf, max_tokens=60)
    content, calls, finish = whole
    assert calls == [] and finish == "stop" and set(json.loads(content)) == {"name", "age"}
    assert streamed == whole


# ----------------------------------------------------------------- the same rules without a server
def plan_for(parser: str, **body):
    request = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER, TIME], **body})
    return plan_tools(request, parser, auto_tool_choice=True)


def streamed_answer(plan, text: str, cuts: list[int], reason: str) -> tuple:
    """``text`` sent as deltas cut at ``cuts``, rebuilt as a client would."""
    stream, content, calls = ToolStream(plan), "", {}
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    for start, end in zip(bounds, bounds[1:]):
        for delta in stream.take(text[start:end], finished=end == len(text)):
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                name, arguments = calls.get(call["index"], ("", ""))
                calls[call["index"]] = (name + call["function"].get("name", ""),
                                        arguments + call["function"]["arguments"])
    return content or None, [calls[i] for i in sorted(calls)], stream.finish_reason(reason)


def whole_answer(plan, text: str, reason: str) -> tuple:
    message, finish = tool_message(plan, text, reason)
    return (message["content"] or None,
            [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])], finish)


LLAMA3_OUTPUTS = ['{"name": "Bob", "age": 30}', '  {"name": "get_time", "parameters": {"zone": "CET"}} ; ',
                  '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_time", '
                  '"parameters": {"zone": "UTC"}} and more', "<|python_tag|>print('hi')", "  plain  ", "{oops"]
REQUIRED_OUTPUTS = ['[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "get_weather", "parameters": '
                    '{"city": "Oslo", "unit": "celsius"}}]']
PLANS = ([("hermes", {}, text) for text, *_ in HERMES_OUTPUTS]
         + [("hermes", {"parallel_tool_calls": False}, CALL + TIME_CALL + " bye")]
         + [("llama3_json", {}, text) for text in LLAMA3_OUTPUTS]
         + [("hermes", {"tool_choice": "required"}, text) for text in REQUIRED_OUTPUTS]
         + [("hermes", {"tool_choice": NAMED}, '{"city": "Oslo", "unit": "celsius"}')])


@pytest.mark.parametrize("parser, body, text", PLANS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_way_of_cutting_the_stream_gives_the_whole_answer(parser, body, text, data):
    """Cut anywhere, and finished there by a stop or by max_tokens: the stream rebuilds the whole answer."""
    plan = plan_for(parser, **body)
    end = data.draw(st.sampled_from([len(text), data.draw(st.integers(0, len(text)))]), label="end")
    reason = "stop" if end == len(text) else "length"
    cuts = data.draw(st.lists(st.integers(1, max(end - 1, 1)), max_size=12), label="cuts")
    assert streamed_answer(plan, text[:end], cuts, reason) == whole_answer(plan, text[:end], reason)


def test_one_character_at_a_time():
    for parser, body, text in PLANS:
        plan = plan_for(parser, **body)
        assert streamed_answer(plan, text, list(range(len(text))), "stop") == whole_answer(plan, text, "stop")


def test_a_required_stream_parses_each_call_once(monkeypatch):
    """Each delta parsed the whole array again: a long answer's stream was quadratic on the event loop."""
    from mempath.server import tool_choice
    made = []
    real = tool_choice.ToolCall
    monkeypatch.setattr(tool_choice, "ToolCall", lambda *a, **k: made.append(a) or real(*a, **k))
    request = ChatCompletionRequest(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required")
    plan = plan_tools(request, "hermes", True)
    items = [{"name": "get_weather", "parameters": {"city": "Paris " * 200}},
             {"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"city": "x"}}]
    text = json.dumps(items)
    stream = ToolStream(plan)
    deltas = [d for i in range(len(text)) for d in stream.take(text[i], False)] + stream.take("", True)
    assert len(made) == 3  # not once per delta after each call
    sent = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    names = [d["function"]["name"] for d in sent if "name" in d["function"]]
    arguments = ["".join(d["function"]["arguments"] for d in sent if d["index"] == i) for i in range(3)]
    assert names == [i["name"] for i in items]
    assert [json.loads(a) for a in arguments] == [i["parameters"] for i in items]
    assert not any("content" in d for d in deltas)
