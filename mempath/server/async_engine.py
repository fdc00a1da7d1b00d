"""AsyncEngine: the LLMEngine on a thread of its own, driven from asyncio.

The engine is not thread-safe, so exactly one thread owns it. That thread runs
commands from an inbox (add, abort, stats, resume, drain) between steps, steps while
anything can run, and sleeps on a condition variable when there is nothing to do.
Each request's outputs reach the event loop through the UpdateQueue the HTTP side
gave when adding it; the event loop never touches the engine.

Backpressure: a request's undelivered updates are merged into one (deltas appended),
so a stream nobody reads holds its new tokens once, not a copy of its whole text per
token. When a request has ``backlog_tokens`` undelivered tokens the engine stops
scheduling it (it keeps its KV blocks unless another request needs them) until the
reader takes the backlog, and aborts it, freeing its blocks, if that takes longer
than ``stream_stall_timeout`` seconds.

With ``log_stats_interval`` the engine thread also writes the periodic stats line
(``server/stats_log.py``), waking for it only while there is something to report.

Grammars (structured outputs) are compiled before a request reaches the engine thread,
in a small pool of this class's (``add_request``), so a compile never stalls the other
requests' decode; xgrammar's tokenizer preprocessing runs in that pool at start-up.

The engine may be a MultiEngine (several models, mempath/multi): requests then name
their model, and the per-model parts (output processors) are set up on each model's engine.
"""
import asyncio
import concurrent.futures
import dataclasses
import functools
import importlib.util
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from mempath.engine.engine import LLMEngine
from mempath.outputs import RequestOutput
from mempath.sampling import SamplingParams
from mempath.server.settings import DEFAULT_STREAM_STALL_TIMEOUT
from mempath.server.stats_log import StatsLog
from mempath.structured.grammar import COMPILE_THREADS

log = logging.getLogger(__name__)

# Undelivered tokens after which a request stops being scheduled: with 20 logprobs a
# token's update holds ~2 KB, so a stalled request holds ~130 KB at most.
STREAM_BACKLOG_TOKENS = 64
SHUTTING_DOWN = "the server is shutting down"


@dataclass(frozen=True)
class Update:
    """What one or more engine steps produced for one request, safe to hand to another thread."""
    request_id: str
    new_text: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None  # one entry per new token
    text: str  # the whole output so far (stop strings already cut off): the engine's own string
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    error: str | None = None
    # Finished updates of a request with SamplingParams.prompt_logprobs: (entries, ranks).
    prompt_logprobs: tuple[list, list] | None = None
    error_param: str | None = None  # the request field an error is about (a 400), None: the server's
    stop_reason: str | int | None = None  # the stop string or token id that ended it (vLLM's field)


class _Backlog:
    """One request's undelivered updates: deltas appended, everything else from the latest."""
    __slots__ = ("latest", "texts", "token_ids", "logprobs", "on_taken")

    def __init__(self, update: Update):
        self.latest = update
        self.texts = [update.new_text]
        self.token_ids = list(update.new_token_ids)
        self.logprobs = None if update.new_logprobs is None else list(update.new_logprobs)
        self.on_taken: Callable[[], None] | None = None

    def add(self, update: Update) -> None:
        self.latest = update
        self.texts.append(update.new_text)
        self.token_ids.extend(update.new_token_ids)
        if update.new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(update.new_logprobs)

    def merged(self) -> Update:
        if len(self.texts) == 1:
            return self.latest
        return dataclasses.replace(self.latest, new_text="".join(self.texts), new_token_ids=self.token_ids,
                                   new_logprobs=self.logprobs)


class UpdateQueue:
    """The updates of one API call's requests, each request's undelivered ones merged into one.

    The engine thread offers updates; the event loop awaits get(), which hands out one
    request's whole backlog at a time, in the order the backlogs began.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._backlogs: dict[str, _Backlog] = {}
        self._ready: asyncio.Queue[str] = asyncio.Queue()  # one entry per backlog
        # Set once a request of this call is in: the call's later ones (the n samples after
        # the first) are still admitted while the server drains, so an admitted call completes.
        self.admitted = False

    def offer(self, update: Update) -> tuple[bool, int]:
        """Add an update from any thread.

        Returns whether it began a backlog (then wake() is due) and the undelivered tokens.
        """
        with self._lock:
            backlog = self._backlogs.get(update.request_id)
            if backlog is None:
                backlog = self._backlogs[update.request_id] = _Backlog(update)
                return True, len(backlog.token_ids)
            backlog.add(update)
            return False, len(backlog.token_ids)

    def wake(self, request_id: str) -> None:
        """Event loop only: the backlog that offer() began can be taken."""
        self._ready.put_nowait(request_id)

    def put_nowait(self, update: Update) -> None:
        """Event loop only: offer and wake in one."""
        if self.offer(update)[0]:
            self.wake(update.request_id)

    def call_when_taken(self, request_id: str, callback: Callable[[], None]) -> bool:
        """Run `callback` on the event loop once the request's backlog is taken; False if it already was."""
        with self._lock:
            backlog = self._backlogs.get(request_id)
            if backlog is None:
                return False
            backlog.on_taken = callback
            return True

    async def get(self) -> Update:
        request_id = await self._ready.get()
        with self._lock:
            backlog = self._backlogs.pop(request_id)
        if backlog.on_taken is not None:
            backlog.on_taken()
        return backlog.merged()


@dataclass
class _Route:
    """Where a request's updates go, and the timing its metrics need."""
    loop: asyncio.AbstractEventLoop
    queue: UpdateQueue
    last_token_time: float | None = None  # when a step last delivered tokens of the request (its `now`)
    model: str | None = None  # the served model whose metric series it counts in (several models)


class EngineDeadError(RuntimeError):
    pass


def model_engines(engine) -> list[LLMEngine]:
    """The LLMEngines behind an engine: a MultiEngine's models, or the engine itself."""
    return list(engine.engines.values()) if hasattr(engine, "engines") else [engine]


def model_names(engine) -> list[str | None]:
    """model_engines' served names (a MultiEngine's), or None for the engine alone."""
    return list(engine.engines) if hasattr(engine, "engines") else [None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics=None,
                 stream_stall_timeout: float = DEFAULT_STREAM_STALL_TIMEOUT,
                 backlog_tokens: int = STREAM_BACKLOG_TOKENS, log_stats_interval: float | None = None):
        self.engine = engine
        self.model_engines = model_engines(engine)
        self.model_names = model_names(engine)
        for part, name in zip(self.model_engines, self.model_names):
            # Every update carries its own logprobs: the engine need not keep a request's history.
            part.outputs.keep_all_logprobs = False
            if metrics is not None:
                part.outputs.on_finish = functools.partial(self._record_request, model=name)
        engine.commit_host_kv()  # RSS stays flat over the server's life instead of creeping up
        self.metrics = metrics
        self.stats_log = None if not log_stats_interval else StatsLog(
            log_stats_interval, "GPU" if engine.device.type == "cuda" else "CPU")
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_request_tokens = engine.max_request_tokens
        self.stream_stall_timeout = stream_stall_timeout
        self.backlog_tokens = backlog_tokens
        self._routes: dict[str, _Route] = {}  # engine thread only
        self._stalls: dict[str, float] = {}  # paused request -> when it is aborted; engine thread only
        self._drain: tuple[float, concurrent.futures.Future] | None = None  # deadline, done; engine thread
        self._inbox: deque[tuple[Callable, concurrent.futures.Future | None]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._admitting = True
        self._thread: threading.Thread | None = None
        self.num_step_errors = 0
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, "mempath-grammar")
        self._compiling: dict[str, bool] = {}  # request id -> aborted meanwhile; under _wake

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="mempath-engine", daemon=True)
        self._thread.start()
        if importlib.util.find_spec("xgrammar") is not None:
            for part in self.model_engines:
                if part.inputs.grammars is not None:
                    self._grammar_pool.submit(_prepare_grammars, part.inputs.grammars)

    def drain(self, timeout: float) -> asyncio.Future:
        """Stop admitting requests now; the result completes once every request has finished,
        or after `timeout` seconds, when those left are ended with an error."""
        with self._wake:
            self._admitting = False
        done = concurrent.futures.Future()
        try:
            self._submit(lambda: self._begin_drain(time.monotonic() + timeout, done), wait=False)
        except EngineDeadError:
            done.set_result(None)  # a stopped engine runs nothing
        return asyncio.wrap_future(done)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still running end with an error, the disk tier is flushed."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ----------------------------------------------------------------- event-loop side
    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                          queue: UpdateQueue, model: str | None = None) -> None:
        """Queue a request (for the named model of a MultiEngine); its Updates will be put on
        `queue`. Raises the engine's ValueError. The request arrives now, as the engine's clock
        reads it: its latency metrics count its grammar's compile, as vLLM's do."""
        arrival_time = time.perf_counter()
        route = _Route(asyncio.get_running_loop(), queue, model=model)
        if params.structured_outputs is not None and not await self._compile_grammar(params, request_id, model):
            return  # aborted while its grammar compiled: it never reaches the engine
        command = lambda: self._add(prompt, params, request_id, route, model, arrival_time)  # noqa: E731
        await asyncio.wrap_future(self._submit(command, admit=not queue.admitted))
        queue.admitted = True

    def check_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                      model: str | None = None) -> None:
        """The engine's own check of a request (for the named model of a MultiEngine), nothing added; raises
        its ValueError. Off the engine thread: it reads the engine's settings and its requests' ids only."""
        engine = self.engine.engine(model) if hasattr(self.engine, "engines") else self.engine
        engine.make_request(prompt, params, request_id)

    def _grammars(self, model: str | None):
        """The model's grammar compiler; None for an unknown model or one without structured outputs (the
        engine's add refuses their requests)."""
        try:
            return self.engine.engine(model).inputs.grammars if hasattr(self.engine, "engines") \
                else self.engine.inputs.grammars
        except ValueError:
            return None

    async def grammar_error(self, constraint, model: str | None = None) -> str | None:
        """Why ``constraint`` (StructuredOutputsParams) does not compile for the model, None if it does (or
        the model has no compiler): compiled in the pool, into the compiler's cache."""
        grammars = self._grammars(model)
        if grammars is None:
            return None
        try:
            await asyncio.get_running_loop().run_in_executor(self._grammar_pool, grammars.compile, constraint)
        except ValueError as error:
            return str(error)
        return None

    async def _compile_grammar(self, params: SamplingParams, request_id: str, model: str | None) -> bool:
        """Compile the request's grammar in the pool, into the compiler's cache, where the engine
        thread's add finds it; False if the request was aborted meanwhile. Raises its ValueError."""
        grammars = self._grammars(model)
        if grammars is None:
            return True  # the engine's add refuses it
        with self._wake:
            self._compiling[request_id] = False
        try:
            await asyncio.get_running_loop().run_in_executor(self._grammar_pool, grammars.compile,
                                                             params.structured_outputs)
        finally:
            with self._wake:
                aborted = self._compiling.pop(request_id, False)
        return not aborted

    async def add_pipeline(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                           queue: UpdateQueue, first: str, second: str, template: str,
                           second_params: SamplingParams) -> None:
        """Queue a MultiEngine pipeline (mempath/multi/pipeline.py): its Updates are the second model's.
        Raises the engine's ValueError; SecondModelError for the second model's request."""
        from mempath.multi.pipeline import SecondModelError
        route = _Route(asyncio.get_running_loop(), queue, model=second)
        # Compiled in the pool, as add_request's are, so that no compile stalls the engine thread;
        # the second's too, so that one that does not compile refuses the pipeline before it runs.
        if params.structured_outputs is not None and not await self._compile_grammar(params, request_id, first):
            return
        if second_params.structured_outputs is not None:
            try:
                if not await self._compile_grammar(second_params, request_id, second):
                    return
            except ValueError as error:
                raise SecondModelError(second, str(error)) from None

        def command():
            self.engine.add_pipeline(prompt, params, request_id, first, second, template, second_params)
            self._routes[request_id] = route
        await asyncio.wrap_future(self._submit(command, admit=not queue.admitted))
        queue.admitted = True

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; safe from any thread, a no-op once it is done."""
        with self._wake:
            if request_id in self._compiling:
                self._compiling[request_id] = True  # add_request drops it once its grammar is compiled
                return
        try:
            self._submit(lambda: self._abort(request_id), wait=False)
        except EngineDeadError:
            pass  # a stopped engine holds no blocks to free

    async def stats(self) -> dict:
        """The engine's stats, read between steps so the figures agree with each other."""
        return await asyncio.wrap_future(self._submit(self._stats))

    def _stats(self) -> dict:
        stats = self.engine.stats()
        device = self.engine.device
        stats["device"] = device.type
        if device.type == "cuda":
            import torch
            free, total = torch.cuda.mem_get_info(device)
            stats["device_memory_used_bytes"] = total - free  # what the budget promises to stay under
        return stats

    def _submit(self, command: Callable, wait: bool = True,
                admit: bool = False) -> concurrent.futures.Future | None:
        if not self.is_alive:
            raise EngineDeadError("the engine thread is not running")
        future = concurrent.futures.Future() if wait else None
        with self._wake:
            if self._stopping or (admit and not self._admitting):
                raise EngineDeadError(SHUTTING_DOWN)
            self._inbox.append((command, future))
            self._wake.notify()
        return future

    def _resume_soon(self, request_id: str) -> None:
        """Event loop: the reader took the backlog of a paused request."""
        try:
            self._submit(lambda: self._resume(request_id), wait=False)
        except EngineDeadError:
            pass  # stopping: the request is being ended anyway

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        if self.stats_log is not None:
            self.stats_log.start(self.engine.stats(), time.monotonic())
        while True:
            with self._wake:
                while not (self._inbox or self._stopping or self.engine.has_runnable_requests()):
                    wait = self._next_deadline()
                    if wait is not None and wait <= 0:
                        break
                    # A deadline past threading's limit (--sleep-after 1e10) is no deadline for this wait.
                    self._wake.wait(None if wait is None or wait >= threading.TIMEOUT_MAX else wait)
                if self._stopping:
                    break
                commands = list(self._inbox)
                self._inbox.clear()
            self._run_commands(commands)
            if self.engine.has_runnable_requests():
                self._step()
            elif hasattr(self.engine, "tick_idle"):  # several models: an idle server still puts them to sleep
                self.engine.tick_idle()
            self._enforce_deadlines()
            if self.stats_log is not None:
                self.stats_log.maybe_log(self.engine.stats, time.monotonic())
        self._fail_all(SHUTTING_DOWN)
        self._refuse_pending()
        self._finish_drain()
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001 - nothing is left to tell but the log
            log.exception("closing the engine failed")

    def _next_deadline(self) -> float | None:
        """Seconds until a stalled stream, the drain, the stats line or a model's sleep is due; None if nothing waits."""
        deadlines = list(self._stalls.values())
        if self._drain is not None:
            deadlines.append(self._drain[0])
        if self.stats_log is not None and self.stats_log.deadline() is not None:
            deadlines.append(self.stats_log.deadline())
        to_sleep = self.engine.seconds_to_sleep() if hasattr(self.engine, "seconds_to_sleep") else None
        if to_sleep is not None:
            deadlines.append(time.monotonic() + max(0.0, to_sleep))
        return min(deadlines) - time.monotonic() if deadlines else None

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for request_id, deadline in list(self._stalls.items()):
            if deadline <= now:
                log.info("request %s: its client read nothing for %.0f s; aborted", request_id,
                         self.stream_stall_timeout)
                message = (f"the client did not read this stream for {self.stream_stall_timeout:g} s "
                           f"(--stream-stall-timeout); it was stopped")
                self._end(request_id, message, "abort")
        if self._drain is not None:
            if self._routes and now >= self._drain[0]:
                log.info("shutdown: ending %d request(s) still running", len(self._routes))
                self._fail_all(SHUTTING_DOWN)
            if not self._routes:
                self._finish_drain()

    def _begin_drain(self, deadline: float, done: concurrent.futures.Future) -> None:
        self._finish_drain()  # a second drain replaces the first
        self._drain = (deadline, done)

    def _finish_drain(self) -> None:
        if self._drain is not None:
            self._drain[1].set_result(None)
            self._drain = None

    def _refuse_pending(self) -> None:
        with self._wake:
            pending = list(self._inbox)
            self._inbox.clear()
        for _, future in pending:
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(SHUTTING_DOWN))

    def _run_commands(self, commands) -> None:
        for command, future in commands:
            if future is not None and not future.set_running_or_notify_cancel():
                continue  # its caller was cancelled (a client gone) before the command ran
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

    def _add(self, prompt, params: SamplingParams, request_id: str, route: _Route, model: str | None,
             arrival_time: float | None = None) -> None:
        if model is None:
            self.engine.add_request(prompt, params, request_id, arrival_time=arrival_time)
        else:
            self.engine.add_request(prompt, params, request_id, model=model, arrival_time=arrival_time)
        self._routes[request_id] = route

    def _close_route(self, request_id: str) -> _Route | None:
        self._stalls.pop(request_id, None)
        return self._routes.pop(request_id, None)

    def _abort(self, request_id: str) -> None:
        route = self._close_route(request_id)
        output = self.engine.abort_request(request_id)
        if output is not None and self.metrics is not None:
            self.metrics.record_finish(output.finish_reason, output.total_time, model=route and route.model)
        if output is not None and route is not None:
            self._deliver(route, self._update(output))

    def _resume(self, request_id: str) -> None:
        if self._stalls.pop(request_id, None) is not None:
            self.engine.resume_request(request_id)

    def _step(self) -> None:
        tokens_before = self._tokens_processed()
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001 - one bad step must not take the server down
            self.num_step_errors += 1
            log.exception("engine step failed; failing the requests in flight")
            self._fail_all(f"the engine failed: {error}")
            return
        now = time.perf_counter()
        if self.stats_log is not None:
            self.stats_log.stepped()
        if self.metrics is not None:
            for name, before, after in zip(self.model_names, tokens_before, self._tokens_processed()):
                if after > before:
                    self.metrics.record_iteration(after - before, model=name)
        for output in outputs:
            route = self._routes.get(output.request_id)
            self._record(output, route, now)
            if output.finished:
                self._close_route(output.request_id)
            if route is not None:
                self._deliver(route, self._update(output))

    def _tokens_processed(self) -> list[int]:
        """Prompt tokens computed and tokens generated so far, per model: the engines' counters."""
        return [e.num_prompt_tokens + e.outputs.num_generation_tokens for e in self.model_engines]

    def _record_request(self, request, model: str | None = None) -> None:
        """The output processor's on_finish: a finished request's phases into the histograms."""
        try:
            self.metrics.record_request(request, model=model)
        except Exception:  # noqa: BLE001 - a metric must never fail a request
            log.exception("recording the metrics of %s failed", request.request_id)

    def _record(self, output: RequestOutput, route: _Route | None, now: float) -> None:
        """One output of the step that ended at ``now``. A step may emit several tokens of a request, an
        output each (speculative decoding): as vLLM's, inter-token latency is one interval per request per
        step, from the step that delivered its previous tokens, and tokens count one by one."""
        if self.metrics is None:
            return
        first = route is None or route.last_token_time is None
        model = route.model if route is not None else None
        if output.new_token_ids:
            if first:
                self.metrics.record_first_token(output.time_to_first_token, len(output.prompt_token_ids), model=model)
            elif route.last_token_time != now:  # this step's first output of the request (one `now` a step)
                self.metrics.record_inter_token(now - route.last_token_time, model=model)
            self.metrics.record_generated(len(output.new_token_ids), model=model)
            if route is not None:
                route.last_token_time = now
        if output.finished:
            self.metrics.record_finish(output.finish_reason, output.total_time, model=model)

    def _fail_all(self, message: str) -> None:
        """Finish every routed request with an error and free its blocks."""
        for request_id in list(self._routes):
            self._end(request_id, message, "error")

    def _end(self, request_id: str, message: str, metric_reason: str) -> None:
        """Finish a routed request with an error update carrying `message`, and free its blocks."""
        route = self._close_route(request_id)
        output = None
        try:
            output = self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - the engine is already in trouble
            log.exception("could not abort %s", request_id)
        if self.metrics is not None:
            self.metrics.record_finish(metric_reason, output.total_time if output else None,
                                       model=route and route.model)
        if route is None:
            return
        if output is not None:
            update = dataclasses.replace(self._update(output), finish_reason="error", error=message,
                                         error_param=None)
        else:
            update = Update(request_id, "", [], None, "", True, "error", 0, 0, 0, message)
        self._deliver(route, update)

    def _update(self, output: RequestOutput) -> Update:
        num_new = len(output.new_token_ids)
        new_logprobs = None
        if output.logprobs is not None:
            # The engine may go on appending to this list: copy the new entries out now.
            new_logprobs = list(output.logprobs[len(output.logprobs) - num_new:]) if num_new else []
        return Update(
            request_id=output.request_id, new_text=output.new_text,
            new_token_ids=list(output.new_token_ids), new_logprobs=new_logprobs, text=output.text,
            finished=output.finished, finish_reason=output.finish_reason,
            num_prompt_tokens=len(output.prompt_token_ids), num_cached_tokens=output.num_cached_tokens,
            num_output_tokens=output.num_output_tokens, error=output.error, error_param=output.error_param,
            stop_reason=output.stop_reason if output.finished else None,
            prompt_logprobs=((output.prompt_logprobs, output.prompt_logprob_ranks)
                             if output.finished and output.prompt_logprobs is not None else None))

    def _deliver(self, route: _Route, update: Update) -> None:
        began, backlog = route.queue.offer(update)
        if began:
            try:
                route.loop.call_soon_threadsafe(route.queue.wake, update.request_id)
            except RuntimeError:
                # The caller's event loop is gone; nobody can read this request any more.
                if not update.finished:
                    self._abort(update.request_id)
                return
        if not update.finished and backlog >= self.backlog_tokens and update.request_id not in self._stalls:
            self._pause(update.request_id, route)

    def _pause(self, request_id: str, route: _Route) -> None:
        """Stop scheduling a request whose reader is behind, until the reader takes its backlog."""
        if route.queue.call_when_taken(request_id, lambda: self._resume_soon(request_id)):
            self.engine.pause_request(request_id)
            self._stalls[request_id] = time.monotonic() + self.stream_stall_timeout


def _prepare_grammars(grammars) -> None:
    """Start-up, in the grammar pool: xgrammar's tokenizer preprocessing, before the first request needs it."""
    try:
        grammars.prepare()
    except Exception:  # noqa: BLE001 - the first structured request sets it up (and says why it cannot)
        log.exception("setting up xgrammar at start-up failed")
