"""Would a wide decode step gain from running attention beside the GEMMs? (#17)

    python benchmarks/bench_overlap.py      # CUDA

A decode step of hundreds of sequences is two kinds of work one after the other: the projections
(compute-bound GEMMs at that many rows) and the decode attention (bound by the KV bytes it reads).
NanoFlow's idea is to split the batch into two micro-batches and run one's attention while the other
runs its GEMMs, so the compute and the memory bus are busy at once. This times chains of Llama-3.1-8B
decoder layers (the four projections through cuBLAS, SiLU-and-mul, the engine's decode kernel over
lognormal contexts; no norms or rotary) at several batch sizes:

- ``serial``: the whole batch on one stream, as the engine runs it;
- ``micro, one stream``: two half batches one after the other on one stream (what splitting costs);
- ``micro, two streams``: the halves on two streams, the second started after the first's first GEMM,
  both free-running (what the hardware overlaps without SM partitioning); ``2 streams, 1 layer``: the
  second started a whole layer behind;
- ``gemm only`` and ``attention only``: the parts alone, for the bound ``max``/``sum``.

Prints a table and one ``RESULT`` JSON line. Measured and not adopted: BENCHMARKS.md, "Two micro-batches
on two streams".
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_decode_balance import contexts  # noqa: E402
from mempath.kernels.attention_triton import alloc_decode_workspace, triton_decode_attention  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK = 4096, 32, 8, 128, 14336, 16


class Layer:
    def __init__(self):
        mk = lambda o, i: torch.randn(o, i, device="cuda", dtype=torch.bfloat16) * 0.02  # noqa: E731
        self.qkv = mk((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)
        self.o = mk(HIDDEN, HEADS * HEAD_DIM)
        self.gate_up = mk(2 * INTER, HIDDEN)
        self.down = mk(HIDDEN, INTER)


class MicroBatch:
    """One slice of the batch: its block tables, lengths, order and workspace."""

    def __init__(self, ctx: np.ndarray, k_cache, first_block: int):
        batch = len(ctx)
        blocks_per = -(-ctx // BLOCK)
        self.tables = torch.zeros(batch, int(blocks_per.max()), dtype=torch.int32, device="cuda")
        used = first_block
        for i, n in enumerate(blocks_per):
            self.tables[i, :n] = torch.arange(used, used + n, dtype=torch.int32, device="cuda")
            used += n
        self.end_block = used
        self.seq_lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
        self.order = torch.tensor(np.argsort(-ctx, kind="stable"), dtype=torch.int32, device="cuda") \
            if batch >= 128 else None
        self.ws = alloc_decode_workspace(batch, HEADS, KV_HEADS, HEAD_DIM, "cuda")
        self.x = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.attn_out = torch.empty(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        self.kv_tokens = int(ctx.sum())


def run_layers(layers, mb: MicroBatch, k_cache, v_cache, gemm=True, attention=True, after_first=None,
               after_layer=None):
    x = mb.x
    for i, layer in enumerate(layers):
        if i == 1 and after_layer is not None:
            after_layer.record()
        if gemm:
            qkv = F.linear(x, layer.qkv)
            if i == 0 and after_first is not None:
                after_first.record()
            q = qkv[:, :HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
        else:
            q = mb.x.view(-1, HEADS, HEAD_DIM)  # HIDDEN == HEADS * HEAD_DIM on this shape
        if attention:
            triton_decode_attention(q, k_cache, v_cache, mb.tables, mb.seq_lens, HEAD_DIM ** -0.5,
                                    out=mb.attn_out, workspace=mb.ws, seq_order=mb.order)
        if gemm:
            h = F.linear(mb.attn_out.view(-1, HEADS * HEAD_DIM), layer.o)
            gu = F.linear(h, layer.gate_up)
            x = F.linear(F.silu(gu[:, :INTER]) * gu[:, INTER:], layer.down)


def time_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="256,512,768,1024")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--mean", type=int, default=460)
    parser.add_argument("--sigma", type=float, default=0.9)
    parser.add_argument("--max-len", type=int, default=3072)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_overlap needs CUDA")
    rng = np.random.default_rng(0)
    layers = [Layer() for _ in range(args.layers)]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    results = []
    print(f"{'batch':>5} {'case':24} {'ms/layer':>9}  (KV GB a layer)")
    for batch in (int(b) for b in args.batches.split(",")):
        ctx = contexts(batch, args.mean, args.sigma, args.max_len, rng)
        num_blocks = int((-(-ctx // BLOCK)).sum()) * 2 + 64
        k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        whole = MicroBatch(ctx, k_cache, 0)
        half = batch // 2
        a = MicroBatch(ctx[:half], k_cache, whole.end_block)
        b = MicroBatch(ctx[half:], k_cache, a.end_block)

        def two_streams(stagger="gemm"):
            started = torch.cuda.Event()
            main = torch.cuda.current_stream()
            s1.wait_stream(main)
            s2.wait_stream(main)
            with torch.cuda.stream(s1):
                run_layers(layers, a, k_cache, v_cache, after_first=started if stagger == "gemm" else None,
                           after_layer=started if stagger == "layer" else None)
            s2.wait_event(started)
            with torch.cuda.stream(s2):
                run_layers(layers, b, k_cache, v_cache)
            main.wait_stream(s1)
            main.wait_stream(s2)

        cases = {
            "serial": lambda: run_layers(layers, whole, k_cache, v_cache),
            "micro, one stream": lambda: (run_layers(layers, a, k_cache, v_cache),
                                          run_layers(layers, b, k_cache, v_cache)),
            "micro, two streams": two_streams,
            "micro, 2 streams, 1 layer": lambda: two_streams("layer"),
            "gemm only": lambda: run_layers(layers, whole, k_cache, v_cache, attention=False),
            "attention only": lambda: run_layers(layers, whole, k_cache, v_cache, gemm=False),
        }
        row = {"batch": batch, "mean_ctx": float(ctx.mean()),
               "kv_gb_a_layer": whole.kv_tokens * KV_HEADS * HEAD_DIM * 4 / 1e9}
        for name, fn in cases.items():
            ms = time_ms(fn) / args.layers
            row[name] = round(ms, 4)
            print(f"{batch:5} {name:24} {ms:9.3f}  ({row['kv_gb_a_layer']:.2f})")
        row["bound max"] = round(max(row["gemm only"], row["attention only"]), 4)
        row["two streams saved of serial"] = round(1 - row["micro, two streams"] / row["serial"], 4)
        print(f"{batch:5} {'max(gemm, attention)':24} {row['bound max']:9.3f}; two streams save "
              f"{100 * row['two streams saved of serial']:.1f}% of serial")
        results.append(row)
        del k_cache, v_cache, whole, a, b
        torch.cuda.empty_cache()
    print("RESULT " + json.dumps({"bench": "overlap", "device": torch.cuda.get_device_name(), "layers": args.layers,
                                  "mean": args.mean, "sigma": args.sigma, "results": results}))


if __name__ == "__main__":
    main()
