"""The dense GEMV's table (#17): the 16-bit projections and LM head at decode batches through the
GEMV kernel (mempath.kernels.fp8_gemv_triton with a 16-bit weight and no scale) against cuBLAS,
timed as a decode step runs them.

    python benchmarks/bench_dense_gemv.py --shape llama-3.1-8b --out /tmp/dense_gemv.json   # CUDA

cuBLAS reaches ~73% of the copy bandwidth on the 4096-wide q/k/v and o projections at one row
(profile_steps.py, BENCHMARKS.md). The GEMV kernel launches with programmatic dependent launch
and may load its first weight tiles before waiting for the kernel before it (``prefetch``),
as the MoE router kernel does. A kernel timed alone cannot show that: here each candidate
runs in a CUDA graph of ``--layers`` links, each the RMSNorm Triton kernel (launched with PDL,
as in the model) followed by the projection, every link with its own weight (together past
the L2), against the same chain with F.linear. Each candidate is first checked against
F.linear's result (float32 product of the same bf16 values).

Writes the fastest configuration per (shape, row bucket) that beats cuBLAS by more than MIN_GAIN
to --out, in the fp8 table's format: the engine reads mempath/assets/dense_gemv_configs.json, or
the file MEMPATH_DENSE_GEMV_CONFIGS names; ``bench_engine.py latency --variants no-dense-gemv``
then measures the whole decode step with and without it. Prints tables and one ``RESULT`` JSON line.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fp8_gemv import median_replay_ms  # noqa: E402
from mempath.kernels.elementwise_triton import triton_rms_norm  # noqa: E402
from mempath.kernels.fp8_gemv_triton import GemvConfig, GemvWorkspace, row_bucket, table_json, triton_fp8_gemv  # noqa: E402

CONFIGS = ROOT / "tests" / "data" / "configs"
DTYPE = torch.bfloat16
# (block_n, block_k, num_warps, num_stages) in 16-bit elements: multiply-adds up to 4 rows, tensor cores from 2.
FMA_TILES = [(32, 128, 4, 3), (16, 256, 4, 3), (64, 64, 4, 3), (32, 256, 8, 3), (64, 128, 8, 3), (16, 512, 8, 2),
             (16, 512, 4, 3), (16, 1024, 8, 2), (32, 512, 8, 2), (64, 128, 4, 4)]
DOT_TILES = [(64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 4), (32, 128, 4, 4), (16, 256, 4, 3), (32, 256, 4, 3),
             (64, 256, 8, 3)]
# A configuration is tabled only where it beats cuBLAS by more than this (the chain's replays vary by less).
MIN_GAIN = 0.01


def projections(config: dict) -> dict[str, tuple[int, int]]:
    """The 16-bit Linear layers of mempath.model.llama (q/k/v and gate/up fused): a mixture of experts
    has no dense MLP (its experts run the grouped GEMM, its router its own kernel)."""
    h, i = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or h // heads
    out = {"qkv_proj": (heads * d + 2 * kv * d, h), "o_proj": (h, heads * d)}
    if not (config.get("num_experts") or config.get("num_local_experts")):
        out.update(gate_up_proj=(2 * i, h), down_proj=(h, i))
    return {**out, "lm_head": (config["vocab_size"], h)}


def candidates(n: int, k: int, rows: int, num_sms: int, max_split_n: int, dot_from_rows: int = 2) -> list[GemvConfig]:
    """Split K only for layers at most ``max_split_n`` wide (the workspace's width); the tensor-core tiles
    from ``dot_from_rows`` rows."""
    out = []
    tiles = [(t, False) for t in FMA_TILES if rows <= 4] + [(t, True) for t in DOT_TILES if rows >= dot_from_rows]
    for (bn, bk, warps, stages), dot in tiles:
        for split in (1, 2, 4, 8):
            programs = -(-n // bn) * split
            if split > 1 and (programs > 8 * num_sms or k // split < bk or n > max_split_n):
                continue
            for prefetch in (False, True):
                out.append(GemvConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages,
                                      use_dot=dot, prefetch=prefetch, reduce="atomic"))
    return out


class Chain:
    """``layers`` links of RMSNorm (Triton, PDL) then a projection, each with its own weight."""

    def __init__(self, n: int, k: int, rows: int, layers: int):
        gen = torch.Generator(device="cuda").manual_seed(n * 7 + k)
        self.weights = [torch.randn(n, k, device="cuda", dtype=DTYPE, generator=gen) * 0.02 for _ in range(layers)]
        self.norm_weight = torch.ones(k, device="cuda", dtype=DTYPE)
        self.x = torch.randn(rows, k, device="cuda", dtype=DTYPE, generator=gen)

    def run(self, linear) -> torch.Tensor:
        for w in self.weights:
            h, _ = triton_rms_norm(self.x, self.norm_weight, 1e-5)
            out = linear(h, w)
        return out

    def time_us(self, linear, replays: int = 7) -> float:
        """µs per link: the median replay of a CUDA graph of the chain."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.run(linear)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.run(linear)
        ms = median_replay_ms(graph, replays)
        del graph
        return 1e3 * ms / len(self.weights)


def main() -> None:
    from bench_engine import copy_bandwidth, print_table
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b",
                        help="configs in tests/data/configs, comma-separated (a shape met twice is swept once)")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--layers", type=int, default=16, help="links of the timed chain")
    parser.add_argument("--out", required=True, help="where the configurations that beat cuBLAS go")
    parser.add_argument("--dot-from-one-row", action="store_true",
                        help="also the tensor-core tiles at one row (else from two: the sweep of 2026-12-04)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("CUDA is needed: this times kernels in CUDA graphs (the kernel's CPU test is "
                     "tests/test_fp8_gemv.py)")
    started = time.time()
    rows_list = [int(r) for r in args.rows.split(",")]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    bandwidth = copy_bandwidth()
    shapes, names = {}, {}
    for shape in args.shape.split(","):
        for name, (n, k) in projections(json.loads((CONFIGS / f"{shape}.json").read_text())).items():
            if (n, k) not in names:
                shapes[f"{name} {n}x{k}"] = (n, k)
            names.setdefault((n, k), []).append(f"{name} ({shape})")
    # The engine's workspace is as wide as the model's widest projection: the LM head runs unsplit.
    workspace = GemvWorkspace(max(n for name, (n, _) in shapes.items() if not name.startswith("lm_head")),
                              torch.device("cuda"))
    device_name = torch.cuda.get_device_name()
    print(f"{device_name}: {num_sms} SMs, copy bandwidth {bandwidth / 1e12:.2f} TB/s; shape {args.shape}, "
          f"rows {rows_list}, {args.layers} links of RMSNorm + projection per graph")
    table, points = {}, {}
    norm_only = None
    rows_table = [("projection", "rows", "cuBLAS us", "best GEMV us", "best", "x cuBLAS", "GEMV % of copy",
                   "cuBLAS % of copy", "checked", "dropped")]
    for name, (n, k) in shapes.items():
        for rows in rows_list:
            chain = Chain(n, k, rows, args.layers)
            if norm_only is None:
                norm_only = chain.time_us(lambda h, w: h)
            cublas_us = chain.time_us(F.linear)
            timed, dropped = [], []
            for candidate in candidates(n, k, rows, num_sms, 0 if name.startswith("lm_head") else workspace.max_out_features,
                                        dot_from_rows=1 if args.dot_from_one_row else 2):
                fn = lambda h, w, c=candidate: triton_fp8_gemv(h, w, None, None, workspace, c)  # noqa: E731
                try:
                    h, _ = triton_rms_norm(chain.x, chain.norm_weight, 1e-5)
                    ref = (h.float() @ chain.weights[0].float().t())
                    out = fn(h, chain.weights[0]).float()
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    dropped.append(f"{candidate.describe()}: {type(e).__name__}")
                    continue
                err = (out - ref).abs().max().item()
                tol = 2 * torch.finfo(DTYPE).eps * max(1.0, ref.abs().max().item())
                if not err <= tol or workspace.partials.any() or workspace.counters.any():
                    dropped.append(f"{candidate.describe()}: max |error| {err:.3g}")
                    continue
                timed.append((chain.time_us(fn), candidate))
            best_us, best = min(timed, key=lambda t: t[0])
            nbytes = 2 * n * k
            # The projection's own share: the link less the norm alone (an upper bound on its time: the
            # overlap PDL gives is credited to the projection).
            gemv_pct = 100 * nbytes / ((best_us - norm_only) * 1e-6) / bandwidth
            cublas_pct = 100 * nbytes / ((cublas_us - norm_only) * 1e-6) / bandwidth
            rows_table.append((name, rows, f"{cublas_us:.1f}", f"{best_us:.1f}", best.describe(),
                               f"{cublas_us / best_us:.3f}", f"{gemv_pct:.0f}%", f"{cublas_pct:.0f}%", len(timed),
                               len(dropped)))
            top = sorted(timed, key=lambda t: t[0])[:5]
            points.setdefault(name, []).append({
                "n": n, "k": k, "rows": rows, "cublas_us": cublas_us, "best_us": best_us, "best": best.describe(),
                "top5": [(round(t, 2), c.describe()) for t, c in top], "dropped": dropped[:5],
                "gemv_pct_of_copy": gemv_pct, "cublas_pct_of_copy": cublas_pct})
            if best_us < (1 - MIN_GAIN) * cublas_us:
                table.setdefault(f"{n}x{k}", {})[str(row_bucket(rows))] = best
            # Written after each point, so a sweep cut short keeps what it measured.
            Path(args.out).write_text(table_json(
                table, device=device_name, made_by=f"benchmarks/bench_dense_gemv.py --shape {args.shape} --rows {args.rows}",
                shapes={f"{n}x{k}": ", ".join(where) for (n, k), where in names.items() if f"{n}x{k}" in table}))
            print(f"{name} rows {rows}: cuBLAS {cublas_us:.1f} us/link, GEMV best {best_us:.1f} ({best.describe()}), "
                  f"norm alone {norm_only:.1f} ({time.time() - started:.0f} s)", flush=True)
            del chain
            torch.cuda.empty_cache()
    print_table(rows_table)
    print(f"configurations that beat cuBLAS written to {args.out} ({time.time() - started:.0f} s)")
    print("RESULT " + json.dumps({"bench": "dense_gemv", "shape": args.shape, "device": device_name,
                                  "copy_bandwidth": bandwidth, "norm_only_us": norm_only, "layers": args.layers,
                                  "points": points}))


if __name__ == "__main__":
    main()
