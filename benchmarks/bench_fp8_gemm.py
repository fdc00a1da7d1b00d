"""The fp8 GEMM (mempath.kernels.fp8_gemm_triton) against torch._scaled_mm: checked, swept, tabled.

    python benchmarks/bench_fp8_gemm.py                             # Llama-3.1-8B shape, rows 2 ... 512 (CUDA)
    python benchmarks/bench_fp8_gemm.py --rows 64,512 --out /tmp/t.json   # some buckets, another table

Above the GEMV's 16 rows, and at the 2-8 rows the GEMV table hands over (its ``kernel: gemm`` entries), an
fp8 projection multiplies a per-token quantized input by its weight with row-wise scales. For each
projection of the shape (fused q/k/v, o, fused gate/up, down) and each batch of rows:

1. check: every candidate tile against the twin (fp8_linear_quantized_torch) on the same fp8 operands;
   one that differs or fails to compile is dropped and counted;
2. time, in a CUDA graph of 20 calls each after a 128 MB L2-flushing write, less the writes alone
   (benchmarks/bench_fp8_gemv.py's timer): every candidate, ``torch._scaled_mm`` with row-wise scales
   (what the engine runs there today), ``_scaled_mm`` with one scale a tensor (cuBLASLt; another
   arithmetic, for reference only) and bf16 ``torch.matmul``; in TFLOP/s against bf16's dense rate
   and in TB/s of weight read;
3. write the best candidate per (shape, row bucket) where it is at least ``--margin`` faster than
   _scaled_mm to --out (default: the shipped table, mempath/assets/fp8_gemm_configs.json, which the
   engine reads; buckets it leaves out run _scaled_mm). Prints tables and one ``RESULT`` JSON line.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fp8_gemv import graph_time_us, projections  # noqa: E402

from mempath.kernels.common import config_table_json  # noqa: E402
from mempath.kernels.fp8_gemm_triton import DEFAULT_TABLE, GemmConfig, row_bucket, triton_fp8_gemm  # noqa: E402
from mempath.model.quant import (Fp8Activation, fp8_linear_quantized_torch, quantize_rows,  # noqa: E402
                                 scaled_mm_quantized)

CONFIGS = ROOT / "tests" / "data" / "configs"
# (block_m, block_n, block_k, num_warps, num_stages): rows tiled by the tensor cores' M (64 or more),
# from 128 rows.
TILES = [(64, 64, 128, 4, 5), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4), (128, 128, 128, 8, 4),
         (64, 256, 128, 8, 3), (128, 256, 128, 8, 3)]
TILES_MIN_ROWS = 128
# Swapped (the weight's channels as the tensor cores' M, the rows as their N), up to 256 rows:
# (block_n, block_k, num_warps, num_stages); below 64 channels a tile takes the pre-Hopper fp8 MMA.
SWAP_TILES = [(32, 256, 4, 4), (32, 128, 4, 6), (64, 128, 4, 4), (64, 256, 4, 3), (64, 128, 4, 6),
              (128, 128, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3)]
SWAP_MAX_ROWS = 256
# A candidate's normwise relative difference from the twin, at most (bf16 output: its rounding is ~2^-9).
MAX_ERROR = 2e-3


def candidates(rows: int) -> list[GemmConfig]:
    out = []
    if rows <= SWAP_MAX_ROWS:
        block_m = min(128, max(16, row_bucket(rows)))
        out += [GemmConfig(block_m=block_m, block_n=n, block_k=k, num_warps=w, num_stages=s, swap_ab=True)
                for n, k, w, s in SWAP_TILES]
    if rows >= TILES_MIN_ROWS:
        out += [GemmConfig(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s) for m, n, k, w, s in TILES]
    return out


def normwise_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def write_table(args, table: dict, device_name: str) -> None:
    Path(args.out).write_text(config_table_json(
        table, device=device_name,
        made_by=f"benchmarks/bench_fp8_gemm.py --shape {args.shape} --rows {args.rows} --margin {args.margin}"))


def main() -> None:
    from bench_engine import copy_bandwidth, print_table
    from bench_mix import matmul_rate
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", help="a config in tests/data/configs")
    # 2-8: the buckets the shipped GEMV table hands over (tests/test_fp8_gemm.py checks a table keeps them).
    parser.add_argument("--rows", default="2,4,8,32,64,128,256,512")
    parser.add_argument("--out", default=str(DEFAULT_TABLE), help="where the table goes")
    parser.add_argument("--margin", type=float, default=0.03,
                        help="list a bucket only where the kernel is at least this much faster than _scaled_mm")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs CUDA (the fp8 tensor cores); the CPU checks the kernel in tests/test_fp8_gemm.py")
    started = time.time()
    config = json.loads((CONFIGS / f"{args.shape}.json").read_text())
    rows_list = [int(r) for r in args.rows.split(",")]
    bandwidth, bf16_rate = copy_bandwidth(), matmul_rate(torch.device("cuda"), torch.bfloat16)
    device_name = torch.cuda.get_device_name()
    print(f"{device_name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {bf16_rate / 1e12:.0f} TFLOP/s; "
          f"shape {args.shape}, rows {rows_list}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, table = {}, {}
    for name, (n, k) in projections(config).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        wq, w_scale = quantize_rows(w)
        points = []
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            xq, x_scale = quantize_rows(x)
            ref = fp8_linear_quantized_torch(Fp8Activation(xq, x_scale, torch.float32), wq, w_scale, None)
            flop = 2 * rows * n * k
            base = {
                "bf16": graph_time_us(lambda: torch.matmul(x, w.t())),
                "scaled_mm": graph_time_us(lambda: scaled_mm_quantized(xq, x_scale, wq, w_scale, None, torch.bfloat16)),
                "scaled_mm_tensorwise": graph_time_us(lambda: torch._scaled_mm(
                    xq, wq.t(), scale_a=x_scale.amax(), scale_b=w_scale.amax(), out_dtype=torch.bfloat16)),
            }
            timed, dropped = [], []
            for cand in candidates(rows):
                try:
                    err = normwise_error(triton_fp8_gemm(xq, x_scale, wq, w_scale, None, torch.bfloat16, cand), ref)
                    if err > MAX_ERROR:
                        dropped.append(f"{cand.describe()}: normwise difference from the twin {err:.3g}")
                        continue
                    timed.append((graph_time_us(
                        lambda: triton_fp8_gemm(xq, x_scale, wq, w_scale, None, torch.bfloat16, cand)), cand))
                except Exception as e:  # noqa: BLE001 - a candidate that does not compile is dropped, counted
                    dropped.append(f"{cand.describe()}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            best_us, best = min(timed, key=lambda t: t[0]) if timed else (float("inf"), None)
            scaled_mm_error = normwise_error(scaled_mm_quantized(xq, x_scale, wq, w_scale, None, torch.bfloat16), ref)
            point = {"rows": rows, "n": n, "k": k, **{f"{key}_us": v for key, v in base.items()},
                     "scaled_mm_error": scaled_mm_error,
                     "best_us": best_us, "best": best.describe() if best else None,
                     "candidates": {c.describe(): us for us, c in timed}, "dropped": dropped}
            points.append(point)
            if best is not None and best_us < (1 - args.margin) * base["scaled_mm"]:
                table.setdefault(f"{n}x{k}", {})[str(row_bucket(rows))] = best
            print(f"{name} {rows:5d} rows: bf16 {base['bf16']:8.1f} us ({flop / base['bf16'] / 1e6:5.0f} TFLOP/s)  "
                  f"_scaled_mm {base['scaled_mm']:8.1f} ({flop / base['scaled_mm'] / 1e6:5.0f})  tensorwise "
                  f"{base['scaled_mm_tensorwise']:8.1f}  best kernel {best_us:8.1f} ({flop / best_us / 1e6:5.0f}) "
                  f"{point['best']}  dropped {len(dropped)}; _scaled_mm's difference from the twin "
                  f"{scaled_mm_error:.2g}", flush=True)
            for line in dropped[:3]:
                print(f"    dropped: {line}")
        results[name] = points
        del w, wq
        write_table(args, table, device_name)  # after each projection: a run cut short keeps what it measured
    print(f"\n{device_name}, fp8 GEMM against _scaled_mm (us a call; x = _scaled_mm / kernel):")
    rows_out = [("projection", "rows", "bf16", "_scaled_mm", "tensorwise", "kernel", "x _scaled_mm", "x bf16",
                 "kernel TFLOP/s", "of bf16 rate", "best")]
    for name, points in results.items():
        for p in points:
            flop = 2 * p["rows"] * p["n"] * p["k"]
            rows_out.append((name, p["rows"], f"{p['bf16_us']:.1f}", f"{p['scaled_mm_us']:.1f}",
                             f"{p['scaled_mm_tensorwise_us']:.1f}", f"{p['best_us']:.1f}",
                             f"{p['scaled_mm_us'] / p['best_us']:.2f}", f"{p['bf16_us'] / p['best_us']:.2f}",
                             f"{flop / p['best_us'] / 1e6:.0f}", f"{flop / p['best_us'] * 1e6 / bf16_rate:.2f}",
                             p["best"]))
    print_table(rows_out)
    print(f"table: {sum(len(b) for b in table.values())} buckets listed -> {args.out} ({time.time() - started:.0f} s)")
    print("RESULT " + json.dumps({"bench": "fp8-gemm", "shape": args.shape, "device": device_name,
                                  "date": time.strftime("%Y-%m-%d"), "copy_bandwidth": bandwidth,
                                  "bf16_matmul_flop_s": bf16_rate, "results": results}))


if __name__ == "__main__":
    main()
