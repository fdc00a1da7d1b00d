"""Probe steps: prefills laid straight on the first KV blocks, outside the scheduler.

Start-up runs them to measure the largest step's peak, to compile every attention-kernel
variant before serving, and to time prefill for the tiers' cost model; `mempath
diagnose` measures pathways with them. They write no request into the KV manager: their
blocks are the pool's first ones, and nothing else is running.
"""
import logging
import time

import torch

from mempath.config import EngineConfig
from mempath.engine.batch import ScheduledBatch
from mempath.engine.request import Request
from mempath.kv.manager import blocks_for
from mempath.sampling import SamplingParams

log = logging.getLogger(__name__)


def probe_lengths(num_tokens: int, num_seqs: int) -> list[int]:
    """num_tokens split over num_seqs sequences that differ by at most one token."""
    return [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]


class Probes:
    def __init__(self, config: EngineConfig, runner, max_model_len: int):
        self.config = config
        self.runner = runner
        self.max_model_len = max_model_len

    def batch(self, num_tokens: int, num_seqs: int, token_ids=None) -> ScheduledBatch:
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

    def run(self, num_tokens: int, num_seqs: int) -> None:
        batch = self.batch(num_tokens, num_seqs)
        self.runner.execute(batch, batch.requests)

    def compile_kernels(self, num_blocks: int) -> None:
        """Compile every attention-kernel variant a step can need, before serving.

        Variants differ in compile-time flags (one query row per sequence or a mixed
        batch; split along the context or not); the first step needing one would
        otherwise stall for a compile (BENCHMARKS.md). The probes are a single row, one
        two-token prefill, a mixed pair, and max_num_seqs rows of one token and of one
        or two tokens.
        """
        start = time.perf_counter()
        runner, block_size = self.runner, self.config.block_size
        many = max(1, min(self.config.max_num_seqs, num_blocks, runner.max_tokens - 1))
        for tokens, seqs in ((1, 1), (2, 1), (3, 2), (many, many), (many + 1, many)):
            per_seq = probe_lengths(tokens, seqs)
            fits = (seqs <= many and tokens <= runner.max_tokens and max(per_seq) <= self.max_model_len
                    and sum(blocks_for(n, block_size) for n in per_seq) <= num_blocks)
            if fits:
                self.run(tokens, seqs)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        log.info("attention kernels compiled and warmed up in %.1f s", time.perf_counter() - start)

    def prefill_rate(self, num_blocks: int) -> float:
        """Prefill tokens per second of one sequence, timed on the second of two probe steps."""
        n = max(1, min(self.config.max_num_batched_tokens, self.max_model_len,
                       num_blocks * self.config.block_size, 1024))
        device = self.runner.device
        seconds = float("inf")
        for _ in range(2):  # the first pays for warm-up (kernel compilation, caches)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            self.run(n, 1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
        return n / seconds
