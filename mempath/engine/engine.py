"""LLMEngine: the step loop over the parts start-up built.

One step is three calls: the scheduler decides what runs (``schedule_step``), the
runner executes it, and the output processor turns the sampled tokens into outputs
(stops, detokenizing, freeing finished requests' blocks through the scheduler).
"""
import logging
import weakref

import torch

from mempath.config import EngineConfig
from mempath.engine.batch import PendingTokens, StepPlan
from mempath.engine.input import InputProcessor
from mempath.engine.output import OutputProcessor
from mempath.engine.request import Request
from mempath.engine.sampler import SamplerOutput
from mempath.engine.scheduler import Scheduler
from mempath.engine.spec.decoder import SpecOutput
from mempath.engine.startup import StageObserver, Startup, no_observer, resolve_max_model_len
from mempath.memory.oom import MempathOutOfMemoryError, oom_guard
from mempath.model.moe import expert_cache_stats
from mempath.outputs import RequestOutput
from mempath.sampling import SamplingParams
from mempath.structured.grammar import GrammarCompiler

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True, stage: StageObserver = no_observer,
                 parts: Startup | None = None):
        # ``parts``: built by another start-up (several models on one device: mempath/multi/startup.py).
        parts = parts if parts is not None else Startup(config, stage).run(show_progress)
        self.config = config
        self.device, self.dtype, self.dtype_name = parts.device, parts.dtype, parts.dtype_name
        self.hf_config, self.spec, self.max_model_len = parts.hf_config, parts.spec, parts.max_model_len
        self.model, self.load_report, self.tokenizer = parts.model, parts.load_report, parts.tokenizer
        self.budget, self.ledger, self.draft_ledger = parts.budget, parts.ledger, parts.draft_ledger
        self.runner, self.probes, self.kv = parts.runner, parts.probes, parts.kv
        self.scheduler = Scheduler(config, self.kv, self.max_model_len)
        self.inputs = InputProcessor(config.model, self.tokenizer, self.spec.vocab_size, self.max_model_len,
                                     config.max_logprobs, config.block_size, self.kv.pool.num_admissible,
                                     self.runner.sampler.make_generator, frozenset(parts.eos_token_ids),
                                     grammars=GrammarCompiler(self.tokenizer, self.spec.vocab_size,
                                                              parts.eos_token_ids)
                                     if self.tokenizer is not None else None,
                                     model_positions=resolve_max_model_len(None, self.spec),
                                     pool_blocks=self.kv.num_blocks)
        self.outputs = OutputProcessor(self.tokenizer, parts.eos_token_ids, self.max_model_len,
                                       self.scheduler.finish)
        self.num_prompt_tokens = 0
        self.spec_decoder = parts.spec_decoder  # speculative decoding (docs/speculative.md), or None
        # A decode step launched but not read back yet (async scheduling).
        self.in_flight: PendingTokens | None = None
        self.num_steps_ahead = 0  # decode steps launched before the previous one's tokens were read
        # PyTorch's allocator cap on the device, held from start-up: given back by close() or when
        # the engine is collected (mempath/memory/device_cap.py).
        held = parts.device_cap.detach() if parts.device_cap is not None else None  # (startup, release, args, kwargs)
        self._device_cap = weakref.finalize(self, held[1]) if held is not None else None

    # ----------------------------------------------------------------- requests
    def tokenize(self, prompt: str) -> list[int]:
        return self.inputs.tokenize(prompt)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt and output) one request may take: max_model_len, or the KV pool if smaller."""
        return min(self.max_model_len, self.inputs.num_kv_blocks * self.inputs.block_size)

    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, arrival_time: float | None = None) -> Request:
        """Validate and build a request; raise ValueError naming the problem and the fix. ``arrival_time``:
        when the request arrived (time.perf_counter), if before this call (the server stamps it on receipt,
        before its grammar compiles); None: now. Latency metrics count from it."""
        return self.inputs.make_request(prompt, params, request_id, self.outputs.requests, arrival_time)

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        return self.add_made_request(self.make_request(prompt, params, request_id, arrival_time))

    def add_made_request(self, request: Request) -> str:
        """Schedule a request ``make_request`` built: for a caller that checks more between the two
        (a pipeline checks its second model's request before its first model's may run)."""
        self.outputs.add(request)
        self.scheduler.add(request)
        return request.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; None if it is unknown or already done."""
        request = self.outputs.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self.scheduler.finish(request, "abort")
        return self.outputs.finished(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def has_runnable_requests(self) -> bool:
        """Whether step() has work: unfinished requests other than paused ones."""
        return self.scheduler.has_runnable() or self.in_flight is not None

    def pause_request(self, request_id: str) -> None:
        """Stop scheduling a request (its reader is behind) until resume_request; it keeps its
        blocks unless another request needs them. A no-op once it is done."""
        request = self.outputs.requests.get(request_id)
        if request is not None and not request.is_finished:
            self.scheduler.pause(request)

    def resume_request(self, request_id: str) -> None:
        request = self.outputs.requests.get(request_id)
        if request is not None:
            self.scheduler.resume(request)

    def commit_host_kv(self) -> None:
        """Write a CPU KV pool once, so that all its pages are resident from now on.

        The pool is allocated empty and the OS backs a page only once it is written, so a
        long-running server's RSS would otherwise climb by the whole pool (1 GiB by
        default) as the free queue reaches blocks never used before.
        """
        if self.device.type == "cpu":
            self.runner.kv_cache.zero_()

    def close(self) -> None:
        """Let the disk tier finish the writes it has queued, then stop its threads; give the
        device's allocator cap back."""
        if self.kv.tiers is not None:
            self.kv.tiers.close()
        if self._device_cap is not None:
            self._device_cap()

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule_step(self.in_flight)
        self.in_flight = None
        result, error = self._execute(plan)
        return self._process_outputs(plan, result, error)

    def _execute(self, plan: StepPlan) -> tuple[SamplerOutput | PendingTokens | None, MempathOutOfMemoryError | None]:
        batch = plan.batch
        if not batch.requests:
            return None, None
        tokens_from = (plan.previous, plan.feed) if plan.previous is not None else None
        try:
            with oom_guard("step", self.ledger, self.config, dtype=self.dtype_name):
                if self.spec_decoder is not None:
                    result = self.spec_decoder.execute(plan)  # may clear plan.defer
                else:
                    result = self.runner.execute(batch, plan.sampling, defer=plan.defer, tokens_from=tokens_from)
        except MempathOutOfMemoryError as error:
            # The failed step's tensors live in its frames, which the tracebacks hold (this error's and its
            # cause's): let go of them, so the cache emptied after the error gets their segments back.
            error.__cause__ = error.__context__ = None
            return None, error.with_traceback(None)
        except BaseException:
            if plan.previous is not None:
                # The in-flight tokens are computed and counted as such: hand them to their
                # requests before the error leaves, or the next schedule finds nothing to run.
                self._emit_pending(plan.previous)
            raise
        self.scheduler.update_after_step(batch)
        if isinstance(result, SpecOutput):
            self.spec_decoder.apply(result)
        if plan.previous is not None:
            self.num_steps_ahead += 1
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens - num_new
            self.num_prompt_tokens += max(0, min(request.num_prompt_tokens, start + num_new) - start)
        return result, None

    def _process_outputs(self, plan: StepPlan, result, error: MempathOutOfMemoryError | None) -> list[RequestOutput]:
        outputs = [self.outputs.finished(request) for request in plan.failed]
        if plan.previous is not None:
            outputs += self._emit_pending(plan.previous)
        if error is not None:
            # After the emit: a request that stopped on its in-flight token is not the victim.
            log.error("%s", error)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            victim = self.scheduler.fail_newest(plan.batch, error.explanation)
            if victim is not None:
                outputs.append(self.outputs.finished(victim))
        elif result is not None:
            if plan.defer:
                result.emit = self._emit_tokens
                self.in_flight = result
            elif isinstance(result, SpecOutput):
                outputs += self._emit_speculative(result)
            else:
                outputs += self.outputs.emit(plan.sampling, result.token_ids, result.logprobs)
        return outputs

    def _emit_speculative(self, result: SpecOutput) -> list[RequestOutput]:
        """A speculative step's tokens, one per request at a time: a request that stops on
        one of them (EOS, stop string, length) takes none of the rest."""
        outputs = []
        for j in range(max(len(t) for t in result.token_ids)):
            rows = [i for i, t in enumerate(result.token_ids) if len(t) > j]
            outputs += self.outputs.emit([result.sampling[i] for i in rows], [result.token_ids[i][j] for i in rows],
                                         [result.logprobs[i] if j == 0 else None for i in rows])
        return outputs

    def _emit_pending(self, pending: PendingTokens) -> list[RequestOutput]:
        return pending.deliver()  # unless a grammar step has already delivered them

    def _emit_tokens(self, sampling: list[Request], token_ids: list[int]) -> list[RequestOutput]:
        return self.outputs.emit(sampling, token_ids, [None] * len(sampling))

    # ----------------------------------------------------------------- visibility
    def stats(self) -> dict:
        pool = self.kv.pool
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_paused": len(self.scheduler.paused),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used,
            "kv_blocks_free": pool.num_free,
            "kv_blocks_cached": pool.num_cached,
            "kv_usage": self.kv.usage(),
            "prefix_cache_queries": pool.num_queries,
            "prefix_cache_hits": pool.num_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "steps_launched_ahead": self.num_steps_ahead,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.outputs.num_generation_tokens,
            "ledger": self.ledger.as_dict(),
            "spec_decode": self.spec_decoder.stats_dict() if self.spec_decoder is not None else None,
            "draft_ledger": self.draft_ledger.as_dict() if self.draft_ledger is not None else None,
            "num_loading": len(self.scheduler.loading),
            "tiers": self.kv.tiers.stats() if self.kv.tiers is not None else {"enabled": False},
            "expert_cache": expert_cache_stats(self.model),  # MoE models (docs/moe.md); {"enabled": False} else
        }
