"""Structured output and tool calls over HTTP, through the clients people use: the openai client,
langchain-openai (bind_tools, with_structured_output) and litellm, streaming and not.

The server runs the shipped mempath-tiny, whose chat template has a Hermes tool-call
format; the model is not trained for tools, so required and named choices (enforced by
the grammar) are what must always come back well formed.
"""
import json

import httpx
import jsonschema
import openai
import pytest

from mempath.assets import ASSETS, DEFAULT_MODEL
from mempath.server.tool_choice import ToolPlan, ToolStream
from mempath.server.tool_parsers import HermesParser, Llama3JsonParser, parse_tool_calls, parser_for_template
from tests.test_server import API_KEY, serving

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
BAD_SCHEMA = {"type": "function", "function": {"name": "bad", "parameters": {"type": "objekt"}}}


@pytest.fixture(scope="module")
def server():
    yield from serving(str(ASSETS / DEFAULT_MODEL), dict(device="cpu", max_num_seqs=16),
                       enable_auto_tool_choice=True)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, **kwargs):
    kwargs = {"max_tokens": 120, **kwargs}
    return client.chat.completions.create(model="tiny", messages=ASK, temperature=0, **kwargs)


def stream_chunks(client, **kwargs):
    return list(client.chat.completions.create(model="tiny", messages=ASK, max_tokens=120, temperature=0,
                                               stream=True, **kwargs))


def streamed_calls(chunks) -> tuple[list[dict], str]:
    """Tool calls rebuilt from stream deltas as a client does, checking OpenAI's order."""
    calls, finish = {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # the first delta of a call: id, type, name
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


# ----------------------------------------------------------------- response_format
def test_json_schema_response_format_validates(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    text = chat(client, response_format=rf).choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream_chunks(client, response_format=rf)
                       if c.choices)
    assert streamed == text


def test_vllm_fields_regex_choice_and_json(client):
    out = chat(client, extra_body={"structured_outputs": {"regex": "[0-9]{2}-[a-z]{3}"}}).choices[0]
    assert len(out.message.content) == 6 and out.message.content[2] == "-" and out.finish_reason == "stop"
    assert chat(client, extra_body={"guided_choice": ["yes", "no"]}).choices[0].message.content in ("yes", "no")
    jsonschema.validate(json.loads(chat(client, extra_body={"guided_json": PERSON}).choices[0].message.content),
                        PERSON)
    completion = client.completions.create(model="tiny", prompt="age = ", max_tokens=10,
                                           extra_body={"guided_regex": "[0-9]{1,3}"})
    assert completion.choices[0].text.isdigit()


@pytest.mark.parametrize("body, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "Unsupported type"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "not a valid regex"),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "not a valid EBNF grammar"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "both constrain"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "cannot be combined"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not in tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name", "name"),
    ({"tools": [WEATHER, TIME, WEATHER]}, "tools.2.function.name", "tools.0 already"),
    ({"tools": [WEATHER, BAD_SCHEMA], "tool_choice": {"type": "function", "function": {"name": "bad"}}},
     "tools.1.function.parameters", "Unsupported type"),
    # required: one grammar over every function, whose error is located at the function that does not compile
    ({"tools": [WEATHER, TIME, BAD_SCHEMA], "tool_choice": "required"}, "tools.2.function.parameters",
     "Unsupported type"),
])
def test_invalid_constraints_are_400s_naming_the_field(server, body, param, says):
    response = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": "tiny", "messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


# ----------------------------------------------------------------- tool calls, openai client
def check_weather_call(name: str, arguments: str) -> None:
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_named_tool_choice_returns_a_valid_call_streaming_or_not(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(client, tools=[WEATHER, TIME], tool_choice=named).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    check_weather_call(call.function.name, call.function.arguments)
    calls, finish = streamed_calls(stream_chunks(client, tools=[WEATHER, TIME], tool_choice=named))
    assert finish == "tool_calls" and [c["arguments"] for c in calls] == [call.function.arguments]


def test_required_tool_choice_gives_one_call_without_parallel_calls(client):
    kwargs = dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    choice = chat(client, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0].function
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)
    calls, finish = streamed_calls(stream_chunks(client, **kwargs))
    assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [(call.name, call.arguments)]


def test_auto_and_none_answer_with_content_when_the_model_calls_nothing(client):
    for tool_choice in ("auto", "none"):
        choice = chat(client, tools=[WEATHER], tool_choice=tool_choice, max_tokens=8).choices[0]
        assert choice.message.tool_calls is None and choice.message.content is not None


def test_a_conversation_with_tool_results_renders(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=5)
    assert out.choices[0].message.content is not None


# ----------------------------------------------------------------- langchain and litellm
def test_langchain_bind_tools_and_structured_output(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    llm = ChatOpenAI(model="tiny", base_url=f"{server.url}/v1", api_key=API_KEY, temperature=0, max_tokens=120,
                     max_retries=0)
    bound = llm.bind_tools([WEATHER], tool_choice="get_weather")
    message = bound.invoke("Weather in Paris?")
    (call,) = message.tool_calls
    check_weather_call(call["name"], json.dumps(call["args"]))
    chunks = list(bound.stream("Weather in Paris?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert [c["args"] for c in merged.tool_calls] == [call["args"]]

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=120)

    person = llm.with_structured_output(Person, method="json_schema").invoke("Describe someone.")
    assert isinstance(person, Person)
    person = llm.with_structured_output(Person, method="function_calling").invoke("Describe someone.")
    assert isinstance(person, Person)


def test_litellm_tool_calls_streaming_and_not(server):
    import litellm
    kwargs = dict(model="openai/tiny", api_base=f"{server.url}/v1", api_key=API_KEY, messages=ASK,
                  tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  max_tokens=120, temperature=0)
    response = litellm.completion(**kwargs)
    call = response.choices[0].message.tool_calls[0]
    check_weather_call(call.function.name, call.function.arguments)
    chunks = list(litellm.completion(stream=True, **kwargs))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=ASK)
    streamed = rebuilt.choices[0].message.tool_calls[0]
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)


# ----------------------------------------------------------------- parsers (no server)
def test_hermes_parser_whole_and_streamed():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    content, calls = parse_tool_calls(HermesParser(), text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
    stream = ToolStream(ToolPlan("auto", [], parser=HermesParser()))
    deltas = []
    for i in range(0, len(text), 3):
        deltas += stream.take(text[i:i + 3], finished=i + 3 >= len(text))
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    headers = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [h["function"]["name"] for h in headers] == ["get_weather", "get_time"]
    assert stream.finish_reason("stop") == "tool_calls"


def test_llama3_json_parser_and_plain_text():
    content, calls = parse_tool_calls(Llama3JsonParser(),
                                      '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}'), ("g", "{}")]
    assert parse_tool_calls(Llama3JsonParser(), "Hello there") == ("Hello there", [])
    assert parse_tool_calls(HermesParser(), "<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [])


def test_the_parser_is_chosen_from_the_chat_template():
    from transformers import AutoTokenizer
    shipped = AutoTokenizer.from_pretrained(str(ASSETS / DEFAULT_MODEL)).chat_template
    assert parser_for_template(shipped) == "hermes"
    assert parser_for_template('{{ "<|python_tag|>" }}') == "llama3_json"
    assert parser_for_template("{{ messages }}") is None


def test_auto_tool_choice_needs_the_flag(server):
    from mempath.server.protocol import APIError, ChatCompletionRequest
    from mempath.server.tool_choice import plan_tools
    req = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER]})
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        plan_tools(req, "hermes", auto_tool_choice=False)
    assert plan_tools(req, "hermes", auto_tool_choice=True).mode == "auto"


def test_openai_client_sees_a_400_for_a_bad_schema(client):
    with pytest.raises(openai.BadRequestError):
        chat(client, extra_body={"guided_json": {"type": "objekt"}})
