"""Default sampling parameters from a checkpoint's generation_config.json (vLLM's --generation-config).

``auto`` reads the model directory's file, a directory path reads that directory's, and
``vllm`` reads none (SamplingParams' own defaults). A field a request gives always wins;
the file only fills the ones it leaves out.
"""
import dataclasses
import logging
import os
from dataclasses import fields
from pathlib import Path

from mempath.config import lookup
from mempath.model.spec import json_kind
from mempath.safe_io import loads_json
from mempath.sampling import SamplingParams

log = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field (the keys vLLM reads).
SAMPLING_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: str, source: str = "auto") -> dict:
    """The SamplingParams fields the generation config sets; ValueError for a source that is not there."""
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"generation_config must be auto, vllm or a directory holding generation_config.json, "
                         f"got {source!r}")
    if source == "vllm":
        return {}
    folder = Path(model_dir if source == "auto" else source)
    path = folder / "generation_config.json"
    is_dir, is_file = lookup(folder)[0], lookup(path)[1]  # a name too long to be a path: none there
    if source != "auto" and not is_dir:
        raise ValueError(f"--generation-config {source}: not a directory; give auto, vllm or a directory "
                         f"holding generation_config.json")
    if not is_file:
        if source != "auto":
            raise ValueError(f"--generation-config {source}: no generation_config.json in that directory")
        return {}
    try:
        config = loads_json(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); fix it or pass --generation-config vllm") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds {json_kind(config)}, expected a JSON object of generation settings; "
                         "fix it or pass --generation-config vllm")
    known = {f.name for f in fields(SamplingParams)}
    defaults = {field: config[key] for key, field in SAMPLING_KEYS.items()
                if key in config and field in known and config[key] is not None}
    try:  # here, naming the file: a request that leaves these out would be refused for them
        SamplingParams(**defaults).validate(max_logprobs=0)
    except (TypeError, ValueError) as error:
        message = str(error)
        for key, field in SAMPLING_KEYS.items():  # the file's names for the fields (max_new_tokens)
            if key != field and key in config:
                message = message.replace(field, key)
        raise ValueError(f"{path}: {message}; fix it or pass --generation-config vllm") from None
    if defaults:
        log.info("default sampling parameters from %s: %s (a request's own values win; "
                 "--generation-config vllm ignores the file)", path, defaults)
    return defaults



# The request fields that set max_tokens, by endpoint.
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def with_defaults(params: SamplingParams, given: set[str], defaults: dict) -> SamplingParams:
    """`params` with the defaults for every field the request did not give (``given``: its field names).

    A default max_tokens only lowers the server's own default (OpenAI's 16 for completions,
    the room left for chat), as vLLM's does.
    """
    changes = {k: v for k, v in defaults.items() if k != "max_tokens" and k not in given}
    if "max_tokens" in defaults and not given.intersection(MAX_TOKENS_FIELDS):
        changes["max_tokens"] = min(defaults["max_tokens"], params.max_tokens)
    return dataclasses.replace(params, **changes) if changes else params
