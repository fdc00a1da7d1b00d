"""AsyncEngine: the LLMEngine on a thread of its own, driven from asyncio.

The engine is not thread-safe, so exactly one thread owns it. That thread runs
commands from an inbox (add, abort, stats) between steps, steps while anything is
unfinished, and sleeps on a condition variable when there is nothing to do. Each
request's outputs reach the event loop through ``loop.call_soon_threadsafe`` into
an asyncio.Queue the HTTP side gave when adding it; the event loop never touches
the engine.
"""
import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from mempath.engine.engine import LLMEngine, RequestOutput
from mempath.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Update:
    """What one engine step produced for one request, safe to hand to another thread."""
    request_id: str
    new_text: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None  # one entry per new token
    text: str  # the whole output so far (stop strings already cut off)
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    error: str | None = None


@dataclass
class _Route:
    """Where a request's updates go, and the timing its metrics need."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    last_token_time: float | None = None


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._routes: dict[str, _Route] = {}  # engine thread only
        self._inbox: deque[tuple[Callable, concurrent.futures.Future | None]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.num_step_errors = 0

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="mempath-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ----------------------------------------------------------------- event-loop side
    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                          queue: asyncio.Queue) -> None:
        """Queue a request; its Updates will be put on `queue`. Raises the engine's ValueError."""
        route = _Route(asyncio.get_running_loop(), queue)
        await asyncio.wrap_future(self._submit(lambda: self._add(prompt, params, request_id, route)))

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; safe from any thread, a no-op once it is done."""
        try:
            self._submit(lambda: self._abort(request_id), wait=False)
        except EngineDeadError:
            pass  # a stopped engine holds no blocks to free

    async def stats(self) -> dict:
        """The engine's stats, read between steps so the figures agree with each other."""
        return await asyncio.wrap_future(self._submit(self.engine.stats))

    def _submit(self, command: Callable, wait: bool = True) -> concurrent.futures.Future | None:
        if not self.is_alive:
            raise EngineDeadError("the engine thread is not running")
        future = concurrent.futures.Future() if wait else None
        with self._wake:
            if self._stopping:
                raise EngineDeadError("the server is shutting down")
            self._inbox.append((command, future))
            self._wake.notify()
        return future

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._inbox or self._stopping or self.engine.has_unfinished_requests()):
                    self._wake.wait()
                if self._stopping:
                    break
                commands = list(self._inbox)
                self._inbox.clear()
            self._run_commands(commands)
            if self.engine.has_unfinished_requests():
                self._step()
        self._fail_all("the server is shutting down")
        self._refuse_pending()

    def _refuse_pending(self) -> None:
        with self._wake:
            pending = list(self._inbox)
            self._inbox.clear()
        for _, future in pending:
            if future is not None:
                future.set_exception(EngineDeadError("the server is shutting down"))

    def _run_commands(self, commands) -> None:
        for command, future in commands:
            try:
                result = command()
            except Exception as error:  # noqa: BLE001 - handed to the caller
                if future is not None:
                    future.set_exception(error)
                else:
                    log.exception("engine command failed")
            else:
                if future is not None:
                    future.set_result(result)

    def _add(self, prompt, params: SamplingParams, request_id: str, route: _Route) -> None:
        self.engine.add_request(prompt, params, request_id)
        self._routes[request_id] = route

    def _abort(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        output = self.engine.abort_request(request_id)
        if output is not None and self.metrics is not None:
            self.metrics.record_finish(output.finish_reason, output.total_time)
        if output is not None and route is not None:
            self._deliver(route, self._update(output))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001 - one bad step must not take the server down
            self.num_step_errors += 1
            log.exception("engine step failed; failing the requests in flight")
            self._fail_all(f"the engine failed: {error}")
            return
        now = time.perf_counter()
        for output in outputs:
            route = self._routes.get(output.request_id)
            self._record(output, route, now)
            if output.finished:
                self._routes.pop(output.request_id, None)
            if route is not None:
                self._deliver(route, self._update(output))

    def _record(self, output: RequestOutput, route: _Route | None, now: float) -> None:
        if self.metrics is None:
            return
        first = route is None or route.last_token_time is None
        if output.new_token_ids:
            if first:
                self.metrics.record_first_token(output.time_to_first_token, len(output.prompt_token_ids))
            else:
                self.metrics.record_inter_token(now - route.last_token_time)
            self.metrics.record_generated(len(output.new_token_ids))
            if route is not None:
                route.last_token_time = now
        if output.finished:
            self.metrics.record_finish(output.finish_reason, output.total_time)

    def _fail_all(self, message: str) -> None:
        """Finish every routed request with an error and free its blocks."""
        for request_id, route in list(self._routes.items()):
            self._routes.pop(request_id, None)
            output = None
            try:
                output = self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - the engine is already in trouble
                log.exception("could not abort %s", request_id)
            if self.metrics is not None:
                self.metrics.record_finish("error", output.total_time if output else None)
            self._deliver(route, Update(request_id, "", [], None, output.text if output else "", True,
                                        "error", 0, 0, 0, message))

    def _update(self, output: RequestOutput) -> Update:
        num_new = len(output.new_token_ids)
        new_logprobs = None
        if output.logprobs is not None:
            # The engine keeps appending to this list: copy the new entries out now.
            new_logprobs = list(output.logprobs[len(output.logprobs) - num_new:]) if num_new else []
        return Update(
            request_id=output.request_id, new_text=output.new_text,
            new_token_ids=list(output.new_token_ids), new_logprobs=new_logprobs, text=output.text,
            finished=output.finished, finish_reason=output.finish_reason,
            num_prompt_tokens=len(output.prompt_token_ids), num_cached_tokens=output.num_cached_tokens,
            num_output_tokens=output.num_output_tokens, error=output.error)

    def _deliver(self, route: _Route, update: Update) -> None:
        try:
            route.loop.call_soon_threadsafe(route.queue.put_nowait, update)
        except RuntimeError:
            # The caller's event loop is gone; nobody can read this request any more.
            if not update.finished:
                self._abort(update.request_id)
