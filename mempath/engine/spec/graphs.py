"""CUDA graphs of the speculative step's forwards: rows of exactly ``query_len`` tokens each.

Three families, each a graph per row bucket (powers of two up to ``SPEC_MAX_ROWS``):

- the target's verify: each row its last token and up to K proposals, at ``max_k + 1``
  tokens (fewer proposals are padded, below), logits at every position;
- the draft's catch-up: at most 2 tokens a row (what a step that kept every proposal
  leaves it: the last proposal and the bonus token), logits at the last;
- the draft's proposal steps: one token a row, logits at it.

A graph fixes the token count and the kernels' launch grids (the attention runs with
``max_query_len = query_len`` and no ``max_seq_len``: the decode kernel's splits and the
prefill kernel's query tiles depend on the shape only), so every row must have exactly
``query_len`` tokens. A row with fewer is padded at the front: it starts earlier, on
tokens whose KV is already in the cache, with slot -1 for them (nothing is rewritten;
their logits are not read). Its sequence length is unchanged, so nothing past its own
positions is read. Rows past the batch (up to the bucket) write nowhere and read block 0.
Inputs go through the runner's static buffers; each graph writes its logits into one
static output per family, allocated here and counted with the graphs' pool.
"""
import time

import numpy as np
import torch

from mempath.engine.spec.rows import Row, sync
from mempath.model.llama import AttentionMetadata


def row_buckets(max_rows: int) -> list[int]:
    sizes, b = [], 1
    while b < max_rows:
        sizes.append(b)
        b *= 2
    return sizes + [max_rows]


class RowGraphs:
    """One family: graphs of ``runner``'s model over rows of ``query_len`` tokens."""

    def __init__(self, runner, query_len: int, all_logits: bool, max_rows: int):
        self.runner = runner
        self.query_len = query_len
        self.all_logits = all_logits
        self.sizes = row_buckets(max_rows)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None

    def size_for(self, rows: list[Row]) -> int | None:
        """The bucket that can run these rows, or None: too many, a row too long, too near the
        start of its sequence to be padded, or asking for other logits than the family gives."""
        if not self.graphs or not rows or len(rows) > self.sizes[-1]:
            return None
        q = self.query_len
        for row in rows:
            n = len(row.token_ids)
            if n > q or row.start + n < q or row.num_logits != (n if self.all_logits else 1):
                return None
        return next(s for s in self.sizes if s >= len(rows))

    def offsets(self, rows: list[Row]) -> list[int]:
        """Flat index of each row's first own token (after its front padding)."""
        q = self.query_len
        return [b * q + q - len(row.token_ids) for b, row in enumerate(rows)]

    # ------------------------------------------------------------ inputs
    def _fill(self, rows: list[Row], size: int) -> None:
        runner = self.runner
        buf, bs, q = runner.buffers, runner.block_size, self.query_len
        buf.wait_until_reusable()
        for b, row in enumerate(rows):
            pad = q - len(row.token_ids)
            start = row.start - pad
            lo = b * q
            buf.input_ids[lo:lo + pad] = row.request.token_ids[start:row.start]
            buf.input_ids[lo + pad:lo + q] = row.token_ids
            pos = runner.arange[start:start + q]
            buf.positions[lo:lo + q] = pos
            table = np.asarray(row.request.block_table, dtype=np.int64)
            buf.slots[lo:lo + pad] = -1
            buf.slots[lo + pad:lo + q] = table[pos[pad:] // bs] * bs + pos[pad:] % bs
            buf.seq_lens[b] = start + q
        runner.table_rows.write(buf.tables, [row.request for row in rows])
        self._fill_padding(len(rows), size)
        buf.qsl[:size + 1] = runner.arange[:size + 1] * q
        buf.upload(size * q, size, 0)

    def _fill_padding(self, first: int, size: int) -> None:
        """Rows first..size: positions 0..q-1 of a sequence that writes nowhere and reads block 0."""
        if first >= size:
            return
        buf, q = self.runner.buffers, self.query_len
        lo, hi = first * q, size * q
        buf.input_ids[lo:hi] = 0
        buf.positions[lo:hi] = np.tile(np.arange(q), size - first)
        buf.slots[lo:hi] = -1
        buf.tables[first:size] = 0
        self.runner.table_rows.forget(slice(first, size))
        buf.seq_lens[first:size] = q

    def _forward(self, size: int) -> torch.Tensor:
        runner, buf, q = self.runner, self.runner.buffers, self.query_len
        t = size * q
        meta = AttentionMetadata(
            slot_mapping=buf.slots_d[:t], block_tables=buf.tables_d[:size],
            query_start_loc=buf.qsl_d[:size + 1], seq_lens=buf.seq_lens_d[:size],
            max_query_len=q, max_seq_len=None, decode_workspace=runner.decode_workspace)
        hidden = runner.model(buf.input_ids_d[:t], buf.positions_d[:t], meta)
        if not self.all_logits:
            hidden = hidden.view(size, q, -1)[:, -1]
        return runner.model.compute_logits(hidden)

    def _out(self, size: int) -> torch.Tensor:
        return self.logits[:size * self.query_len if self.all_logits else size]

    # ------------------------------------------------------------ running
    def run(self, rows: list[Row], size: int, device_tokens=None, eager: bool = False) -> torch.Tensor:
        """The logits of ``rows`` run in bucket ``size`` (from ``size_for``): [len(rows) * query_len, V]
        in the padded layout (``offsets``), or [len(rows), V] at each row's last token.
        ``device_tokens``: (flat indices in that layout, token ids), written on the device.
        ``eager``: the same forward without the graph (tests compare the two)."""
        self._fill(rows, size)
        if device_tokens is not None:
            index, values = device_tokens
            self.runner.buffers.input_ids_d.index_copy_(0, index, values)
        n = len(rows) * self.query_len if self.all_logits else len(rows)
        if eager:
            return self._forward(size)[:n]
        self.graphs[size].replay()
        return self._out(size)[:n]

    def replay_seconds(self, size: int, repeats: int = 3) -> float:
        """Seconds of one replay at bucket ``size`` on dummy rows (the cost model's calibration)."""
        self.runner.buffers.wait_until_reusable()
        self._fill_padding(0, size)
        self.runner.buffers.qsl[:size + 1] = self.runner.arange[:size + 1] * self.query_len
        self.runner.buffers.upload(size * self.query_len, size, 0)
        best = float("inf")
        for i in range(repeats + 1):
            sync(self.runner.device)
            start = time.perf_counter()
            self.graphs[size].replay()
            sync(self.runner.device)
            if i:
                best = min(best, time.perf_counter() - start)
        return best

    # ------------------------------------------------------------ capture
    def capture(self, pool=None):
        """Capture every bucket, largest first, into ``pool`` (shared with the runner's decode
        graphs: one step runs at a time); return the pool."""
        runner = self.runner
        largest = self.sizes[-1]
        rows = largest * self.query_len if self.all_logits else largest
        self.logits = torch.empty(rows, runner.spec.vocab_size, dtype=runner.dtype, device=runner.device)
        for size in reversed(self.sizes):
            buf = runner.buffers
            buf.wait_until_reusable()
            self._fill_padding(0, size)
            buf.qsl[:size + 1] = runner.arange[:size + 1] * self.query_len
            buf.upload(size * self.query_len, size, 0)
            self._out(size).copy_(self._forward(size))  # warm-up: compiles and sizes the pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self._out(size).copy_(self._forward(size))
            self.graphs[size] = graph
            pool = graph.pool() if pool is None else pool
        return pool

    def nbytes(self) -> int:
        return 0 if self.logits is None else self.logits.numel() * self.logits.element_size()
