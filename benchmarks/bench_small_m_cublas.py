"""Three ways to ask cuBLAS for a projection at a few rows (#17: o_proj ran at half the copy rate at 8-32 rows,
BENCHMARKS.md, twenty-third session): ``F.linear(x, w)`` as the engine does; the same under cuBLASLt as torch's
preferred BLAS; and the transposed product ``(w @ x.T).T`` made contiguous again, which gives cuBLAS the weight as
its M side, so its heuristics pick other tiles.

    python benchmarks/bench_small_m_cublas.py --shape llama-3.1-8b --rows 4,8,16,32   # CUDA

Each is timed as bench_dense_gemv.py times its candidates: a CUDA graph of ``--layers`` links, each the RMSNorm
Triton kernel then the projection, every link with its own weight; µs a link, less the norm alone, and that as a
share of the copy bandwidth. Each way is checked against F.linear first. Prints a table and one ``RESULT`` line.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_dense_gemv import CONFIGS, Chain, projections  # noqa: E402


def transposed(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, h.t()).t().contiguous()


def main() -> None:
    from bench_engine import copy_bandwidth, print_table
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--rows", default="4,8,16,32")
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("CUDA is needed: this times cuBLAS in CUDA graphs")
    bandwidth = copy_bandwidth()
    ways = {"F.linear": (F.linear, "cublas"), "F.linear, cuBLASLt": (F.linear, "cublaslt"),
            "transposed": (transposed, "cublas")}
    rows_table = [("projection", "rows", *[f"{w} us (% copy)" for w in ways])]
    points = []
    norm_only = None
    for name, (n, k) in projections(json.loads((CONFIGS / f"{args.shape}.json").read_text())).items():
        for rows in [int(r) for r in args.rows.split(",")]:
            chain = Chain(n, k, rows, args.layers)
            if norm_only is None:
                norm_only = chain.time_us(lambda h, w: h)
            ref = F.linear(chain.x, chain.weights[0]).float()
            point = {"projection": name, "n": n, "k": k, "rows": rows}
            cells = []
            for way, (fn, library) in ways.items():
                torch.backends.cuda.preferred_blas_library(library)
                try:
                    torch.testing.assert_close(fn(chain.x, chain.weights[0]).float(), ref, rtol=2e-2, atol=2e-2)
                    us = chain.time_us(fn)
                finally:
                    torch.backends.cuda.preferred_blas_library("cublas")
                share = 100 * 2 * n * k / ((us - norm_only) * 1e-6) / bandwidth
                point[way] = {"us": us, "pct_of_copy": share}
                cells.append(f"{us:.1f} ({share:.0f}%)")
            rows_table.append((name, rows, *cells))
            points.append(point)
            del chain
            torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, {args.layers} links of RMSNorm "
          f"+ projection a graph, the norm alone {norm_only:.1f} us a link")
    print_table(rows_table)
    print("RESULT " + json.dumps({"bench": "small_m_cublas", "shape": args.shape, "device": torch.cuda.get_device_name(),
                                  "copy_bandwidth": bandwidth, "norm_only_us": norm_only, "points": points}))


if __name__ == "__main__":
    main()
