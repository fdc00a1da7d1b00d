"""--generation-config and the chat command's first errors: the file named, its keys named, the fix named."""
import json
import shutil

import pytest

from mempath import LLM, SamplingParams
from mempath.assets import default_model_path
from mempath.server.cli import read_chat_template
from tests.conftest import make_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    shutil.copytree(default_model_path(), path)
    (path / "generation_config.json").unlink(missing_ok=True)
    return path


def settings_dir(tmp_path, **config) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_generation_config_directorys_eos_token_id_stops_the_output(tiny, tmp_path):
    """It was read from the model directory only: the directory --generation-config named had its sampling
    defaults taken and its eos_token_id silently ignored."""
    plain = LLM(str(tiny), show_progress=False)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    first = plain.generate("Hi", params, use_tqdm=False)[0].token_ids
    stop_at = first[2]
    llm = LLM(str(tiny), show_progress=False, generation_config=settings_dir(tmp_path, eos_token_id=[stop_at]))
    out = llm.generate("Hi", params, use_tqdm=False)[0]
    assert out.token_ids == first[:first.index(stop_at) + 1] and out.finish_reason == "stop"


def test_a_bad_eos_token_id_names_generation_config_json(tiny, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    settings_dir(bad, eos_token_id="2")
    with pytest.raises(ValueError, match=r"generation_config.json: field 'eos_token_id' holds .*; correct it in "
                                         r"generation_config.json"):
        LLM(str(bad), show_progress=False)


def test_an_eos_token_id_outside_the_vocabulary_is_named_at_start_up(tiny, tmp_path, caplog):
    """An id past the logits is never sampled: outputs ran to max_tokens with no word of why."""
    with caplog.at_level("WARNING", logger="mempath.engine.startup"):
        llm = LLM(str(tiny), show_progress=False, generation_config=settings_dir(tmp_path, eos_token_id=[10 ** 6]))
    vocab = llm.engine.spec.vocab_size
    said = [r.getMessage() for r in caplog.records if "end-of-sequence" in r.getMessage()]
    assert said and said[0].startswith(f"end-of-sequence id 1000000 is outside the model's {vocab} logits")
    assert "outputs end on [" in said[0]  # the tokenizer's own EOS still ends them


def test_a_bad_max_new_tokens_is_named_as_the_file_names_it(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1, got 0"):
        LLM(str(tiny), show_progress=False, generation_config=settings_dir(tmp_path, max_new_tokens=0))


def test_an_empty_chat_template_is_named_empty():
    with pytest.raises(ValueError, match="--chat-template is empty; give the template's file or its text"):
        read_chat_template("")


def test_chat_without_a_template_or_a_tokenizer_names_the_fix(tmp_path):
    make_model(tmp_path / "nt", "llama", tokenizer=False)
    with pytest.raises(ValueError, match="has no tokenizer; give one with tokenizer="):
        LLM(str(tmp_path / "nt"), show_progress=False).chat([{"role": "user", "content": "Hi"}])
    make_model(tmp_path / "tok", "llama")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    if config.pop("chat_template", None) is not None:
        (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    for template in tmp_path.joinpath("tok").glob("chat_template.*"):
        template.unlink()
    with pytest.raises(ValueError, match="has no chat template .*; pass chat_template="):
        LLM(str(tmp_path / "tok"), show_progress=False).chat([{"role": "user", "content": "Hi"}])
