"""MultiEngine: several models' LLMEngines stepped by one loop over one shared KV page pool.

Each model keeps its own scheduler, runner, sampler and graphs (an LLMEngine each); a
request names its model and lives in that model's engine. ``step`` steps every model
that has work once, in a fixed order: one model's step is one batch through its weights,
and models cannot share a batch, so taking turns is what bounds the wait of a model's
requests behind another's (one step of each other busy model), and a model with a burst
cannot starve another of steps. A model without work is skipped, so a lone busy model
steps as often as it would alone.

When a model needs pages and the pool has none free to it, the victim policy below
chooses across models before its own scheduler preempts one of its own requests: the
model furthest above its guaranteed share (``kv_min_share``) gives up its newest request
(its scheduler's own victim rule, preempt by recompute), provided it would stay further
above its share than the asking model will be, or the asking model runs nothing at all
(else it could never start). That drives the split towards equal excess over the
guarantees under contention, and a model never loses pages below its guarantee.
"""
from __future__ import annotations

import itertools
import time

from mempath.engine.engine import LLMEngine
from mempath.multi.pages import POOL_TENANT, PagePool, TenantPages
from mempath.multi.pipeline import (Pipeline, SecondModelError, Template, count_device_reads, failed_output,
                                    handoff_text, handoff_token_ids, same_vocabulary, special_prefix)
from mempath.multi.sleep import IdleSleep, WeightsOffload

MAX_CACHED_LITERALS = 1024  # template pieces' token ids kept (a client sends few distinct templates)
from mempath.outputs import RequestOutput
from mempath.sampling import SamplingParams


class UnknownModelError(ValueError):
    """A request named a model that is not served (the server answers 404, as vLLM does)."""


class MultiEngine:
    def __init__(self, engines: dict[str, LLMEngine], pool: PagePool, sleep_after: float | None = None,
                 clock=time.monotonic):
        """``sleep_after``: seconds idle after which a model gives up its KV guarantee (sleep.py);
        ``clock``: the time the idle seconds are read from."""
        self.engines = engines
        self.pool = pool
        # Models loaded with their weights in arenas (--sleep-offload-weights) sleep with them in host memory.
        arenas = all(e.model.weights_arena is not None for e in engines.values())
        self.sleep = IdleSleep(pool, list(engines), sleep_after, clock,
                               WeightsOffload(engines) if arenas and sleep_after is not None else None)
        self.owner: dict[str, LLMEngine] = {}  # request id -> the engine it runs in
        self.pipelines: dict[str, Pipeline] = {}  # request id -> its hand-off, while its first model runs
        self.num_cross_preemptions = 0
        self.cross_preemptions_by_model = {name: 0 for name in engines}  # requests of that model preempted
        self.num_handoff_device_reads = 0  # reads of tensor data on the hand-off path (pipeline.py)
        self.vocabulary_pairs: dict[tuple[str, str], bool] = {}
        self.prefixes: dict[LLMEngine, list[int]] = {}
        self.literal_ids: dict[tuple[str, str], list[int]] = {}
        self.num_handoffs = 0
        self.handoff_seconds = 0.0
        for name, engine in engines.items():
            engine.kv.pool.reclaim = self._reclaim

    @property
    def names(self) -> list[str]:
        return list(self.engines)

    @property
    def first(self) -> LLMEngine:
        return next(iter(self.engines.values()))

    @property
    def device(self):
        return self.first.device

    @property
    def tokenizer(self):
        return self.first.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.first.max_model_len

    @property
    def max_request_tokens(self) -> int:
        return self.first.max_request_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return sum(e.num_prompt_tokens for e in self.engines.values())

    def commit_host_kv(self) -> None:
        for engine in self.engines.values():  # the views overlap; the largest model's covers every page
            engine.commit_host_kv()

    def engine(self, model: str | None) -> LLMEngine:
        """The named model's engine; None: the first model's."""
        if model is None:
            return next(iter(self.engines.values()))
        engine = self.engines.get(model) if isinstance(model, str) else None
        if engine is None:
            served = ", ".join(f"'{name}'" for name in self.engines)
            raise UnknownModelError(f"the model '{model}' does not exist; this server serves {served}")
        return engine

    # ----------------------------------------------------------------- requests
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                    model: str | None = None, arrival_time: float | None = None) -> str:
        self._check_new(request_id)
        engine = self.engine(model)
        request = engine.make_request(prompt, params, request_id, arrival_time)  # a refused request wakes nothing
        self.sleep.active(self._name_of(engine))
        engine.add_made_request(request)
        self.owner[request_id] = engine
        return request_id

    def _check_new(self, request_id: str) -> None:
        if request_id in self.owner:
            raise ValueError(f"request id {request_id!r} is already running")

    def add_pipeline(self, prompt: str | list[int], params: SamplingParams, request_id: str, first: str,
                     second: str, template: str, second_params: SamplingParams) -> Pipeline:
        """A request that ``first`` answers, whose answer through ``template`` ``second`` then
        answers (pipeline.py); its outputs are the second model's, under ``request_id``.

        The second model's request is checked before the first may run, as far as it can be without
        the first's answer: its parameters as ``second`` checks any request's, and its prompt made
        with an empty answer (the shortest it can be); a refusal raises SecondModelError."""
        second_engine = self.engine(second)
        pipeline = Pipeline(second, Template.parse(template), second_params)
        if params.n != 1 or second_params.n != 1:
            raise ValueError("a pipeline hands one answer on: use n=1 in both models' sampling parameters")
        self._check_new(request_id)
        first_engine = self.engine(first)
        request = first_engine.make_request(prompt, params, request_id)  # the first's own refusals come first
        shortest = RequestOutput.of_sample(request_id=request_id, prompt=request.prompt,
                                           prompt_token_ids=request.prompt_token_ids, token_ids=[], text="",
                                           finished=True)
        # An empty answer through "{output}" is an empty prompt where the second tokenizer adds no BOS: one
        # token stands in for the shortest answer then (an empty one is refused at its hand-off, if it comes).
        check_prompt = self._second_prompt(first_engine, pipeline, shortest) or [0]
        try:
            second_engine.make_request(check_prompt, second_params, request_id)
        except ValueError as error:
            raise SecondModelError(second, str(error)) from None
        self.sleep.active(first)
        first_engine.add_made_request(request)
        self.owner[request_id] = first_engine
        self.pipelines[request_id] = pipeline
        return pipeline

    def abort_request(self, request_id: str) -> RequestOutput | None:
        pipeline = self.pipelines.pop(request_id, None)
        engine = self.owner.pop(request_id, None)
        output = engine.abort_request(request_id) if engine is not None else None
        if pipeline is not None and output is not None:  # still in its first model
            pipeline.first_output = output
            return failed_output(output, output.finish_reason, output.error)
        return output

    def pause_request(self, request_id: str) -> None:
        if request_id in self.owner:
            self.owner[request_id].pause_request(request_id)

    def resume_request(self, request_id: str) -> None:
        if request_id in self.owner:
            self.owner[request_id].resume_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines.values())

    def has_runnable_requests(self) -> bool:
        return any(e.has_runnable_requests() for e in self.engines.values())

    def seconds_to_sleep(self) -> float | None:
        """Seconds until an idle model falls asleep (the server's loop waits no longer); None: never."""
        deadline = self.sleep.next_deadline()
        return None if deadline is None else deadline - self.sleep.clock()

    def tick_idle(self) -> None:
        """Between steps, or with nothing to step: models idle past --sleep-after fall asleep."""
        self.sleep.tick([name for name, e in self.engines.items() if e.has_unfinished_requests()])

    def step(self) -> list[RequestOutput]:
        """One step of every model with work, in turn; the idle ones may fall asleep first."""
        self.tick_idle()
        outputs = []
        for name, engine in self.engines.items():
            if engine.has_runnable_requests():
                if name in self.pool.asleep:  # a request added past add_request: never run asleep weights
                    self.sleep.active(name)
                outputs += [o for o in map(self._pipeline_output, engine.step()) if o is not None]
        for output in outputs:
            if output.finished:
                self.owner.pop(output.request_id, None)
        return outputs

    def _pipeline_output(self, output: RequestOutput) -> RequestOutput | None:
        """The request's output for a model's: a first model's output of a pipeline is not the
        request's (None); once it finishes well, the second model's request starts (in this loop,
        so before the second model's next step). A pipeline that ends before the second model
        answers ends with a failure that holds nothing of the first's answer."""
        pipeline = self.pipelines.get(output.request_id)
        if pipeline is None:
            return output
        if not output.finished:
            return None
        del self.pipelines[output.request_id]
        pipeline.first_output = output
        if output.finish_reason in ("error", "abort"):
            return failed_output(output, output.finish_reason, output.error)
        first = self.owner.pop(output.request_id)
        start = time.perf_counter()
        with count_device_reads() as reads:
            prompt = self._second_prompt(first, pipeline, output)
        self.num_handoff_device_reads += reads.count
        try:
            self.add_request(prompt, pipeline.params, output.request_id, model=pipeline.second)
        except ValueError as error:
            # The second's request was checked with the first's prompt alone before the first ran, so what
            # is new here is the answer: its length is the client's max_tokens (a 400, not the server's fault).
            answer = len(output.outputs[0].token_ids)
            return failed_output(output, "error", f"the hand-off to {pipeline.second} failed: the first model's "
                                 f"answer ({answer} tokens) made the second model's request too large: {error}. "
                                 f"Lower max_tokens (the first model's answer) or then.max_tokens, or shorten "
                                 f"then.template", "max_tokens")
        self.num_handoffs += 1
        self.handoff_seconds += time.perf_counter() - start  # building B's prompt and adding its request
        return None

    def _second_prompt(self, first: LLMEngine, pipeline: Pipeline, output: RequestOutput) -> str | list[int]:
        """The second model's prompt from the first's (finished) output."""
        if self._same_vocabulary(first, pipeline.second):
            return handoff_token_ids(pipeline.template, output, self._prefix(first),
                                     self._prefix(self.engines[pipeline.second]),
                                     lambda text: self._literal_ids(pipeline.second, text))
        return handoff_text(pipeline.template, output, first.tokenizer)

    def _prefix(self, engine: LLMEngine) -> list[int]:
        if engine not in self.prefixes:
            self.prefixes[engine] = special_prefix(engine.tokenizer)
        return self.prefixes[engine]

    def _literal_ids(self, model: str, text: str) -> list[int]:
        """A template piece's ids in the model's tokenizer, cached (templates repeat)."""
        key = (model, text)
        if key not in self.literal_ids:
            if len(self.literal_ids) >= MAX_CACHED_LITERALS:
                self.literal_ids.clear()
            self.literal_ids[key] = self.engines[model].tokenizer.encode(text, add_special_tokens=False)
        return self.literal_ids[key]

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()

    def _same_vocabulary(self, first: LLMEngine, second: str) -> bool:
        """Whether the models' tokenizers agree, compared once per pair of models."""
        key = (next(name for name, e in self.engines.items() if e is first), second)
        if key not in self.vocabulary_pairs:
            self.vocabulary_pairs[key] = same_vocabulary(first.tokenizer, self.engines[second].tokenizer)
        return self.vocabulary_pairs[key]

    # ----------------------------------------------------------------- the victim policy
    def _excess(self, view: TenantPages, extra: int = 0) -> int:
        return view.num_used + extra - self.pool.guaranteed(view.name)

    def _reclaim(self, asking: TenantPages, n: int) -> bool:
        """Preempt other models' requests until ``asking`` may take ``n`` pages; whether it may."""
        asking_engine = self.engines[asking.name]
        while asking.num_free < n:
            victim = self._victim(asking, n, runs_nothing=not asking_engine.scheduler.running)
            if victim is None:
                return False
            victim.scheduler.preempt_newest()
            self.num_cross_preemptions += 1
            self.cross_preemptions_by_model[self._name_of(victim)] += 1
        return True

    def _name_of(self, engine: LLMEngine) -> str:
        return next(name for name, e in self.engines.items() if e is engine)

    def _victim(self, asking: TenantPages, n: int, runs_nothing: bool) -> LLMEngine | None:
        """The other model furthest above its guarantee, if it may give pages to ``asking``."""
        others = [e for name, e in self.engines.items() if name != asking.name and e.scheduler.running]
        if not others:
            return None
        victim = max(others, key=lambda e: self._excess(e.kv.pool))
        excess, asking_excess = self._excess(victim.kv.pool), self._excess(asking, n)
        if excess <= 0 or not (runs_nothing or excess > asking_excess):
            return None
        if asking_excess > 0 and not self._came_after(victim, self.engines[asking.name]):
            # Above its guarantee a model takes no pages from requests older than its own: two long prefills
            # preempted each other's first chunks, and neither ever finished.
            return None
        return victim

    @staticmethod
    def _came_after(victim: LLMEngine, asking: LLMEngine) -> bool:
        """Whether the victim's newest running request arrived after the asking model's oldest request."""
        ours = [*asking.scheduler.running, *itertools.islice(asking.scheduler.waiting, 1)]
        if not ours:
            return False
        newest_theirs = max(r.arrival_time for r in victim.scheduler.running)
        return newest_theirs > min(r.arrival_time for r in ours)

    # ----------------------------------------------------------------- visibility
    def stats(self) -> dict:
        """LLMEngine.stats()'s figures over all models (KV in pages of the shared pool; the ledger's
        rows named 'model: pathway'), each model's own under ``models``, the pool's split under ``kv_pages``."""
        per_model = {name: engine.stats() for name, engine in self.engines.items()}
        summed = {key: sum(s[key] for s in per_model.values()) for key in SUMMED_STATS}
        pages = self.pool.pages
        ledgers = self.first.budget.ledgers
        return {
            **summed,
            "kv_blocks_total": pages.num_blocks, "kv_blocks_used": pages.num_used, "kv_blocks_free": pages.num_free,
            "kv_blocks_cached": pages.num_cached, "kv_usage": pages.num_used / pages.num_blocks,
            "ledger": {f"{tenant}: {pathway}": entry for tenant, ledger in ledgers.items()
                       for pathway, entry in ledger.as_dict().items()},
            "spec_decode": None, "draft_ledger": None, "tiers": {"enabled": False},
            "models": per_model,
            "kv_pages": {"total": self.pool.num_pages, "page_bytes": self.pool.page_bytes,
                         "free": pages.num_free, "guaranteed_per_model": self.pool.guaranteed(),
                         "guaranteed_by_model": {name: self.pool.guaranteed(name) for name in self.engines},
                         "used_by_model": self.pool.split()},
            "pool_ledger": ledgers[POOL_TENANT].as_dict() if POOL_TENANT in ledgers else {},
            "num_cross_model_preemptions": self.num_cross_preemptions,
            "cross_model_preemptions_by_model": dict(self.cross_preemptions_by_model),
            "sleep": self.sleep.stats(),
            "handoffs": {"count": self.num_handoffs, "seconds_total": self.handoff_seconds,
                         "device_reads": self.num_handoff_device_reads},
        }


SUMMED_STATS = ("num_running", "num_waiting", "num_paused", "num_loading", "prefix_cache_queries",
                "prefix_cache_hits", "num_preemptions", "steps_launched_ahead", "prompt_tokens",
                "generation_tokens")
