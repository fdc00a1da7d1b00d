"""The OpenAI-compatible HTTP API over an AsyncEngine.

Every failure answers with OpenAI's error body and a status that says whose fault
it is (400 bad request or foreign Host, 401 key, 404 model or route, 413 body too
large, 415 not JSON, 431 headers too large, 503 engine down); docs/server.md lists
the limits. Every engine request that an HTTP request started is aborted when
that HTTP request ends for any reason, so a client that goes away frees its KV
blocks at once.
"""
import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mempath import __version__
from mempath.generation_config import with_defaults
from mempath.sampling import SamplingParams
from mempath.multi.sleep import WakeFailed
from mempath.server.async_engine import AsyncEngine, EngineDeadError, Update
from mempath.server.calls import (SSE_DONE, Call, ChoiceText, Limits, SSEResponse, api_key_checker,  # noqa: F401
                                  check_context, check_model, check_num_choices, check_prompt_length, collect,
                                  error_of, param_named_in, read_body, render_messages, resolve_max_tokens, sse,
                                  off_the_loop, stream_error_body, token_ids_of, until_disconnect)
from mempath.server.guards import HeaderLimits, LoopbackHostOnly, is_loopback_address
from mempath.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_body,
                                     completion_body, error_body, models_body, parse_request)
from mempath.server.structured_request import StructuredRequest, structured_request
from mempath.server.tool_choice import (ToolStream, located_tools_error, plan_tools, tool_message,
                                        with_tool_constraint)
from mempath.server.tool_parsers import PARSERS, parser_for_template
from mempath.server.responses import ResponsesRequest, responses_router
from mempath.server.tokens import DetokenizeRequest, TokenizeRequest, tokens_router
from mempath.server.settings import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS,
                                     DEFAULT_MAX_N, check_api_key)

log = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MIN_LOGPROB = -9999.0  # JSON has no -inf


def build_app(engine_client: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_tokens_limit: int | None = None,
              max_n: int = DEFAULT_MAX_N, bind_host: str | None = None,
              allowed_origins: Sequence[str] = (), max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
              max_headers: int = DEFAULT_MAX_HEADERS, sampling_defaults: dict | None = None,
              root_path: str = "", enable_docs: bool = True, tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False, models_listed: Sequence[tuple[str, int]] = (),
              extra_routers: Sequence[APIRouter] = ()) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine thread.

    ``bind_host``: the address the server listens on; a loopback one turns on the
    Host check (guards.LoopbackHostOnly). None (tests, other servers): no check.
    ``allowed_origins``: CORS, off when empty. ``sampling_defaults``: SamplingParams
    fields for what a request leaves out (--generation-config). ``root_path``: the
    prefix a proxy serves this under (--root-path). ``enable_docs``: /docs and
    /openapi.json (--disable-fastapi-docs turns them off). ``tool_call_parser`` (vLLM's
    names, None: the chat template's format) and ``enable_auto_tool_choice``:
    server/tool_choice.py. ``models_listed``: (name, max_model_len) of every model /v1/models
    lists, when this app is one of several models' (mempath/multi/http.py); empty: this one.
    ``extra_routers``: routes beside the OpenAI ones (several models' /v1/pipelines).
    """
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSERS)}, got {tool_call_parser!r}")
    tools = ToolSettings(tool_call_parser or parser_for_template(
        getattr(engine_client.tokenizer, "chat_template", None)), enable_auto_tool_choice)
    if api_key is not None:
        check_api_key(api_key)
    limits = Limits(max_tokens=max_tokens_limit or engine_client.max_model_len, max_n=max_n,
                    max_body_bytes=max_body_bytes)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_client.start()
        try:
            yield
        finally:
            engine_client.shutdown()

    app = FastAPI(title="mempath", version=__version__, lifespan=lifespan,
                  docs_url="/docs" if enable_docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if enable_docs else None)
    if root_path:
        app.add_middleware(RootPath, root_path=root_path)
    install_openapi(app)
    app.state.engine_client = engine_client  # for tests and benchmarks that look behind the API
    install_error_handlers(app)
    install_guards(app, bind_host, allowed_origins, max_header_bytes, max_headers)

    @app.get("/health")
    async def health():
        if not engine_client.is_alive:
            return JSONResponse(error_body("the engine thread is not running", "server_error"), 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        stats = await engine_stats(engine_client)
        return Response(engine_client.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    defaults = dict(sampling_defaults or {})
    listed = list(models_listed) or [(served_model_name, engine_client.max_model_len)]
    app.include_router(openai_router(engine_client, served_model_name, api_key, limits, created, defaults,
                                     tools, listed))
    app.include_router(responses_router(engine_client, served_model_name, api_key, limits, defaults))
    app.include_router(tokens_router(engine_client, served_model_name, api_key, limits))
    for router in extra_routers:
        app.include_router(router)
    return app


@dataclass(frozen=True)
class ToolSettings:
    parser: str | None  # the tool-call parser's name
    auto_tool_choice: bool


def openai_router(engine_client: AsyncEngine, served_model_name: str, api_key: str | None,
                  limits: Limits, created: int, sampling_defaults: dict, tools: ToolSettings,
                  listed: list[tuple[str, int]]) -> APIRouter:
    """/v1: models, completions, chat completions, behind the API key when one is set."""
    api = APIRouter(prefix="/v1", dependencies=[Depends(api_key_checker(api_key))])

    @api.get("/models")
    async def list_models():
        bodies = [models_body(name, max_model_len, created) for name, max_model_len in listed]
        return {"object": "list", "data": [model for body in bodies for model in body["data"]]}

    @api.post("/completions")
    async def create_completion(request: Request):
        body = await read_body(request, limits.max_body_bytes)
        req = parse_request(CompletionRequest, body)
        check_model(req.model, served_model_name)
        prompts = req.prompts()
        check_num_choices(len(prompts), req.n, limits)
        max_tokens = resolve_max_tokens(req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, limits)
        structured = structured_request(req)
        prompts = await off_the_loop(lambda texts: [token_ids_of(engine_client.tokenizer, t) for t in texts], prompts)
        for prompt in (p for p in prompts if isinstance(p, list)):  # text only without a tokenizer
            check_context(len(prompt), req.max_tokens, engine_client.max_model_len)
        params = with_defaults(sampling_params(req, max_tokens, req.logprobs, structured),
                               req.model_fields_set, sampling_defaults)
        call = Call(engine_client, f"cmpl-{uuid.uuid4().hex}", served_model_name, req.stop_list(),
                    req.n, req.logprobs)
        await call.start(prompts, params, structured)
        if req.stream:
            return SSEResponse(stream_completion(call, req.include_usage), on_close=call.abort)
        return JSONResponse(await until_disconnect(request, finish_completion(call)))

    @api.post("/chat/completions")
    async def create_chat_completion(request: Request):
        body = await read_body(request, limits.max_body_bytes)
        req = parse_request(ChatCompletionRequest, body)
        check_model(req.model, served_model_name)
        check_num_choices(1, req.n, limits)
        plan = plan_tools(req, tools.parser, tools.auto_tool_choice)
        structured = with_tool_constraint(plan, structured_request(req))
        prompt = await off_the_loop(render_chat, engine_client.tokenizer, req, plan.tools if plan is not None else None)
        check_prompt_length(len(prompt), engine_client.max_model_len, "messages")  # before max_tokens is resolved
        room = max(1, engine_client.max_request_tokens - len(prompt))  # a pool too small: the engine refuses
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(req.requested_max_tokens, room, limits, param)
        check_context(len(prompt), req.requested_max_tokens, engine_client.max_model_len, param, "messages")
        params = with_defaults(sampling_params(req, max_tokens, req.num_logprobs, structured),
                               req.model_fields_set, sampling_defaults)
        call = Call(engine_client, f"chatcmpl-{uuid.uuid4().hex}", served_model_name,
                    req.stop_list(), req.n, req.num_logprobs)
        try:
            await call.start([prompt], params, structured,
                             {"logprobs": "top_logprobs", "max_tokens": param, "prompt": "messages"})
        except APIError as error:
            raise await located_tools_error(plan, error, engine_client.grammar_error) from None
        if req.stream:
            return SSEResponse(stream_chat(call, req.include_usage, plan), on_close=call.abort)
        return JSONResponse(await until_disconnect(request, finish_chat(call, plan)))

    return api


# ----------------------------------------------------------------- running under uvicorn
RESPONSE_FLUSH_TIMEOUT = 5.0  # seconds, after the drain, for the last events to reach the clients


class GracefulServer(uvicorn.Server):
    """uvicorn that drains the engine on SIGINT / SIGTERM before it closes connections.

    uvicorn alone waits for open responses, cancels them (a stream just stops, with no
    error event), and then re-raises the signal, so the exit status is the signal's.
    Here: stop accepting connections, stop admitting requests, give running ones
    ``shutdown_timeout`` seconds, end the rest with an error event and [DONE], let uvicorn
    close the connections, stop the engine (which flushes the disk tier), exit 0.
    """

    def __init__(self, config: uvicorn.Config, engine_client: AsyncEngine, shutdown_timeout: float):
        super().__init__(config)
        self.engine_client = engine_client
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        for server in getattr(self, "servers", []):
            server.close()
        log.info("shutting down: running requests get %g s to finish (--shutdown-timeout)",
                 self.shutdown_timeout)
        drained = self.engine_client.drain(self.shutdown_timeout)
        while not (drained.done() or self.force_exit):  # a second Ctrl+C skips the wait
            await asyncio.wait({drained}, timeout=0.1)
        await super().shutdown(sockets)
        self._captured_signals.clear()  # handled: the process exits normally instead of by the signal


def serve(app: FastAPI, shutdown_timeout: float, **uvicorn_options) -> None:
    """Serve `app` (from build_app) until SIGINT / SIGTERM, then shut down gracefully."""
    config = uvicorn.Config(app, timeout_graceful_shutdown=RESPONSE_FLUSH_TIMEOUT, **uvicorn_options)
    server = GracefulServer(config, app.state.engine_client, shutdown_timeout)
    server.run()
    if not server.started:
        raise SystemExit(uvicorn.config.STARTUP_FAILURE)  # uvicorn has logged why


# ----------------------------------------------------------------- errors and checks
def install_guards(app: FastAPI, bind_host: str | None, allowed_origins: Sequence[str],
                   max_header_bytes: int, max_headers: int) -> None:
    """Middleware, outermost first: header limits, the Host check, CORS."""
    if allowed_origins:
        # Browsers send credentials here as an Authorization header, not cookies: no credentials mode.
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])
    if bind_host is not None and is_loopback_address(bind_host):
        app.add_middleware(LoopbackHostOnly, bind_host=bind_host)
    app.add_middleware(HeaderLimits, max_bytes=max_header_bytes, max_headers=max_headers)


# The routes read their bodies themselves (JSON only, size-limited, strict): their request
# models are added to the OpenAPI page here.
REQUEST_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def install_openapi(app: FastAPI) -> None:
    """/openapi.json (and /docs) with each route's request body, from its pydantic model."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes, servers=app.servers)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in REQUEST_MODELS.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


class RootPath:
    """Tells the app the prefix a proxy serves it under (--root-path): routes match with or without it,
    and /openapi.json names it in ``servers``, as FastAPI's deprecated ``root_path=`` did."""

    def __init__(self, app, root_path: str):
        self.app, self.root_path = app, root_path

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request, error: APIError):
        return JSONResponse(error.body(), error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, error: StarletteHTTPException):
        code = "not_found" if error.status_code == 404 else None
        return JSONResponse(error_body(str(error.detail), "invalid_request_error", None, code),
                            error.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, error: RequestValidationError):
        return JSONResponse(error_body(str(error), "invalid_request_error"), 400)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_request, error: EngineDeadError):
        return JSONResponse(error_body(str(error), "server_error", None, "engine_unavailable"), 503)

    @app.exception_handler(WakeFailed)
    async def wake_failed(_request, error: WakeFailed):
        log.warning("%s", error)
        return JSONResponse(error_body(str(error), "server_error", None, "model_unavailable"), 503,
                            headers={"Retry-After": "1"})

    @app.exception_handler(ClientDisconnect)
    async def client_hung_up(request: Request, _error: ClientDisconnect):
        # Nobody is left to read an answer, and a traceback per hang-up floods the log: one
        # debug line, and the count in /metrics.
        metrics = request.app.state.engine_client.metrics
        count = metrics.record_disconnect("upload") if metrics is not None else "?"
        log.debug("a client hung up during the upload of its %s %s body (%s so far)",
                  request.method, request.url.path, count)
        return Response(status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(_request, error: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {error}", "server_error"), 500)


def sampling_params(req, max_tokens: int, logprobs: int | None,
                    structured: StructuredRequest | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, min_p=req.min_p,
                          logprobs=logprobs, presence_penalty=req.presence_penalty or 0.0,
                          frequency_penalty=req.frequency_penalty or 0.0, min_tokens=req.min_tokens or 0,
                          bad_words=req.bad_words or [], prompt_logprobs=req.prompt_logprobs,
                          structured_outputs=structured.params if structured is not None else None,
                          **req.extension_params())


def render_chat(tokenizer, req: ChatCompletionRequest, tools: list[dict] | None = None) -> list[int]:
    """The conversation (and the tools, when given) through the chat template, as token ids."""
    return render_messages(tokenizer, [m.as_template_input() for m in req.messages], tools=tools)


async def engine_stats(engine_client: AsyncEngine) -> dict:
    try:
        return await engine_client.stats()
    except EngineDeadError as error:
        raise APIError(503, str(error), None, "engine_unavailable", "server_error") from None


# ----------------------------------------------------------------- one API call's engine requests
def openai_finish_reason(update: Update) -> str:
    return "length" if update.finish_reason == "length" else "stop"


def top_entries(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:n]


def completion_logprobs(call: Call, token_ids: list[int], logprobs: list[dict[int, float]],
                        offset: int) -> dict:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs):
        text = call.token_text(token_id)
        tokens.append(text)
        token_logprobs.append(max(entry[token_id], MIN_LOGPROB))
        # OpenAI: "the API will always return the logprob of the sampled token, so there may be up to
        # logprobs+1 elements", as vLLM's do (chat's top_logprobs are the top n only). Set last, the sampled
        # token's value is the one kept where another of the top n decodes to the same text.
        top = {call.token_text(t): max(v, MIN_LOGPROB) for t, v in top_entries(entry, call.num_logprobs)}
        top[text] = token_logprobs[-1]
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(call: Call, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict:
    def item(token_id: int, value: float) -> dict:
        text = call.token_text(token_id)
        return {"token": text, "logprob": max(value, MIN_LOGPROB), "bytes": list(text.encode())}

    return {"content": [
        {**item(token_id, entry[token_id]),
         "top_logprobs": [item(t, v) for t, v in top_entries(entry, call.num_logprobs)]}
        for token_id, entry in zip(token_ids, logprobs)]}


# ----------------------------------------------------------------- non-streaming
def prompt_logprobs_body(call: Call, prompt_logprobs: tuple[list, list] | None, n: int) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the actual token and the top ``n``."""
    if prompt_logprobs is None:
        return None
    body = []
    for entry, rank in zip(*prompt_logprobs):
        if entry is None:
            body.append(None)
            continue
        actual, *others = entry  # the actual token first, then the rest of the top-n in order
        top = others[:rank - 1] + [actual] + others[rank - 1:] if rank <= n else others
        ranks = {token_id: place for place, token_id in enumerate(top, start=1)}
        ranks[actual] = rank
        body.append({str(t): {"logprob": max(entry[t], MIN_LOGPROB), "rank": ranks[t],
                              "decoded_token": call.token_text(t)} for t in [actual, *others]})
    return body


async def finish_completion(call: Call) -> dict:
    finals, tokens, logprobs = await collect(call)
    choices = [{"index": i, "text": u.text, "finish_reason": openai_finish_reason(u), "stop_reason": u.stop_reason,
                "logprobs": (completion_logprobs(call, tokens[i], logprobs[i], 0)
                             if call.num_logprobs is not None else None)}
               for i, u in sorted(finals.items())]
    if call.num_prompt_logprobs is not None:  # each choice shows its prompt's (the first sample's)
        for choice in choices:
            first = finals[choice["index"] - choice["index"] % call.n]
            choice["prompt_logprobs"] = prompt_logprobs_body(call, first.prompt_logprobs,
                                                             call.num_prompt_logprobs)
    return completion_body(call.id, call.model, choices, call.usage(finals), created=call.created)


async def finish_chat(call: Call, plan=None) -> dict:
    finals, tokens, logprobs = await collect(call)
    messages = {i: tool_message(plan, u.text, openai_finish_reason(u)) for i, u in finals.items()}
    choices = [{"index": i, "message": messages[i][0], "finish_reason": messages[i][1], "stop_reason": u.stop_reason,
                "logprobs": (chat_logprobs(call, tokens[i], logprobs[i])
                             if call.num_logprobs is not None else None)}
               for i, u in sorted(finals.items())]
    body = chat_body(call.id, call.model, choices, call.usage(finals), created=call.created)
    if call.num_prompt_logprobs is not None:  # one prompt: vLLM puts it beside the choices
        body["prompt_logprobs"] = prompt_logprobs_body(call, finals[0].prompt_logprobs,
                                                       call.num_prompt_logprobs)
    return body


# ----------------------------------------------------------------- streaming
async def stream_sse(call: Call, include_usage: bool, chunk, choice, logprobs_for, opening: str | None = None):
    """Server-sent events for one call; `chunk`, `choice` and `logprobs_for` give the
    endpoint's shapes. The request is aborted however the stream ends."""
    texts = [ChoiceText(call.stops) for _ in range(call.num_choices)]
    finals: dict[int, Update] = {}
    try:
        if opening is not None:
            yield opening
        async for index, update in call.updates():
            if update.finished:
                finals[index] = update
            failed = update.finish_reason == "error"
            delta = texts[index].take(update)
            logprobs = None
            if call.num_logprobs is not None and update.new_token_ids:
                logprobs = logprobs_for(index, update)
            # Undelivered updates arrive merged, so one can hold tokens and then an error:
            # the tokens go out first.
            if delta or logprobs or (update.finished and not failed):
                finish = openai_finish_reason(update) if update.finished and not failed else None
                made = choice(index, delta, logprobs, finish)  # a chat choice with tools: one per delta
                for one in made if isinstance(made, list) else [made]:
                    if one["finish_reason"] is not None:
                        one["stop_reason"] = update.stop_reason
                    yield chunk([one])
            if failed:
                yield sse(stream_error_body(update, call.structured))
        if include_usage:
            yield chunk([], call.usage(finals))
        yield SSE_DONE
    finally:
        call.abort()


def stream_completion(call: Call, include_usage: bool):
    offsets = [0] * call.num_choices  # text offsets of each choice's logprobs

    def logprobs_for(index: int, update: Update) -> dict:
        logprobs = completion_logprobs(call, update.new_token_ids, update.new_logprobs, offsets[index])
        offsets[index] += sum(len(t) for t in logprobs["tokens"])
        return logprobs

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        return sse(completion_body(call.id, call.model, choices, usage, chunk=True, created=call.created))

    def choice(index, delta, logprobs, finish) -> dict:
        return {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}

    return stream_sse(call, include_usage, chunk, choice, logprobs_for)


def stream_chat(call: Call, include_usage: bool, plan=None):
    streams = [ToolStream(plan) for _ in range(call.num_choices)]

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        return sse(chat_body(call.id, call.model, choices, usage, chunk=True, created=call.created))

    def choice(index, delta, logprobs, finish) -> dict | list[dict]:
        if plan is None:
            return {"index": index, "delta": {"content": delta} if delta else {}, "logprobs": logprobs,
                    "finish_reason": finish}
        deltas = streams[index].take(delta, finish is not None)
        made = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if made:
            made[0]["logprobs"] = logprobs
        elif logprobs is not None and finish is None:
            made.append({"index": index, "delta": {}, "logprobs": logprobs, "finish_reason": None})
        if finish is not None:
            made.append({"index": index, "delta": {}, "logprobs": None if made else logprobs,
                         "finish_reason": streams[index].finish_reason(finish)})
        return made

    opening = chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(call.num_choices)])
    return stream_sse(call, include_usage, chunk, choice,
                      lambda index, update: chat_logprobs(call, update.new_token_ids, update.new_logprobs),
                      opening)
