"""Forwards over explicit rows: each row is a request, the position its tokens start at, its
input tokens and how many of its last positions need logits.

The speculative step runs the draft and the target over rows the scheduler's batch does
not describe (a draft catching up, proposals at positions past the computed tokens), with
the same paged-KV path as a chunked prefill: the runner's static buffers, its block-table
rows, and explicit attention metadata. A token still on the device (a proposal) is copied
into the input buffer there: ``device_tokens`` gives its flat index and its source.
"""
from dataclasses import dataclass

import numpy as np
import torch

from mempath.engine.request import Request
from mempath.model.llama import AttentionMetadata


@dataclass
class Row:
    request: Request
    start: int  # position of the first input token
    token_ids: list[int]  # host-known inputs (placeholders where device tokens go)
    num_logits: int  # logits for the row's last num_logits positions


class RowBuffers:
    """The logit-row indices of a speculative step (up to one per token): pinned host, static device."""

    def __init__(self, max_tokens: int, device: torch.device):
        pin = device.type == "cuda"
        self.rows_h = torch.zeros(max_tokens, dtype=torch.int64, pin_memory=pin)
        self.rows = self.rows_h.numpy()
        self.rows_d = torch.zeros(max_tokens, dtype=torch.int64, device=device)

    def nbytes(self) -> int:
        return self.rows_d.numel() * self.rows_d.element_size()


def forward_rows(runner, row_buf: RowBuffers, rows: list[Row],
                 device_tokens: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Run ``runner``'s model over ``rows``; the logits [sum(num_logits), V] in row order.

    ``device_tokens``: (flat input indices, token ids) written into the input buffer on the
    device after the upload.
    """
    buf, bs = runner.buffers, runner.block_size
    buf.wait_until_reusable()
    t = r = max_seq_len = max_query = 0
    buf.qsl[0] = 0
    for b, row in enumerate(rows):
        n = len(row.token_ids)
        end = row.start + n
        pos = runner.arange[row.start:end]
        buf.input_ids[t:t + n] = row.token_ids
        buf.positions[t:t + n] = pos
        table = np.asarray(row.request.block_table, dtype=np.int64)
        buf.slots[t:t + n] = table[pos // bs] * bs + pos % bs
        row_buf.rows[r:r + row.num_logits] = runner.arange[t + n - row.num_logits:t + n]
        t += n
        r += row.num_logits
        buf.qsl[b + 1] = t
        buf.seq_lens[b] = end
        max_seq_len, max_query = max(max_seq_len, end), max(max_query, n)
    runner.table_rows.write(buf.tables, [row.request for row in rows])
    # Before the upload: its event then also marks when rows_h may be rewritten.
    row_buf.rows_d[:r].copy_(row_buf.rows_h[:r], non_blocking=True)
    buf.upload(t, len(rows), 0)
    if device_tokens is not None:
        index, values = device_tokens
        buf.input_ids_d.index_copy_(0, index, values)
    meta = AttentionMetadata(
        slot_mapping=buf.slots_d[:t], block_tables=buf.tables_d[:len(rows)],
        query_start_loc=buf.qsl_d[:len(rows) + 1], seq_lens=buf.seq_lens_d[:len(rows)],
        max_query_len=max_query, max_seq_len=max_seq_len, decode_workspace=runner.decode_workspace)
    hidden = runner.model(buf.input_ids_d[:t], buf.positions_d[:t], meta)
    return runner.model.compute_logits(hidden[row_buf.rows_d[:r]])


def time_forward(runner, row_buf: RowBuffers, num_seqs: int, query_len: int, repeats: int = 3) -> float:
    """Seconds of one forward of num_seqs rows of query_len tokens each, logits at every token.

    Calibration for the cost model: the rows write nowhere (slot -1) and read block 0,
    so the cache's contents do not matter; the fastest of ``repeats`` after a warm-up.
    """
    import time
    buf = runner.buffers
    buf.wait_until_reusable()
    t = num_seqs * query_len
    buf.input_ids[:t] = 0
    buf.positions[:t] = np.tile(np.arange(query_len), num_seqs)
    buf.slots[:t] = -1
    buf.tables[:num_seqs] = 0
    runner.table_rows.forget(slice(None))
    buf.qsl[:num_seqs + 1] = np.arange(num_seqs + 1) * query_len
    buf.seq_lens[:num_seqs] = query_len
    buf.seq_order[:num_seqs] = np.arange(num_seqs)  # a replayed graph of an ordered size reads it
    row_buf.rows[:t] = np.arange(t)
    row_buf.rows_d[:t].copy_(row_buf.rows_h[:t], non_blocking=True)
    buf.upload(t, num_seqs, 0, num_seqs)
    meta = AttentionMetadata(
        slot_mapping=buf.slots_d[:t], block_tables=buf.tables_d[:num_seqs],
        query_start_loc=buf.qsl_d[:num_seqs + 1], seq_lens=buf.seq_lens_d[:num_seqs],
        max_query_len=query_len, max_seq_len=query_len, decode_workspace=runner.decode_workspace)
    graph = runner.graphs.get(num_seqs) if query_len == 1 else None  # plain decode replays its graph
    best = float("inf")
    for i in range(repeats + 1):
        sync(runner.device)
        start = time.perf_counter()
        if graph is not None:
            graph.replay()
        else:
            hidden = runner.model(buf.input_ids_d[:t], buf.positions_d[:t], meta)
            runner.model.compute_logits(hidden[row_buf.rows_d[:t]])
        sync(runner.device)
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
