"""vLLM's flags: each parses and has its effect; the ones mempath cannot honour are refused with the reason."""
import json
import re
import shutil

import httpx
import pytest

from mempath.cli import build_parser, main, sampling_params
from mempath.engine_flags import REFUSED, engine_options
from mempath.sampling import SamplingParams
from mempath.server.cli import build_server_app, read_chat_template
from tests.test_server import API_KEY, ENGINE_OPTIONS, RunningServer


def parse(*flags: str):
    return build_parser().parse_args(["serve", "some/model", *flags])


# ----------------------------------------------------------------- parsing
@pytest.mark.parametrize("flags, option, value", [
    ((), "enable_prefix_caching", True),
    (("--enable-prefix-caching",), "enable_prefix_caching", True),
    (("--no-enable-prefix-caching",), "enable_prefix_caching", False),
    ((), "enable_chunked_prefill", True),
    (("--no-enable-chunked-prefill",), "enable_chunked_prefill", False),
    (("--async-scheduling",), "async_scheduling", True),
    (("--no-async-scheduling",), "async_scheduling", False),
    (("--enforce-eager",), "enforce_eager", True),
    (("--max-logprobs", "5"), "max_logprobs", 5),
    (("--tokenizer", "tok/dir"), "tokenizer", "tok/dir"),
    (("--generation-config", "vllm"), "generation_config", "vllm"),
    (("--swap-space", "2"), "cpu_kv_gb", 2.0),
    (("--cpu-kv-gb", "3"), "cpu_kv_gb", 3.0),
])
def test_engine_flags_parse_to_engine_options(flags, option, value):
    assert engine_options(parse(*flags)).get(option, False if option == "cpu_kv_gb" else None) == value


def test_cpu_kv_gb_wins_over_swap_space_and_says_so(caplog):
    assert engine_options(parse("--swap-space", "4", "--cpu-kv-gb", "1"))["cpu_kv_gb"] == 1.0
    assert "--cpu-kv-gb wins" in caplog.text
    assert "cpu_kv_gb" not in engine_options(parse())  # neither given: EngineConfig's default (none)


@pytest.mark.parametrize("flags", [("--disable-log-requests",), ("--enable-log-requests",), ("--root-path", "/x"),
                                   ("--chat-template", "{{ x }}"), ("-tp", "1"), ("--tensor-parallel-size", "1"),
                                   ("--pipeline-parallel-size", "1"), ("--disable-custom-all-reduce",),
                                   ("--disable-frontend-multiprocessing",), ("--enable-prompt-tokens-details",),
                                   ("--disable-fastapi-docs",), ("--tokenizer-mode", "auto"),
                                   ("--quantization", "fp8"), ("-q", "fp8")])
def test_vllm_flags_that_change_nothing_here_are_accepted(flags):
    assert not getattr(parse(*flags), "refused", None)


@pytest.mark.parametrize("flags, says", [
    (("--trust-remote-code",), "never runs code from a checkpoint"),
    (("--tensor-parallel-size", "2"), "one device"),
    (("-tp", "4"), "tensor parallelism"),
    (("--pipeline-parallel-size", "2"), "pipeline parallelism"),
    (("--quantization", "awq"), "only fp8 is supported"),
    (("-q", "gptq"), "use the unquantized checkpoint"),
    (("--enable-lora",), "merge the adapter"),
    (("--revision", "main"), "local directory"),
    (("--scheduling-policy", "priority"), "first come, first served"),
    (("--ssl-keyfile", "k.pem"), "reverse proxy"),
    (("--allow-credentials",), "CORS"),
])
def test_flags_we_cannot_honour_are_refused_in_one_line(capsys, flags, says):
    assert main(["serve", "some/model", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and err.startswith(f"mempath: error: {flags[0]}"), err


def test_every_refused_flag_says_why_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in REFUSED:
        assert flag in text
    for default in ("else 256 (default: auto)", "(default: 0.9)", "(default: 8192)", "(default: auto)", "(default: 20)"):
        assert default in text
    assert "--no-enable-prefix-caching" in text and "--no-enable-chunked-prefill" in text


def test_generate_help_states_where_its_defaults_differ_from_sampling_params(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "SamplingParams' default is 16" in text and "SamplingParams' default is 1.0" in text


def test_cli_sampling_resolution_flags_then_generation_config_then_cli_defaults():
    args = build_parser().parse_args(["generate", "p"])
    assert sampling_params(args) == SamplingParams(max_tokens=64, temperature=0.0)
    assert sampling_params(args, {"temperature": 0.7, "top_p": 0.8}) == SamplingParams(
        max_tokens=64, temperature=0.7, top_p=0.8)
    given = build_parser().parse_args(["generate", "p", "--temperature", "0.2", "--max-tokens", "3"])
    assert sampling_params(given, {"temperature": 0.7}) == SamplingParams(max_tokens=3, temperature=0.2)


def test_chat_template_is_a_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))


# ----------------------------------------------------------------- effects in the engine
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.conftest import make_model
    path = tmp_path_factory.mktemp("flags-model")
    make_model(path, "llama")
    return path


def test_max_logprobs_bounds_a_request_and_chat_takes_a_template(model_dir):
    from mempath import LLM
    llm = LLM(str(model_dir), show_progress=False, max_logprobs=2, **ENGINE_OPTIONS)
    assert len(llm.generate([1, 2, 3], SamplingParams(max_tokens=1, logprobs=2))[0].logprobs[0]) >= 2
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 2\]"):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=1, logprobs=3))
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=2), chat_template=TEMPLATE)[0]
    assert out.prompt == "<<hello>>"


def prefill_chunks(llm, prompts) -> list[list[int]]:
    """Each step's new tokens per request, with the generated tokens."""
    steps, schedule = [], llm.engine.scheduler.schedule

    def recording():
        batch = schedule()
        steps.append(list(batch.num_new_tokens))
        return batch
    llm.engine.scheduler.schedule = recording
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    return steps, [o.token_ids for o in outs]


def test_without_chunked_prefill_a_prompt_is_prefilled_in_one_step(model_dir):
    from mempath import LLM
    options = {**ENGINE_OPTIONS, "max_model_len": 64, "max_num_batched_tokens": 64, "async_scheduling": False}
    prompts = [list(range(3, 43)), list(range(50, 90))]  # 40 tokens each: both do not fit one step of 64
    chunked, chunked_tokens = prefill_chunks(LLM(str(model_dir), show_progress=False, **options), prompts)
    whole, whole_tokens = prefill_chunks(LLM(str(model_dir), show_progress=False, enable_chunked_prefill=False,
                                             **options), prompts)
    assert chunked[0] == [40, 24]  # the second prompt's first chunk
    assert whole[0] == [40] and whole[1][-1] == 40  # waits, then all of it
    assert chunked_tokens == whole_tokens


def test_without_chunked_prefill_the_budget_must_hold_a_whole_prompt(model_dir):
    from mempath import LLM
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be >= max_model_len"):
        LLM(str(model_dir), show_progress=False, enable_chunked_prefill=False,
            **{**ENGINE_OPTIONS, "max_num_batched_tokens": 64})  # max_model_len 256
    assert main(["generate", "--model", str(model_dir), "--no-enable-chunked-prefill", "--max-model-len", "128",
                 "--max-num-batched-tokens", "64", "--device", "cpu", "x"]) == 2


def test_generation_config_sets_the_defaults_a_call_leaves_out(model_dir, tmp_path):
    from mempath import LLM
    elsewhere = tmp_path / "gen"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    llm = LLM(str(model_dir), show_progress=False, generation_config=str(elsewhere), **ENGINE_OPTIONS)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
    out = llm.generate([5, 6, 7])[0]
    assert len(out.token_ids) <= 3
    assert out.token_ids == llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=3))[0].token_ids
    plain = LLM(str(model_dir), show_progress=False, generation_config="vllm", **ENGINE_OPTIONS)
    assert plain.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="not a directory"):
        LLM(str(model_dir), show_progress=False, generation_config=str(tmp_path / "none"), **ENGINE_OPTIONS)


# ----------------------------------------------------------------- effects on a live server
TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


@pytest.fixture(scope="module")
def flagged_server(model_dir, tmp_path_factory):
    """The model with a generation config, another tokenizer, a chat template file, under /llm."""
    from tests.conftest import build_tokenizer
    root = tmp_path_factory.mktemp("flagged")
    model = root / "model"
    shutil.copytree(model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 4}))
    tokenizer = root / "tokenizer"
    build_tokenizer(300).save_pretrained(tokenizer)
    template = root / "chat.jinja"
    template.write_text(TEMPLATE)
    app, name = build_server_app(str(model), {**ENGINE_OPTIONS, "tokenizer": str(tokenizer)},
                                 served_model_name="tiny", api_key=API_KEY, show_progress=False,
                                 chat_template=read_chat_template(str(template)), root_path="/llm")
    running = RunningServer(app, name)
    yield running, tokenizer
    running.stop()


def test_root_path_serves_under_the_prefix_and_in_the_openapi_page(flagged_server):
    server, _ = flagged_server
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{server.url}/llm/v1/models", headers=headers).json()["data"][0]["id"] == "tiny"
    assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 200  # a proxy that strips it
    assert {"url": "/llm"} in httpx.get(f"{server.url}/llm/openapi.json").json()["servers"]


def test_tokenizer_and_chat_template_flags_shape_the_prompt(flagged_server):
    from transformers import AutoTokenizer
    server, tokenizer_dir = flagged_server
    other = AutoTokenizer.from_pretrained(tokenizer_dir)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = httpx.post(f"{server.url}/llm/tokenize", headers=headers,
                      json={"messages": [{"role": "user", "content": "The quick brown fox"}]}).json()
    assert body["tokens"] == other.encode("<<The quick brown fox>>", add_special_tokens=False)
    plain = httpx.post(f"{server.url}/llm/tokenize", headers=headers, json={"prompt": "The quick brown fox"}).json()
    assert plain["tokens"] == other.encode("The quick brown fox")


def test_generation_config_defaults_apply_over_http_and_requests_win(flagged_server):
    server, _ = flagged_server
    client = server.client()
    client.base_url = f"{server.url}/llm/v1"
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], extra_body={"ignore_eos": True})
    first = client.chat.completions.create(**chat)  # temperature 0 and 4 tokens: the file's
    again = client.chat.completions.create(**chat)
    assert first.usage.completion_tokens == 4 and first.choices[0].message.content == again.choices[0].message.content
    assert client.chat.completions.create(**chat, max_tokens=2).usage.completion_tokens == 2
    sampled = {client.chat.completions.create(**chat, temperature=1.5, seed=s).choices[0].message.content
               for s in range(4)}
    assert len(sampled) > 1  # the request's temperature wins over the file's
    assert client.completions.create(model="tiny", prompt="hello", extra_body={"ignore_eos": True}
                                     ).usage.completion_tokens == 4


def test_enable_log_requests_logs_one_line_per_request(flagged_server, caplog, monkeypatch):
    import logging

    from mempath.server import app as server_app
    from mempath.server import cli
    from mempath.server.calls import request_log
    assert parse("--enable-log-requests").enable_log_requests and not parse().enable_log_requests
    assert not parse("--enable-log-requests", "--disable-log-requests").enable_log_requests
    monkeypatch.setattr(cli, "build_server_app", lambda *args, **kwargs: ("app", "served"))
    monkeypatch.setattr(server_app, "serve", lambda *args, **kwargs: None)
    monkeypatch.setattr(request_log, "level", request_log.level)  # restored after the test
    assert main(["serve", "some/model", "--enable-log-requests"]) == 0
    assert request_log.level == logging.INFO
    server, _ = flagged_server
    client = server.client()
    client.base_url = f"{server.url}/llm/v1"
    with caplog.at_level(logging.INFO, logger="mempath.requests"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    lines = [r.getMessage() for r in caplog.records if r.name == "mempath.requests"]
    assert len(lines) == 1 and lines[0].startswith("request cmpl-") and "max_tokens=2" in lines[0], lines
    assert main(["serve", "some/model"]) == 0 and request_log.level == logging.WARNING


@pytest.mark.parametrize("content, says", [
    ('"temperature top_p"', "holds a string, expected a JSON object of generation settings"),
    ('["temperature"]', "holds a list, expected a JSON object of generation settings"),
    ("[1]", "holds a list, expected a JSON object of generation settings"),
    ('{"temperature": -1}', "temperature must be >= 0, got -1"),
    ('{"max_new_tokens": 1.5}', "max_new_tokens must be an integer >= 1, got 1.5"),
])
def test_a_generation_config_that_is_not_settings_is_refused_naming_the_file(tmp_path, content, says):
    """A string or a list used to raise a TypeError from indexing it, or (a list of ids) be ignored; a bad value
    was refused without naming the file the user never passed as a flag."""
    from mempath.generation_config import generation_defaults
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError) as refused:
        generation_defaults(str(tmp_path))
    message = str(refused.value)
    assert message.startswith(str(tmp_path / "generation_config.json")) and says in message, message
    assert message.endswith("fix it or pass --generation-config vllm"), message


def test_a_long_inline_template_is_a_template_and_a_bad_file_is_named(tmp_path):
    """An inline template longer than a file name may be (255 bytes) used to be refused as 'File name too long';
    a directory was 'no such file' and a file that is not UTF-8 was a codec error naming neither."""
    long_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{# " + "x" * 300 + " #}"
    assert read_chat_template(long_template) == long_template
    with pytest.raises(ValueError, match=re.escape(f"--chat-template {tmp_path}: is a directory")):
        read_chat_template(str(tmp_path))
    (tmp_path / "t.jinja").write_bytes(b"{{ \xff }}")
    with pytest.raises(ValueError, match=re.escape(f"--chat-template {tmp_path / 't.jinja'}: is not UTF-8 text")):
        read_chat_template(str(tmp_path / "t.jinja"))


def test_several_models_check_their_generation_configs_before_any_weights_load(tmp_path, monkeypatch):
    """One model's bad generation_config.json used to be found only after every model's weights had loaded."""
    from mempath import LLM
    from mempath.assets import default_model_path
    from mempath.engine import startup
    good, bad = tmp_path / "good", tmp_path / "bad"
    shutil.copytree(default_model_path(), good)
    shutil.copytree(default_model_path(), bad)
    (bad / "generation_config.json").write_text('{"temperature": -1}')
    monkeypatch.setattr(startup.Startup, "load_weights", lambda *a, **k: pytest.fail("the weights loaded"))
    with pytest.raises(ValueError, match=re.escape(f"{bad / 'generation_config.json'}: temperature must be >= 0")):
        LLM([str(good), str(bad)], device="cpu", show_progress=False)


def test_several_models_refuse_a_generation_config_that_is_no_path_in_one_line():
    from mempath import LLM
    from mempath.assets import default_model_path
    model = str(default_model_path())
    with pytest.raises(ValueError, match=re.escape("generation_config must be auto, vllm or a directory holding "
                                                   "generation_config.json, got 5")):
        LLM([f"a={model}", f"b={model}"], generation_config=5, device="cpu", show_progress=False)
