"""``POST /v1/pipelines``: the HTTP face of LLM.pipeline (docs/server.md, "Pipelines").

The body is a completion request for the first model, with one more field, ``then``: the
second model's ``model``, the ``template`` its prompt is made from (``{output}``, and
``{prompt}``), and its own completion fields (``max_tokens``, ``temperature``, ``stop``...).
Both halves are validated as /v1/completions validates a body (a bad field is a 400
naming it, ``then.`` before the second's), the second's before the first model runs, as
far as it can be without the first's answer (MultiEngine.add_pipeline); the answer is a
completion of the second model, streamed when ``stream`` is true, as /v1/completions answers.
"""
from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from mempath.generation_config import with_defaults
from mempath.multi.pipeline import SecondModelError, Template
from mempath.safe_io import loads_json
from mempath.server.app import (COMPLETION_DEFAULT_MAX_TOKENS, finish_completion, sampling_params,
                                stream_completion)
from mempath.server.calls import (Call, Limits, SSEResponse, api_key_checker, check_num_choices, off_the_loop,
                                  param_named_in, read_body, resolve_max_tokens, token_ids_of, until_disconnect)
from mempath.server.protocol import APIError, CompletionRequest, parse_request
from mempath.server.structured_request import StructuredRequest, structured_request


class PipelineClient:
    """A ModelClient whose requests are pipelines: added to the first model, answered by the second."""

    def __init__(self, client, second: str, template: str, second_params, second_structured):
        self.client, self.second, self.template, self.second_params = client, second, template, second_params
        self.second_structured = second_structured
        self.tokenizer, self.max_model_len = client.tokenizer, client.max_model_len
        self.max_request_tokens = client.max_request_tokens

    async def add_request(self, prompt, params, request_id: str, queue) -> None:
        try:
            await self.client.shared.add_pipeline(prompt, params, request_id, queue, self.client.name,
                                                  self.second, self.template, self.second_params)
        except SecondModelError as error:
            raise second_model_error(error, self.second_structured) from None

    def abort(self, request_id: str) -> None:
        self.client.abort(request_id)

    def check_request(self, prompt, params, request_id: str) -> None:
        self.client.check_request(prompt, params, request_id)  # the prompt is the first model's


def second_model_error(error: SecondModelError, structured: StructuredRequest | None) -> APIError:
    """The second model's refusal as a 400 naming its field under ``then``."""
    refused = APIError(400, error.reason, param_named_in(error.reason))
    if structured is not None:
        refused = structured.field_error(refused)
    message, param = refused.message, refused.param
    if param == "prompt":  # the second model's prompt is the template filled in
        message, param = (f"then.template with the first model's prompt and no answer yet makes the second "
                          f"model's prompt, and {message}"), "template"
    return APIError(400, f"{error.model} refuses the pipeline's second request (then): {message}",
                    f"then.{param}" if param else "then", refused.code)


def under_then(error: APIError) -> APIError:
    error.param = f"then.{error.param}" if error.param else "then"
    return error


def split_body(body: bytes) -> tuple[bytes, dict]:
    """(the first model's completion body, ``then``), refusing a ``then`` that is no object."""
    try:
        data = loads_json(body)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        parse_request(CompletionRequest, body)  # the same 400 /v1/completions gives
        raise APIError(400, "the body must be a JSON object", None, "invalid_body")
    then = data.pop("then", None)
    if not isinstance(then, dict):
        raise APIError(400, "a pipeline needs 'then': an object with the second model's 'model', its "
                            "'template' ({output}: the first model's answer) and its completion fields", "then")
    return json.dumps(data).encode(), then


def second_request(then: dict, names: list[str]) -> tuple[str, str, CompletionRequest]:
    """The second model's name, template and completion fields, validated as a completion body
    (its fields that need the model: MultiEngine.add_pipeline)."""
    model, template = then.get("model"), then.get("template")
    if model not in names:
        served = ", ".join(f"'{name}'" for name in names)
        raise APIError(404 if isinstance(model, str) else 400,
                       f"then.model must be a served model ({served}), got {model!r}", "then.model",
                       "model_not_found" if isinstance(model, str) else "invalid_value")
    if not isinstance(template, str):
        raise APIError(400, "then.template must be a string holding {output} (the first model's answer)",
                       "then.template")
    try:
        Template.parse(template)
    except ValueError as error:
        raise APIError(400, str(error), "then.template") from None
    fields = {k: v for k, v in then.items() if k != "template"}
    for name in ("prompt", "stream", "n", "echo", "suffix"):
        if name in fields:
            raise APIError(400, f"then.{name} is not taken: the second model's prompt is the template, "
                                f"its one answer is the response", f"then.{name}")
    if fields.get("prompt_logprobs") is not None:
        raise APIError(400, "then.prompt_logprobs is not supported: the answer holds no prompt logprobs of "
                            "the second model's prompt (the filled template); leave it out", "then.prompt_logprobs")
    try:
        req = parse_request(CompletionRequest, json.dumps({**fields, "prompt": ""}).encode())
    except APIError as error:
        raise under_then(error) from None
    return model, template, req


def refuse_first_logprobs(req: CompletionRequest) -> None:
    """The answer is the second model's: the first's logprobs would have nowhere to go."""
    if req.logprobs is not None:
        raise APIError(400, "logprobs is not supported for the first model of a pipeline: the answer is the "
                            "second model's tokens; ask for theirs as then.logprobs", "logprobs")
    if req.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs is not supported in a pipeline: the answer is the second "
                            "model's; leave it out", "prompt_logprobs")


def pipeline_router(client, names: list[str], api_key: str | None, limits_by_model: dict[str, Limits],
                    defaults_by_model: dict[str, dict]) -> APIRouter:
    """``limits_by_model``: each served model's Limits (the first's for the body, the second's for ``then``)."""
    api = APIRouter(prefix="/v1", dependencies=[Depends(api_key_checker(api_key))])
    limits = limits_by_model[client.name]

    @api.post("/pipelines")
    async def create_pipeline(request: Request):
        first_body, then = split_body(await read_body(request, limits.max_body_bytes))
        req = parse_request(CompletionRequest, first_body)
        second, template, then_req = second_request(then, names)
        refuse_first_logprobs(req)
        prompts = req.prompts()
        if req.n != 1:
            raise APIError(400, "a pipeline hands one answer on: n must be 1", "n")
        check_num_choices(len(prompts), 1, limits)
        structured = structured_request(req)
        first_params = with_defaults(
            sampling_params(req, resolve_max_tokens(req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, limits),
                            None, structured), req.model_fields_set, defaults_by_model[client.name])
        try:
            second_structured = structured_request(then_req)
            second_max_tokens = resolve_max_tokens(then_req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS,
                                                   limits_by_model[second])
        except APIError as error:
            raise under_then(error) from None
        second_params = with_defaults(
            sampling_params(then_req, second_max_tokens, then_req.logprobs, second_structured),
            then_req.model_fields_set, defaults_by_model[second])
        pipeline = PipelineClient(client, second, template, second_params, second_structured)
        # On the tokenizing thread, as /v1/completions does: the engine thread steps every model.
        prompts = await off_the_loop(lambda texts: [token_ids_of(client.tokenizer, t) for t in texts], prompts)
        call = Call(pipeline, f"pipe-{uuid.uuid4().hex}", second, then_req.stop_list(), 1, then_req.logprobs)
        await call.start(prompts, first_params, structured)
        if req.stream:
            return SSEResponse(stream_completion(call, req.include_usage), on_close=call.abort)
        return JSONResponse(await until_disconnect(request, finish_completion(call)))

    return api
