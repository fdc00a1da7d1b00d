"""OpenAI request shapes, response builders, and the one error body every failure uses.

Requests are parsed in strict mode straight from the JSON bytes: ``"max_tokens": "5"``
is a wrong type, not a number, and the error names the field. Unknown fields are
ignored (clients send fields they don't expect us to use); known fields that we
cannot honour are rejected rather than silently dropped.
"""
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1


class APIError(Exception):
    """An error with its HTTP status and OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ----------------------------------------------------------------- requests
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""
    model: str | None = None  # None: the one served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # extension, as in vLLM
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # extension
    ignore_eos: bool = False  # extension: generate exactly max_tokens (benchmarks)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _check_supported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise APIError(400, f"{name} is not supported by this server; leave it at 0", name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        return self

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}",
                           "stop")
        if any(not s for s in stops):
            raise APIError(400, "stop strings must be non-empty", "stop")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion_fields(self):
        if self.echo:
            raise APIError(400, "echo is not supported by this server", "echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported by this server (use n)", "best_of")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt is empty; give a string, a list of strings or token ids",
                           "prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _check_chat_fields(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree; give one",
                           "max_completion_tokens")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def parse_request(model: type[BaseModel], body: bytes):
    """Validate JSON bytes into a request model; raise APIError(400) naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise validation_error(error) from None


def validation_error(error: ValidationError) -> APIError:
    first = error.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first['msg']}", None, "invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return APIError(400, "the body must be a JSON object", None, "invalid_body")
    # Union members add their type name to loc: keep the field path only.
    path = [str(p) for p in first["loc"] if not _is_type_name(p)]
    param = ".".join(path) or None
    shown = first.get("input")
    detail = f"{first['msg']} (got {shown!r})" if first["type"] != "missing" else first["msg"]
    return APIError(400, f"invalid value for '{param}': {detail}", param, "invalid_value")


def _is_type_name(part) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part
                                      or part[0].isupper())


# ----------------------------------------------------------------- responses
def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(request_id: str, model: str, choices: list[dict], usage: dict | None,
                    chunk: bool = False, created: int | None = None) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": created or int(time.time()),
            "model": model, "choices": choices}
    if usage is not None or not chunk:
        body["usage"] = usage
    return body


def chat_body(request_id: str, model: str, choices: list[dict], usage: dict | None,
              chunk: bool = False, created: int | None = None) -> dict:
    body = {"id": request_id, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": created or int(time.time()), "model": model, "choices": choices}
    if usage is not None or not chunk:
        body["usage"] = usage
    return body


def models_body(name: str, max_model_len: int, created: int) -> dict:
    return {"object": "list", "data": [{
        "id": name, "object": "model", "created": created, "owned_by": "mempath",
        "root": name, "max_model_len": max_model_len}]}
