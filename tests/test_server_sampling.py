"""Sampling parameters over HTTP, through the official openai client against a live server:
penalties, logit_bias, min_tokens, bad_words, skip_special_tokens and prompt_logprobs give what
the engine gives for the same SamplingParams; bad values are 400s naming the field."""
import json

import openai
import pytest

from mempath.sampling import SamplingParams
from tests.test_server import API_KEY, ENGINE_OPTIONS, assert_error, raw_post, serving, tiny_llama

PROMPT = "def read_config(path):"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_llama(tmp_path_factory, "sampling-model")


@pytest.fixture(scope="module")
def server(model_path):
    yield from serving(model_path)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def reference(model_path):
    from mempath import LLM
    return LLM(model_path, show_progress=False, **ENGINE_OPTIONS)


def engine_text(reference, prompt, **params) -> str:
    return reference.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].text


def test_openai_penalties_and_logit_bias_match_the_engine(client, reference):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                                    presence_penalty=0.7, frequency_penalty=1.1, logit_bias={"60": 4.5},
                                    extra_body={"ignore_eos": True})
    expected = engine_text(reference, PROMPT, max_tokens=16, temperature=0, presence_penalty=0.7,
                           frequency_penalty=1.1, logit_bias={60: 4.5}, ignore_eos=True)
    plain = engine_text(reference, PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    assert out.choices[0].text == expected != plain


def test_vllm_extensions_through_extra_body_match_the_engine(client, reference):
    extra = {"repetition_penalty": 1.4, "min_tokens": 4, "bad_words": ["x"], "ignore_eos": False}
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body=extra)
    expected = engine_text(reference, PROMPT, max_tokens=12, temperature=0, repetition_penalty=1.4,
                           min_tokens=4, bad_words=["x"])
    assert out.choices[0].text == expected
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=0, extra_body=extra)
    expected = reference.chat([{"role": "user", "content": "hi"}],
                              SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.4, min_tokens=4,
                                             bad_words=["x"]), use_tqdm=False)[0].text
    assert chat.choices[0].message.content == expected


def test_skip_special_tokens_over_http(client):
    common = dict(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, logit_bias={"2": 100})
    kept = client.completions.create(**common, extra_body={"skip_special_tokens": False, "ignore_eos": True})
    skipped = client.completions.create(**common, extra_body={"ignore_eos": True})
    assert kept.choices[0].text == "</s></s>" and skipped.choices[0].text == ""


def expected_prompt_logprobs(reference, prompt, n):
    out = reference.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=n),
                             use_tqdm=False)[0]
    return out.prompt_token_ids, out.prompt_logprobs, out.prompt_logprob_ranks


def check_prompt_logprobs(body, reference, prompt, n):
    token_ids, entries, ranks = expected_prompt_logprobs(reference, prompt, n)
    assert body[0] is None and len(body) == len(token_ids)
    for position, (got, entry, rank) in enumerate(zip(body[1:], entries[1:], ranks[1:]), start=1):
        actual = token_ids[position]
        assert set(got) == {str(t) for t in entry}
        assert got[str(actual)]["rank"] == rank
        assert got[str(actual)]["logprob"] == pytest.approx(entry[actual], abs=1e-5)
        assert got[str(actual)]["decoded_token"] == reference.engine.tokenizer.decode([actual])
        assert sorted(v["rank"] for t, v in got.items() if t != str(actual) or rank <= n) == list(range(1, n + 1))


def test_prompt_logprobs_in_vllms_response_fields(client, reference):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2, temperature=0,
                                    extra_body={"prompt_logprobs": 3})
    for choice in out.choices:
        check_prompt_logprobs(choice.model_extra["prompt_logprobs"], reference, PROMPT, 3)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 1})
    token_ids = reference.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1),
                               use_tqdm=False)[0].prompt_token_ids
    check_prompt_logprobs(chat.model_extra["prompt_logprobs"], reference, token_ids, 1)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})


@pytest.mark.parametrize("fields, param, says", [
    ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": "high"}, "frequency_penalty", "valid number"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"logit_bias": {"ten": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias", "is not a token id: the vocabulary has"),  # no Python advice
    ({"logit_bias": {"0" * 30 + "99999": 1}}, "logit_bias", "outside the vocabulary"),  # zero-padded: read as 99999
    ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "max_tokens=4"),
    ({"bad_words": "x"}, "bad_words", "valid array"),
    ({"bad_words": [" "]}, "bad_words", "non-empty"),
    ({"prompt_logprobs": 99}, "prompt_logprobs", "[0, 20]"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens", "valid boolean"),
    ({"best_of": 2, "n": 2}, "best_of", "vLLM removed it"),
])
def test_bad_sampling_fields_are_400s_naming_the_field(server, fields, param, says):
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        if param == "best_of" and "chat" in path:
            continue
        body = {"model": "tiny", "max_tokens": 2, **base, **fields}
        assert_error(raw_post(server, path, json.dumps(body).encode()), 400, param, says)


def test_the_openai_client_sees_a_400_for_best_of(client):
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, best_of=3)
