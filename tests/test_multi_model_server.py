"""`mempath serve A B`: requests routed by their model over one engine thread and one KV page pool."""
import concurrent.futures

import httpx
import openai
import pytest

from mempath import LLM, SamplingParams
from mempath.multi.http import build_multi_server_app
from tests.test_server import API_KEY, RunningServer

OPTIONS = {"dtype": "float32", "num_gpu_blocks_override": 24}
PROMPT = [5, 17, 33, 9, 101, 7, 64, 12, 40]


@pytest.fixture(scope="module")
def paths(model_factory):
    llama, _ = model_factory("llama")
    qwen, _ = model_factory("qwen3", vocab_size=384, seed=1)
    return llama, qwen


@pytest.fixture(scope="module")
def server(paths):
    llama, qwen = paths
    app, names = build_multi_server_app([f"small={llama}", qwen], OPTIONS, None, 0.25, API_KEY, {}, False,
                                        30.0, None, None, {"bind_host": "127.0.0.1"})
    assert names == ["small", qwen.rstrip("/").rsplit("/", 1)[-1]]
    running = RunningServer(app, names[0])
    yield running
    running.stop()


def alone_text(path) -> str:
    llm = LLM(path, show_progress=False, **OPTIONS)
    return llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0].text


def test_models_lists_every_model(server, paths):
    names = [m.id for m in server.client().models.list().data]
    assert names == list(server.app.apps) and len(names) == 2 and names[0] == "small"


def test_requests_go_to_their_model(server, paths):
    llama, qwen = paths
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


def test_pipeline_route_answers_with_the_second_model(server, paths):
    llama, qwen = paths
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
