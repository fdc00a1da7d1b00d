"""`mempath serve A B`: requests routed by their model over one engine thread and one KV page pool."""
import concurrent.futures
import json
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mempath import LLM, SamplingParams
from mempath.multi.http import build_multi_server_app
from tests.test_server import API_KEY, RunningServer

OPTIONS = {"dtype": "float32", "num_gpu_blocks_override": 24}
PROMPT = [5, 17, 33, 9, 101, 7, 64, 12, 40]


@pytest.fixture(scope="module")
def server(two_models):
    llama, qwen = two_models
    app, names = build_multi_server_app([f"small={llama}", qwen], OPTIONS, None, 0.25, API_KEY, {}, False,
                                        30.0, None, None, {"bind_host": "127.0.0.1"})
    assert names == ["small", qwen.rstrip("/").rsplit("/", 1)[-1]]
    running = MultiModelServer(app, names[0])
    yield running
    running.stop()


class MultiModelServer(RunningServer):
    def series(self) -> dict[tuple, float]:
        """{(name, model_name, sorted other label items): value}"""
        values = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics").text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
                values[(sample.name, sample.labels.get("model_name"), labels)] = sample.value
        return values

    def metrics(self) -> dict[tuple, float]:
        """RunningServer.metrics' keys, each value summed over the models (idle: every model's is 0)."""
        values = {}
        for (name, _, labels), value in self.series().items():
            values[(name, labels)] = values.get((name, labels), 0) + value
        return values


def alone_text(path) -> str:
    llm = LLM(path, show_progress=False, **OPTIONS)
    return llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0].text


def test_models_lists_every_model(server, two_models):
    names = [m.id for m in server.client().models.list().data]
    assert names == list(server.app.apps) and len(names) == 2 and names[0] == "small"


def test_requests_go_to_their_model(server, two_models):
    llama, qwen = two_models
    client = server.client()
    second = list(server.app.apps)[1]

    def complete(model):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # both models at once, twice each
        results = list(pool.map(complete, ["small", second, "small", second]))
    assert results == [alone_text(llama), alone_text(qwen)] * 2
    stats = server.wait_until_idle()
    assert stats is not None
    assert server.engine.pool.pages.num_used == 0


def test_unknown_model_is_a_404_naming_the_served_models(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "c", "prompt": "x"},
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found"
    assert error["message"].startswith("the model 'c' does not exist; this server serves 'small', ")
    # Behind the key, as every route: no key, no list of models.
    assert httpx.post(f"{server.url}/v1/completions", json={"model": "c", "prompt": "x"}).status_code == 401


def test_no_model_goes_to_the_first_and_metrics_serve(server):
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200 and response.json()["model"] == "small"
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200


def post_pipeline(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/pipelines", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60)


def test_pipeline_route_answers_with_the_second_model(server, two_models):
    llama, qwen = two_models
    second = list(server.app.apps)[1]
    first_params = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    second_params = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    prompt = "def read_config(path):"
    first_text = LLM(llama, show_progress=False, **OPTIONS).generate(
        prompt, SamplingParams(**first_params), use_tqdm=False)[0].text
    expected = LLM(qwen, show_progress=False, **OPTIONS).generate(
        f"Summary: {first_text}\nAnswer:", SamplingParams(**second_params), use_tqdm=False)[0].text
    response = post_pipeline(server, {"model": "small", "prompt": prompt, **first_params, "then": {
        "model": second, "template": "Summary: {output}\nAnswer:", **second_params}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == second and body["choices"][0]["text"] == expected
    server.wait_until_idle()
    assert server.engine.pool.pages.num_used == 0 and not server.engine.pipelines


@pytest.mark.parametrize("then, status, param", [
    (None, 400, "then"),
    ({"model": "nope", "template": "{output}"}, 404, "then.model"),
    ({"model": "small", "template": "{answer}"}, 400, "then.template"),
    ({"model": "small", "template": "{output}", "n": 2}, 400, "then.n"),
    ({"model": "small", "template": "{output}", "temperature": "hot"}, 400, "then.temperature"),
])
def test_pipeline_route_refuses_bad_fields(server, then, status, param):
    body = {"model": "small", "prompt": "x", "max_tokens": 2}
    if then is not None:
        body["then"] = then
    response = post_pipeline(server, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def model_series(series: dict, model: str) -> dict[tuple, float]:
    """The series of one model, keyed (name, other labels); the process's figures left out."""
    return {(name, labels): value for (name, owner, labels), value in series.items() if owner == model}


# Request-driven series: they move with a model's own requests and with nothing else.
REQUEST_SERIES = ("mempath:prompt_tokens_total", "mempath:generation_tokens_total",
                  "mempath:time_to_first_token_seconds_count", "mempath:e2e_request_latency_seconds_count",
                  "mempath:request_queue_time_seconds_count", "mempath:request_prompt_tokens_sum",
                  "mempath:iteration_tokens_total_count")


def test_metrics_each_model_its_own_series(server):
    """Requests to one model move that model's counters and histograms only (vLLM's model_name rule)."""
    names = list(server.app.apps)
    client = server.client()
    for model, other in (names, names[::-1]):
        before = server.wait_until_idle() and server.series()
        for _ in range(2):
            client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
        server.wait_until_idle()
        after = server.series()
        for name in REQUEST_SERIES:
            assert after[(name, model, ())] > before[(name, model, ())], (name, model)
            assert after[(name, other, ())] == before[(name, other, ())], (name, other)
        assert after[("mempath:prompt_tokens_total", model, ())] - before[("mempath:prompt_tokens_total", model, ())] \
            == 2 * len(PROMPT)
        success = ("mempath:request_success_total", model, (("finished_reason", "length"),))
        assert after[success] == before[success] + 2


def test_metrics_state_and_ledger_per_model_and_the_pool(server):
    names = list(server.app.apps)
    series = server.series()
    engines = server.engine.engines
    for name in names:
        own = model_series(series, name)
        assert own[("mempath:kv_pages_used", ())] == 0
        assert own[("mempath:kv_pages_guaranteed", ())] == server.engine.pool.guaranteed() == 6  # 0.25 of 24
        assert own[("mempath:num_cross_model_preemptions_total", ())] == 0
        assert own[("mempath:kv_blocks_total", ())] == 24
        # The model's own ledger: its weights, under its own name.
        weights = [v for (metric, labels), v in own.items()
                   if metric == "mempath:memory_bytes" and ("pathway", "weights") in labels]
        assert weights == [engines[name].ledger.as_dict()["weights"]["bytes"]]
    process = model_series(series, ",".join(names))
    assert process[("mempath:kv_pages_total", ())] == 24 and process[("mempath:kv_pages_free", ())] == 24
    pool_bytes = [v for (metric, labels), v in process.items() if metric == "mempath:memory_bytes"]
    assert pool_bytes == [24 * server.engine.pool.page_bytes]
    # Every series names a model, or the models together (the process's figures).
    owners = {owner for (metric, owner, _) in series if metric.startswith("mempath:")}
    assert owners == {*names, ",".join(names)}
    # Each model's cache settings, as its own series (its block size differs from the other's).
    infos = {owner: dict(labels) for (metric, owner, labels) in series if metric == "mempath:cache_config_info"}
    assert set(infos) == set(names)
    for name in names:
        assert infos[name]["block_size"] == str(engines[name].config.block_size)
        assert infos[name]["num_gpu_blocks"] == str(engines[name].kv.num_blocks)


def test_one_model_metrics_keep_their_series():
    """One model: every series under its one name, none of the shared pool's."""
    from mempath.server.metrics import ServerMetrics
    llm = LLM("mempath/assets/mempath-tiny", show_progress=False, num_gpu_blocks_override=8)
    llm.generate([1, 2, 3], SamplingParams(max_tokens=2), use_tqdm=False)
    metrics = ServerMetrics.for_engine("tiny", llm.engine)
    text = metrics.render({**llm.engine.stats(), "device": "cpu"}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert not [name for name in families if name.startswith("mempath:kv_pages") or "cross_model" in name]
    for name in ("mempath:kv_blocks", "mempath:memory_bytes", "mempath:num_requests_running",
                 "mempath:time_to_first_token_seconds", "mempath:request_queue_time_seconds"):
        assert {s.labels["model_name"] for s in families[name].samples} == {"tiny"}


def first_model_work(server) -> int:
    return server.engine.engines["small"].num_prompt_tokens


@pytest.mark.parametrize("first, then, param", [
    ({}, {"logprobs": 100}, "then.logprobs"),
    ({}, {"max_tokens": 2, "min_tokens": 5}, "then.min_tokens"),
    ({}, {"logit_bias": {"100000": 1}}, "then.logit_bias"),
    ({}, {"guided_regex": "(("}, "then.guided_regex"),
    ({}, {"guided_regex": "a+", "guided_choice": ["a"]}, "then.guided_choice"),
    ({}, {"max_tokens": 100000}, "then.max_tokens"),
    ({}, {"template": "a " * 2000 + "{output}"}, "then.template"),  # too long before the first model says a word
    ({"stream": True}, {"logprobs": 100}, "then.logprobs"),
    ({}, {"prompt_logprobs": 1}, "then.prompt_logprobs"),  # the answer has no place for the second's prompt
    ({"logprobs": 1}, {}, "logprobs"),  # the answer is the second model's tokens
    ({"prompt_logprobs": 1}, {}, "prompt_logprobs"),
    ({"guided_regex": "(("}, {}, "guided_regex"),
])
def test_pipeline_refuses_before_the_first_model_runs(server, first, then, param):
    second = list(server.app.apps)[1]
    server.wait_until_idle()
    before = first_model_work(server)
    response = post_pipeline(server, {"model": "small", "prompt": "def read_config(path):", "max_tokens": 4,
                                      **first, "then": {"model": second, "template": "S: {output}", **then}})
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["param"] == param, response.text
    server.wait_until_idle()
    assert first_model_work(server) == before
    assert server.engine.pool.pages.num_used == 0 and not server.engine.pipelines


def overflowing_pipeline(server, stream: bool) -> dict:
    """A pipeline whose second prompt (the first's prompt, then its answer, for the same model) fits
    max_model_len exactly until the first model's one answer token is added to it."""
    engine = server.engine.engines["small"]
    literal = len(engine.tokenizer.encode("x", add_special_tokens=False))
    prompt = [5 + i % 50 for i in range(engine.max_model_len - literal)]
    return {"model": "small", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
            "stream": stream, "then": {"model": "small", "template": "x{prompt}{output}", "max_tokens": 2,
                                       "logprobs": 2}}


def test_pipeline_failing_after_the_hand_off_is_a_400_naming_max_tokens_without_the_first_answer(server):
    response = post_pipeline(server, overflowing_pipeline(server, stream=False))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and "max_model_len" in error["message"], error
    assert "answer (1 tokens)" in error["message"] and "Lower max_tokens" in error["message"]
    server.wait_until_idle()
    assert server.engine.pool.pages.num_used == 0 and not server.engine.pipelines


def test_streamed_pipeline_failing_after_the_hand_off_ends_with_an_error_event(server):
    body = overflowing_pipeline(server, stream=True)
    with httpx.stream("POST", f"{server.url}/v1/pipelines", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "max_model_len" in payloads[-1]["error"]["message"] and payloads[-1]["error"]["param"] == "max_tokens"
    # The first model's answer is not the pipeline's: none of it goes out.
    assert all(c["text"] == "" for p in payloads if "choices" in p for c in p["choices"])
    server.wait_until_idle()
    assert server.engine.pool.pages.num_used == 0 and not server.engine.pipelines


def test_a_pipelines_first_prompt_is_tokenized_off_the_engine_thread(server, monkeypatch):
    """The engine thread steps every model: a long first prompt tokenized there stalled them all (as
    /v1/completions tokenizes its prompts on the server's tokenizing thread, the pipeline route does too)."""
    tokenizer = server.engine.engine("small").tokenizer
    prompt = "def read_config(path):\n" * 3
    threads = []
    encode = tokenizer.encode

    def spy(text, *args, **kwargs):
        if text == prompt:
            threads.append(threading.current_thread().name)
        return encode(text, *args, **kwargs)
    monkeypatch.setattr(tokenizer, "encode", spy)
    second = list(server.app.apps)[1]
    response = post_pipeline(server, {"model": "small", "prompt": prompt, "max_tokens": 2, "then": {
        "model": second, "template": "Summary: {output}", "max_tokens": 2}})
    assert response.status_code == 200, response.text
    assert threads and "mempath-engine" not in threads, threads


def test_a_required_tool_choice_names_the_function_whose_schema_does_not_compile(server):
    """As with one model (tests/test_tool_calls.py): the schemas are compiled for the model the request names."""
    tools = [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "bad", "parameters": {"type": "objekt"}}}]
    response = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                "tools": tools, "tool_choice": "required"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools.1.function.parameters" and "objekt" in error["message"], error
