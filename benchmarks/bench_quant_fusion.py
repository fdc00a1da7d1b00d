"""The per-token fp8 quantization of a projection's input, alone or inside the kernel that makes it
(mempath.kernels.quant_triton), on the Llama-3.1-8B shape's activations, GPU only:

    python3 benchmarks/bench_quant_fusion.py --rows 64,768,8192

For the RMSNorm (+ residual) before q/k/v and gate/up (4,096 columns) and the SiLU-and-mul before down
(14,336): the 16-bit kernel then ``triton_quantize_rows`` (two launches), the fused kernel, and for the
SiLU the fused kernel with the row computed twice, 4,096 columns at a time, beside the row held in
registers. µs a call (triton.testing.do_bench, median) and the bytes the fused kernel must move (16-bit
inputs read once, fp8 values and scales written) over that time.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mempath.constants import FP8_MAX, MIN_SCALE  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64,768,8192")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_quant_fusion.py times CUDA kernels; the CPU test is tests/test_fp8_weights.py")
    from triton.testing import do_bench

    from mempath.kernels.elementwise_triton import triton_rms_norm, triton_silu_and_mul
    from mempath.kernels.quant_triton import triton_quantize_rows, triton_rms_norm_quant, triton_silu_and_mul_quant
    fp8 = {"fp8_max": FP8_MAX, "min_scale": MIN_SCALE}
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        h, i = args.hidden, args.intermediate
        x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        weight = torch.ones(h, device="cuda", dtype=torch.bfloat16)
        gate_up = torch.randn(rows, 2 * i, device="cuda", dtype=torch.bfloat16)
        timed = {
            "norm: two launches": lambda: triton_quantize_rows(triton_rms_norm(x, weight, 1e-5, residual)[0], **fp8),
            "norm: fused": lambda: triton_rms_norm_quant(x, weight, 1e-5, residual, **fp8),
            "silu: two launches": lambda: triton_quantize_rows(triton_silu_and_mul(gate_up), **fp8),
            "silu: fused, 4096 columns at a time": lambda: triton_silu_and_mul_quant(gate_up, block=4096, **fp8),
            "silu: fused, the row in registers": lambda: triton_silu_and_mul_quant(gate_up, **fp8),
        }
        moved = {"norm": rows * (3 * 2 * h + h + 4), "silu": rows * (2 * 2 * i + i + 4)}
        row = {"bench": "quant-fusion", "rows": rows, "us": {}}
        for name, fn in timed.items():
            us = 1e3 * do_bench(fn, warmup=10, rep=50, return_mode="median")
            row["us"][name] = us
            print(f"rows {rows:5d}  {name:38s} {us:9.1f} us  {moved[name[:4]] / us / 1e6:6.2f} TB/s of the fused bytes")
        results.append(row)
    for r in results:
        r.update(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name())
        print("RESULT " + json.dumps(r))


if __name__ == "__main__":
    main()
