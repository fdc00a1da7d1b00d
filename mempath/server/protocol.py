"""OpenAI request shapes, response builders, and the one error body every failure uses.

Requests are parsed in strict mode straight from the JSON bytes: ``"max_tokens": "5"``
is a wrong type, not a number, and ``Infinity``, ``NaN`` or ``1e999`` are not finite
numbers; the error names the field. ``null`` in a field that has a default is that
default, as OpenAI's spec and vLLM take it. Unknown fields are ignored, with one
warning per request naming them, as vLLM logs them (clients send fields they don't
expect us to use, such as ``store`` or ``service_tier``); the fields of OpenAI's API
and vLLM's extensions that would change the answer and that we cannot honour are
refused, naming the field, unless they hold the value that asks for nothing
(``NOT_HONOURED``). A chat message and its text parts follow the top level's rule: an
unknown key there (``messages.0.weird``, ``messages.0.content.0.cache_control``) is
ignored and named in the same warning (``_Strict.nested_ignored``), as clients replay
fields of OpenAI's answers we do not read. The structured-output objects are stricter
(server/structured_request.py): each of their keys shapes the output.
"""
import json
import logging
import math
import re
import time
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from mempath.engine.input import join_text_parts
from mempath.sampling import MAX_LOGIT_BIAS

log = logging.getLogger(__name__)

# Matching stop strings costs work per token for each of them, in proportion to their
# length on some paths: bound both (docs/server.md compares these with OpenAI and vLLM).
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters
MAX_SEED = 2**63 - 1
MAX_BAD_WORDS = 64  # each is tokenized per request and matched per step
TOKEN_ID_KEY = re.compile(r"-?[0-9]+")  # a logit_bias key
MAX_TOKEN_ID_DIGITS = 18  # more digits than any vocabulary's ids have: refused before int() reads them
MAX_IGNORED_NAMED = 20  # unknown fields a warning names; the body limit bounds the rest

# Field -> the values that ask for nothing beyond what the server does (None: absent).
NOT_HONOURED_SAMPLING = {
    "use_beam_search": (False,), "length_penalty": (1,),
    "stop_token_ids": ([],), "include_stop_str_in_output": (False,),
    "spaces_between_special_tokens": (True,), "allowed_token_ids": (),
    "truncate_prompt_tokens": (),
    # response_format, structured_outputs and guided_json / regex / choice / grammar are honoured
    # (server/structured_request.py); xgrammar is the one backend.
    "guided_decoding_backend": ("xgrammar", "auto"), "guided_whitespace_pattern": (),
    "logits_processors": (), "priority": (0,), "return_tokens_as_token_ids": (False,),
    "cache_salt": (), "prediction": (),
}
NOT_HONOURED_CHAT = {
    **NOT_HONOURED_SAMPLING, "functions": ([],),
    "function_call": ("none", "auto"), "add_generation_prompt": (True,),
    "continue_final_message": (False,), "chat_template": (), "chat_template_kwargs": ({},),
    "documents": (), "echo": (False,), "add_special_tokens": (False,), "audio": (),
    "modalities": (["text"],), "reasoning_effort": (), "web_search_options": (),
    "mm_processor_kwargs": (),
}
NOT_HONOURED_COMPLETION = {**NOT_HONOURED_SAMPLING, "add_special_tokens": (True,),
                           "tools": ([],), "tool_choice": ("none", "auto")}  # chat only
NOT_HONOURED_MESSAGE = {"function_call": (), "audio": (), "refusal": ()}


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
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    # Fields checked by a validator of their own rather than declared (NOT_HONOURED_*): not "ignored".
    checked_fields: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data, info: ValidationInfo):
        """Drop the nulls of fields that have a default; note the top level's unknown fields."""
        if not isinstance(data, dict):
            return data
        if info.context is not None and info.context.get("model") is cls:
            info.context["ignored"] = (set(data) - set(cls.model_fields) - set(cls.checked_fields)
                                       | cls.nested_ignored(data))
        # OpenAI's clients send null for a field they leave unset; dropped, it is neither a type
        # error nor in model_fields_set, so the --generation-config default applies to it as well.
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}

    @classmethod
    def nested_ignored(cls, data: dict) -> set[str]:
        """The paths of unknown keys in nested objects that are ignored as the top level's are."""
        return set()


def same_json(value, neutral) -> bool:
    """Equal and of the same JSON type (True is not 1 here, but 1 is 1.0)."""
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return type(value) is type(neutral) and value == neutral


def refuse_not_honoured(data, fields: dict, where: str = "", fixes: dict[str, str] | None = None) -> None:
    """APIError(400) for the first field that asks for something this server does not do (``fields``: name ->
    the values that ask for nothing), naming ``fixes[name]`` where given, else how to leave it be."""
    if not isinstance(data, dict):
        return
    for name, neutral in fields.items():
        value = data.get(name)
        if isinstance(value, float) and not math.isfinite(value):
            raise APIError(400, f"invalid value for '{where}{name}': Input should be a finite number "
                                f"(got {value!r})", f"{where}{name}", "invalid_value")
        if value is None or any(same_json(value, n) for n in neutral):
            continue
        allowed = " or ".join(json.dumps(n) for n in neutral)
        hint = (fixes or {}).get(name) or (f"leave it out or at {allowed}" if neutral else "leave it out")
        raise APIError(400, f"{where}{name} is not supported by this server; {hint}", f"{where}{name}")


def unknown_stream_options(data: dict, known) -> set[str]:
    """``stream_options.KEY`` for each key of the body's stream_options not in ``known`` (the ignored warning)."""
    options = data.get("stream_options")
    return {f"stream_options.{key}" for key in set(options) - set(known)} if isinstance(options, dict) else set()


def check_stream_options(req) -> None:
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")


def refuse_not_honoured_in_messages(data) -> None:
    """refuse_not_honoured for each chat message of a request body (``messages.{i}.field``), and the
    400s its chat template would otherwise give in its own words, or not at all: a turn with no
    content, a malformed earlier tool call (check_message)."""
    messages = data.get("messages") if isinstance(data, dict) else None
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        refuse_not_honoured(message, NOT_HONOURED_MESSAGE, f"messages.{i}.")
        check_message(message, f"messages.{i}")


def check_message(message, where: str) -> None:
    """APIError(400) for a message of a known role with no content (null, left out or ``[]``; an
    assistant's may be, beside tool_calls, as OpenAI's), or an entry of tool_calls that is not
    OpenAI's shape: ``{"type": "function", "function": {"name": str, "arguments": str}}`` (the type may be
    left out: function is the only one)."""
    if not isinstance(message, dict) or message.get("role") not in MESSAGE_ROLES:
        return  # not an object, or an unknown role: the model's validation names it
    role, content, calls = message["role"], message.get("content"), message.get("tool_calls")
    if (content is None or content == []) and not (role == "assistant" and calls):
        also = " (an assistant message may leave it out when it has tool_calls)" if role == "assistant" else ""
        raise APIError(400, f"{where}.content is {'empty' if content == [] else 'missing'}: {role} messages "
                            f"need content, a string or a list of text parts{also}", f"{where}.content")
    for j, call in enumerate(calls if isinstance(calls, list) else []):  # another type: the model's validation
        at = f"{where}.tool_calls.{j}"
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(call, dict) and not isinstance(function, dict):
            raise APIError(400, f"{at}.function must be an object with a string name and string arguments "
                                f"(JSON text), as OpenAI returned the call", f"{at}.function")
        if isinstance(call, dict) and call.get("type") not in (None, "function"):  # left out: a function, as OpenAI
            raise APIError(400, f"{at}.type must be \"function\", got {json.dumps(call.get('type'))[:40]}",
                           f"{at}.type")
        for key, what, kinds in (("name", "the function's name", str),
                                 ("arguments", "the arguments as JSON text, or their object", (str, dict))):
            value = function.get(key) if isinstance(function, dict) else ""
            if not isinstance(value, kinds):
                got = "it is missing" if value is None else f"got {type(value).__name__}"
                raise APIError(400, f"{at}.function.{key} must be {what}; {got}", f"{at}.function.{key}")


def ignored_in_messages(data: dict) -> set[str]:
    """``messages.N.key`` and ``messages.N.content.M.key`` for each key a message or text part does
    not have: ignored, as unknown top-level fields are, and named in the same warning."""
    return ignored_in_items(data.get("messages"), "messages", MESSAGE_KEYS, TextPart.model_fields, ("text",))


def ignored_in_items(items, where: str, item_keys, part_keys, part_kinds: tuple[str, ...]) -> set[str]:
    """``where.N.key`` for each key of a listed message that is not in ``item_keys``, and
    ``where.N.content.M.key`` for each key of a text part (of a type in ``part_kinds``) not in ``part_keys``."""
    found = set()
    for i, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        found.update(f"{where}.{i}.{key}" for key in item if key not in item_keys)
        content = item.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") in part_kinds:
                found.update(f"{where}.{i}.content.{j}.{key}" for key in part if key not in part_keys)
    return found


def refuse_other_parts(messages, where: str, kinds: tuple[str, ...]) -> None:
    """APIError(400) for the first content part that is not text (images, audio, files), by its type."""
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in kinds:
                shown = kind if len(kind) <= 40 else kind[:40] + "..."
                raise APIError(400, f"{shown} content parts are not supported by this server (text only: "
                                    f"{' or '.join(kinds)} parts, or a string)",
                               f"{where}.{i}.content.{j}.type")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk

    @model_validator(mode="after")
    def _check_supported(self):
        if self.continuous_usage_stats:
            raise APIError(400, "stream_options.continuous_usage_stats is not supported by this "
                                "server; leave it out or at false", "stream_options")
        return self


class _SamplingExtensions(_Strict):
    """vLLM's sampling fields beyond OpenAI's, which /v1/responses takes as well as completions and chat."""
    top_k: int = Field(0, ge=-1)
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    # null is the default, as in vLLM's protocol (clients send null for unset fields).
    logit_bias: dict[str, float] | None = None  # OpenAI's on completions and chat
    repetition_penalty: float | None = Field(None, gt=0.0)
    skip_special_tokens: bool | None = None

    @model_validator(mode="after")
    def _check_extensions(self):
        self.stop_list()
        self.logit_bias_ids()
        return self

    def extension_params(self) -> dict:
        """These fields as SamplingParams' keyword arguments."""
        return dict(top_k=self.top_k, seed=self.seed, stop=self.stop_list(), ignore_eos=self.ignore_eos,
                    repetition_penalty=self.repetition_penalty or 1.0, logit_bias=self.logit_bias_ids(),
                    skip_special_tokens=self.skip_special_tokens is not False)

    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with its JSON string keys as token ids; 400 naming the bad entry."""
        if not self.logit_bias:
            return None
        bias, keys = {}, {}
        for key, value in self.logit_bias.items():
            # ASCII digits only: int() also reads "٥", " 5" and "+5", and str.isdigit() takes "²".
            if not TOKEN_ID_KEY.fullmatch(key):
                raise APIError(400, f"logit_bias keys must be token ids written as decimal integers "
                                    f"(\"50256\"), got {key!r}", "logit_bias")
            if len(key.lstrip("-").lstrip("0")) > MAX_TOKEN_ID_DIGITS:  # int() refuses past 4,300 digits
                raise APIError(400, f"logit_bias key {key[:12] + '...'!r} ({len(key)} characters) is not a token id: "
                                    f"the vocabulary has far fewer tokens", "logit_bias")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise APIError(400, f"logit_bias[{key}] must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
                                    f"got {value}", "logit_bias")
            token_id = int(key)
            if token_id in bias:
                raise APIError(400, f"logit_bias names token {token_id} twice ({keys[token_id]!r} and "
                                    f"{key!r}); give it once", "logit_bias")
            bias[token_id], keys[token_id] = value, key
        return bias

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}",
                           "stop")
        if any(not s for s in stops):
            raise APIError(400, "stop strings must be non-empty", "stop")
        longest = max(stops, key=len, default="")
        if len(longest) > MAX_STOP_LENGTH:
            raise APIError(400, f"stop strings may have at most {MAX_STOP_LENGTH} characters, got one "
                                f"of {len(longest)}", "stop")
        return stops


class _SamplingRequest(_SamplingExtensions):
    """Fields shared by completions and chat completions."""
    model: str | None = None  # None: the one served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # extension
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's penalties, and vLLM's extensions (extra_body), in vLLM's ranges; SamplingParams.validate
    # checks the rest (min_tokens <= max_tokens). null is the default.
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    min_tokens: int | None = Field(None, ge=0)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    prompt_logprobs: int | None = Field(None, ge=0)
    length_penalty: float | None = None  # typed for its error; NOT_HONOURED refuses all but 1
    best_of: int | None = None  # typed for its error: refused but for 1
    user: str | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and guided_* fields
    # (checked and turned into StructuredOutputsParams by server/structured_request.py).
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @classmethod
    def nested_ignored(cls, data: dict) -> set[str]:
        return unknown_stream_options(data, StreamOptions.model_fields)

    @model_validator(mode="after")
    def _check_supported(self):
        check_stream_options(self)
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs is not supported with stream: true; leave one out",
                           "prompt_logprobs")
        if self.best_of is not None and self.best_of != 1:
            raise APIError(400, "best_of is not supported by this server (vLLM removed it too); "
                                "leave it out and use n", "best_of")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    checked_fields: ClassVar[tuple[str, ...]] = tuple(NOT_HONOURED_COMPLETION)

    @model_validator(mode="before")
    @classmethod
    def _refuse_not_honoured(cls, data):
        refuse_not_honoured(data, NOT_HONOURED_COMPLETION)
        return data

    @model_validator(mode="after")
    def _check_completion_fields(self):
        if self.echo:
            raise APIError(400, "echo is not supported by this server", "echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix")
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


MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(_Strict):
    """One chat turn. ``developer`` is OpenAI's newer name for ``system``: it reaches a chat template that
    never mentions "developer" as ``system`` (server/calls.py:with_roles_of), as most templates raise on
    a role they do not know. Checked before this model: refuse_not_honoured_in_messages."""
    role: Literal[MESSAGE_ROLES]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool's answer: the template may show which call it answers
    tool_calls: list[dict] | None = None  # an assistant's earlier calls, as OpenAI returned them

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = join_text_parts([part.text for part in content])
        message = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_call_id", "tool_calls"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


MESSAGE_KEYS = frozenset(ChatMessage.model_fields) | frozenset(NOT_HONOURED_MESSAGE)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[dict] | None = None  # checked by server/tool_choice.py
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    checked_fields: ClassVar[tuple[str, ...]] = tuple(NOT_HONOURED_CHAT)

    @model_validator(mode="before")
    @classmethod
    def _refuse_not_honoured(cls, data):
        refuse_not_honoured(data, NOT_HONOURED_CHAT)
        refuse_not_honoured_in_messages(data)
        refuse_other_parts(data.get("messages") if isinstance(data, dict) else None, "messages", ("text",))
        return data

    @classmethod
    def nested_ignored(cls, data: dict) -> set[str]:
        return super().nested_ignored(data) | ignored_in_messages(data)

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
    """Validate JSON bytes into a request model; raise APIError(400) naming the field.

    Unknown top-level fields are ignored with one warning naming them (vLLM's line)."""
    context = {"model": model}
    try:
        request = model.model_validate_json(body, context=context)
    except ValidationError as error:
        raise validation_error(error) from None
    if context.get("ignored"):
        names = sorted(context["ignored"])
        shown = "{" + ", ".join(repr(n[:64]) for n in names[:MAX_IGNORED_NAMED]) + "}"
        more = f" and {len(names) - MAX_IGNORED_NAMED} more" if len(names) > MAX_IGNORED_NAMED else ""
        log.warning("The following fields were present in the request but ignored: %s%s", shown, more)
    return request


def validation_error(error: ValidationError) -> APIError:
    errors = error.errors(include_url=False)
    first = errors[0]
    if first["type"].endswith("_type") and len(errors) > 1:
        # A union's first alternative refused the value's type (a list where str | list[...] goes): the
        # alternative that took the type and failed inside it names the real problem, and its error is
        # deeper; among those the one that got furthest through the list ([1, "a"]: item 1, not item 0).
        field = _field_path(first)
        same = [e for e in errors if _field_path(e)[:len(field)] == field]
        first = max(same, key=lambda e: (len(_field_path(e)), [p if isinstance(p, int) else -1 for p in e["loc"]]))
    if first["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first['msg']}", None, "invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return APIError(400, "the body must be a JSON object", None, "invalid_body")
    param = ".".join(_field_path(first)) or None
    shown = first.get("input")
    detail = f"{first['msg']} (got {shown!r})" if first["type"] != "missing" else first["msg"]
    return APIError(400, f"invalid value for '{param}': {detail}", param, "invalid_value")


def _field_path(error: dict) -> list[str]:
    """An error's location without the type names union members add to it."""
    return [str(p) for p in error["loc"] if not _is_type_name(p)]


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
