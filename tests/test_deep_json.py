"""JSON nested deeper than Python's parser recurses (a RecursionError, which no caller caught) is bad JSON
like any other wherever mempath reads JSON it did not write: files, flags, request bodies and model output."""
import json

import pytest

from mempath.safe_io import loads_json

DEEP = "[" * 100_000 + "]" * 100_000
DEEP_OBJECT = '{"a": ' * 100_000 + "1" + "}" * 100_000


@pytest.mark.parametrize("text", [DEEP, DEEP_OBJECT, DEEP.encode()])
def test_loads_json_calls_deep_nesting_bad_json(text):
    with pytest.raises(json.JSONDecodeError, match="nested too deeply"):
        loads_json(text)
    assert loads_json("[[1]]") == [[1]]


def test_files_and_flags(tmp_path):
    from mempath.engine.spec.config import parse_speculative_config
    from mempath.generation_config import generation_defaults
    from mempath.model.loader import read_config
    from mempath.model.spec import CheckpointError
    from mempath.server.cli import parse_allowed_origins
    (tmp_path / "config.json").write_text(DEEP)
    with pytest.raises(CheckpointError, match=r"config.json: is not valid JSON \(nested too deeply"):
        read_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(DEEP)
    with pytest.raises(ValueError, match=r"generation_config.json is not valid JSON \(nested too deeply"):
        generation_defaults(str(tmp_path))
    with pytest.raises(ValueError, match=r"speculative_config is not valid JSON \(nested too deeply"):
        parse_speculative_config(DEEP)
    with pytest.raises(ValueError, match=r"--allowed-origins is not a valid JSON list"):
        parse_allowed_origins(DEEP)


def test_request_bodies():
    pytest.importorskip("fastapi")
    from mempath.multi.http import MultiModelApp
    from mempath.multi.pipeline_route import split_body
    from mempath.server.protocol import APIError
    app = MultiModelApp(None, {"a": "first"}, "unknown", max_body_bytes=1 << 30)
    assert app._app_for(DEEP.encode()) == "first"  # the first model's app answers it with its 400
    with pytest.raises(APIError) as caught:
        split_body(DEEP.encode())
    assert caught.value.status == 400


def test_model_output_is_no_tool_call():
    from mempath.server.tool_parsers import HermesParser, Llama3JsonParser, parse_tool_calls
    hermes = "<tool_call>" + DEEP_OBJECT + "</tool_call>"
    assert parse_tool_calls(HermesParser(), hermes) == (hermes, [])
    assert parse_tool_calls(Llama3JsonParser(), DEEP_OBJECT) == (DEEP_OBJECT, [])
