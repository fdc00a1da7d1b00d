"""Continuous batching: who runs this step, with how many tokens each.

Every step spends a budget of ``max_num_batched_tokens``: running requests first
(a decode costs one token, an unfinished chunked prefill its next chunk), then
waiting requests in arrival order, each prefilling as much of its prompt as the
budget allows. When the KV pool runs dry, the newest running request is
preempted by recompute: its blocks are freed (they stay in the prefix cache until
reused) and it goes back to the front of the queue with the tokens it already
generated.

The KV manager gives and takes the blocks (``admit``, ``append_slots``,
``land_ready``, ``preempt``, ``free``); the scheduler only decides who asks. With KV
tiers, admission may find the request's next blocks in the host or disk tier and
load them when that beats recomputing them: the request then waits in ``loading``
(other requests keep running) until they land, and runs with those tokens
computed. A preempted request may be swapped to host memory instead of recomputed
(the manager decides by the tiers' cost model).

A request can be paused (the server does so while its client is not reading): it is
not scheduled and keeps its blocks, but it is the first to be preempted when a
running or waiting request needs room; preempted, it is parked outside the queue
until resumed, so it never holds up the head of the queue.
"""
from __future__ import annotations

import logging
from collections import deque
from mempath.config import EngineConfig, chunking_needs_budget
from mempath.engine.batch import PendingTokens, ScheduledBatch, StepPlan
from mempath.engine.request import Request, RequestStatus
from mempath.kv.manager import Admit, KVCacheManager

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked_prefill = config.enable_chunked_prefill
        if not self.chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(chunking_needs_budget(self.max_num_batched_tokens, max_model_len))
        self.async_scheduling = config.async_scheduling
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Admitted, KV blocks still on their way: the KV manager's handle of each load.
        self.loading: dict[Request, object] = {}
        self.paused: set[Request] = set()  # not scheduled until resumed (running, loading or parked)
        self.parked: list[Request] = []  # paused and without blocks: back to the queue's front on resume
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.parked)

    def has_runnable(self) -> bool:
        """Whether a step has anything to do: unfinished requests besides paused ones."""
        return bool(self.waiting or self.loading) or self.num_active() > 0

    def num_active(self) -> int:
        """Running requests that are not paused."""
        return len(self.running) - sum(1 for r in self.paused if r.status == RequestStatus.RUNNING)

    def pause(self, request: Request) -> None:
        if request.status == RequestStatus.WAITING and request not in self.parked:
            self.waiting.remove(request)
            self.parked.append(request)
        self.paused.add(request)

    def resume(self, request: Request) -> None:
        if request not in self.paused:
            return
        self.paused.discard(request)
        if request in self.parked:
            self.parked.remove(request)
            self.waiting.appendleft(request)
        elif request.status == RequestStatus.RUNNING and self.num_active() > self.max_num_seqs:
            # Others were admitted while it was paused and a step has no row for it now.
            self.running.remove(request)
            self.preempt(request)

    def schedule_step(self, in_flight: PendingTokens | None) -> StepPlan:
        """This step: the next decode step ahead of one in flight, else the ordinary schedule."""
        if in_flight is not None:
            ahead = self._schedule_ahead(in_flight)
            batch, feed = ahead if ahead is not None else (ScheduledBatch(), None)
            return StepPlan(batch, batch.requests, defer=True, previous=in_flight, feed=feed)
        batch = self.schedule()
        if batch.requests:
            sampling = batch.sampling_requests()
            return StepPlan(batch, sampling, defer=self._can_defer(batch, sampling))
        if self.loading:
            self.wait_for_loads()
        elif self.waiting and not self.running and not self._head_may_fit_later(batch):
            # Nothing runs and the head cannot be admitted, with no page to come back: the request
            # can never fit. Fail it, keep the rest.
            return StepPlan(batch, failed=[self._fail_head()])
        return StepPlan(batch)

    def _head_may_fit_later(self, batch: ScheduledBatch) -> bool:
        """Whether the waiting head, which fits what this model may hold, was not admitted only for now: this step
        preempted (and so tried no admission), or other models of a shared pool hold the pages it lacks."""
        if self.kv.blocks_for(self.waiting[0].num_tokens) > self.kv.pool.num_reachable:
            return False
        return batch.preempted or self.kv.pool.num_held_by_others > 0

    def _fail_head(self) -> Request:
        request = self.waiting[0]
        need, reachable = self.kv.blocks_for(request.num_tokens), self.kv.pool.num_reachable
        held = (f"the pool has {self.kv.num_blocks}" if reachable == self.kv.num_blocks else
                f"this model may hold {reachable} of the pool's {self.kv.num_blocks} (the other models are "
                f"guaranteed the rest: --kv-min-share)")
        request.error = (f"the request does not fit in the KV pool: it needs {need} blocks "
                         f"({request.num_tokens} tokens), {held}; shorten the "
                         f"prompt or max_tokens, or give the KV cache more memory "
                         f"(--gpu-memory-utilization, --num-gpu-blocks-override)")
        self.finish(request, "error")
        return request

    def fail_newest(self, batch: ScheduledBatch, explanation: str) -> Request | None:
        """A step ran out of memory: fail its newest unfinished request, keep the rest.

        The others did not advance (num_computed_tokens is unchanged), so the next
        step recomputes their tokens into the blocks they already hold.
        """
        victim = next((r for r in reversed(batch.requests) if not r.is_finished), None)
        if victim is not None:
            victim.error = explanation
            self.finish(victim, "error")
        return victim

    # A decode step whose tokens nobody needs on the host before the next step can
    # launch (no logprobs, every row samples) is left in flight: the next step is
    # launched first, fed those tokens on the device, and only then are they read
    # back, stops checked and finished requests freed, while the device computes. A
    # request that stopped (EOS, stop string) thus runs one surplus row whose token is
    # dropped; requests that end by length are known in advance and not scheduled.
    # Anything else (new requests to admit, loads landing, a block shortage that may
    # preempt) goes through the ordinary schedule once the in-flight tokens are read.
    # A step with grammar rows is left in flight too: the step after it reads its tokens
    # back before its own masks are filled (ModelRunner.execute), while its forward runs.

    def _can_defer(self, batch: ScheduledBatch, sampling: list[Request]) -> bool:
        return (self.async_scheduling and len(sampling) == len(batch.requests)
                and all(n == 1 for n in batch.num_new_tokens)
                and all(r.params.logprobs is None for r in sampling))

    def _schedule_ahead(self, previous: PendingTokens) -> tuple[ScheduledBatch, list[int]] | None:
        """The next decode step of the in-flight requests, or None when the ordinary schedule is needed."""
        num_active = self.num_active()
        if self.loading or (self.waiting and num_active < self.max_num_seqs):
            return None
        rows = [i for i, r in enumerate(previous.sampling)
                if r.status == RequestStatus.RUNNING and r not in self.paused]
        if len(rows) != num_active or len(rows) > self.max_num_batched_tokens:
            return None  # someone runs that the in-flight step did not cover
        batch, feed = ScheduledBatch(), []
        for i in rows:
            request = previous.sampling[i]
            # With its in-flight token, does it end by length? Then it is not scheduled.
            if (request.num_output_tokens + 1 >= request.params.max_tokens
                    or request.num_tokens + 1 >= self.max_model_len):
                continue
            if not self.kv.append_slots(request, 1):
                return None  # room must come from preemption: the ordinary schedule decides
            batch.requests.append(request)
            batch.num_new_tokens.append(1)
            feed.append(i)
        return (batch, feed) if batch.requests else None

    def schedule(self) -> ScheduledBatch:
        self._land_loads()
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        self._schedule_running(batch, budget)
        budget -= batch.total_tokens
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> None:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request in self.paused:
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.append_slots(request, num_new):
                j = self._victim_index()
                victim = self.running.pop(j)
                if j < i:
                    i -= 1  # a paused request, skipped above: the current one moved down
                self.preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    return
            batch.requests.append(request)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and self.num_active() + len(self.loading) < self.max_num_seqs:
            request = self.waiting[0]
            if not self.chunked_prefill and request.num_tokens - request.num_computed_tokens > budget:
                break  # its whole prompt in one step, or wait for a step with room for it
            admission = self.kv.admit(request, budget, self.loading.values())
            if admission.outcome is Admit.LOAD:
                self._start_loading(request, admission.load)
                continue
            if admission.outcome is Admit.NO_ROOM and self._preempt_paused():
                continue  # with a paused request's blocks it may fit now
            if admission.outcome is not Admit.RUN:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            if request.num_cached_tokens is None:
                request.num_cached_tokens = admission.num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append(request)
            batch.num_new_tokens.append(admission.num_new_tokens)
            budget -= admission.num_new_tokens

    def _victim_index(self) -> int:
        """Who is preempted for room: the newest paused running request, else the newest."""
        for j in range(len(self.running) - 1, -1, -1):
            if self.running[j] in self.paused:
                return j
        return len(self.running) - 1

    def preempt_newest(self) -> Request | None:
        """Preempt the request ``_victim_index`` picks, for room another model needs (mempath/multi)."""
        if not self.running:
            return None
        request = self.running.pop(self._victim_index())
        self.preempt(request)
        return request

    def _preempt_paused(self) -> bool:
        """Preempt the newest paused running request; False if none runs."""
        if not self.running:
            return False
        j = self._victim_index()
        if self.running[j] not in self.paused:
            return False
        self.preempt(self.running.pop(j))
        return True

    def _start_loading(self, request: Request, load) -> None:
        self.waiting.popleft()
        request.status = RequestStatus.LOADING
        self.loading[request] = load

    def _land_loads(self) -> None:
        """Requests whose blocks have all landed become running, with those tokens computed."""
        for request in self.kv.land_ready(list(self.loading.values())):
            del self.loading[request]
            if request.num_cached_tokens is None:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def wait_for_loads(self) -> None:
        """Nothing else can run: block until the oldest load lands instead of spinning."""
        if self.loading:
            self.kv.wait_for_load(next(iter(self.loading.values())))

    def preempt(self, request: Request) -> None:
        """Free the request's device blocks (swapping them to the host tier if that is cheaper), requeue it first."""
        preemption = self.kv.preempt(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request in self.paused:
            self.parked.append(request)
        else:
            self.waiting.appendleft(request)
        log.debug("preempted %s by %s (%d tokens)", request.request_id,
                  "swap" if preemption.swapped else "recompute", request.num_tokens)

    def update_after_step(self, batch: ScheduledBatch) -> None:
        """Advance each request by what the step computed and publish its full blocks."""
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            request.num_computed_tokens += num_new
            if not request.is_finished:  # a grammar step may finish requests: their blocks are freed
                self.kv.cache_full_blocks(request)

    def finish(self, request: Request, reason: str) -> None:
        """Take a request out of the queues and give its blocks back."""
        self.paused.discard(request)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            if request in self.parked:
                self.parked.remove(request)
            else:
                try:
                    self.waiting.remove(request)
                except ValueError:
                    pass
        self.kv.free(request, self.loading.pop(request, None))
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or reason
