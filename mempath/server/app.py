"""The OpenAI-compatible HTTP API over an AsyncEngine.

Every failure answers with OpenAI's error body and a status that says whose fault
it is (400 bad request or foreign Host, 401 key, 404 model or route, 413 body too
large, 415 not JSON, 431 headers too large, 503 engine down); docs/server.md lists
the limits. Every engine request that an HTTP request started is aborted when
that HTTP request ends for any reason, so a client that goes away frees its KV
blocks at once.
"""
import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mempath.engine.detokenizer import StopPrefixes
from mempath.sampling import SamplingParams
from mempath.server.async_engine import AsyncEngine, EngineDeadError, Update, UpdateQueue
from mempath.server.guards import HeaderLimits, LoopbackHostOnly, is_loopback_address
from mempath.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_body,
                                     completion_body, error_body, models_body, parse_request, usage_body)
from mempath.server.structured_request import StructuredRequest, structured_request
from mempath.server.tool_choice import ToolStream, plan_tools, tool_message
from mempath.server.tool_parsers import PARSERS, parser_for_template
from mempath.server.settings import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS,
                                     DEFAULT_MAX_N, check_api_key)

log = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass(frozen=True)
class Limits:
    """What no single request may exceed."""
    max_tokens: int
    max_n: int
    max_body_bytes: int


def build_app(engine_client: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_tokens_limit: int | None = None,
              max_n: int = DEFAULT_MAX_N, bind_host: str | None = None,
              allowed_origins: Sequence[str] = (), max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
              max_headers: int = DEFAULT_MAX_HEADERS, tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine thread.

    ``bind_host``: the address the server listens on; a loopback one turns on the
    Host check (guards.LoopbackHostOnly). None (tests, other servers): no check.
    ``allowed_origins``: CORS, off when empty. ``tool_call_parser`` (vLLM's names, None: the
    chat template's format) and ``enable_auto_tool_choice``: server/tool_choice.py.
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

    app = FastAPI(title="mempath", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
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

    app.include_router(openai_router(engine_client, served_model_name, api_key, limits, created, tools))
    return app


@dataclass(frozen=True)
class ToolSettings:
    parser: str | None  # the tool-call parser's name
    auto_tool_choice: bool


def openai_router(engine_client: AsyncEngine, served_model_name: str, api_key: str | None,
                  limits: Limits, created: int, tools: ToolSettings) -> APIRouter:
    """/v1: models, completions, chat completions, behind the API key when one is set."""
    api = APIRouter(prefix="/v1", dependencies=[Depends(api_key_checker(api_key))])

    @api.get("/models")
    async def list_models():
        return models_body(served_model_name, engine_client.max_model_len, created)

    @api.post("/completions")
    async def create_completion(request: Request):
        body = await read_body(request, limits.max_body_bytes)
        req = parse_request(CompletionRequest, body)
        check_model(req.model, served_model_name)
        prompts = req.prompts()
        check_num_choices(len(prompts), req.n, limits)
        max_tokens = resolve_max_tokens(req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, limits)
        structured = structured_request(req)
        params = sampling_params(req, max_tokens, req.logprobs, structured)
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
        structured = structured_request(req)
        if plan is not None and plan.grammar() is not None:
            if structured is not None:
                raise APIError(400, f"tool_choice {plan.mode} constrains the output; it cannot be combined "
                                    f"with {structured.field}", "tool_choice")
            structured = StructuredRequest(plan.grammar(), "tools")
        prompt = render_chat(engine_client.tokenizer, req, plan.tools if plan is not None else None)
        room = max(1, engine_client.max_model_len - len(prompt))
        max_tokens = resolve_max_tokens(req.requested_max_tokens, room, limits)
        params = sampling_params(req, max_tokens, req.num_logprobs, structured)
        call = Call(engine_client, f"chatcmpl-{uuid.uuid4().hex}", served_model_name,
                    req.stop_list(), req.n, req.num_logprobs)
        await call.start([prompt], params, structured)
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


def api_key_checker(api_key: str | None):
    expected = api_key.encode() if api_key else None

    async def check_api_key(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           None, "invalid_api_key")

    return check_api_key


async def read_body(request: Request, limit: int) -> bytes:
    """The JSON request body, refusing anything over `limit` bytes before reading it all.

    Any other content type is refused: a web page may POST text/plain, form or multipart
    bodies to any address, this server's included, without asking first (no CORS preflight).
    """
    content_type = request.headers.get("content-type")
    if (content_type or "").partition(";")[0].strip().lower() != "application/json":
        got = f"got {content_type!r}" if content_type else "got none"
        raise APIError(415, f"send the body as JSON with 'Content-Type: application/json' ({got})",
                       None, "unsupported_media_type")
    too_large = APIError(413, f"the request body is larger than this server's limit of {limit} "
                              f"bytes (--max-body-bytes)", None, "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"the model '{requested}' does not exist; this server serves '{served}'",
                       "model", "model_not_found")


def check_num_choices(num_prompts: int, n: int, limits: Limits) -> None:
    if num_prompts * n > limits.max_n:
        what = f"n={n}" if num_prompts == 1 else f"{num_prompts} prompts x n={n}"
        raise APIError(400, f"{what} asks for {num_prompts * n} choices; this server allows at most "
                            f"{limits.max_n} per request (--max-n)", "n")


def resolve_max_tokens(requested: int | None, default: int, limits: Limits) -> int:
    if requested is None:
        return min(default, limits.max_tokens)
    if requested > limits.max_tokens:
        raise APIError(400, f"max_tokens {requested} is more than this server allows per request "
                            f"({limits.max_tokens}, --max-tokens-limit)", "max_tokens")
    return requested


def sampling_params(req, max_tokens: int, logprobs: int | None,
                    structured: StructuredRequest | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                          top_p=req.top_p, min_p=req.min_p, seed=req.seed, stop=req.stop_list(),
                          ignore_eos=req.ignore_eos, logprobs=logprobs,
                          structured_outputs=structured.params if structured is not None else None)


def render_chat(tokenizer, req: ChatCompletionRequest, tools: list[dict] | None = None) -> list[int]:
    """The conversation (and the tools, when given) through the tokenizer's chat template, as token ids."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    messages = [m.as_template_input() for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # noqa: BLE001 - a template can raise anything
        raise APIError(400, f"the chat template rejected these messages: {error}", "messages") from None
    # The template already holds the special tokens: encode without adding more.
    return tokenizer.encode(text, add_special_tokens=False)


def param_named_in(message: str) -> str | None:
    """The request field an engine error message is about (it starts with the field's name)."""
    for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "logprobs", "stop", "seed",
                 "structured_outputs"):
        if message.startswith(name):
            return name
    return "prompt" if "prompt" in message else None


async def engine_stats(engine_client: AsyncEngine) -> dict:
    try:
        return await engine_client.stats()
    except EngineDeadError as error:
        raise APIError(503, str(error), None, "engine_unavailable", "server_error") from None


# ----------------------------------------------------------------- one API call's engine requests
class Call:
    """The engine requests behind one API call: each prompt x n samples, one queue for all.

    Sample 0 of a prompt goes first; its siblings follow once it has produced a
    token, i.e. once its prompt is prefilled and its full blocks are in the prefix
    cache, so the n samples share the prompt's KV blocks instead of each computing
    their own.
    """

    def __init__(self, engine_client: AsyncEngine, call_id: str, model: str, stops: list[str],
                 n: int, num_logprobs: int | None):
        self.engine = engine_client
        self.id = call_id
        self.model = model
        self.stops = stops
        self.n = n
        self.num_logprobs = num_logprobs
        self.created = int(time.time())
        self.queue = UpdateQueue()
        self.choice_of: dict[str, int] = {}
        self.num_choices = 0
        self._open: set[str] = set()
        # First sample's request id -> (choice, prompt, params) of the samples that wait for it.
        self._siblings: dict[str, list[tuple[int, str | list[int], SamplingParams]]] = {}

    async def start(self, prompts: list[str | list[int]], params: SamplingParams,
                    structured: StructuredRequest | None = None) -> None:
        """Submit every prompt's first sample; a request the engine rejects raises APIError(400)
        (naming the client's structured-output field when its grammar does not compile)."""
        self.num_choices = len(prompts) * self.n
        try:
            for p, prompt in enumerate(prompts):
                samples = [(p * self.n + i, prompt, self._sample_params(params, i))
                           for i in range(self.n)]
                await self._add(*samples[0])
                self._siblings[self._request_id(p * self.n)] = samples[1:]
        except ValueError as error:
            self.abort()
            api_error = APIError(400, str(error), param_named_in(str(error)))
            raise (structured.field_error(api_error) if structured is not None else api_error) from None
        except BaseException:
            self.abort()
            raise

    def _sample_params(self, params: SamplingParams, index: int) -> SamplingParams:
        if index == 0 or params.seed is None:
            return params
        return SamplingParams(**{**params.__dict__, "seed": params.seed + index})

    def _request_id(self, choice: int) -> str:
        return f"{self.id}-{choice}"

    async def _add(self, choice: int, prompt, params: SamplingParams) -> None:
        request_id = self._request_id(choice)
        self.choice_of[request_id] = choice
        self._open.add(request_id)  # before awaiting: an abort meanwhile must cover it
        await self.engine.add_request(prompt, params, request_id, self.queue)

    async def _add_siblings(self, siblings) -> None:
        for choice, prompt, params in siblings:
            try:
                await self._add(choice, prompt, params)
            except ValueError as error:
                self.queue.put_nowait(Update(self._request_id(choice), "", [], None, "", True,
                                             "error", 0, 0, 0, str(error)))

    async def updates(self):
        """(choice index, Update) until every sample has finished."""
        while self._open:
            update = await self.queue.get()
            if update.request_id not in self._open:
                continue
            siblings = self._siblings.pop(update.request_id, None)
            if siblings:
                await self._add_siblings(siblings)
            if update.finished:
                self._open.discard(update.request_id)
            yield self.choice_of[update.request_id], update

    def abort(self) -> None:
        """Abort every sample still running; idempotent, so any exit path may call it."""
        for request_id in self._open:
            self.engine.abort(request_id)
        self._open.clear()
        self._siblings.clear()

    def usage(self, finals: dict[int, Update]) -> dict:
        """Usage over the finished choices: each prompt counted once, as OpenAI does."""
        firsts = [u for i, u in finals.items() if i % self.n == 0]
        return usage_body(sum(u.num_prompt_tokens for u in firsts),
                          sum(u.num_output_tokens for u in finals.values()),
                          sum(u.num_cached_tokens for u in firsts))

    def token_text(self, token_id: int) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


class ChoiceText:
    """One choice's text as streamed: a tail that could begin a stop string is held back.

    The engine cuts a stop string out of the text only once it is complete, so
    text that may turn out to be the start of one must wait; otherwise the stream
    would show characters the final text does not have. Each update's new
    characters are read once (StopPrefixes), so this work on the event loop does
    not grow with the text.
    """

    def __init__(self, stops: list[str]):
        self.stop_prefixes = StopPrefixes(stops)
        self.held = 0  # characters at the end of the text read so far that may start a stop
        self.read = 0
        self.sent = 0

    def take(self, update: Update) -> str:
        text = update.text
        if update.finished:
            end = len(text)
        else:
            if len(text) > self.read:
                self.held = self.stop_prefixes.feed(text[self.read:])
                self.read = len(text)
            end = len(text) - self.held
        end = max(end, self.sent)
        delta, self.sent = text[self.sent:end], end
        return delta


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
        tops.append({call.token_text(t): max(v, MIN_LOGPROB)
                     for t, v in top_entries(entry, call.num_logprobs)})
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


def error_of(finals: dict[int, Update]) -> APIError | None:
    for update in finals.values():
        if update.finish_reason in ("error", "abort"):
            return APIError(500, update.error or "the request was aborted", None, "generation_failed",
                            "server_error")
    return None


# ----------------------------------------------------------------- non-streaming
async def collect(call: Call) -> tuple[dict[int, Update], dict[int, list[int]], dict[int, list]]:
    """Run a call to the end: final update, token ids and logprobs per choice."""
    finals: dict[int, Update] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(call.num_choices)}
    logprobs: dict[int, list] = {i: [] for i in range(call.num_choices)}
    try:
        async for index, update in call.updates():
            tokens[index].extend(update.new_token_ids)
            logprobs[index].extend(update.new_logprobs or [])
            if update.finished:
                finals[index] = update
    finally:
        call.abort()
    error = error_of(finals)
    if error is not None:
        raise error
    return finals, tokens, logprobs


async def finish_completion(call: Call) -> dict:
    finals, tokens, logprobs = await collect(call)
    choices = [{"index": i, "text": u.text, "finish_reason": openai_finish_reason(u),
                "logprobs": (completion_logprobs(call, tokens[i], logprobs[i], 0)
                             if call.num_logprobs is not None else None)}
               for i, u in sorted(finals.items())]
    return completion_body(call.id, call.model, choices, call.usage(finals), created=call.created)


async def finish_chat(call: Call, plan=None) -> dict:
    finals, tokens, logprobs = await collect(call)
    messages = {i: tool_message(plan, u.text, openai_finish_reason(u)) for i, u in finals.items()}
    choices = [{"index": i, "message": messages[i][0], "finish_reason": messages[i][1],
                "logprobs": (chat_logprobs(call, tokens[i], logprobs[i])
                             if call.num_logprobs is not None else None)}
               for i, u in sorted(finals.items())]
    return chat_body(call.id, call.model, choices, call.usage(finals), created=call.created)


async def until_disconnect(request: Request, work):
    """Await `work`, cancelling it if the client hangs up first (its finally aborts the call)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return error_body("the client disconnected", "invalid_request_error")
    return task.result()


async def wait_for_disconnect(request: Request) -> None:
    # The body has been read: the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ----------------------------------------------------------------- streaming
class SSEResponse(StreamingResponse):
    """Server-sent events that run `on_close` however the response ends (done, error, hang-up)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


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
                    yield chunk([one])
            if failed:
                yield sse(error_body(update.error or "generation failed", "server_error"))
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
