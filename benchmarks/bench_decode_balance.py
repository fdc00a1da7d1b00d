"""Decode attention over a realistic mix of context lengths: does the order of the batch matter? (#17)

    python benchmarks/bench_decode_balance.py      # CUDA

The decode kernel runs one program per (sequence, KV head, split), and a wide batch gets one split
(``decode_num_splits``: enough programs already). In a real batch the contexts spread far (the
mix's lengths are lognormal), so one program's work can be many times another's, and the
programs the GPU starts last decide when the kernel ends. This times one layer's decode kernel
(Llama-3.1-8B attention shape, bf16 cache, block 16) at several batch sizes with every sequence at
the mean context, with lognormal contexts of the same mean in random order, longest first,
shortest first, in random order but started longest first (``seq_order``, as the runner orders wide
steps), and with ``--splits`` forced. Prints a table and one ``RESULT`` JSON line.

    python benchmarks/bench_decode_balance.py --batches 8,16,32,64,128 --splits 1,4
    python benchmarks/bench_decode_balance.py --batches 32,128 --mean 1024 --splits 1,2
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mempath.kernels.attention_triton import (alloc_decode_workspace, decode_num_splits,  # noqa: E402
                                              decode_splits_used, triton_decode_attention)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def contexts(batch: int, mean: int, sigma: float, max_len: int, rng) -> np.ndarray:
    raw = rng.lognormal(0.0, sigma, batch)
    ctx = np.clip(np.round(raw / raw.mean() * mean), 16, max_len).astype(np.int64)
    return ctx


def time_graph(fns, replays: int = 5) -> float:
    """µs per call of ``fns`` (one call each, in order), captured in one CUDA graph and replayed.

    Timing the launcher in a Python loop timed the host: at 16-64 sequences a call's launches took
    longer to issue than the kernels took to run (the first runs of this bench, 2026-12-06).
    """
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / len(fns))
    return best


def case(ctx: np.ndarray, k_cache, v_cache, splits=None, ordered=False) -> tuple[float, float]:
    """µs per call and KV TB/s for one batch of contexts (in the given order).

    The cache holds ``copies`` disjoint sets of the batch's blocks (``cache_copies``), and the timed
    graph runs one call on each set in turn, as a step's layers each read their own KV: a batch
    small enough to sit in the L2 is not read from there by the next call.
    """
    batch = len(ctx)
    blocks_per = -(-ctx // BLOCK)
    width = int(blocks_per.max())
    need = int(blocks_per.sum())
    copies = k_cache.shape[0] // need
    perm = torch.randperm(k_cache.shape[0], device="cuda")
    seq_lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    order = torch.tensor(np.argsort(-ctx, kind="stable"), dtype=torch.int32, device="cuda") if ordered else None
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ws = alloc_decode_workspace(batch, HEADS, KV_HEADS, HEAD_DIM, "cuda")
    if splits is not None and splits > 1:
        rows = batch * HEADS * splits
        ws = type(ws)(torch.empty(rows * HEAD_DIM, device="cuda"), torch.empty(rows, device="cuda"))
    calls = []
    for copy in range(copies):
        tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
        used = copy * need
        for i, n in enumerate(blocks_per):
            tables[i, :n] = perm[used:used + n]
            used += n
        calls.append(lambda tables=tables: triton_decode_attention(
            q, k_cache, v_cache, tables, seq_lens, HEAD_DIM ** -0.5, out=out, workspace=ws, num_splits=splits,
            seq_order=order))
    us = time_graph(calls * max(1, 32 // copies))
    kv_bytes = int(ctx.sum()) * KV_HEADS * HEAD_DIM * 2 * 2
    return us, kv_bytes / (us * 1e-6) / 1e12


def cache_copies(blocks: int) -> int:
    """Sets of ``blocks`` blocks to rotate over: at least 4, and at least 512 MB of K and V together
    (ten times an H200's L2)."""
    block_bytes = 2 * BLOCK * KV_HEADS * HEAD_DIM * 2
    return max(4, -(-512 * 2 ** 20 // (blocks * block_bytes)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="64,128,300,768")
    parser.add_argument("--mean", type=int, default=460)
    parser.add_argument("--sigma", type=float, default=0.9)
    parser.add_argument("--max-len", type=int, default=3072)
    parser.add_argument("--splits", type=lambda v: [int(x) for x in v.split(",")], default=[])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_balance needs CUDA")
    rng = np.random.default_rng(0)
    results = []
    print(f"{'batch':>5} {'case':28} {'µs':>8} {'KV TB/s':>8}  (max ctx, splits, programs reading KV / grid)")
    for batch in (int(b) for b in args.batches.split(",")):
        mixed = contexts(batch, args.mean, args.sigma, args.max_len, rng)
        uniform = np.full(batch, int(round(mixed.mean())))
        blocks = max(int((-(-mixed // BLOCK)).sum()), int((-(-uniform // BLOCK)).sum()))
        num_blocks = blocks * cache_copies(blocks)
        k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        default_splits = decode_num_splits(batch, KV_HEADS, torch.device("cuda"))
        # (name, contexts, splits forced, started longest first)
        cases = [("uniform", uniform, None, False), ("mixed", mixed, None, False),
                 ("mixed, seq_order longest first", mixed, None, True),
                 ("mixed, rows longest first", np.sort(mixed)[::-1].copy(), None, False),
                 ("mixed, rows shortest first", np.sort(mixed), None, False)]
        for s in args.splits:
            cases += [(f"mixed, {s} splits", mixed, s, False), (f"uniform, {s} splits", uniform, s, False),
                      (f"mixed, seq_order, {s} splits", mixed, s, True)]
        for name, ctx, splits, ordered in cases:
            us, tbs = case(ctx, k_cache, v_cache, splits, ordered)
            width = splits or default_splits
            # Programs that read KV, of the grid's batch x KV heads x splits (one split: no workspace, all read).
            working = KV_HEADS * sum(decode_splits_used(ctx, width)) if width > 1 else batch * KV_HEADS
            grid = batch * KV_HEADS * width
            print(f"{batch:5} {name:28} {us:8.1f} {tbs:8.2f}  ({int(ctx.max())}, {width}, "
                  f"{working}/{grid} programs)")
            results.append({"batch": batch, "case": name, "us": round(us, 2), "kv_tb_s": round(tbs, 3),
                            "mean_ctx": float(ctx.mean()), "max_ctx": int(ctx.max()), "splits": width,
                            "seq_order": ordered, "working_programs": working,
                            "grid_programs": grid})
        del k_cache, v_cache
        torch.cuda.empty_cache()
    print("RESULT " + json.dumps({"bench": "decode_balance", "device": torch.cuda.get_device_name(),
                                  "mean": args.mean, "sigma": args.sigma, "results": results}))


if __name__ == "__main__":
    main()
