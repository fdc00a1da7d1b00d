"""The clients vLLM users drive a server with — openai, langchain-openai, litellm — against a live server,
and the endpoints beside the OpenAI ones: /v1/responses, /tokenize, /detokenize, /version, /docs."""
import asyncio

import httpx
import openai
import pytest

from mempath.sampling import SamplingParams
from tests.test_server import API_KEY, ENGINE_OPTIONS, serving, tiny_llama

PROMPT = "def read_config(path):"
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_llama(tmp_path_factory, "client-model")


@pytest.fixture(scope="module")
def server(model_path):
    yield from serving(model_path)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def reference(model_path):
    from mempath import LLM
    return LLM(model_path, show_progress=False, **ENGINE_OPTIONS)


def greedy_chat(reference, messages, max_tokens: int) -> str:
    return reference.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                          use_tqdm=False)[0].text


# ----------------------------------------------------------------- openai
def test_openai_sync_calls(client):
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, n=2, logprobs=2)
    assert len(done.choices) == 2 and done.choices[0].text == done.choices[1].text  # greedy: equal samples
    assert len(done.choices[0].logprobs.tokens) == done.usage.completion_tokens // 2
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == chat.choices[0].message.content


def test_openai_async_calls(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as aclient:
            chat = await aclient.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                                         temperature=0)
            stream = await aclient.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                                           temperature=0, stream=True)
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return chat.choices[0].message.content, streamed
    text, streamed = asyncio.run(run())
    assert text == streamed


# ----------------------------------------------------------------- /v1/responses
def test_responses_create_is_the_chat_answer(client, reference):
    response = client.responses.create(model="tiny", input=MESSAGES[0]["content"], max_output_tokens=6,
                                       temperature=0)
    assert response.output_text == greedy_chat(reference, MESSAGES, 6)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 6 and response.usage.input_tokens > 0
    assert response.output[0].role == "assistant" and response.id.startswith("resp_")


def test_responses_instructions_and_message_input(client, reference):
    response = client.responses.create(
        model="tiny", instructions="Be brief.", max_output_tokens=4, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
               {"role": "user", "content": "again"}])
    expected = greedy_chat(reference, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
                                       {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}], 4)
    assert response.output_text == expected


def test_responses_stream_sends_openais_events(client):
    expected = client.responses.create(model="tiny", input="hello", max_output_tokens=6, temperature=0).output_text
    with client.responses.stream(model="tiny", input="hello", max_output_tokens=6, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    raw = list(client.responses.create(model="tiny", input="hello", max_output_tokens=6, temperature=0, stream=True))
    # How many deltas carry the text depends on how fast the client reads (a reader that falls behind gets them
    # merged): the same events, a run of deltas counted once, and the same text.
    assert collapsed([e.type for e in raw]) == collapsed(kinds)
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == expected


def collapsed(kinds: list[str]) -> list[str]:
    return [k for i, k in enumerate(kinds) if not (k == "response.output_text.delta" and kinds[i - 1] == k)]


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"store": True}, "store"),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input.0.type"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
])
def test_responses_refuse_what_they_cannot_do(client, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(**{"model": "tiny", "input": "hi", **fields})
    assert raised.value.body["param"] == param, raised.value.body


# ----------------------------------------------------------------- tokenize, detokenize, version, docs
def post(server, path: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers)


def test_tokenize_and_detokenize_in_vllms_shapes(server, reference):
    tok = reference.tokenizer
    body = post(server, "/tokenize", {"model": "tiny", "prompt": PROMPT, "return_token_strs": True}).json()
    assert body["tokens"] == tok.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == ENGINE_OPTIONS["max_model_len"]
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    chat = post(server, "/tokenize", {"messages": MESSAGES}).json()
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False) and chat["token_strs"] is None
    back = post(server, "/detokenize", {"tokens": body["tokens"]}).json()
    assert back == {"prompt": tok.decode(body["tokens"])}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_tokenize_errors_name_the_field(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_the_key_guards_the_tokenizer_but_not_version_or_docs(server):
    assert post(server, "/tokenize", {"prompt": "a"}, key=None).status_code == 401
    assert post(server, "/detokenize", {"tokens": [1]}, key="wrong").status_code == 401
    from mempath import __version__
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/responses", "/tokenize", "/detokenize", "/version", "/v1/chat/completions"} <= set(spec["paths"])
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema = spec["components"]["schemas"][body["$ref"].rpartition("/")[2]]
    assert {"messages", "max_tokens", "temperature"} <= set(schema["properties"])
    assert "ChatMessage" in spec["components"]["schemas"]  # the nested models, where the refs point
    assert "swagger" in httpx.get(f"{server.url}/docs").text.lower()


def test_docs_obey_the_host_guard_and_can_be_turned_off(server):
    from fastapi.testclient import TestClient
    from mempath.server.app import build_app
    guarded = TestClient(build_app(server.app.state.engine_client, "tiny", bind_host="127.0.0.1"),
                         base_url="http://evil.example")
    assert guarded.get("/docs").status_code == 400 and guarded.get("/openapi.json").status_code == 400
    off = TestClient(build_app(server.app.state.engine_client, "tiny", enable_docs=False))
    assert off.get("/docs").status_code == 404 and off.get("/openapi.json").status_code == 404


# ----------------------------------------------------------------- langchain-openai
def test_langchain_chat_openai(server):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, model="tiny", temperature=0, max_tokens=5,
                     max_retries=0)
    text = llm.invoke("The quick brown fox").content
    assert text and "".join(chunk.content for chunk in llm.stream("The quick brown fox")) == text
    assert [m.content for m in llm.batch(["The quick brown fox"] * 2)] == [text, text]

    async def astream() -> str:
        return "".join([chunk.content async for chunk in llm.astream("The quick brown fox")])
    assert asyncio.run(astream()) == text


# ----------------------------------------------------------------- litellm
@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm_providers(server, provider):
    import litellm
    kwargs = dict(model=f"{provider}/tiny", api_base=f"{server.url}/v1", api_key=API_KEY, messages=MESSAGES,
                  max_tokens=5, temperature=0)
    text = litellm.completion(**kwargs).choices[0].message.content
    assert text
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**kwargs, stream=True))
    assert streamed == text
    del kwargs["messages"]
    assert litellm.text_completion(**kwargs, prompt=PROMPT).choices[0].text
