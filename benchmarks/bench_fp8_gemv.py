"""The weight-only fp8 GEMV (mempath.kernels.fp8_gemv_triton) on a model's projections: checked, swept, tabled.

    python benchmarks/bench_fp8_gemv.py                          # Llama-3.1-8B shape, rows 1 2 4 8 16 (CUDA)
    python benchmarks/bench_fp8_gemv.py --quick --out /tmp/t.json   # a smaller grid, another table
    TRITON_INTERPRET=1 python benchmarks/bench_fp8_gemv.py --smoke --out /tmp/smoke.json   # CPU, end to end

For each quantized projection of the shape (fused q/k/v, o, fused gate/up, down: the LM head
stays bf16) and each batch of rows:

1. check: the table's configuration (the shipped or --table one) and every candidate of the
   sweep against the PyTorch twin (fp8_gemv_torch); a candidate that differs, fails to compile
   or leaves the workspace dirty is dropped and counted;
2. sweep: every candidate (block sizes, split-K, atomic or two-pass reduce, warps, stages,
   multiply-adds or tensor cores, multiply-adds summed over K at every step with and without prefetch, and
   _scaled_mm itself; then the three fastest others with prefetch), timed in a CUDA graph of 20 calls,
   each after a write of 128 MB that flushes the L2 (in a decode step the weights are never in L2),
   less the same graph of writes alone: calls back to back as in a decode graph, without the launch
   gaps that event timing of single calls adds to kernels of 10-40 us (``--timer do_bench``: that way), beside bf16
   torch.matmul and the current fp8 path (Triton quantization + _scaled_mm) at the same shape,
   in GB/s of weight read against the device-to-device copy bandwidth measured in the run
   (bytes read + written per second: the weight-read limit bench_fp8_weights.py uses);
3. write the best configuration per (shape, row bucket) to --out (default: the shipped table,
   mempath/assets/fp8_gemv_configs.json, which the engine reads; commit it).

Then the sum of the four projections over the layers at each batch, fp8 GEMV against bf16:
the projections' share of a decode step. Prints tables and one ``RESULT`` JSON line.
"""
import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from mempath.kernels.fp8_gemv_triton import (DEFAULT_TABLE, QUANT_X_GROUP, GemvConfig, GemvWorkspace,  # noqa: E402
                                            heuristic_config, load_table, row_bucket, table_json, triton_fp8_gemv)
from mempath.kernels.quant_triton import triton_quantize_rows  # noqa: E402
from mempath.model.quant import FP8_MAX, MIN_SCALE, fp8_gemv_torch, fp8_linear_scaled_mm, quantize_rows  # noqa: E402

CONFIGS = ROOT / "tests" / "data" / "configs"
# --smoke: the script end to end on the CPU, kernels in Triton's interpreter (run it with
# TRITON_INTERPRET=1), on a toy shape, in float16 (the interpreter multiplies bfloat16 tiles as raw bits).
SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 2, "num_key_value_heads": 1,
               "num_hidden_layers": 2}
DEVICE, DTYPE = "cuda", torch.bfloat16
TIMER = "graph"  # or "do_bench", "rotate" or "chain" (--timer)
# --timer rotate: each projection's weight copied until the copies hold this many bytes (several times the L2)
ROTATE_BYTES = 256 << 20
# (block_n, block_k, num_warps, num_stages): multiply-adds in registers (up to 4 rows) and tensor cores.
FMA_TILES = [(32, 256, 4, 2), (64, 128, 4, 2), (64, 256, 8, 2), (128, 128, 8, 2), (16, 512, 4, 2), (32, 512, 8, 3)]
DOT_TILES = [(64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 4, 3), (128, 256, 8, 3), (64, 128, 4, 5), (128, 128, 8, 4),
             (32, 256, 4, 4)]
# Multiply-add tiles whose product is summed over K at every step (GemvConfig.sum_k_each_step), each
# with prefetching on and off: two of the tiles above, to compare like with like, and wider ones at
# 4 warps, which a [BLOCK_N, BLOCK_K] float32 accumulator made too costly in registers.
SUMMED_TILES = [(128, 128, 8, 2), (16, 512, 4, 2), (128, 128, 4, 2), (64, 256, 4, 2), (32, 1024, 4, 2)]
# The fp8 tensor-core product (x quantized in groups of QUANT_X_GROUP along K, so block_k is that):
# widths of one to four warpgroup tiles, pipelined 3 to 6 deep.
FP8_DOT_TILES = [(64, QUANT_X_GROUP, 4, 3), (64, QUANT_X_GROUP, 4, 4), (64, QUANT_X_GROUP, 4, 6),
                 (128, QUANT_X_GROUP, 4, 4), (128, QUANT_X_GROUP, 8, 4), (128, QUANT_X_GROUP, 4, 6),
                 (256, QUANT_X_GROUP, 8, 3), (256, QUANT_X_GROUP, 8, 4)]
# One row through the TMA (GemvConfig.tma): tiles 256 B wide (the box's limit), pipelined 3 to 6 deep.
TMA_TILES = [(16, 256, 4, 4), (16, 256, 4, 6), (32, 256, 4, 3), (32, 256, 4, 4), (64, 256, 4, 3), (64, 128, 4, 4)]
QUICK_FMA, QUICK_DOT, QUICK_SUMMED, QUICK_FP8_DOT = FMA_TILES[:3], DOT_TILES[:4], SUMMED_TILES[2:4], FP8_DOT_TILES[:3]
QUICK_TMA = TMA_TILES[::2]
PRODUCTS = ("fma", "dot", "sum-k", "dot-fp8", "tma", "scaled_mm")


def projections(config: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the fp8 layers, as mempath.model.llama builds them (q/k/v and gate/up fused)."""
    h, i = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or h // heads
    return {"qkv_proj": (heads * d + 2 * kv * d, h), "o_proj": (h, heads * d), "gate_up_proj": (2 * i, h),
            "down_proj": (h, i)}


def candidates(n: int, k: int, rows: int, num_sms: int, quick: bool, products=PRODUCTS) -> list[GemvConfig]:
    """The sweep's grid at one shape and batch, of the ``products`` asked for: splits whose grid covers
    half to eight times the SMs (and split 1), each split at least one K block, atomic and two-pass;
    and _scaled_mm. Up to 4 rows also the tiles summed over K at every step, with and without
    prefetching, split atomically. The fp8 tensor-core tiles at every batch."""
    out = [GemvConfig(kernel="scaled_mm")] if "scaled_mm" in products else []
    fma = rows <= 4
    tiles = [(t, dict(use_dot=False)) for t in (QUICK_FMA if quick else FMA_TILES) if fma and "fma" in products]
    tiles += [(t, dict(use_dot=True)) for t in (QUICK_DOT if quick else DOT_TILES) if rows >= 2 and "dot" in products]
    tiles += [(t, dict(sum_k_each_step=True, prefetch=prefetch)) for t in (QUICK_SUMMED if quick else SUMMED_TILES)
              for prefetch in (False, True) if fma and "sum-k" in products]
    tiles += [(t, dict(use_dot=True, quantize_x=True)) for t in (QUICK_FP8_DOT if quick else FP8_DOT_TILES)
              if "dot-fp8" in products]
    tiles += [(t, dict(tma=True)) for t in (QUICK_TMA if quick else TMA_TILES) if rows == 1 and "tma" in products]
    for (bn, bk, warps, stages), options in tiles:
        for split in (1, 2, 4, 8, 16):
            programs = -(-n // bn) * split
            if split > 1 and (programs > 8 * num_sms or k // split < bk or programs < num_sms // 2):
                continue
            # The summed tiles ask about the accumulator, not the reduce: one launch (atomic) keeps the grid small.
            # The TMA tiles have the atomic reduce only.
            two_pass = split > 1 and not options.get("sum_k_each_step") and not options.get("tma")
            for reduce in (("atomic", "two_pass") if two_pass else ("atomic",)):
                out.append(GemvConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages,
                                      reduce=reduce, **options))
    return out


class Layer:
    """One projection's weights: bf16, fp8 with scales, and the callables the sweep times."""

    def __init__(self, n: int, k: int, workspace: GemvWorkspace):
        gen = torch.Generator(device=DEVICE).manual_seed(n * 7 + k)
        self.n, self.k, self.workspace = n, k, workspace
        self.w16 = torch.randn(n, k, device=DEVICE, dtype=DTYPE, generator=gen) * 0.02
        self.wq, self.scale = quantize_rows(self.w16)
        self.fp8_bytes = n * k + 4 * n
        # --timer rotate: copies of the fp8 weight at other addresses, ROTATE_BYTES in all, read in turn
        copies = max(2, -(-ROTATE_BYTES // self.fp8_bytes)) if TIMER in ("rotate", "chain") else 1
        self.copies = [(self.wq, self.scale)] + [(self.wq.clone(), self.scale.clone()) for _ in range(copies - 1)]

    def run(self, x: torch.Tensor, config: GemvConfig, copy: int = 0) -> torch.Tensor:
        wq, scale = self.copies[copy % len(self.copies)]
        if config.kernel == "scaled_mm":
            return fp8_linear_scaled_mm(x, wq, scale, None, quantize=lambda t: triton_quantize_rows(
                t, fp8_max=FP8_MAX, min_scale=MIN_SCALE))
        return triton_fp8_gemv(x, wq, scale, None, self.workspace, config)

    def check(self, x: torch.Tensor, config: GemvConfig, refs: dict) -> str | None:
        """None when ``config`` gives the twin's result and leaves the workspace zero, else why not.
        ``refs``: the twin's results by x_group, filled as needed."""
        try:
            out = self.run(x, config)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
            return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        if config.kernel == "scaled_mm":
            return None  # its own arithmetic (quantized input): tests/test_fp8_weights.py checks it
        x_group = QUANT_X_GROUP if config.quantize_x else None
        if x_group not in refs:
            refs[x_group] = fp8_gemv_torch(x, self.wq, self.scale, None, x_group=x_group)
        ref = refs[x_group]
        err = (out.float() - ref.float()).abs().max().item()
        tol = 2 * torch.finfo(DTYPE).eps * max(1.0, ref.float().abs().max().item())
        if not err <= tol:
            return f"max |error| {err:.3g} > {tol:.3g}"
        if self.workspace.partials.any() or self.workspace.counters.any():
            return "workspace not zero after the call"
        return None


def time_us(fn, copies: int = 0) -> float:
    """µs a call of ``fn``. ``copies``: fn takes the index of the weight copy it reads (--timer rotate)."""
    if TIMER in ("rotate", "chain") and copies and DEVICE != "cpu":
        return rotate_time_us(fn, copies, norm_first=TIMER == "chain")
    if copies:
        fn = functools.partial(fn, 0)
    if DEVICE == "cpu":
        start = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - start)
    if TIMER == "do_bench":
        from triton.testing import do_bench
        return 1e3 * do_bench(fn, warmup=5, rep=20, return_mode="median")
    return graph_time_us(fn)


_FLUSH: list[torch.Tensor] = []


def graph_time_us(fn, calls: int = 20, replays: int = 5) -> float:
    """µs per call of ``fn`` in a CUDA graph of ``calls`` calls, each after an L2-flushing write, less
    the graph of the writes alone (the median of ``replays`` replays of each)."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE))
    flush = _FLUSH[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capturing stream, as capture wants
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for with_fn in (True, False):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                flush.zero_()
                if with_fn:
                    fn()
        graphs.append(graph)
    times = {True: [], False: []}
    for _ in range(replays):
        for with_fn, graph in zip((True, False), graphs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[with_fn].append(start.elapsed_time(end))
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return 1e3 * max(0.0, median(times[True]) - median(times[False])) / calls


def rotate_time_us(fn, copies: int, calls: int = 24, replays: int = 5, norm_first: bool = False) -> float:
    """µs per call of ``fn(i)`` in a CUDA graph of ``calls`` calls back to back, each reading the next of
    ``copies`` weight copies (several times the L2 in all, so no call finds its weight there), no write between
    them: the median of ``replays`` replays. Unlike the flushing timer, no L2 write-back of a flush competes with
    the call's reads, and each call can overlap the previous one's tail. ``norm_first`` (--timer chain): each
    call after an RMSNorm launch (Triton, PDL) of a hidden row, as a projection follows a kernel in a decode step;
    the norm's ~1-2 µs are in the figure."""
    from mempath.kernels.elementwise_triton import triton_rms_norm
    hidden = torch.randn(1, 4096, device=DEVICE, dtype=DTYPE)
    norm_weight = torch.ones(4096, device=DEVICE, dtype=DTYPE)

    def call(i):
        if norm_first:
            triton_rms_norm(hidden, norm_weight, 1e-5)
        fn(i)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(copies):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % copies)
    return 1e3 * median_replay_ms(graph, replays) / calls


def median_replay_ms(graph, replays: int) -> float:
    """The median of ``replays`` replays of a captured CUDA graph, ms (CUDA events around each)."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def sweep_point(layer: Layer, rows: int, table_config: GemvConfig, num_sms: int, quick: bool,
                products=PRODUCTS) -> dict:
    """Check and time every candidate at one shape and batch; the best (the table's configuration
    among them, so a narrower sweep never writes a slower table), the table's, and the baselines."""
    x = torch.randn(rows, layer.k, device=DEVICE, dtype=DTYPE)
    refs = {}
    table_error = layer.check(x, table_config, refs)
    timed, failed = [], []
    for config in candidates(layer.n, layer.k, rows, num_sms, quick, products):
        error = layer.check(x, config, refs)
        if error:
            failed.append(f"{config.describe()}: {error}")
            continue
        timed.append((time_us(lambda i: layer.run(x, config, i), len(layer.copies)), config))
    # Prefetching (a second weight tile in registers, the first before the PDL wait) on the three
    # fastest GEMV configurations only: on the whole grid it would double the compilations. (The
    # grid has the tiles summed over K each step with it already.)
    fastest = sorted((t for t in timed if t[1].kernel == "gemv" and not t[1].sum_k_each_step
                      and not t[1].quantize_x and not t[1].tma), key=lambda t: t[0])[:3]
    for config in (dataclasses.replace(c, prefetch=True) for _, c in fastest):
        error = layer.check(x, config, refs)
        if error:
            failed.append(f"{config.describe()}: {error}")
            continue
        timed.append((time_us(lambda i: layer.run(x, config, i), len(layer.copies)), config))
    table_us = None if table_error else time_us(lambda i: layer.run(x, table_config, i), len(layer.copies))
    # What each product costs in accuracy: the RMS of its difference from the bf16 product, over that product's RMS.
    exact = x.float() @ layer.w16.float().t()
    def relative_error(config):
        return None if config is None else \
            ((layer.run(x, config).float() - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()
    best_us, best = min(timed + ([(table_us, table_config)] if table_us else []), key=lambda t: t[0])
    fp8_dot_us, fp8_dot = min(((t, c) for t, c in timed if c.quantize_x), key=lambda t: t[0], default=(None, None))
    # The best tile summed over K each step, beside the best overall, whichever wins: the A/B the option awaits.
    summed_us, summed = min(((t, c) for t, c in timed if c.sum_k_each_step), key=lambda t: t[0], default=(None, None))
    return {"rows": rows, "best": best, "best_us": best_us,
            "sum_k_best": summed.describe() if summed else None, "sum_k_us": summed_us,
            "dot_fp8_best": fp8_dot.describe() if fp8_dot else None, "dot_fp8_us": fp8_dot_us,
            "error_vs_bf16": {"weight_only": relative_error(GemvConfig(block_n=64, block_k=128)),
                              "dot_fp8": relative_error(fp8_dot), "scaled_mm": relative_error(GemvConfig(
                                  kernel="scaled_mm"))},
            "table": table_config, "table_error": table_error, "table_us": table_us,
            "bf16_us": time_us(lambda: x @ layer.w16.t()),
            "scaled_mm_us": next((t for t, c in timed if c.kernel == "scaled_mm"), float("nan")),
            "candidates": len(timed), "failed": failed}


def gbps(nbytes: int, us: float) -> float:
    return nbytes / us / 1e3


def main() -> None:
    """Check and sweep every projection at every batch, print the tables, write the best table."""
    from bench_engine import copy_bandwidth, print_table
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", help="a config in tests/data/configs")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--out", default=str(DEFAULT_TABLE), help="where the best configurations go")
    parser.add_argument("--table", default=str(DEFAULT_TABLE), help="the table whose configurations are checked")
    parser.add_argument("--quick", action="store_true", help="a third of the grid")
    parser.add_argument("--timer", choices=("graph", "do_bench", "rotate", "chain"), default="graph",
                        help="calls back to back in a CUDA graph, each after an L2-flushing write (default); "
                             "triton's do_bench of single calls; or rotate: a graph of calls back to back over "
                             "copies of the weight that together overflow the L2, no write between them; or chain: "
                             "rotate with an RMSNorm launch before each call")
    parser.add_argument("--products", default=",".join(PRODUCTS),
                        help=f"the products swept, of {','.join(PRODUCTS)} (the table's configuration is timed "
                             f"and kept where it is faster, whatever it is)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, TRITON_INTERPRET=1: a toy shape, --quick, timings meaningless")
    args = parser.parse_args()
    if args.smoke and Path(args.out).resolve() == DEFAULT_TABLE.resolve():
        parser.error("--smoke times a toy shape in the interpreter: give --out FILE, or it would replace the "
                     "shipped table")
    started = time.time()
    global DEVICE, DTYPE, TIMER
    TIMER = args.timer
    if args.smoke:
        DEVICE, DTYPE, args.quick, args.shape = "cpu", torch.float16, True, "smoke"
    config = SMOKE_SHAPE if args.smoke else json.loads((CONFIGS / f"{args.shape}.json").read_text())
    rows_list = [int(r) for r in args.rows.split(",")]
    products = tuple(p for p in args.products.split(",") if p)
    if not products or set(products) - set(PRODUCTS):
        parser.error(f"--products: {'unknown ' + str(sorted(set(products) - set(PRODUCTS))) if products else 'none'}"
                     f"; name one or more of {','.join(PRODUCTS)}")
    num_sms = 4 if args.smoke else torch.cuda.get_device_properties(0).multi_processor_count
    bandwidth = 1e9 if args.smoke else copy_bandwidth()
    read_bw = bandwidth  # bytes read + written per second by a copy: the rate a read-only stream gets too
    try:
        table = load_table(args.table)
    except ValueError as error:  # absent or malformed: one line
        parser.error(f"--table: {error}")
    shapes = projections(config)
    workspace = GemvWorkspace(max(n for n, _ in shapes.values()), torch.device(DEVICE))
    device_name = "cpu (Triton's interpreter)" if args.smoke else torch.cuda.get_device_name()
    print(f"{device_name}: {num_sms} SMs, copy bandwidth {bandwidth / 1e12:.2f} TB/s "
          f"(read + written, the weight-read limit of bench_fp8_weights.py); shape {args.shape}, rows {rows_list}")
    results, best_table = {}, {}
    for name, (n, k) in shapes.items():
        layer = Layer(n, k, workspace)
        shape_started = time.time()
        rows_out = []
        for rows in rows_list:
            table_config = table.get(f"{n}x{k}", {}).get(str(row_bucket(rows))) or heuristic_config(n, k, rows, num_sms)
            point = sweep_point(layer, rows, table_config, num_sms, args.quick, products)
            rows_out.append(point)
            best_table.setdefault(f"{n}x{k}", {})[str(row_bucket(rows))] = point["best"]
        results[name] = rows_out
        print(f"\n{name} {n}x{k}: fp8 weight {layer.fp8_bytes / 1e6:.1f} MB ({time.time() - shape_started:.0f} s)")
        table_rows = [("rows", "best", "us", "GB/s", "% of copy", "table's us", "best dot-fp8 us", "bf16 us",
                       "_scaled_mm us",
                       "x bf16", "x _scaled_mm", "checked", "dropped")]
        for p in rows_out:
            table_col = f"{p['table_us']:.1f}" if p["table_us"] else f"WRONG: {p['table_error']}"
            table_rows.append((p["rows"], p["best"].describe(), f"{p['best_us']:.1f}",
                               f"{gbps(layer.fp8_bytes, p['best_us']):.0f}",
                               f"{100 * layer.fp8_bytes / (p['best_us'] * 1e-6) / read_bw:.0f}%", table_col,
                               f"{p['dot_fp8_us']:.1f}" if p["dot_fp8_us"] else "-", f"{p['bf16_us']:.1f}",
                               f"{p['scaled_mm_us']:.1f}", f"{p['bf16_us'] / p['best_us']:.2f}",
                               f"{p['scaled_mm_us'] / p['best_us']:.2f}", p["candidates"], len(p["failed"])))
        print_table(table_rows)
        for p in rows_out:
            errors = ", ".join(f"{name} {100 * e:.2f}%" for name, e in p["error_vs_bf16"].items() if e is not None)
            print(f"  {p['rows']} rows: RMS difference from the bf16 product: {errors}")
        for p in rows_out:
            for line in p["failed"][:5]:
                print(f"  dropped at {p['rows']} rows: {line}")
        del layer
    layers = config["num_hidden_layers"]
    print(f"\nthe projections of one decode step ({layers} layers; LM head, attention and norms not included):")
    step_rows = [("rows", "fp8 best ms", "bf16 ms", "x bf16", "fp8 weight-read limit ms")]
    fp8_step_bytes = layers * sum(n * k + 4 * n for n, k in shapes.values())
    summary = {}
    for i, rows in enumerate(rows_list):
        fp8_ms = layers * sum(results[name][i]["best_us"] for name in shapes) / 1e3
        bf16_ms = layers * sum(results[name][i]["bf16_us"] for name in shapes) / 1e3
        summary[rows] = {"fp8_ms": fp8_ms, "bf16_ms": bf16_ms}
        step_rows.append((rows, f"{fp8_ms:.3f}", f"{bf16_ms:.3f}", f"{bf16_ms / fp8_ms:.2f}",
                          f"{1e3 * fp8_step_bytes / read_bw:.3f}"))
    print_table(step_rows)
    Path(args.out).write_text(table_json(
        best_table, device=device_name,
        made_by=f"benchmarks/bench_fp8_gemv.py --shape {args.shape} --rows {args.rows}"
                f"{' --quick' if args.quick else ''}"
                f"{'' if args.timer == 'graph' else ' --timer ' + args.timer}"
                f"{'' if products == PRODUCTS else ' --products ' + ','.join(products)}",
        shapes={f"{n}x{k}": f"{name} ({args.shape})" for name, (n, k) in shapes.items()}))
    print(f"\nbest configurations written to {args.out} ({time.time() - started:.0f} s in all)")
    print("RESULT " + json.dumps({
        "bench": "fp8_gemv", "shape": args.shape, "device": device_name, "copy_bandwidth": bandwidth,
        "step_projections": summary, "table_wrong": sum(p["table_error"] is not None for r in results.values() for p in r),
        "points": {name: [{"rows": p["rows"], "best": p["best"].describe(), "best_us": p["best_us"],
                           "table_us": p["table_us"], "bf16_us": p["bf16_us"], "scaled_mm_us": p["scaled_mm_us"],
                           "sum_k_best": p["sum_k_best"], "sum_k_us": p["sum_k_us"],
                           "dot_fp8_best": p["dot_fp8_best"], "dot_fp8_us": p["dot_fp8_us"],
                           "error_vs_bf16": p["error_vs_bf16"],
                           "dropped": len(p["failed"])} for p in r] for name, r in results.items()}}))


if __name__ == "__main__":
    main()
