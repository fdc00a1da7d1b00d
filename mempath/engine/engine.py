"""LLMEngine: loads the model, sizes the KV pool, and runs the step loop.

One step: schedule → run the model on the scheduled tokens → sample → append
tokens, check stop conditions, free finished requests' blocks → outputs.
"""
import contextlib
import hashlib
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

import torch

from mempath.config import EngineConfig
from mempath.engine.detokenizer import IncrementalDetokenizer, find_stop
from mempath.engine.request import Request, RequestStatus
from mempath.engine.runner import ModelRunner, PendingTokens
from mempath.engine.scheduler import ScheduledBatch, Scheduler
from mempath.kv.manager import KVCacheManager, blocks_for
from mempath.memory.ledger import Ledger, format_bytes
from mempath.memory.oom import MempathOutOfMemoryError, oom_guard
from mempath.model.spec import ConfigFields, ModelSpec
from mempath.model.loader import (checkpoint_dtype, digest_cache_file, load_model, read_config,
                                  read_json_object, weights_digest)
from mempath.sampling import SamplingParams

log = logging.getLogger(__name__)

# Device memory outside PyTorch that grows after start-up (kernel modules loaded on
# first use): a few MiB over 1,000 serving steps on the H200 (BENCHMARKS.md, "The
# budget is a promise"); the budget keeps this much spare for it.
OUTSIDE_TORCH_GROWTH = 32 << 20
# One fresh segment of each of PyTorch's caching-allocator pools (2 MiB small, 20 MiB
# large): the least a step reserves when it finds no cached block that fits.
ALLOCATOR_SEGMENTS = 22 << 20


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated tokens once finished; while streaming, see new_token_ids
    text: str
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    time_to_first_token: float | None = None  # seconds from arrival
    total_time: float | None = None  # seconds from arrival to finish
    new_text: str = ""  # text added since the previous output for this request
    new_token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or None when the directory has none."""
    path = Path(model_dir)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def load_generation_eos(model_dir: str) -> list[int]:
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return []
    fields = ConfigFields(read_json_object(path, "a JSON object of generation settings"), str(path))
    return fields.token_ids("eos_token_id")


def probe_lengths(num_tokens: int, num_seqs: int) -> list[int]:
    """num_tokens split over num_seqs sequences that differ by at most one token."""
    return [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]


# Start-up stages an observer can wrap (`mempath diagnose` measures each one): the name and
# the ledger pathway the stage fills, None for one that only warms up.
StageObserver = Callable[[str, "str | None"], ContextManager]


def no_observer(name: str, pathway: str | None) -> ContextManager:
    return contextlib.nullcontext()


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True, stage: StageObserver = no_observer):
        self.config = config
        self.stage = stage
        self.device = config.torch_device()
        self.ledger = Ledger()
        cfg = self.hf_config = read_config(config.model)
        # Validate the architecture and lengths before anything is allocated.
        spec = ModelSpec.from_hf_config(cfg, source=str(Path(config.model) / "config.json"))
        self.max_model_len = self._resolve_max_model_len(spec)
        self.dtype = config.torch_dtype(checkpoint_dtype(cfg))

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # The whole budget until start-up has measured what it may leave PyTorch (_cap_device_memory).
            torch.cuda.set_per_process_memory_fraction(config.gpu_memory_utilization, self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        dtype_name = str(self.dtype).removeprefix("torch.")
        self.dtype_name = dtype_name
        with oom_guard("load", self.ledger, config, dtype=dtype_name), stage("load weights", "weights"):
            self.model, self.spec, self.load_report = load_model(
                config.model, self.dtype, self.device, self.max_model_len, show_progress,
                dummy=config.load_format == "dummy", spec=spec)
        self.ledger.record("weights", self.load_report.weight_bytes, self.device.type, "measured",
                           f"{self.load_report.tensors_loaded} tensors, {self.dtype}".replace("torch.", ""))
        if self.device.type == "cuda":
            measured = torch.cuda.memory_allocated(self.device) - before
            log.info("weights: %s of parameters, %s allocated on the device",
                     format_bytes(self.load_report.weight_bytes), format_bytes(measured))

        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = set(spec.eos_token_ids) | set(load_generation_eos(config.model))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

        self.runner = ModelRunner(config, self.model, self.spec, self.device, self.dtype, self.max_model_len)
        self.ledger.record("step_buffers", self.runner.workspace_bytes(), self.device.type, "measured",
                           "static inputs and decode split workspace")
        num_blocks = self._plan_kv_blocks()
        with oom_guard("kv_allocation", self.ledger, config, dtype=dtype_name,
                       requested_bytes=num_blocks * self.runner.kv_bytes_per_block()), \
                stage("kv allocation", "kv_cache"):
            self.runner.allocate_kv_cache(num_blocks)
        self.ledger.record("kv_cache", self.runner.kv_cache.numel() * self.runner.kv_cache.element_size(),
                           self.device.type, "measured",
                           f"{num_blocks} blocks x {config.block_size} tokens")
        if self.runner.use_triton:
            with stage("compile kernels", None):
                self._compile_kernels(num_blocks)
        with oom_guard("cuda_graphs", self.ledger, config, dtype=dtype_name), stage("cuda graph capture", "cuda_graphs"):
            graph_bytes = self.runner.capture_cuda_graphs()
        if self.runner.graphs:
            self.ledger.record("cuda_graphs", graph_bytes, "cuda", "measured",
                               f"{len(self.runner.graphs)} decode graphs, batch 1..{config.max_num_seqs}")
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        if config.tiers_enabled:
            with stage("attach tiers", None):
                self._attach_tiers()
        if self.device.type == "cuda":
            self._cap_device_memory()
        self.scheduler = Scheduler(config, self.kv)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        # step() reports every token (streaming callers); offline callers that only
        # want finished requests turn this off and save an output object per token.
        self.emit_progress = True
        # Finished outputs carry every token's logprobs; a caller that takes them from each
        # step's output (the server) turns this off, and the engine keeps none of them.
        self.keep_all_logprobs = True
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # A decode step launched but not read back yet (async scheduling).
        self.in_flight: PendingTokens | None = None
        self.num_steps_ahead = 0  # decode steps launched before the previous one's tokens were read
        log.info("memory by pathway:\n%s", self.ledger.table())

    # ----------------------------------------------------------------- set-up
    def _resolve_max_model_len(self, spec) -> int:
        limit = spec.max_position_embeddings
        if spec.sliding_window is not None:
            # The attention path has no sliding-window mask: stay where it makes no difference.
            limit = min(limit, spec.sliding_window)
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            raise ValueError(
                f"max_model_len {wanted} exceeds what this model supports ({limit}: "
                f"max_position_embeddings{' / sliding_window' if spec.sliding_window else ''}); "
                f"use --max-model-len {limit} or less")
        return wanted

    def _plan_kv_blocks(self) -> int:
        """How many KV blocks fit: fixed by override, by the CPU budget, or measured on CUDA."""
        per_block = self.runner.kv_bytes_per_block()
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        if self.device.type != "cuda":
            num_blocks = self.config.cpu_kv_cache_bytes // per_block
        else:
            with oom_guard("profile", self.ledger, self.config, dtype=self.dtype_name), \
                    self.stage("profile step", "activation_peak"):
                num_blocks = self._profile_cuda_kv_blocks(per_block)
        if num_blocks < 1:
            raise ValueError(
                f"no memory is left for the KV cache (one block needs {format_bytes(per_block)}); "
                f"raise --gpu-memory-utilization, lower --max-num-batched-tokens, or use a smaller --dtype")
        tokens = num_blocks * self.config.block_size
        if tokens < self.max_model_len:
            log.warning("the KV cache holds %d tokens, less than max_model_len %d: long requests "
                        "will be rejected", tokens, self.max_model_len)
        return num_blocks

    def _profile_cuda_kv_blocks(self, per_block: int) -> int:
        """Run the largest step once, measure its peak, give the rest of the budget to KV.

        Everything that takes device memory after the KV cache is allocated is reserved
        here: the step's activations, the graph pool and the driver memory of the
        captured graphs (measured on trial captures), the tiers' staging buffers, and
        room for what grows outside PyTorch while serving.
        """
        device = self.device
        torch.cuda.synchronize(device)
        weights_end = torch.cuda.memory_allocated(device)
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len * self.config.max_num_seqs)
        num_seqs = max(1, min(self.config.max_num_seqs, num_tokens))
        longest = -(-num_tokens // num_seqs)  # the probe's sequences differ by at most one token
        probe_blocks = num_seqs * blocks_for(longest, self.config.block_size)
        self.runner.allocate_kv_cache(probe_blocks)
        probe_kv = self.runner.kv_cache.numel() * self.runner.kv_cache.element_size()
        # From an empty cache, as serving steps start once the KV cache and the graphs have
        # taken the rest: the step must reserve its own segments, and the allocator's
        # segment sizes (2 MiB at the least) count, not only the bytes it hands out.
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        reserved_before_step = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        self._run_probe_step(num_tokens, num_seqs)
        torch.cuda.synchronize(device)
        # The allocator rounds and splits blocks: what the step reserved counts when it exceeds what it used.
        activation_peak = max(torch.cuda.max_memory_allocated(device) - weights_end - probe_kv,
                              torch.cuda.max_memory_reserved(device) - reserved_before_step,
                              ALLOCATOR_SEGMENTS)
        graph_driver_bytes = self.runner.graph_overhead_per_graph() * len(self.runner.graph_sizes())
        self.runner.allocate_kv_cache(0)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free  # our weights, context and allocator, plus other processes
        reserved = torch.cuda.memory_reserved(device)
        # CUDA graphs are captured after the KV cache exists; keep room for their pool
        # (its size is measured then and shows in the ledger).
        graph_reserve = self._graph_pool_estimate() if self.runner.graph_sizes() else 0
        staging = self._tier_staging_bytes(per_block)
        budget = (self.budget_bytes() - in_use - activation_peak - graph_reserve - graph_driver_bytes
                  - staging - OUTSIDE_TORCH_GROWTH)
        self.ledger.record("activation_peak", activation_peak, "cuda", "measured",
                           f"profile step of {num_tokens} tokens in {num_seqs} sequences")
        self.ledger.record("non_torch", in_use - reserved, "cuda", "derived",
                           "device used - torch reserved (context, other processes)")
        if graph_driver_bytes:
            self.ledger.record("cuda_graphs_driver", graph_driver_bytes, "cuda", "derived",
                               f"{len(self.runner.graph_sizes())} graphs x driver memory of one trial capture")
        return max(0, budget) // per_block

    def budget_bytes(self) -> int:
        """gpu_memory_utilization x the device's memory: what this process may use, all of it."""
        return int(torch.cuda.mem_get_info(self.device)[1] * self.config.gpu_memory_utilization)

    def _tier_staging_bytes(self, per_block: int) -> int:
        if not self.config.tiers_enabled:
            return 0
        from mempath.kv.tiered import STAGING_BLOCKS
        return 2 * STAGING_BLOCKS * per_block  # one staging buffer per direction

    def _cap_device_memory(self) -> None:
        """Hold PyTorch's allocator to what the budget leaves it once start-up is done.

        Serving steps of other shapes than the profile step's make the caching
        allocator reserve more than they allocate (split and cached blocks); capped,
        it hands cached blocks back to the device before it would pass the limit, so
        device use stays within gpu_memory_utilization x total.
        """
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-ups' cached blocks: serving reserves its own
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        outside = total - free - reserved
        cap = self.budget_bytes() - outside - OUTSIDE_TORCH_GROWTH
        # Never below what start-up holds plus room for fresh segments: a budget start-up
        # already passed is reported below, and serving must still be able to run a step.
        allowed = max(cap, reserved + ALLOCATOR_SEGMENTS)
        torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, allowed / total)), self.device)
        self.ledger.record("non_torch", outside, "cuda", "measured",
                           "device used - torch reserved after start-up (context, kernels, graphs, other processes)")
        if reserved > cap:
            log.warning("after start-up PyTorch holds %s, more than the %s the budget leaves it "
                        "(gpu_memory_utilization %.2f): lower --max-num-batched-tokens or --max-num-seqs, "
                        "or raise --gpu-memory-utilization",
                        format_bytes(reserved), format_bytes(cap), self.config.gpu_memory_utilization)

    def _graph_pool_estimate(self) -> int:
        """Room for the decode graphs: memory.plan.cuda_graph_bytes at the largest captured batch.

        The measured size, once captured, is what the ledger reports.
        """
        from mempath.memory.plan import MAX_GRAPH_BATCH, cublas_workspace_bytes, cuda_graph_bytes, shape_from_spec
        major, _ = torch.cuda.get_device_capability(self.device)
        return cuda_graph_bytes(shape_from_spec(self.spec), min(self.config.max_num_seqs, MAX_GRAPH_BATCH),
                                self.dtype.itemsize, cublas_workspace_bytes(major))

    def _compile_kernels(self, num_blocks: int) -> None:
        """Compile every attention-kernel variant a step can need, before serving.

        Variants differ in compile-time flags (one query row per sequence or a
        mixed batch; split along the context or not); the first step needing one
        would otherwise stall for a compile (measured on an H200: the throughput
        benchmark's 19 prefill steps took 2.4 s of device-side wall time, of which
        kernels were 0.4 s). The probes are a single row, one two-token
        prefill, a mixed pair, and max_num_seqs rows of one token and of one or two tokens.
        """
        start = time.perf_counter()
        many = max(1, min(self.config.max_num_seqs, num_blocks, self.runner.max_tokens - 1))
        for tokens, seqs in ((1, 1), (2, 1), (3, 2), (many, many), (many + 1, many)):
            per_seq = probe_lengths(tokens, seqs)
            fits = (seqs <= many and tokens <= self.runner.max_tokens and max(per_seq) <= self.max_model_len
                    and sum(blocks_for(n, self.config.block_size) for n in per_seq) <= num_blocks)
            if fits:
                self._run_probe_step(tokens, seqs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("attention kernels compiled and warmed up in %.1f s", time.perf_counter() - start)

    def probe_batch(self, num_tokens: int, num_seqs: int, token_ids=None) -> ScheduledBatch:
        """A prefill of num_tokens over num_seqs sequences laid on the first KV blocks.

        Its requests sample with the sampler's costliest settings in memory (top-p
        without top-k sorts the logits) and logprobs: what the profile step and
        `mempath diagnose` measure. ``token_ids(n)`` gives a prompt (default: zeros).
        """
        batch, next_block = ScheduledBatch(), 0
        params = SamplingParams(temperature=1.0, top_p=0.9, logprobs=self.config.max_logprobs)
        for i, n in enumerate(probe_lengths(num_tokens, num_seqs)):
            request = Request(f"probe-{i}", None, token_ids(n) if token_ids else [0] * n, params)
            blocks = blocks_for(n, self.config.block_size)
            request.block_table = list(range(next_block, next_block + blocks))
            next_block += blocks
            batch.requests.append(request)
            batch.num_new_tokens.append(n)
        return batch

    def _run_probe_step(self, num_tokens: int, num_seqs: int) -> None:
        batch = self.probe_batch(num_tokens, num_seqs)
        self.runner.execute(batch, batch.requests)

    def _attach_tiers(self) -> None:
        """Reserve the host tier, open the disk tier, calibrate the cost model (docs/tiers.md)."""
        from mempath.kv.tiered import TieredKV
        c = self.config
        tiers = TieredKV(self.kv.pool, self.runner.kv_cache, c.block_size, int(c.cpu_kv_gb * (1 << 30)),
                         c.disk_kv_path, int(c.disk_kv_gb * (1 << 30)), c.disk_write_policy == "write-through",
                         self._kv_fingerprint(), c.preemption_mode)
        host = tiers.host
        self.ledger.record("kv_cpu", host.capacity_bytes, "cpu", "measured",
                           f"{host.num_blocks} blocks, {'pinned' if host.storage.is_pinned() else 'pageable'}")
        if tiers.disk is not None:
            self.ledger.record("kv_disk", tiers.disk.capacity_bytes, "disk", "derived",
                               f"capacity at {tiers.disk.path}, {c.disk_write_policy}")
        self.ledger.record("kv_transfer_staging", tiers.transfer.staging_nbytes, self.device.type, "measured",
                           f"{tiers.transfer.staging_blocks} blocks per direction")
        tiers.calibrate(self._measure_prefill_rate)
        self.kv.tiers = tiers

    def _kv_fingerprint(self) -> str:
        """What makes a block's bytes this model's: the weights' and config's content, the KV dtype.

        Only the disk tier's blocks outlive the process, so without one nothing is hashed.
        Each weights file is hashed once: its digest is cached in mempath's cache directory
        under the file's identity (device, inode, size, mtime, ctime, header hash), never
        in the model directory (docs/tiers.md).
        """
        c = self.config
        parts = [self.dtype_name, c.load_format] + ([] if c.kv_cache_dtype == "auto" else [str(c.kv_torch_dtype(self.dtype))])
        if c.disk_kv_path:
            parts.append(json.dumps(self.hf_config, sort_keys=True))
            if c.load_format == "dummy":
                parts.append(f"seed={c.seed}")
            else:
                parts.append(weights_digest(self.load_report.file_identities, digest_cache_file()))
        return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()

    def _measure_prefill_rate(self) -> float:
        """Prefill tokens per second of one sequence, timed on the second of two probe steps."""
        n = max(1, min(self.config.max_num_batched_tokens, self.max_model_len,
                       self.kv.num_blocks * self.config.block_size, 1024))
        seconds = float("inf")
        for _ in range(2):  # the first pays for warm-up (kernel compilation, caches)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            self._run_probe_step(n, 1)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - start
        return n / seconds

    # ----------------------------------------------------------------- requests
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                f"{self.config.model} has no tokenizer files (tokenizer.json / tokenizer.model); "
                f"pass prompts as lists of token ids")
        return self.tokenizer.encode(prompt)

    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None) -> Request:
        """Validate and build a request; raise ValueError naming the problem and the fix."""
        params.validate(self.config.max_logprobs)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none: use stop_token_ids")
        if params.n != 1:
            raise ValueError("the engine runs one sample per request; LLM.generate expands n > 1")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give at least one token of text")
            text, token_ids = prompt, self.tokenize(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.spec.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_model_len "
                f"{self.max_model_len}; shorten it or raise --max-model-len")
        kv_tokens = min(len(token_ids) + params.max_tokens - 1, self.max_model_len)
        needed = self.kv.blocks_for(kv_tokens)
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"the prompt plus max_tokens needs {needed} KV blocks ({kv_tokens} tokens) but the "
                f"whole KV pool has {self.kv.num_blocks} ({self.kv.num_blocks * self.config.block_size} "
                f"tokens); lower max_tokens, shorten the prompt, or give the KV cache more memory "
                f"(--gpu-memory-utilization, num_gpu_blocks_override)")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, text, token_ids, params)
        if params.seed is not None:
            request.generator = self.runner.sampler.make_generator(params.seed)
        return request

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        request = self.make_request(prompt, params, request_id)
        self.requests[request.request_id] = request
        if self.tokenizer is not None:
            self.detokenizers[request.request_id] = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(request)
        return request.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; None if it is unknown or already done."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self.scheduler.finish(request, "abort")
        return self._output(request, "", [], finished=True)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def has_runnable_requests(self) -> bool:
        """Whether step() has work: unfinished requests other than paused ones."""
        return self.scheduler.has_runnable() or self.in_flight is not None

    def pause_request(self, request_id: str) -> None:
        """Stop scheduling a request (its reader is behind) until resume_request; it keeps its
        blocks unless another request needs them. A no-op once it is done."""
        request = self.requests.get(request_id)
        if request is not None and not request.is_finished:
            self.scheduler.pause(request)

    def resume_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
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
        """Let the disk tier finish the writes it has queued, then stop its threads."""
        if self.kv.tiers is not None:
            self.kv.tiers.close()

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        if self.in_flight is not None:
            return self._step_ahead()
        batch = self.scheduler.schedule()
        if not batch.requests:
            if self.scheduler.loading:
                self.scheduler.wait_for_loads()
                return []
            if self.scheduler.waiting and not self.scheduler.running:
                # Nothing runs and the head cannot be admitted: only possible if the pool is
                # pinned by nothing, i.e. the request can never fit. Fail it, keep the rest.
                request = self.scheduler.waiting[0]
                need = blocks_for(request.num_tokens, self.config.block_size)
                request.error = (f"the request does not fit in the KV pool: it needs {need} blocks "
                                 f"({request.num_tokens} tokens), the pool has {self.kv.num_blocks}; shorten the "
                                 f"prompt or max_tokens, or give the KV cache more memory "
                                 f"(--gpu-memory-utilization, --num-gpu-blocks-override)")
                self.scheduler.finish(request, "error")
                return [self._output(request, "", [], finished=True)]
            return []
        sampling = batch.sampling_requests()
        defer = self._can_defer(batch, sampling)
        try:
            with oom_guard("step", self.ledger, self.config, dtype=self.dtype_name):
                result = self.runner.execute(batch, sampling, defer=defer)
        except MempathOutOfMemoryError as error:
            victim = self._fail_newest(batch, error)
            return [victim] if victim is not None else []
        self.scheduler.update_after_step(batch)
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens - num_new
            self.num_prompt_tokens += max(0, min(request.num_prompt_tokens, start + num_new) - start)
        if result is None:
            return []
        if defer:
            self.in_flight = result
            return []
        return self._emit(sampling, result.token_ids, result.logprobs)

    def _emit(self, sampling: list[Request], token_ids: list[int], logprobs: list) -> list[RequestOutput]:
        outputs = []
        now = time.perf_counter()
        for request, token_id, row_logprobs in zip(sampling, token_ids, logprobs):
            if request.is_finished:
                continue  # finished or aborted while its step ran: the token is surplus
            try:
                output = self._append_token(request, token_id, row_logprobs, now)
            except Exception as error:  # one request's bookkeeping failed: fail it alone
                log.exception("request %s failed after its step", request.request_id)
                request.error = f"{type(error).__name__}: {error}"
                self.scheduler.finish(request, "error")
                output = self._output(request, "", [], finished=True)
            if output is not None:
                outputs.append(output)
        return outputs

    # ----------------------------------------------------------------- async scheduling
    # A decode step whose tokens nobody needs on the host before the next step can
    # launch (no logprobs, every row samples) is left in flight: the next call
    # launches the following decode step first, feeding it those tokens on the
    # device, and only then reads them back, checks stops and frees finished
    # requests while the device computes. A request that stopped (EOS, stop string)
    # thus runs one surplus row whose token is dropped; requests that end by length
    # are known in advance and not scheduled. Anything else (new requests to admit,
    # loads landing, a block shortage that may preempt) goes through the ordinary
    # schedule once the in-flight tokens are read.

    def _can_defer(self, batch: ScheduledBatch, sampling: list[Request]) -> bool:
        return (self.config.async_scheduling and len(sampling) == len(batch.requests)
                and all(n == 1 for n in batch.num_new_tokens)
                and all(r.params.logprobs is None for r in sampling))

    def _step_ahead(self) -> list[RequestOutput]:
        previous, self.in_flight = self.in_flight, None
        ahead = self._schedule_ahead(previous)
        launched = failed = None
        if ahead is not None:
            batch, src = ahead
            try:
                with oom_guard("step", self.ledger, self.config, dtype=self.dtype_name):
                    launched = self.runner.execute(batch, batch.requests, defer=True, tokens_from=(previous, src))
                self.scheduler.update_after_step(batch)
                self.num_steps_ahead += 1
            except MempathOutOfMemoryError as error:
                failed = (batch, error)
            except BaseException:
                # The in-flight tokens are computed and counted as such: hand them to their
                # requests before the error leaves, or the next schedule finds nothing to run.
                self._emit_pending(previous)
                raise
        outputs = self._emit_pending(previous)
        if failed is not None:
            # After the emit: a request that stopped on its in-flight token is not the victim.
            victim = self._fail_newest(*failed)
            if victim is not None:
                outputs.append(victim)
        self.in_flight = launched
        return outputs

    def _emit_pending(self, pending: PendingTokens) -> list[RequestOutput]:
        return self._emit(pending.sampling, pending.token_ids(), [None] * len(pending.sampling))

    def _schedule_ahead(self, previous: PendingTokens) -> tuple[ScheduledBatch, list[int]] | None:
        """The next decode step of the in-flight requests, or None when the ordinary schedule is needed."""
        s = self.scheduler
        num_active = s.num_active()
        if s.loading or (s.waiting and num_active < self.config.max_num_seqs):
            return None
        rows = [i for i, r in enumerate(previous.sampling)
                if r.status == RequestStatus.RUNNING and r not in s.paused]
        if len(rows) != num_active or len(rows) > self.config.max_num_batched_tokens:
            return None  # someone runs that the in-flight step did not cover
        batch, src = ScheduledBatch(), []
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
            src.append(i)
        return (batch, src) if batch.requests else None

    def _fail_newest(self, batch: ScheduledBatch, error: MempathOutOfMemoryError) -> RequestOutput | None:
        """One step ran out of memory: fail its newest unfinished request and keep serving the rest.

        The others did not advance (num_computed_tokens is unchanged), so the next
        step recomputes their tokens into the blocks they already hold.
        """
        log.error("%s", error)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        victim = next((r for r in reversed(batch.requests) if not r.is_finished), None)
        if victim is None:
            return None
        victim.error = error.explanation
        self.scheduler.finish(victim, "error")
        return self._output(victim, "", [], finished=True)

    def _append_token(self, request: Request, token_id: int, logprobs, now: float) -> RequestOutput | None:
        request.token_ids.append(token_id)
        self.num_generation_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = now
        if request.logprobs is not None:
            request.logprobs.append(logprobs)
        params = request.params
        new_text = ""
        detok = self.detokenizers.get(request.request_id)
        if detok is not None:
            new_text = detok.delta(request.token_ids[request.num_prompt_tokens:])
            request.output_text += new_text
        reason = None
        if token_id in params.stop_token_ids:
            reason, request.stop_reason = "stop", token_id
        elif not params.ignore_eos and token_id in self.eos_token_ids:
            reason = "stop"
        elif params.stop and new_text:
            hit = find_stop(request.output_text, params.stop, len(new_text))
            if hit is not None:
                index, stop = hit
                kept = len(request.output_text) - len(new_text)
                request.output_text = request.output_text[:index]
                new_text = request.output_text[kept:] if index > kept else ""
                reason, request.stop_reason = "stop", stop
        if reason is None and (request.num_output_tokens >= params.max_tokens
                               or request.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if detok is not None and reason != "stop":
                tail = detok.flush(request.token_ids[request.num_prompt_tokens:])
                request.output_text += tail
                new_text += tail
            self.scheduler.finish(request, reason)
        elif not self.emit_progress:
            return None
        return self._output(request, new_text, [token_id], finished=reason is not None)

    def _output(self, request: Request, new_text: str, new_token_ids: list[int],
                finished: bool) -> RequestOutput:
        if finished:
            request.finish_time = time.perf_counter()
            self.requests.pop(request.request_id, None)
            self.detokenizers.pop(request.request_id, None)
        ttft = None if request.first_token_time is None else request.first_token_time - request.arrival_time
        total = None if request.finish_time is None else request.finish_time - request.arrival_time
        logprobs = request.logprobs
        if logprobs is not None and not self.keep_all_logprobs:
            request.logprobs = []  # this output hands them over
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids if finished else [],
            text=request.output_text, finished=finished, finish_reason=request.finish_reason,
            stop_reason=request.stop_reason, num_cached_tokens=request.num_cached_tokens or 0,
            logprobs=logprobs, error=request.error, time_to_first_token=ttft,
            total_time=total, new_text=new_text, new_token_ids=new_token_ids,
            num_output_tokens=request.num_output_tokens)

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
            "generation_tokens": self.num_generation_tokens,
            "ledger": self.ledger.as_dict(),
            "num_loading": len(self.scheduler.loading),
            "tiers": self.kv.tiers.stats() if self.kv.tiers is not None else {"enabled": False},
        }
