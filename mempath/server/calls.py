"""One API call's engine requests, and reading and answering the HTTP request behind it.

Shared by every route module (app.py's completions and chat, responses.py, tokens.py):
the body reader (JSON only, size-limited), the model and limit checks, the API key,
``Call`` (each prompt x n samples on one queue, aborted however the call ends), the
streamed text that holds back a possible stop string, and the SSE response.
"""
import asyncio
import concurrent.futures
import functools
import hmac
import json
import logging
import time
from contextlib import suppress
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from mempath.engine.detokenizer import StopPrefixes
from mempath.sampling import SamplingParams
from mempath.server.async_engine import AsyncEngine, Update, UpdateQueue
from mempath.server.protocol import APIError, error_body, usage_body

# One INFO line per request when `mempath serve --enable-log-requests` (vLLM's flag) turns it on.
request_log = logging.getLogger("mempath.requests")

# Prompts are tokenized and chat templates rendered here, not on the event loop: a 100k-token prompt takes a
# few hundred ms, during which the loop would stream nothing to anyone. The tokenizer releases the GIL while it
# encodes. One thread: requests' tokenizer calls run one at a time, as they did on the loop.
_TOKENIZING = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mempath-tokenize")


async def off_the_loop(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on the tokenizing thread; its exceptions (an APIError) raise here."""
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZING, functools.partial(fn, *args, **kwargs))


@dataclass(frozen=True)
class Limits:
    """What no single request may exceed."""
    max_tokens: int
    max_n: int
    max_body_bytes: int


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
    So is a compressed body (a Content-Encoding other than identity), 415 naming the header.
    """
    content_type = request.headers.get("content-type")
    if (content_type or "").partition(";")[0].strip().lower() != "application/json":
        got = f"got {content_type!r}" if content_type else "got none"
        raise APIError(415, f"send the body as JSON with 'Content-Type: application/json' ({got})",
                       None, "unsupported_media_type")
    # Starlette does not decompress request bodies: a gzipped one would read as invalid JSON.
    encoding = request.headers.get("content-encoding", "")
    if any(coding.strip().lower() not in ("", "identity") for coding in encoding.split(",")):
        raise APIError(415, f"this server accepts only uncompressed JSON bodies: send the body without "
                            f"'Content-Encoding: {encoding[:40]}'", None, "unsupported_media_type")
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


def resolve_max_tokens(requested: int | None, default: int, limits: Limits, param: str = "max_tokens") -> int:
    """``param``: the field the client sent it in (max_completion_tokens, max_output_tokens)."""
    if requested is None:
        return min(default, limits.max_tokens)
    if requested > limits.max_tokens:
        raise APIError(400, f"{param} {requested} is more than this server allows per request "
                            f"({limits.max_tokens}, --max-tokens-limit)", param)
    return requested


def check_prompt_length(num_prompt_tokens: int, max_model_len: int, prompt_param: str = "prompt") -> None:
    """APIError(400) for a prompt that leaves no room for one generated token, as vLLM's server refuses a
    prompt of max_model_len tokens or more, whatever max_tokens says."""
    if num_prompt_tokens >= max_model_len:
        raise APIError(400, f"{prompt_param} has {num_prompt_tokens} tokens and this model's maximum context length "
                            f"is {max_model_len} tokens (max_model_len), which leaves no room for the output; "
                            f"shorten it to fewer than {max_model_len} tokens or raise --max-model-len", prompt_param)


def check_context(num_prompt_tokens: int, requested: int | None, max_model_len: int, param: str = "max_tokens",
                  prompt_param: str = "prompt") -> None:
    """APIError(400) for a prompt that leaves no room, or an explicit max_tokens (``param``) past the
    context, as vLLM's server answers: it is not quietly cut (the offline LLM still caps it)."""
    check_prompt_length(num_prompt_tokens, max_model_len, prompt_param)
    if requested is not None and num_prompt_tokens + requested > max_model_len:
        raise APIError(400, f"'{param}' is too large: {requested}. This model's maximum context length is "
                            f"{max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
                            f"({requested} > {max_model_len} - {num_prompt_tokens})", param)


def token_ids_of(tokenizer, prompt: str | list[int]) -> str | list[int]:
    """A text prompt as the token ids the engine would make of it (InputProcessor.tokenize), so that
    its length can be checked here; empty text, or text without a tokenizer, is left for the engine
    to refuse."""
    if isinstance(prompt, str) and prompt and tokenizer is not None:
        return tokenizer.encode(prompt)
    return prompt


def param_named_in(message: str) -> str | None:
    """The request field an engine error message is about (it starts with the field's name)."""
    for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "prompt_logprobs", "logprobs",
                 "stop", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "logit_bias", "min_tokens", "bad_words", "best_of", "structured_outputs"):
        if message.startswith(name):
            return name
    return "prompt" if "prompt" in message else None


def renamed(error: APIError, fields: dict[str, str]) -> APIError:
    """``error`` naming the request's field where its param is a SamplingParams field of another name."""
    name = fields.get(error.param)
    if name is None:
        return error
    message = name + error.message[len(error.param):] if error.message.startswith(error.param) else error.message
    return APIError(error.status, message, name, error.code, error.type)


def check_requests(engine_client, prompts: list, params: SamplingParams, request_ids: list[str]) -> None:
    """The engine's own check of each prompt's request (its Request is dropped), so that a later prompt it
    refuses refuses the call before an earlier one runs; raises its ValueError. The grammar and the seed are
    the same for every prompt and cost work to build (a compile, a device generator): they are checked when
    the first prompt is added, before anything runs."""
    checked = SamplingParams(**{**params.__dict__, "structured_outputs": None, "seed": None})
    for prompt, request_id in zip(prompts, request_ids):
        engine_client.check_request(prompt, checked, request_id)


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
        self.num_prompt_logprobs: int | None = None  # set by start() from the params
        self.structured = None  # set by start(): the StructuredRequest an error of its constraint names
        self.created = int(time.time())
        self.queue = UpdateQueue()
        self.choice_of: dict[str, int] = {}
        self.num_choices = 0
        self._open: set[str] = set()
        # First sample's request id -> (choice, prompt, params) of the samples that wait for it.
        self._siblings: dict[str, list[tuple[int, str | list[int], SamplingParams]]] = {}

    async def start(self, prompts: list[str | list[int]], params: SamplingParams,
                    structured=None, fields: dict[str, str] | None = None) -> None:
        """Submit every prompt's first sample; a request the engine rejects raises APIError(400)
        (naming the client's structured-output field, ``structured``'s, when its grammar does
        not compile). ``fields``: SamplingParams field -> the request field the client sent it as
        (chat's top_logprobs for logprobs), for the error's param and message."""
        self.num_choices = len(prompts) * self.n
        self.num_prompt_logprobs = params.prompt_logprobs
        self.structured = structured
        request_log.info("request %s: %d prompt(s) of %s tokens, n=%d, %s", self.id, len(prompts),
                         "/".join(str(len(p)) if isinstance(p, list) else "text" for p in prompts), self.n, params)
        try:
            if len(prompts) > 1:  # a lone prompt's add is its check
                await off_the_loop(check_requests, self.engine, prompts, params,
                                   [self._request_id(p * self.n) for p in range(len(prompts))])
            for p, prompt in enumerate(prompts):
                samples = [(p * self.n + i, prompt, self._sample_params(params, i))
                           for i in range(self.n)]
                await self._add(*samples[0])
                self._siblings[self._request_id(p * self.n)] = samples[1:]
        except ValueError as error:
            self.abort()
            api_error = renamed(APIError(400, str(error), param_named_in(str(error))), fields or {})
            raise (structured.field_error(api_error) if structured is not None else api_error) from None
        except BaseException:
            self.abort()
            raise

    def _sample_params(self, params: SamplingParams, index: int) -> SamplingParams:
        if index == 0 or (params.seed is None and params.prompt_logprobs is None):
            return params
        # The first sample's prompt logprobs serve every choice of its prompt; the others
        # then reuse its prompt's KV from the prefix cache.
        seed = None if params.seed is None else params.seed + index
        return SamplingParams(**{**params.__dict__, "seed": seed, "prompt_logprobs": None})

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


def error_of(finals: dict[int, Update], structured=None) -> APIError | None:
    """The call's error from its choices' final updates; ``structured`` (StructuredRequest): renames a
    constraint's error to the field the client sent it as."""
    for update in finals.values():
        if update.finish_reason in ("error", "abort"):
            if update.error_param is not None:  # the request's own constraints failed it
                error = APIError(400, update.error, update.error_param, "invalid_value")
                return structured.field_error(error) if structured is not None else error
            return APIError(500, update.error or "the request was aborted", None, "generation_failed",
                            "server_error")
    return None


def stream_error_body(update: Update, structured=None) -> dict:
    """The error event of a stream whose request failed: the client's fault when it names a field
    (``structured``: as in ``error_of``)."""
    if update.error_param is not None:
        error = error_of({0: update}, structured)
        return error_body(error.message, "invalid_request_error", error.param, "invalid_value")
    return error_body(update.error or "generation failed", "server_error")


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
    error = error_of(finals, call.structured)
    if error is not None:
        raise error
    return finals, tokens, logprobs


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


def chat_text(tokenizer, messages: list[dict], param: str = "messages", add_generation_prompt: bool = True,
              tools: list[dict] | None = None) -> str:
    """A conversation through the tokenizer's chat template; APIError(400) naming `param`."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions, or start the server "
                            "with --chat-template", param)
    try:
        return tokenizer.apply_chat_template(with_roles_of(tokenizer.chat_template, messages), tools=tools,
                                             tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as error:  # noqa: BLE001 - a template can raise anything
        raise APIError(400, f"the chat template rejected these messages: {error}", param) from None


def with_roles_of(template, messages: list[dict]) -> list[dict]:
    """``messages`` with OpenAI's ``developer`` role (its newer name for ``system``) sent as ``system`` when
    the chat template's source never mentions "developer": most templates know only system, user,
    assistant and tool, and raise on any other role. A template that names developer gets it as sent."""
    source = " ".join(map(str, template.values())) if isinstance(template, dict) else str(template)  # named ones
    if "developer" in source:
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def render_messages(tokenizer, messages: list[dict], param: str = "messages",
                    tools: list[dict] | None = None) -> list[int]:
    """A conversation (and the tools, when given) through the chat template, as the token ids
    to generate from."""
    # The template already holds the special tokens: encode without adding more.
    return tokenizer.encode(chat_text(tokenizer, messages, param, tools=tools), add_special_tokens=False)
