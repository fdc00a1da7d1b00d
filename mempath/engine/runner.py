"""ModelRunner: owns the KV cache and the step's static buffers, turns a scheduled
batch into model inputs, runs the model (eagerly or by replaying a CUDA graph)
and samples.

Every per-step input lives in a buffer allocated once, sized by the engine's
limits (max_num_batched_tokens, max_num_seqs, max_model_len): the host side is
pinned so the copies are asynchronous, the device side is what the model and
the CUDA graphs read. A step writes into them; it allocates none.
"""
import gc
from typing import NamedTuple

import numpy as np
import torch

from mempath.config import EngineConfig
from mempath.constants import MAX_GRAPH_BATCH
from mempath.engine.batch import PendingTokens, ScheduledBatch
from mempath.engine.penalties import LogitsAdjustments, build_adjustments
from mempath.engine.prompt_logprobs import prompt_logprob_rows, record_prompt_logprobs
from mempath.engine.request import Request
from mempath.engine.sampler import Sampler, SamplerOutput
from mempath.engine.piecewise import PiecewiseGraph, cuts_at
from mempath.kv.block_table import BlockTableRows
from mempath.memory.budget import check_host_room
from mempath.model import moe_slots
from mempath.model.llama import AttentionMetadata, CausalLM
from mempath.model.quant import fp8_gemv_bytes
from mempath.model.spec import ModelSpec
from mempath.structured.bitmask import GrammarBitmask


# Steps of at least this many sequences hand the decode attention kernel their order by descending
# context: across unequal contexts a wide batch then ends on short programs rather than on a long one
# started last. Below it the order bought nothing measurable and cost a load per program
# (BENCHMARKS.md, "Decode attention over unequal contexts"). Graph sizes are fixed, so a captured size
# is ordered or not for good. DECODE_LONGEST_FIRST False turns it off (A/B: bench_mix --decode-order
# batch, bench_engine --variants batch-decode-order). Both are read once, when a runner is built: a graph
# captured with the order must be replayed with a fresh one.
DECODE_LONGEST_FIRST = True
DECODE_ORDER_MIN_SEQS = 128


class TrialGraphs(NamedTuple):
    """What the decode graphs captured over the profile's KV cache measured (ModelRunner.trial_capture_graphs)."""

    pool_bytes: int  # the graph pool, freed with the graphs
    driver_bytes: int  # driver memory outside PyTorch the driver gave back when they were freed
    driver_bytes_per_graph: int  # driver memory one graph held, whether given back or kept


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph: 1, 2, 4, 8, then every 8 up to the limit."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class StepBuffers:
    """Static per-step inputs: pinned host arrays and their device twins."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        pin = device.type == "cuda"
        self.device = device
        # Before allocating: the block tables alone are max_seqs · max_blocks int32, host and device twin (both
        # host memory on a CPU device), and an absurd --max-num-seqs otherwise fails in the allocator.
        host_bytes = StepBuffers.host_nbytes(max_tokens, max_seqs, max_blocks)
        tokens_larger = 3 * max_tokens * 8 > max_seqs * max_blocks * 4  # name the flag behind the larger part
        setting = f"--max-num-batched-tokens {max_tokens}" if tokens_larger else f"--max-num-seqs {max_seqs}"
        check_host_room(host_bytes * (1 if pin else 2), setting, "step buffers")

        def pair(shape, dtype):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, host.numpy(), torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids_h, self.input_ids, self.input_ids_d = pair(max_tokens, torch.int64)
        self.positions_h, self.positions, self.positions_d = pair(max_tokens, torch.int64)
        self.slots_h, self.slots, self.slots_d = pair(max_tokens, torch.int64)
        self.tables_h, self.tables, self.tables_d = pair((max_seqs, max_blocks), torch.int32)
        self.qsl_h, self.qsl, self.qsl_d = pair(max_seqs + 1, torch.int32)
        self.seq_lens_h, self.seq_lens, self.seq_lens_d = pair(max_seqs, torch.int32)
        # The sequences by descending length: the decode attention kernel starts the longest first.
        self.seq_order_h, self.seq_order, self.seq_order_d = pair(max_seqs, torch.int32)
        self.rows_h, self.rows, self.rows_d = pair(max_seqs, torch.int64)
        # Rows of the previous step's sampled tokens that feed this step (async scheduling).
        self.src_rows_h, self.src_rows, self.src_rows_d = pair(max_seqs, torch.int64)
        # Two landing buffers for sampled tokens: one step's copy may still be unread
        # when the next step's copy is queued.
        self.sampled_h = [torch.zeros(max_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.sampled_ready = [torch.cuda.Event() for _ in range(2)] if pin else [None, None]
        self.next_sampled = 0
        # Marks when the last upload has left the pinned buffers, so they may be rewritten.
        self.uploaded = torch.cuda.Event() if pin else None

    @staticmethod
    def host_nbytes(max_tokens: int, max_seqs: int, max_blocks: int) -> int:
        """The pinned host arrays' bytes (each device twin is as large, but for the sampled tokens')."""
        return (3 * max_tokens * 8 + max_seqs * max_blocks * 4 + (max_seqs + 1) * 4 + 2 * max_seqs * 4
                + 2 * max_seqs * 8 + 2 * max_seqs * 8)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (
            self.input_ids_d, self.positions_d, self.slots_d, self.tables_d, self.qsl_d,
            self.seq_lens_d, self.seq_order_d, self.rows_d, self.src_rows_d))

    def wait_until_reusable(self) -> None:
        if self.uploaded is not None:
            self.uploaded.synchronize()

    def upload(self, num_tokens: int, num_seqs: int, num_rows: int, num_ordered: int = 0) -> None:
        """Copy the filled prefixes host → device (asynchronous from pinned memory); ``seq_order`` only
        for a step that passes it (``num_ordered`` sequences), so other steps pay no copy for it."""
        for host, dev, n in ((self.input_ids_h, self.input_ids_d, num_tokens),
                             (self.positions_h, self.positions_d, num_tokens),
                             (self.slots_h, self.slots_d, num_tokens),
                             (self.tables_h, self.tables_d, num_seqs),
                             (self.qsl_h, self.qsl_d, num_seqs + 1),
                             (self.seq_lens_h, self.seq_lens_d, num_seqs),
                             (self.seq_order_h, self.seq_order_d, num_ordered),
                             (self.rows_h, self.rows_d, num_rows)):
            if n:
                dev[:n].copy_(host[:n], non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()


def kv_block_nbytes(spec, block_size: int, itemsize: int) -> int:
    """One KV block's bytes: K and V of every layer for ``block_size`` tokens."""
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * itemsize


class ModelRunner:
    def __init__(self, config: EngineConfig, model: CausalLM, spec: ModelSpec,
                 device: torch.device, dtype: torch.dtype, max_model_len: int):
        self.config = config
        self.model = model
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // config.block_size)
        self.max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.sampler = Sampler(device, config.seed)
        self.kv_cache = torch.empty(0)
        self.buffers = StepBuffers(self.max_tokens, config.max_num_seqs, self.max_blocks_per_seq, device)
        self.grammar_bitmask = GrammarBitmask(config.max_num_seqs, spec.vocab_size, device)
        self.arange = np.arange(max(self.max_tokens, max_model_len) + 1, dtype=np.int64)
        self.table_rows = BlockTableRows(config.max_num_seqs)  # what each row of buffers.tables holds
        self.decode_workspace = None
        # Steps of at least this many sequences pass the decode kernel their longest-first order (None: never).
        self.decode_order_min_seqs = DECODE_ORDER_MIN_SEQS if DECODE_LONGEST_FIRST else None
        self.graphs: dict[int, torch.cuda.CUDAGraph | PiecewiseGraph] = {}
        # MoE layers with experts in host memory: decode graphs are cut at them (engine/piecewise.py).
        self.cut_blocks = moe_slots.offloaded_blocks(model) if device.type == "cuda" else []
        self.slot_table_bytes = moe_slots.allocate_slot_tables(model) if self.cut_blocks else 0
        self.graph_logits: torch.Tensor | None = None
        # The model's kernels decide the path (mempath.kernels.dispatch); the Triton decode
        # kernel's split workspace is allocated once, here.
        self.use_triton = model.kernels.triton
        if self.use_triton:
            from mempath.kernels.attention_triton import alloc_decode_workspace
            self.decode_workspace = alloc_decode_workspace(
                self.max_num_seqs, spec.num_heads, spec.num_kv_heads, spec.head_dim, device)

    def decode_order_on(self, num_seqs: int) -> bool:
        return self.decode_order_min_seqs is not None and num_seqs >= self.decode_order_min_seqs

    def kv_bytes_per_block(self) -> int:
        return kv_block_nbytes(self.spec, self.block_size, self.config.kv_torch_dtype(self.dtype).itemsize)

    def workspace_bytes(self) -> int:
        """Bytes of the static step buffers, the decode split workspaces (attention's, fp8 GEMV's) and the
        offloaded MoE layers' slot tables."""
        total = (self.buffers.nbytes() + self.grammar_bitmask.nbytes() + fp8_gemv_bytes(self.model)
                 + self.slot_table_bytes)
        if self.decode_workspace is not None:
            total += sum(t.numel() * t.element_size() for t in self.decode_workspace)
        return total

    def allocate_kv_cache(self, num_blocks: int) -> None:
        s = self.spec
        self.graphs.clear()  # graphs captured against an old cache would read freed memory
        self.graph_logits = None
        self.kv_cache = torch.empty(0)
        kv_dtype = self.config.kv_torch_dtype(self.dtype)
        # An fp8 cache is kept as bytes and viewed as fp8 by the attention layers: the tiers
        # move blocks with index_copy_, which PyTorch's CPU build lacks for float8.
        storage_dtype = torch.uint8 if kv_dtype.itemsize == 1 else kv_dtype
        self.kv_cache = torch.empty(
            s.num_layers, 2, num_blocks, self.block_size, s.num_kv_heads, s.head_dim,
            dtype=storage_dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache = self.kv_cache[i, 0].view(kv_dtype)
            attn.v_cache = self.kv_cache[i, 1].view(kv_dtype)

    # ----------------------------------------------------------------- inputs
    def prepare(self, batch: ScheduledBatch, sampling: set[int], pad_to: int | None = None,
                tokens_from: tuple[PendingTokens, list[int]] | None = None):
        """Fill the static buffers for this batch; return the metadata over their prefixes.

        With ``tokens_from`` (a decode batch whose input tokens were sampled by the
        step before and are not on the host yet), row i's input id is copied on the
        device from row ``src[i]`` of that step's tokens.
        """
        buf = self.buffers
        buf.wait_until_reusable()
        num_seqs = len(batch.requests)
        self.table_rows.write(buf.tables, batch.requests)  # first: _fill_mixed reads the slots' blocks there
        if max(batch.num_new_tokens) == 1:
            t, rows, max_seq_len = self._fill_decode(batch.requests, sampling, tokens_from is not None)
        else:
            t, rows, max_seq_len = self._fill_mixed(batch, sampling)
        if pad_to is not None and pad_to > num_seqs:
            # Padding rows of a captured decode graph: write nothing, read one slot of block 0.
            pad = slice(num_seqs, pad_to)
            buf.input_ids[pad] = 0
            buf.positions[pad] = 0
            buf.slots[pad] = -1
            buf.tables[pad, 0] = 0
            self.table_rows.forget(pad)
            buf.qsl[num_seqs + 1:pad_to + 1] = np.arange(t + 1, t + 1 + pad_to - num_seqs)
            buf.seq_lens[pad] = 1
            num_seqs, t = pad_to, pad_to
        ordered = self.decode_order_on(num_seqs)
        if ordered:  # stable: equal lengths keep batch order
            buf.seq_order[:num_seqs] = np.argsort(-buf.seq_lens[:num_seqs], kind="stable")
        if tokens_from is not None:
            pending, src = tokens_from
            buf.src_rows[:len(src)] = src
            buf.src_rows_d[:len(src)].copy_(buf.src_rows_h[:len(src)], non_blocking=True)
        buf.upload(t, num_seqs, rows, num_seqs if ordered else 0)
        if tokens_from is not None:
            torch.index_select(pending.tokens, 0, buf.src_rows_d[:len(src)], out=buf.input_ids_d[:len(src)])
        meta = AttentionMetadata(
            slot_mapping=buf.slots_d[:t], block_tables=buf.tables_d[:num_seqs],
            query_start_loc=buf.qsl_d[:num_seqs + 1], seq_lens=buf.seq_lens_d[:num_seqs],
            max_query_len=max(batch.num_new_tokens), max_seq_len=max_seq_len,
            decode_workspace=self.decode_workspace,
            seq_order=buf.seq_order_d[:num_seqs] if ordered else None)
        return buf.input_ids_d[:t], buf.positions_d[:t], meta, buf.rows_d[:rows]

    def _fill_decode(self, requests: list[Request], sampling: set[int], tokens_on_device: bool = False):
        """One new token per request: whole-array writes, no per-request numpy calls."""
        bs = self.block_size
        buf = self.buffers
        n = len(requests)
        positions = [r.num_computed_tokens for r in requests]
        if not tokens_on_device:
            buf.input_ids[:n] = [r.token_ids[p] for r, p in zip(requests, positions)]
        buf.positions[:n] = positions
        buf.slots[:n] = [r.block_table[p // bs] * bs + p % bs for r, p in zip(requests, positions)]
        buf.qsl[:n + 1] = self.arange[:n + 1]
        buf.seq_lens[:n] = positions
        buf.seq_lens[:n] += 1
        if len(sampling) == n:
            buf.rows[:n] = self.arange[:n]
            rows = n
        else:
            picked = [i for i, r in enumerate(requests) if id(r) in sampling]
            buf.rows[:len(picked)] = picked
            rows = len(picked)
        return n, rows, max(positions) + 1

    def _fill_mixed(self, batch: ScheduledBatch, sampling: set[int]):
        """Rows of any length: the tokens gathered into one list, then positions, slots and
        offsets as whole-array operations over the batch (a step carrying a prefill has up to
        max_num_seqs rows, and per-row numpy writes cost more than the arrays). The slots'
        blocks are read from the block tables already written into ``buffers.tables``."""
        bs = self.block_size
        buf = self.buffers
        requests = batch.requests
        n = len(requests)
        counts = np.asarray(batch.num_new_tokens, dtype=np.int64)
        starts = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=n)
        ends = starts + counts
        ids: list[int] = []
        for request, start, end in zip(requests, starts.tolist(), ends.tolist()):
            ids += request.token_ids[start:end]
        t = len(ids)
        buf.input_ids[:t] = ids
        qsl = buf.qsl[:n + 1]
        qsl[0] = 0
        np.cumsum(counts, out=qsl[1:])
        positions = self.arange[:t] + np.repeat(starts - qsl[:n], counts)
        buf.positions[:t] = positions
        blocks = buf.tables[np.repeat(self.arange[:n], counts), positions // bs].astype(np.int64)
        buf.slots[:t] = blocks * bs + positions % bs
        buf.seq_lens[:n] = ends
        last = qsl[1:] - 1
        if len(sampling) != n:
            last = last[[i for i, r in enumerate(requests) if id(r) in sampling]]
        buf.rows[:len(last)] = last
        return t, len(last), int(ends.max())

    # ----------------------------------------------------------------- running
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, sampling: list[Request], defer: bool = False,
                tokens_from: tuple[PendingTokens, list[int]] | None = None
                ) -> SamplerOutput | PendingTokens | None:
        """Run one step; sample for the requests in `sampling` (in batch order).

        ``defer``: return the sampled tokens as PendingTokens without waiting for them
        (no logprobs). ``tokens_from``: see ``prepare``.
        """
        graph_size = self._graph_size(batch, sampling)
        if graph_size is not None:
            self.prepare(batch, {id(r) for r in sampling}, pad_to=graph_size, tokens_from=tokens_from)
            graph = self.graphs[graph_size]
            if isinstance(graph, PiecewiseGraph):
                graph.replay(len(batch.requests))  # its host steps read the real rows' routing only
            else:
                graph.replay()
            logits = self.graph_logits[:len(batch.requests)]
        else:
            input_ids, positions, meta, logits_rows = self.prepare(
                batch, {id(r) for r in sampling}, tokens_from=tokens_from)
            hidden = self.model(input_ids, positions, meta)
            if any(r.prompt_logprobs is not None for r in batch.requests):
                record_prompt_logprobs(self.model, hidden, batch, prompt_logprob_rows(self.max_num_seqs))
            if not sampling:
                return None
            logits = self.model.compute_logits(hidden[logits_rows])
        buf = self.buffers
        tokens_on_device = tokens_from is not None
        if tokens_on_device and any(r.grammar is not None for r in sampling):
            # A grammar row's mask needs its newest token in its matcher: with the forward
            # queued, the previous step's tokens are read back and handed to their requests
            # now (the matchers advance, stops finish requests), then the masks are filled,
            # and only then is the sampling queued.
            tokens_from[0].deliver()
            tokens_on_device = False
        # Each sampling row's last input token is its newest token, on the device even when
        # the host does not have it yet (tokens_from): the penalties read it from there.
        adjust = self.mask_and_adjust(logits, sampling, tokens_on_device,
                                      lambda: buf.input_ids_d.index_select(0, buf.rows_d[:len(sampling)]))
        params, generators = [r.params for r in sampling], [r.generator for r in sampling]
        if not defer:
            return self.sampler(logits, params, generators, adjust)
        tokens, for_host = self.sampler.sample_tokens(logits, params, generators, adjust)
        host, ready = buf.sampled_h[buf.next_sampled][:len(sampling)], buf.sampled_ready[buf.next_sampled]
        buf.next_sampled ^= 1
        host.copy_(for_host, non_blocking=True)
        if ready is not None:
            ready.record()
        return PendingTokens(sampling, tokens, host, ready)

    def mask_and_adjust(self, logits: torch.Tensor, sampling: list[Request], tokens_on_device: bool,
                        last_tokens) -> LogitsAdjustments | None:
        """Before sampling ``logits`` (a row per request of ``sampling``): grammar rows masked in
        place, and this step's logit edits (penalties, logit_bias, min_tokens, bad_words) for the
        sampler; ``tokens_on_device`` and ``last_tokens``: see ``build_adjustments``."""
        # A finished request's row (its stop token was in flight when this step was scheduled)
        # samples a surplus token that is dropped: no mask.
        grammars = [r.grammar if not r.is_finished else None for r in sampling]
        only_ends = None
        if any(g is not None for g in grammars):
            # Here the forward is queued, not finished: the host fills the masks meanwhile.
            self.grammar_bitmask.apply(logits, grammars)
            only_ends = lambda row, ids: (grammars[row] is not None  # noqa: E731
                                          and self.grammar_bitmask.allows_only(row, ids))
        return build_adjustments(sampling, tokens_on_device, last_tokens, self.spec.vocab_size, self.device,
                                 only_ends)

    def _graph_size(self, batch: ScheduledBatch, sampling: list[Request]) -> int | None:
        """The captured graph that can run this batch: decode-only, every row sampling."""
        if not self.graphs or len(sampling) != len(batch.requests):
            return None
        if any(n != 1 for n in batch.num_new_tokens):
            return None
        for size in self.graphs:  # ascending
            if size >= len(batch.requests):
                return size
        return None

    @torch.inference_mode()
    def graph_sizes(self) -> list[int]:
        """The decode batch sizes that get a CUDA graph (none when eager or on the CPU). A MoE model with
        fewer experts resident than all gets graphs cut at its MoE layers (engine/piecewise.py) for the
        batches whose k experts per row fit the slots at once, none if a miss may run on the host.
        """
        if self.device.type != "cuda" or self.config.enforce_eager:
            return []
        if any(block.experts.kernels.grouped_experts is None for block in self.model.moe_blocks()):
            return []
        sizes = graph_batch_sizes(min(self.max_num_seqs, MAX_GRAPH_BATCH))
        limit = moe_slots.graph_rows_limit(self.model)
        return sizes if limit is None else [size for size in sizes if size <= limit]

    def capture_cuda_graphs(self) -> int:
        """Capture decode steps for each bucket size; return the graph pool's bytes."""
        sizes = self.graph_sizes()
        if not sizes:
            return 0
        torch.cuda.synchronize(self.device)
        # Capture empties the allocator's cache first; do it before measuring, or blocks
        # cached by earlier steps (the kernel warm-up) count as negative graph bytes.
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        self._prepare_graph_inputs(sizes[-1])
        pool = None
        graphs = {}
        for size in reversed(sizes):
            graphs[size] = self._capture_decode(size, pool)
            if pool is None:
                pool = graphs[size].pool()
        self.graphs = dict(sorted(graphs.items()))
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-ups' blocks: the pool's segments stay, held by the graphs
        return torch.cuda.memory_reserved(self.device) - before

    def trial_capture_graphs(self) -> TrialGraphs:
        """Capture every graph size over whatever KV cache is allocated (the profile's) and free them
        again: what the graphs held beyond what stays once they are freed, measured, for the KV budget
        to keep before the real captures. In PyTorch's allocator that is the graph pool (the first
        capture's cuBLAS workspace stays, and is counted where it is then reserved); outside it, the
        driver memory of the instantiated graphs (their kernels' parameters) that the driver hands back
        when they are freed (what it keeps is then counted outside PyTorch, and the real captures reuse
        it). A batch-1 figure scaled to every size fell short: larger sizes have other kernels."""
        sizes = self.graph_sizes()
        if not sizes:
            return TrialGraphs(0, 0, 0)
        device = self.device

        def reserved_and_outside() -> tuple[int, int]:
            torch.cuda.synchronize(device)
            gc.collect()  # a graph held only by a reference cycle would keep its pool until a later collection
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            reserved = torch.cuda.memory_reserved(device)
            return reserved, total - free - reserved
        _, outside_before = reserved_and_outside()
        self.capture_cuda_graphs()
        reserved_held, outside_held = reserved_and_outside()
        self.graphs = {}
        self.graph_logits = None
        reserved_after, outside_after = reserved_and_outside()
        return TrialGraphs(max(0, reserved_held - reserved_after), max(0, outside_held - outside_after),
                           max(0, outside_held - outside_before) // len(sizes))

    def _prepare_graph_inputs(self, max_size: int) -> None:
        """Static graph inputs: decode rows of one token each at position 0, writing nowhere."""
        buf = self.buffers
        buf.wait_until_reusable()
        buf.input_ids[:max_size] = 0
        buf.positions[:max_size] = 0
        buf.slots[:max_size] = -1
        buf.tables[:max_size] = 0
        self.table_rows.forget(slice(None))
        buf.qsl[:max_size + 1] = np.arange(max_size + 1)
        buf.seq_lens[:max_size] = 1
        buf.seq_order[:max_size] = np.arange(max_size)
        buf.rows[:max_size] = np.arange(max_size)
        buf.upload(max_size, max_size, max_size, max_size)
        self.graph_logits = torch.empty(max_size, self.spec.vocab_size, dtype=self.dtype, device=self.device)

    def _capture_decode(self, size: int, pool) -> "torch.cuda.CUDAGraph":
        buf = self.buffers
        meta = AttentionMetadata(
            slot_mapping=buf.slots_d[:size], block_tables=buf.tables_d[:size],
            query_start_loc=buf.qsl_d[:size + 1], seq_lens=buf.seq_lens_d[:size],
            max_query_len=1, max_seq_len=None, decode_workspace=self.decode_workspace,
            seq_order=buf.seq_order_d[:size] if self.decode_order_on(size) else None)
        ids, pos = buf.input_ids_d[:size], buf.positions_d[:size]

        def step():
            self.graph_logits[:size] = self.model.compute_logits(self.model(ids, pos, meta))
        step()  # warm-up
        if self.cut_blocks:
            pieces = PiecewiseGraph()
            with cuts_at(self.cut_blocks, pieces):
                pieces.capture(step, pool)
            return pieces
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            step()
        return graph
