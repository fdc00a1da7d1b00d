"""SpeculativeDecoder: one engine step with proposals, in place of the runner's plain step.

A step (synchronous: the next step's positions depend on how many tokens were kept):

1. choose K for the batch's decode rows (the cost model, or the configured K) and reserve
   their lookahead slots through the KV manager; rows with logprobs, a grammar or logit
   edits (penalties, logit_bias, min_tokens, bad_words: plain_sampling_only), rows near their
   length limits and batches over ``SPEC_MAX_ROWS`` rows propose nothing;
2. propose: n-gram lookup on the host, or the draft model: one forward that brings its
   KV up to every row's tokens (prefill chunks too, and what it missed while K was 0),
   sampling the first proposal, then K - 1 one-token forwards, proposals fed on the device;
3. verify: one target forward over the batch, each speculating row with its last token
   and its proposals (K + 1 positions, logits at each), other rows as scheduled;
4. rejection sampling (``rejection.py``); ``apply`` then tells the KV manager what was
   kept (``accept_speculation``: the rest of the lookahead is freed).

Draft and target share block tables: block i holds both models' KV, in two caches.
"""
import gc
import logging
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from mempath.engine.batch import ScheduledBatch, StepPlan
from mempath.engine.request import Request
from mempath.engine.sampler import SamplerOutput, row_argmax, to_device
from mempath.engine.spec.config import SpeculativeConfig
from mempath.engine.spec.cost import SpecCostModel
from mempath.engine.spec.graphs import RowGraphs, row_buckets
from mempath.engine.spec.ngram import propose_ngram
from mempath.engine.spec.rejection import filtered_probs, greedy_accept, rejection_sample, sample_probs
from mempath.engine.spec.rows import Row, RowBuffers, forward_rows, time_forward
from mempath.memory.formulas import cuda_graph_bytes

log = logging.getLogger(__name__)

SPEC_MAX_ROWS = 64  # larger decode batches run plainly: compute-bound, speculation does not pay
PROBE_EVERY = 64  # after this many steps at K = 0, one row speculates at K = 1 to refresh the acceptance rates
MAX_PROBE_EVERY = 4096  # each probe that does not turn speculation on waits 4x longer for the next
# A probe's extra time (its row's draft catch-up, the draft step, the wider verify) is at most
# this fraction of the time decoded at K = 0 since the last one: on the H200 (2026-12-01) a
# probe cost about 1% of a 256-token run at batch 4-16, the margin of the never-slower target.
PROBE_BUDGET = 0.005
PRIOR_ACCEPTANCE = 0.6  # before anything is measured
PRIOR_WEIGHT = 4.0  # proposals' worth of the global rate in a request's running rate (and of the first guess in it)
# The global rate counts proposals, each row's weight decaying by this factor per row recorded
# since (about the last 50 rows): a few rejected proposals move it as far as they should.
GLOBAL_DECAY = 0.98
# A K = 0 choice stands this many steps while the rows and their rates are unchanged (only the
# smoothed step times move meanwhile): choosing afresh is a pass over every row each step.
RECHOOSE_EVERY = 16


def spec_workspace_bytes(max_rows: int, k: int, vocab: int, max_tokens: int) -> int:
    """The step's largest speculative temporaries: the draft's and the target's float32
    probabilities of every speculating row, and the logit-row index buffers."""
    return max_rows * (2 * k + 1) * vocab * 4 + 2 * max_tokens * 8


def spec_graph_bytes(target, draft, max_rows: int, k: int, dtype_bytes: int, cublas_workspace: int) -> tuple[int, int]:
    """(bytes, count) of the speculative step's CUDA graphs (graphs.py) for ModelShapes ``target``
    and ``draft`` (None: n-gram): each family's pool and logits as the decode graphs' formula
    counts them (an upper bound: they share the decode graphs' pool), and how many graphs."""
    total = cuda_graph_bytes(target, max_rows * (k + 1), dtype_bytes, cublas_workspace)
    families = 1
    if draft is not None:
        total += cuda_graph_bytes(draft, 2 * max_rows, dtype_bytes, cublas_workspace)
        families = 3
    return total, families * len(row_buckets(max_rows))


@dataclass
class SpecOutput:
    """A speculative step's tokens: one list per sampling request (batch order)."""
    sampling: list[Request]
    token_ids: list[list[int]]
    logprobs: list  # the first token's logprobs per request (rows that did not speculate), else None
    kept: dict = field(default_factory=dict)  # speculating request -> (tokens kept, draft KV end)


class SpecStats:
    def __init__(self, max_k: int):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * max_k
        self.num_spec_steps = self.num_plain_steps = 0
        self.last_k = 0
        self.k_counts = [0] * (max_k + 1)
        self.num_probes = 0  # K = 1 steps of one row taken to refresh the acceptance rates
        self.draft_seconds = self.verify_seconds = 0.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None,
                "mean_acceptance_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None,
                "chosen_k": self.last_k, "chosen_k_counts": list(self.k_counts), "num_probes": self.num_probes,
                "num_spec_steps": self.num_spec_steps, "num_plain_steps": self.num_plain_steps,
                "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds}


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, target, draft, kv, max_model_len: int):
        self.config = config
        self.target, self.draft, self.kv = target, draft, kv
        self.max_model_len = max_model_len
        self.max_k = config.num_speculative_tokens
        self.device = target.device
        self.generator = target.sampler.generator
        self.target_rows = RowBuffers(target.max_tokens, self.device)
        self.draft_rows = RowBuffers(draft.max_tokens, self.device) if draft is not None else None
        self.cost = SpecCostModel(self.max_k)
        self.stats = SpecStats(self.max_k)
        self.rates = weakref.WeakKeyDictionary()  # request -> [kept, proposed]
        self.kept_sum, self.proposed_sum = PRIOR_ACCEPTANCE * PRIOR_WEIGHT, PRIOR_WEIGHT  # decayed
        self.rates_version = 0  # bumped by every record: a standing K = 0 is chosen afresh
        self.standing_zero = None  # (rates version, rows' signature, steps it still stands)
        self.steps_at_zero = 0
        self.seconds_at_zero = 0.0  # predicted plain-decoding time of those steps
        self.probe_every = PROBE_EVERY
        self.probing = False  # this step's K = 1 is a probe: one row speculates
        self.probe_cost = 0.0  # the last probe's measured time over a plain step
        self.probe_step = False  # the step being planned is a probe
        self.pending_k: int | None = None  # chosen on an asynchronous step for the next one
        self._interval = None  # the last step's (batch size, K, start, draft seconds)
        self.force_accept = False  # benchmarks: keep every proposal (the cost model's check)
        self.accept_rule = None  # tests: a deliberately wrong rule (see rejection_sample)
        # CUDA graphs (graphs.py): the verify, the draft's catch-up and its proposal steps.
        self.verify_graphs = self.catch_up_graphs = self.step_graphs = None
        self.use_graphs = True  # benchmarks: False runs the speculative step eagerly
        # The draft's device time, read once the step's tokens are on the host (no sync between).
        self.timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if self.device.type == "cuda" else None

    def workspace_bytes(self) -> int:
        return self.target_rows.nbytes() + (self.draft_rows.nbytes() if self.draft_rows else 0)

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """CUDA graphs of the verify step and the draft's forwards (where the runners capture whole
        decode graphs: CUDA, not enforce_eager, no MoE layer with experts in host memory, whose
        graphs are cut at its host steps), in the target's decode graph pool; return the device
        bytes they added (pool growth and their logit outputs)."""
        rows = min(self.target.max_num_seqs, SPEC_MAX_ROWS)
        if (not self.target.graph_sizes() or self.target.cut_blocks
                or self.target.max_tokens < rows * (self.max_k + 1)):
            return 0
        device = self.device
        torch.cuda.synchronize(device)
        # Each capture collects garbage and empties the allocator's cache first (torch.cuda.graph): blocks
        # freed or cached before would count as negative graph bytes, so the baseline is read after the same.
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        pool = next(iter(self.target.graphs.values())).pool() if self.target.graphs else None
        self.verify_graphs = RowGraphs(self.target, self.max_k + 1, True, rows)
        pool = self.verify_graphs.capture(pool)
        if self.draft is not None and self.draft.graph_sizes() and not self.draft.cut_blocks:
            self.catch_up_graphs = RowGraphs(self.draft, 2, False, rows)
            pool = self.catch_up_graphs.capture(pool)
            self.step_graphs = RowGraphs(self.draft, 1, False, rows)
            self.step_graphs.capture(pool)
        # A verify replays at max_k + 1 tokens a row whatever K is: the cost model prices it so.
        self.cost.fixed_verify_len = self.max_k + 1
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-ups' blocks: the graphs hold their pool
        return torch.cuda.memory_reserved(device) - before

    def num_graphs(self) -> int:
        return sum(len(g.graphs) for g in (self.verify_graphs, self.catch_up_graphs, self.step_graphs) if g)

    @torch.inference_mode()
    def calibrate(self, max_num_seqs: int) -> None:
        """Time draft and verify forwards per batch bucket, for the cost model's first choices
        (on their graphs where captured)."""
        start = time.perf_counter()
        b = 1
        while b <= min(max_num_seqs, SPEC_MAX_ROWS):
            for q in (1, self.max_k + 1):
                if q > 1 and self.verify_graphs is not None and b in self.verify_graphs.graphs:
                    self.cost.observe_verify(b, q, self.verify_graphs.replay_seconds(b))
                elif b * q <= self.target.max_tokens:
                    self.cost.observe_verify(b, q, time_forward(self.target, self.target_rows, b, q))
            if self.step_graphs is not None and b in self.step_graphs.graphs:
                self.cost.observe_draft(b, self.step_graphs.replay_seconds(b))
            elif self.draft is not None:
                self.cost.observe_draft(b, time_forward(self.draft, self.draft_rows, b, 1))
            b *= 2
        log.info("speculation: draft and verify steps calibrated in %.1f s", time.perf_counter() - start)

    # ------------------------------------------------------------ acceptance
    @property
    def global_rate(self) -> float:
        return self.kept_sum / self.proposed_sum

    def rate(self, request: Request) -> float:
        kept, proposed = self.rates.get(request, (0, 0))
        return (kept + PRIOR_WEIGHT * self.global_rate) / (proposed + PRIOR_WEIGHT)

    def _record(self, request: Request, kept: int, proposed: int) -> None:
        entry = self.rates.setdefault(request, [0, 0])
        entry[0] += kept
        entry[1] += proposed
        self.kept_sum = GLOBAL_DECAY * self.kept_sum + kept
        self.proposed_sum = GLOBAL_DECAY * self.proposed_sum + proposed
        self.rates_version += 1
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += proposed
        s.num_accepted_tokens += kept
        for j in range(kept):
            s.accepted_per_pos[j] += 1

    # ------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute(self, plan: StepPlan):
        """Run the scheduler's step: speculative when some decode row proposes, else the
        runner's plain step. A plain decode step stays asynchronous as planned (its tokens
        in flight, the next step scheduled ahead); when the cost model would speculate on
        it, it is read back instead (``plan.defer`` cleared), so the next step can."""
        now = time.perf_counter()
        self._close_interval(now)
        batch, sampling = plan.batch, plan.sampling
        if plan.previous is None:
            proposals = self._plan(batch, sampling)
            if proposals:
                plan.defer = False
                try:
                    return self._speculate(batch, sampling, proposals, now)
                except BaseException:
                    for request in proposals:
                        self.kv.trim_lookahead(request)
                    raise
        elif plan.defer and self._wants_to_speculate(batch, sampling):
            plan.defer = False
        self.stats.num_plain_steps += 1
        self._open_interval(batch, 0, now)
        tokens_from = (plan.previous, plan.feed) if plan.previous is not None else None
        return self.target.execute(batch, sampling, defer=plan.defer, tokens_from=tokens_from)

    # Step times are intervals between step starts (what tokens per second sees: an
    # asynchronous plain step's host work overlaps the device), for decode-only batches;
    # an interval far over the estimate (the engine sat idle) is not a step's time.
    def _open_interval(self, batch: ScheduledBatch, k: int, start: float, draft_seconds: float = 0.0) -> None:
        decode_only = bool(batch.requests) and all(n == 1 for n in batch.num_new_tokens)
        self._interval = (len(batch), k, start, draft_seconds) if decode_only and len(batch) <= SPEC_MAX_ROWS else None

    def _close_interval(self, now: float) -> None:
        if self._interval is None:
            return
        b, k, start, draft_seconds = self._interval
        self._interval = None
        verify = now - start - draft_seconds
        estimate = self.cost.verify_time(b, k + 1)
        if verify <= 0 or (estimate is not None and verify > 4 * estimate):
            return
        self.cost.observe_verify(b, k + 1, verify)
        if k and self.draft is not None:
            self.cost.observe_draft(b, draft_seconds / k)

    def _decode_rows(self, batch: ScheduledBatch, sampling: list[Request]) -> list[Request]:
        ids = {id(r) for r in sampling}
        return [r for r, n in zip(batch.requests, batch.num_new_tokens)
                if n == 1 and id(r) in ids and r.num_computed_tokens == r.num_tokens - 1
                and plain_sampling_only(r)]

    def _wants_to_speculate(self, batch: ScheduledBatch, sampling: list[Request]) -> bool:
        # A step scheduled ahead: every row a decode whose input token is still in flight.
        # Rows that never speculate (grammar, logit edits, logprobs) do not read it back.
        rows = [r for r in batch.requests if plain_sampling_only(r)]
        if not rows or len(rows) > SPEC_MAX_ROWS:
            return False
        self.pending_k = None  # chosen afresh every step: a K = 0 is not carried forward
        k = self._choose_k(rows)
        self.pending_k = k or None
        return k > 0

    def _choose_k(self, rows: list[Request]) -> int:
        if not self.config.adaptive:
            return self.max_k
        if self.pending_k is not None:
            k, self.pending_k = self.pending_k, None
            return k
        self.probing, k = False, 0
        if not self._zero_stands(rows):
            catch_up = self._catch_up_seconds(rows)
            k = self.cost.choose([self.rate(r) for r in rows], draft_free=self.draft is None, overhead=catch_up)
            if k:
                self.standing_zero = None
                self.steps_at_zero, self.seconds_at_zero = 0, 0.0
                self.probe_every = PROBE_EVERY
                return k
            self.standing_zero = (self.rates_version, len(rows), sum(map(id, rows)), RECHOOSE_EVERY - 1)
        self.steps_at_zero += 1
        self.seconds_at_zero += self.cost.step_time(len(rows), 0) or 0.0
        # Probing refreshes the acceptance rates: worth it only where speculation could pay at all,
        # and only once the time at K = 0 pays for it.
        if (self.steps_at_zero >= self.probe_every
                and self.cost.could_pay(len(rows), self.draft is None, self._catch_up_seconds(rows))
                and self._probe_seconds(rows) <= PROBE_BUDGET * self.seconds_at_zero):
            self.steps_at_zero, self.seconds_at_zero = 0, 0.0
            self.probe_every = min(MAX_PROBE_EVERY, 4 * self.probe_every)
            self.stats.num_probes += 1
            self.probing, k = True, 1
        return k

    def _zero_stands(self, rows: list[Request]) -> bool:
        """Whether the last K = 0 choice still holds for these rows (and counts this step against it)."""
        standing = self.standing_zero
        if standing is None or standing[3] <= 0 or standing[:3] != (self.rates_version, len(rows), sum(map(id, rows))):
            return False
        self.standing_zero = standing[:3] + (standing[3] - 1,)
        return True

    def _probe_seconds(self, rows: list[Request]) -> float:
        """A probe's time over a plain step's: one row (the draft's least behind) at K = 1, its
        catch-up whole; no less than the last probe measured."""
        behind = 0
        if self.draft is not None:
            behind = max(0, min(r.num_tokens - 1 - r.num_draft_computed for r in rows))
        catch_up = self.cost.draft_prefill_time(behind) if behind else 0.0
        spec = self.cost.step_time(len(rows), 1, self.draft is None, catch_up)
        plain = self.cost.step_time(len(rows), 0)
        return max(self.probe_cost, 0.0 if spec is None or plain is None else spec - plain)

    def _catch_up_seconds(self, rows: list[Request]) -> float:
        """The draft's catch-up over the tokens it has no KV for (built only once a request
        speculates), spread over the steps the rows have left: charged to every K > 0."""
        if self.draft is None:
            return 0.0
        behind = sum(r.num_tokens - 1 - r.num_draft_computed for r in rows)
        if behind <= 0:
            return 0.0
        steps_left = max(1, min(r.params.max_tokens - r.num_output_tokens for r in rows))
        return self.cost.draft_prefill_time(behind) / steps_left

    def _plan(self, batch: ScheduledBatch, sampling: list[Request]) -> dict:
        """request -> its proposals' count (draft model) or its proposed tokens (n-gram)."""
        rows = self._decode_rows(batch, sampling)
        # The verify forward does not record prompt logprobs: a step prefilling a request
        # that asks for them runs plainly.
        records_prompt_logprobs = any(r.prompt_logprobs is not None and r.num_computed_tokens < r.num_prompt_tokens
                                      for r in batch.requests)
        self.probe_step = False
        if not rows or len(rows) > SPEC_MAX_ROWS or records_prompt_logprobs:
            self.stats.last_k = 0
            self.stats.k_counts[0] += 1
            return {}
        k = self._choose_k(rows)
        self.probe_step = self.probing
        if self.probing:  # the row the draft is least behind on
            rows = [min(rows, key=lambda r: r.num_tokens - r.num_draft_computed)]
            self.probing = False
        self.stats.last_k = k
        self.stats.k_counts[k] += 1
        room = self.target.max_tokens - batch.total_tokens
        plan = {}
        for request in rows:
            kr = min(k, request.params.max_tokens - request.num_output_tokens - 1,
                     self.max_model_len - request.num_tokens - 1, room)
            if kr <= 0:
                continue
            if self.draft is None:
                proposal = propose_ngram(request.token_ids, kr, self.config.prompt_lookup_min,
                                         self.config.prompt_lookup_max)
                kr = len(proposal)
            if kr > 0 and self.kv.reserve_lookahead(request, kr):
                plan[request] = proposal if self.draft is None else kr
                room -= kr
        return plan

    def _speculate(self, batch: ScheduledBatch, sampling: list[Request], plan: dict, start: float) -> SpecOutput:
        if self.timing is not None:
            self.timing[0].record()
        if self.draft is not None:
            proposed = self._propose_with_draft(batch, plan)
            if proposed is None:
                return self.target.execute(batch, sampling)
            spec_rows, drafts, draft_probs = proposed
            num = [plan[r] for r in spec_rows]
        else:
            spec_rows = [r for r in batch.requests if r in plan]
            num = [len(plan[r]) for r in spec_rows]
            k = max(num)
            drafts = torch.tensor([plan[r] + [0] * (k - len(plan[r])) for r in spec_rows], dtype=torch.int64)
            drafts, draft_probs = drafts.to(self.device), None
        if self.timing is not None:
            self.timing[1].record()
        drafted = time.perf_counter()
        output = self._verify(batch, sampling, spec_rows, num, drafts, draft_probs)  # reads the tokens back
        done = time.perf_counter()
        draft_seconds = drafted - start if self.timing is None else self.timing[0].elapsed_time(self.timing[1]) / 1e3
        s = self.stats
        s.num_spec_steps += 1
        s.draft_seconds += draft_seconds
        s.verify_seconds += done - start - draft_seconds
        if len(spec_rows) == len(batch):
            self._open_interval(batch, max(num), start, draft_seconds if self.draft is not None else 0.0)
        if self.probe_step:  # synchronous (the tokens were read back): its wall time is its cost
            self.probe_cost = max(0.0, done - start - (self.cost.step_time(len(batch), 0) or 0.0))
        return output

    def _propose(self, logits: torch.Tensor, params: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's tokens for these rows, and the distributions they were drawn from (None: all greedy)."""
        if all(p.greedy for p in params):
            return row_argmax(logits), None
        probs = filtered_probs(logits, params)
        drawn = sample_probs(probs, [None] * len(params), self.generator)
        greedy = to_device([p.greedy for p in params], torch.bool, self.device)
        return torch.where(greedy, row_argmax(logits), drawn), probs

    def _catch_up_rows(self, batch: ScheduledBatch, plan: dict) -> list[Row]:
        """The draft's first forward: each speculating row's tokens the draft has no KV for yet
        (rows that do not speculate leave the draft idle); a row whose catch-up does not fit
        the draft's buffers this step stops speculating (it keeps what was computed)."""
        rows, room = [], self.draft.max_tokens
        for request in [r for r in batch.requests if r in plan]:
            end, begin = request.num_tokens, request.num_draft_computed
            take = min(end - begin, room)
            if take < end - begin:
                del plan[request]
                self.kv.trim_lookahead(request)
            if take <= 0:
                continue
            rows.append(Row(request, begin, request.token_ids[begin:begin + take], 1 if request in plan else 0))
            room -= take
        return rows

    def _propose_with_draft(self, batch: ScheduledBatch, plan: dict):
        """Catch the draft up, then K proposals per speculating row: [R, K] tokens and their q
        (None when no row is caught up enough to propose this step)."""
        rows = self._catch_up_rows(batch, plan)
        spec_rows = [r for r in batch.requests if r in plan]
        logits = self._draft_forward(self.catch_up_graphs, rows)
        for row in rows:
            self.kv.advance_draft(row.request, row.start + len(row.token_ids))
        if not spec_rows:
            return None  # every row is still catching up: the step runs plainly
        params = [r.params for r in spec_rows]
        k = max(plan[r] for r in spec_rows)
        drafts = torch.zeros(len(spec_rows), k, dtype=torch.int64, device=self.device)
        probs = None
        active = list(range(len(spec_rows)))
        for j in range(k):
            tokens, q = self._propose(logits, [params[i] for i in active])
            index_d = to_device(active, torch.int64, self.device)
            drafts[index_d, j] = tokens
            if q is not None:
                if probs is None:
                    probs = torch.zeros(len(spec_rows), k, q.shape[-1], device=self.device)
                probs[index_d, j] = q
            active = [i for i in active if plan[spec_rows[i]] > j + 1]
            if not active:
                break
            # Proposal j + 1 goes in at position num_tokens + j; its KV is the draft's next.
            step_rows = [Row(spec_rows[i], spec_rows[i].num_tokens + j, [0], 1) for i in active]
            feed = (torch.arange(len(active), device=self.device),
                    drafts[to_device(active, torch.int64, self.device), j])
            logits = self._draft_forward(self.step_graphs, step_rows, feed)
        return spec_rows, drafts, probs

    def _draft_forward(self, graphs: RowGraphs | None, rows: list[Row], feed=None) -> torch.Tensor:
        """The draft's logits at each row's last token: replayed where a graph fits, else eager.
        A proposal step's device tokens sit at the same flat index (its row) either way."""
        size = graphs.size_for(rows) if graphs is not None and self.use_graphs else None
        if size is None:
            return forward_rows(self.draft, self.draft_rows, rows, device_tokens=feed)
        return graphs.run(rows, size, feed)

    def _verify_rows(self, batch: ScheduledBatch, sampling: list[Request], spec_rows: list[Request],
                     num: list[int]) -> list[Row]:
        """The target's rows: a speculating row its last token and its proposals (placeholders,
        fed on the device), the others as scheduled."""
        sampling_ids, proposed = {id(r) for r in sampling}, dict(zip(spec_rows, num))
        rows = []
        for request, n in zip(batch.requests, batch.num_new_tokens):
            if request in proposed:
                k = proposed[request]
                rows.append(Row(request, request.num_tokens - 1, [request.token_ids[-1]] + [0] * k, k + 1))
            else:
                start = request.num_computed_tokens
                rows.append(Row(request, start, request.token_ids[start:start + n], int(id(request) in sampling_ids)))
        return rows

    def _proposal_feed(self, rows: list[Row], offsets: list[int], speculating: set, num: list[int],
                       drafts: torch.Tensor):
        """(flat input indices, proposals): each speculating row's proposals after its own token.
        Speculating rows are in batch order, as ``num`` and ``drafts`` are."""
        spec_offsets = [off for row, off in zip(rows, offsets) if row.request in speculating]
        index = [off + 1 + j for off, k in zip(spec_offsets, num) for j in range(k)]
        flat = [i * drafts.shape[1] + j for i, k in enumerate(num) for j in range(k)]
        return (to_device(index, torch.int64, self.device),
                drafts.reshape(-1)[to_device(flat, torch.int64, self.device)])

    def _verify(self, batch, sampling, spec_rows, num, drafts, draft_probs) -> SpecOutput:
        """One target forward over every row (its graph when every row speculates); rejection
        sampling for the speculating ones."""
        rows = self._verify_rows(batch, sampling, spec_rows, num)
        speculating = set(spec_rows)
        k = drafts.shape[1]
        graphs = self.verify_graphs if self.use_graphs and len(spec_rows) == len(rows) else None
        size = graphs.size_for(rows) if graphs is not None else None
        spec_index, plain_index = [], []
        if size is not None:
            offsets = graphs.offsets(rows)
            logits = graphs.run(rows, size, self._proposal_feed(rows, offsets, speculating, num, drafts))
            # Positions past a row's own proposals repeat its last: never read (num_proposed masks them).
            spec_index = [off + min(j, n) for off, n in zip(offsets, num) for j in range(k + 1)]
        else:
            offsets = np.cumsum([0] + [len(row.token_ids) for row in rows[:-1]]).tolist()
            logits = forward_rows(self.target, self.target_rows, rows,
                                  device_tokens=self._proposal_feed(rows, offsets, speculating, num, drafts))
            offset = 0
            for row in rows:
                if row.request in speculating:
                    spec_index += [offset + min(j, row.num_logits - 1) for j in range(k + 1)]
                elif row.num_logits:
                    plain_index.append(offset)
                offset += row.num_logits
        target = logits[to_device(spec_index, torch.int64, self.device)]
        params = [r.params for r in spec_rows]
        argmax = row_argmax(target).view(len(spec_rows), k + 1)
        if self.force_accept:
            kept = torch.cat([drafts, argmax], dim=1).tolist()  # one read of both
            emitted = [row[:n] + [row[k + n]] for row, n in zip(kept, num)]
        elif draft_probs is None and all(p.greedy for p in params):
            emitted = greedy_accept(argmax, drafts, num)
        else:
            probs = filtered_probs(target, [p for p in params for _ in range(k + 1)])
            emitted = rejection_sample(probs.view(len(spec_rows), k + 1, -1), argmax, drafts, draft_probs, num,
                                       [p.greedy for p in params], [r.generator for r in spec_rows],
                                       self.generator, accept_rule=self.accept_rule)
        plain_rows = [r for r in sampling if r not in spec_rows]
        plain = None
        if plain_rows:
            plain = self._sample_plain(logits[to_device(plain_index, torch.int64, self.device)], plain_rows)
        return self._output(sampling, spec_rows, num, emitted, plain_rows, plain)

    def _sample_plain(self, logits: torch.Tensor, rows: list[Request]) -> SamplerOutput:
        """The rows that did not speculate, sampled as the runner's plain step samples them:
        grammar masks and logit edits (penalties, logit_bias, min_tokens, bad_words) first."""
        # A speculative step is synchronous: each row's newest token is on the host.
        adjust = self.target.mask_and_adjust(
            logits, rows, False, lambda: to_device([r.token_ids[-1] for r in rows], torch.int64, self.device))
        return self.target.sampler(logits, [r.params for r in rows], [r.generator for r in rows], adjust)

    def _output(self, sampling, spec_rows, num, emitted, plain_rows, plain) -> SpecOutput:
        by_request = dict(zip(spec_rows, emitted))
        if plain is not None:
            for request, token, lp in zip(plain_rows, plain.token_ids, plain.logprobs):
                by_request[request] = ([token], lp)
        out = SpecOutput(sampling, [], [])
        for request in sampling:
            got = by_request[request]
            tokens, lp = got if isinstance(got, tuple) else (got, None)
            out.token_ids.append(tokens)
            out.logprobs.append(lp)
        for request, k in zip(spec_rows, num):
            kept = len(by_request[request]) - 1
            self._record(request, kept, k)
            # The draft wrote its KV up to its second-to-last proposal.
            out.kept[request] = (kept, request.num_tokens + k - 1)
        return out

    def apply(self, output: SpecOutput) -> None:
        """After the step's ordinary bookkeeping: the kept proposals count as computed, the rest of
        each speculating row's lookahead goes back to the pool."""
        for request, (kept, draft_end) in output.kept.items():
            if not request.is_finished:
                self.kv.accept_speculation(request, kept, draft_end)

    def stats_dict(self) -> dict:
        d = self.stats.as_dict()
        d["method"] = self.config.method
        d["num_speculative_tokens"] = self.max_k
        d["adaptive"] = self.config.adaptive
        return d


def plain_sampling_only(request: Request) -> bool:
    """Whether verify may score this row's proposals with the plain filters alone.

    Rejection sampling here applies temperature, top-k, top-p and min-p; a row whose logits
    are also edited (penalties, logit_bias, min_tokens, bad_words: engine/penalties.py), masked
    by a grammar (mempath.structured), or that asks for logprobs, decodes one token a step.
    """
    return request.params.logprobs is None and request.grammar is None and not request.adjusts_logits
