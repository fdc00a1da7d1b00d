"""SpeculativeConfig: vLLM's ``speculative_config`` dict, validated once (torch-free).

Keys as vLLM names them: ``model`` (the draft model's directory), ``method``
(``draft_model``, the default with a model, or ``ngram``), ``num_speculative_tokens``
(the most tokens proposed per step, 1..8), ``prompt_lookup_min`` / ``prompt_lookup_max``
(n-gram lengths). mempath adds ``adaptive`` (default true: the draft length is chosen
every step by the cost model, 0 when speculation does not pay; false: always
``num_speculative_tokens``).
"""
import json
from dataclasses import dataclass

from mempath.safe_io import loads_json

MAX_SPECULATIVE_TOKENS = 8
METHODS = ("draft_model", "ngram")
KEYS = ("model", "method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    adaptive: bool = True

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"


def _int(fields: dict, name: str, low: int, high: int, default=None) -> int:
    value = fields.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config: {name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """A dict, its JSON text (the CLI's --speculative-config) or None; ValueError naming the key."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = loads_json(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"speculative_config is not valid JSON ({error.msg} at character {error.pos}); "
                             """write it as '{"model": DIR, "num_speculative_tokens": 4}'""") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {unknown}; known keys: {list(KEYS)}")
    method = value.get("method", "draft_model" if "model" in value else None)
    if method not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {list(METHODS)} (or give a draft "
                         f"\"model\"), got {method!r}")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config: num_speculative_tokens is required (1 to "
                         f"{MAX_SPECULATIVE_TOKENS})")
    k = _int(value, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    model = value.get("model")
    if method == "draft_model" and (not isinstance(model, str) or not model):
        raise ValueError("speculative_config: method draft_model needs \"model\": the draft's directory")
    if method == "ngram" and model is not None:
        raise ValueError("speculative_config: method ngram uses no draft model; drop \"model\"")
    lookup = [key for key in ("prompt_lookup_min", "prompt_lookup_max") if key in value]
    if method == "draft_model" and lookup:
        raise ValueError(f"speculative_config: {' and '.join(lookup)} set the ngram method's lookup; a draft "
                         f"model proposes without it: drop {'them' if len(lookup) > 1 else 'it'}")
    low = _int(value, "prompt_lookup_min", 1, 64, 1)
    high = _int(value, "prompt_lookup_max", low, 64, max(low, 4))
    adaptive = value.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"speculative_config: adaptive must be true or false, got {adaptive!r}")
    return SpeculativeConfig(method, k, model, low, high, adaptive)
