"""One-row GEMV weight streaming through the tensor memory accelerator (TMA), against the shipped GEMV (#20, #17).

    python benchmarks/bench_gemv_tma.py                      # Llama-3.1-8B projections, fp8 and bf16 weights (CUDA)
    TRITON_INTERPRET=1 python benchmarks/bench_gemv_tma.py --smoke   # CPU: the kernel against the twin only

The lead: compiled for sm_90, the one-row GEMV's multiply-adds load their weight tile with plain
``ld.global`` (no ``cp.async``, whatever ``num_stages``): each program has one tile in flight and waits for
it, so the bytes in flight an SM are bounded by the registers. The TMA path (``GemvConfig.tma``, which this
bench led to) brings each tile into shared memory by a TMA copy, pipelined ``num_stages`` deep, so the bytes
in flight are bounded by shared memory. The bench sweeps its tiles against the table's entry.

Each candidate is checked against ``fp8_gemv_torch`` (``F.linear`` for bf16) and timed as
bench_fp8_gemv.py times the table (a CUDA graph of 20 calls after L2-flushing writes, less the writes),
against the shipped table's configuration at the same shape. Prints a table and one ``RESULT`` line.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import triton  # noqa: E402

from mempath.kernels import fp8_gemv_triton as gemv  # noqa: E402
from mempath.model.quant import fp8_gemv_torch, quantize_rows  # noqa: E402

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}


class TmaGemv:
    """One weight through the engine's TMA path (``GemvConfig.tma``: ``_fp8_gemv_tma_kernel``) at one tile."""

    def __init__(self, weight, scale, workspace, block_n, block_k, split_k, stages, warps):
        if not gemv.tma_fits(weight, 1):
            raise ValueError("the TMA cannot address this weight here (gemv.tma_fits)")
        self.weight, self.scale, self.workspace = weight, scale, workspace
        self.config = gemv.GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=warps,
                                      num_stages=stages, tma=True)

    def describe(self) -> str:
        c = self.config
        return f"tma n{c.block_n} k{c.block_k} split{c.split_k} w{c.num_warps} s{c.num_stages}"

    def __call__(self, x):
        return gemv.triton_fp8_gemv(x, self.weight, self.scale, None, self.workspace, self.config)


def candidates(n, k, elem_bytes, num_sms, quick):
    """(block_n, block_k, split, stages, warps): a TMA box's inner side is at most 256 elements; 4 warps up to
    64 outputs a tile, 8 above."""
    tiles = [(64, 256 // elem_bytes), (32, 256 // elem_bytes), (128, 128 // elem_bytes), (16, 256 // elem_bytes)]
    out = []
    for bn, bk in tiles[:2] if quick else tiles:
        for split in (1, 2, 4, 8, 16):
            programs = n // bn * split
            if k % (bk * split) or n % bn or programs > 8 * num_sms or (split > 1 and programs < num_sms // 2):
                continue
            for stages in ((4,) if quick else (3, 4, 6)):
                out.append((bn, bk, split, stages, 8 if bn > 64 else 4))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtypes", default="fp8,bf16")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--timer", choices=("graph", "chain"), default="graph",
                        help="bench_fp8_gemv.py's timers: L2-flushing writes between calls, or calls after an "
                             "RMSNorm launch each over weight copies that overflow the L2 (the one that matched a "
                             "decode step's GEMV time, BENCHMARKS.md)")
    args = parser.parse_args(argv)
    import bench_fp8_gemv as bench
    device = "cpu" if args.smoke else "cuda"
    bench.DEVICE = device
    bench.TIMER = args.timer
    shapes = {"toy": (64, 512)} if args.smoke else {s: SHAPES[s] for s in args.shapes.split(",")}
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    dense_table = gemv.load_dense_table()
    fp8_table = gemv.load_table()
    results = []
    for dtype_name in args.dtypes.split(","):
        for name, (n, k) in shapes.items():
            workspace = gemv.GemvWorkspace(n, torch.device(device))
            gen = torch.Generator(device=device).manual_seed(n + k)
            w16 = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(torch.bfloat16)
            x = torch.randn(1, k, device=device, generator=gen).to(torch.bfloat16)
            if dtype_name == "fp8":
                weight, scale = quantize_rows(w16)
                ref = fp8_gemv_torch(x, weight, scale, None)
                elem = 1
                shipped = fp8_table.get(f"{n}x{k}", {}).get("1") or gemv.heuristic_config(n, k, 1, num_sms)
                shipped_fn = lambda w, s: gemv.triton_fp8_gemv(x, w, s, None, workspace, shipped)  # noqa: E731
                shipped_name = shipped.describe()
            else:
                weight, scale = w16, None
                ref = torch.nn.functional.linear(x, weight)
                elem = 2
                config = dense_table.get(f"{n}x{k}", {}).get("1")
                if config is None:
                    shipped_fn = lambda w, s: torch.nn.functional.linear(x, w)  # noqa: E731
                    shipped_name = "cuBLAS"
                else:
                    shipped_fn = lambda w, s: gemv.triton_fp8_gemv(x, w, None, None, workspace, config)  # noqa: E731
                    shipped_name = config.describe()
            nbytes = weight.numel() * elem
            # --timer chain: the weight (and scales) copied until the copies overflow the L2; call i reads copy i
            copies = [(weight, scale)] + [(weight.clone(), None if scale is None else scale.clone())
                                          for _ in range(max(2, -(-bench.ROTATE_BYTES // nbytes)) - 1
                                                         if args.timer == "chain" else 0)]
            row = {"dtype": dtype_name, "proj": name, "n": n, "k": k, "shipped": shipped_name, "timer": args.timer}
            if device == "cuda":
                row["shipped_us"] = bench.time_us(lambda i: shipped_fn(*copies[i]), len(copies))
            timed = []
            for bn, bk, split, stages, warps in (candidates(n, k, elem, num_sms, args.quick) if not args.smoke
                                                 else [(16, 64, 2, 3, 4), (32, 128, 1, 2, 4)]):
                try:
                    fns = [TmaGemv(w, sc, workspace, bn, bk, split, stages, warps) for w, sc in copies]
                    fn = fns[0]
                    got = fn(x)
                    if device == "cuda":
                        torch.cuda.synchronize()
                except Exception as error:  # noqa: BLE001 - a candidate that does not compile is dropped
                    print(f"  {name} n{bn} k{bk} split{split} s{stages} w{warps}: {type(error).__name__}: "
                          f"{str(error)[:160]}")
                    continue
                diff = (got.float() - ref.float()).abs().max().item()
                tol = 2e-2 * ref.float().abs().max().item() + 1e-3
                if not diff <= tol or workspace.partials.abs().max().item() != 0 or workspace.counters.abs().max() != 0:
                    print(f"  {fn.describe()}: differs from the twin by {diff:.3g} (tolerance {tol:.3g}) or left "
                          f"the workspace dirty: dropped")
                    continue
                if device == "cuda":
                    timed.append((bench.time_us(lambda i: fns[i](x), len(fns)), fn.describe()))
                else:
                    timed.append((0.0, fn.describe()))
            timed.sort()
            row["tma_best"] = [{"config": d, "us": round(t, 2)} for t, d in timed[:args.top]]
            if device == "cuda" and timed:
                row["tma_best_us"] = timed[0][0]
                row["gbps_shipped"] = nbytes / row["shipped_us"] / 1e3
                row["gbps_tma"] = nbytes / timed[0][0] / 1e3
                print(f"{dtype_name} {name} {n}x{k}: shipped {shipped_name} {row['shipped_us']:.1f} us "
                      f"({row['gbps_shipped']:.0f} GB/s); TMA best {timed[0][1]} {timed[0][0]:.1f} us "
                      f"({row['gbps_tma']:.0f} GB/s); next: {[f'{d} {t:.1f}' for t, d in timed[1:args.top]]}")
            else:
                print(f"{dtype_name} {name}: {len(timed)} candidates match the twin")
            results.append(row)
    if device == "cuda":
        copy_src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        copy_dst = torch.empty_like(copy_src)
        us = bench.time_us(lambda: copy_dst.copy_(copy_src))
        print(f"copy bandwidth (read + write): {2 * copy_src.numel() / us / 1e3:.0f} GB/s")
        results.append({"copy_gbps": 2 * copy_src.numel() / us / 1e3})
    print("RESULT " + json.dumps({"bench": "gemv_tma", "device": torch.cuda.get_device_name() if device == "cuda"
                                  else "cpu", "triton": triton.__version__, "rows": results}))
    if args.smoke and not all(r.get("tma_best") for r in results):
        sys.exit("smoke: a dtype had no candidate matching the twin")


if __name__ == "__main__":
    main()
