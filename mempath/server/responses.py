"""/v1/responses: OpenAI's Responses API for text in and text out, streaming or not.

The input is a string or a list of messages (``input_text`` / ``output_text`` parts),
``instructions`` a system message before them; the conversation goes through the chat
template as /v1/chat/completions does. vLLM's extensions of this API (seed, stop, top_k,
repetition_penalty ...) are honoured as on the other routes. Nothing is stored, so
``previous_response_id`` and ``store: true`` are refused, as are tools, structured text
formats, reasoning and other inputs than text, each with a 400 naming the field; so are
the other routes' fields that would change the answer (``max_tokens``: use
``max_output_tokens``), which vLLM ignores. A stream sends OpenAI's
events (``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ..., the matching
``.done`` events, then ``response.completed``). One difference, as vLLM's: a response
cut at ``max_output_tokens`` ends with ``response.completed`` carrying status
``incomplete`` (OpenAI sends ``response.incomplete``), so that the official client's
``stream(...).get_final_response()`` returns it.
"""
import itertools
import json
import time
import uuid
from typing import ClassVar, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import Field, model_validator

from mempath.engine.input import join_text_parts
from mempath.generation_config import with_defaults
from mempath.sampling import SamplingParams
from mempath.server.async_engine import AsyncEngine, Update
from mempath.server.calls import (Call, ChoiceText, Limits, SSEResponse, api_key_checker, check_context,
                                  check_model, check_prompt_length, collect, off_the_loop, read_body,
                                  render_messages, resolve_max_tokens, stream_error_body, until_disconnect)
from mempath.server.protocol import (APIError, _SamplingExtensions, _Strict, check_stream_options, error_body,
                                     ignored_in_items, parse_request, refuse_not_honoured, refuse_other_parts,
                                     unknown_stream_options)

# Field -> the values that ask for nothing this server does not do: OpenAI's Responses API's fields, then
# vLLM's extensions of it (its seed, stop, top_k ... are honoured: _SamplingExtensions).
NOT_HONOURED_RESPONSES = {
    "previous_response_id": (), "conversation": (), "store": (False,), "background": (False,),
    "tools": ([],), "tool_choice": ("none", "auto"), "max_tool_calls": (), "prompt": (),
    "text": ({"format": {"type": "text"}},), "reasoning": (), "include": ([],), "truncation": ("disabled",),
    "top_logprobs": (0,),
    "include_stop_str_in_output": (False,), "structured_outputs": (), "priority": (0,), "cache_salt": (),
    "mm_processor_kwargs": (), "media_io_kwargs": (), "vllm_xargs": (), "kv_transfer_params": (),
    "previous_input_messages": (), "enable_response_messages": (False,),
}
ON_CHAT = "leave it out, or use /v1/chat/completions, which takes it"
# Fields of this server's other routes that would change the answer, sent here out of habit: refused with
# the fix, as /v1/completions refuses chat's tools (field -> the values that ask for nothing). Any other
# field neither API has is ignored with the warning (protocol.parse_request).
OTHER_ROUTES_FIELDS = {"max_tokens": (), "max_completion_tokens": (), "n": (1,), "logprobs": (False,), "min_p": (0,),
                       "presence_penalty": (0,), "frequency_penalty": (0,), "min_tokens": (0,), "bad_words": ([],),
                       "response_format": ({"type": "text"},), "prompt_logprobs": (), "best_of": (1,)}
OTHER_ROUTES_FIXES = {
    "max_tokens": "use max_output_tokens", "max_completion_tokens": "use max_output_tokens",
    "n": "a response has one output: send the request again for another, or use /v1/chat/completions with n",
    "logprobs": "this server's responses carry no logprobs: use /v1/chat/completions or /v1/completions",
    **{name: ON_CHAT for name in ("min_p", "presence_penalty", "frequency_penalty", "min_tokens", "bad_words",
                                  "response_format", "prompt_logprobs")},
}


INPUT_PART_KINDS = ("input_text", "output_text")


class InputPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) else join_text_parts([p.text for p in self.content])
        return {"role": self.role, "content": content}


class ResponsesStreamOptions(_Strict):
    # OpenAI pads its deltas with random characters against length side channels unless this is false:
    # either way the text is the same, and no padding is sent here (nor by vLLM).
    include_obfuscation: bool = True


class ResponsesRequest(_SamplingExtensions):
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    checked_fields: ClassVar[tuple[str, ...]] = (*NOT_HONOURED_RESPONSES, *OTHER_ROUTES_FIELDS)

    @model_validator(mode="before")
    @classmethod
    def _refuse_not_honoured(cls, data):
        refuse_not_honoured(data, NOT_HONOURED_RESPONSES)
        refuse_not_honoured(data, OTHER_ROUTES_FIELDS, fixes=OTHER_ROUTES_FIXES)
        items = data.get("input") if isinstance(data, dict) else None
        for i, item in enumerate(items if isinstance(items, list) else []):
            if not isinstance(item, dict):
                raise APIError(400, f"input.{i} must be a message object ({{\"role\": ..., \"content\": ...}}), "
                                    f"got {type(item).__name__}", f"input.{i}")
            kind = item.get("type")
            if kind not in ("message", None):  # null is the default: a message
                raise APIError(400, f"input.{i}: only messages with text are supported, got type {kind!r}",
                               f"input.{i}.type")
        refuse_other_parts(items, "input", INPUT_PART_KINDS)
        return data

    @model_validator(mode="after")
    def _check_stream_options(self):
        check_stream_options(self)
        return self

    @classmethod
    def nested_ignored(cls, data: dict) -> set[str]:
        return unknown_stream_options(data, ResponsesStreamOptions.model_fields) | ignored_in_items(
            data.get("input"), "input", InputMessage.model_fields, InputPart.model_fields, INPUT_PART_KINDS)

    def messages(self) -> list[dict]:
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return system + [m.as_template_input() for m in items]


def responses_router(engine_client: AsyncEngine, served_model_name: str, api_key: str | None,
                     limits: Limits, sampling_defaults: dict) -> APIRouter:
    api = APIRouter(prefix="/v1", dependencies=[Depends(api_key_checker(api_key))])

    @api.post("/responses")
    async def create_response(request: Request):
        req = parse_request(ResponsesRequest, await read_body(request, limits.max_body_bytes))
        check_model(req.model, served_model_name)
        prompt = await off_the_loop(render_messages, engine_client.tokenizer, req.messages(), "input")
        check_prompt_length(len(prompt), engine_client.max_model_len, "input")  # before max_tokens is resolved
        room = max(1, engine_client.max_request_tokens - len(prompt))  # a pool too small: the engine refuses
        max_tokens = resolve_max_tokens(req.max_output_tokens, room, limits, "max_output_tokens")
        check_context(len(prompt), req.max_output_tokens, engine_client.max_model_len, "max_output_tokens", "input")
        params = with_defaults(sampling_params(req, max_tokens), req.model_fields_set, sampling_defaults)
        call = Call(engine_client, f"resp_{uuid.uuid4().hex}", served_model_name, req.stop_list(), 1, None)
        shape = ResponseShape(call, req, params)
        await call.start([prompt], params, fields={"max_tokens": "max_output_tokens", "prompt": "input"})
        if req.stream:
            return SSEResponse(stream_response(call, shape), on_close=call.abort)
        return JSONResponse(await until_disconnect(request, finish_response(call, shape)))

    return api


def sampling_params(req: ResponsesRequest, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                          **req.extension_params())


class ResponseShape:
    """The bodies of one response: the Response object at each stage, its message item."""

    def __init__(self, call: Call, req: ResponsesRequest, params: SamplingParams):
        self.call, self.req, self.params = call, req, params
        self.created_at = time.time()
        self.message_id = f"msg_{uuid.uuid4().hex}"

    def message(self, status: str, text: str | None) -> dict:
        content = [] if text is None else [output_text(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": content}

    def body(self, status: str, output: list[dict], usage: dict | None = None,
             final: Update | None = None, error: dict | None = None) -> dict:
        incomplete = final is not None and final.finish_reason == "length"
        return {
            "id": self.call.id, "object": "response", "created_at": self.created_at,
            "status": "incomplete" if incomplete else status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": self.req.instructions, "max_output_tokens": self.req.max_output_tokens,
            "model": self.call.model, "output": output, "parallel_tool_calls": False,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [], "truncation": "disabled",
            "usage": usage, "user": self.req.user, "metadata": self.req.metadata or {}}

    def usage(self, final: Update) -> dict:
        prompt, output = final.num_prompt_tokens, final.num_output_tokens
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + output}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def finish_response(call: Call, shape: ResponseShape) -> dict:
    finals, _, _ = await collect(call)
    final = finals[0]
    return shape.body("completed", [shape.message("completed", final.text)], shape.usage(final), final)


async def stream_response(call: Call, shape: ResponseShape):
    """The Responses API's server-sent events for one response; aborted however the stream ends."""
    numbers = itertools.count()

    def event(kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": next(numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    where = {"item_id": shape.message_id, "output_index": 0, "content_index": 0}
    text, sent = ChoiceText(call.stops), ""
    try:
        yield event("response.created", response=shape.body("in_progress", []))
        yield event("response.in_progress", response=shape.body("in_progress", []))
        yield event("response.output_item.added", output_index=0, item=shape.message("in_progress", None))
        yield event("response.content_part.added", **where, part=output_text(""))
        async for _, update in call.updates():
            delta = text.take(update)
            if delta:
                sent += delta
                yield event("response.output_text.delta", **where, delta=delta, logprobs=[])
            if update.finish_reason in ("error", "abort"):
                failure = (stream_error_body(update) if update.error else
                           error_body("the request was aborted", "server_error"))["error"]
                code = "invalid_value" if failure["param"] else "server_error"
                yield event("error", code=code, message=failure["message"], param=failure["param"])
                yield event("response.failed", response=shape.body(
                    "failed", [shape.message("incomplete", sent)], error={"code": code,
                                                                          "message": failure["message"]}))
                return
            if update.finished:
                yield event("response.output_text.done", **where, text=sent, logprobs=[])
                yield event("response.content_part.done", **where, part=output_text(sent))
                item = shape.message("completed", sent)
                yield event("response.output_item.done", output_index=0, item=item)
                yield event("response.completed", response=shape.body("completed", [item], shape.usage(update),
                                                                      update))
    finally:
        call.abort()
