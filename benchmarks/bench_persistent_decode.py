"""Batch-1 decode's decoder layers as one persistent kernel against the read limit (#17, CUDA).

    python benchmarks/bench_persistent_decode.py --shape llama-3.1-8b --contexts 128,2048
    python benchmarks/bench_persistent_decode.py --configs 1x:16:512:8,2x:16:512:4   # programs:rows:k:warps

Random weights of the shape's layers (bf16), a paged KV cache filled at random to each context, one
sequence; the rotary tables from rope_theta without the shape's rope_scaling (the same work a step). Each
config is checked against the PyTorch twin (``persistent_decode.layer_stack_torch``) before it is timed.

Timed: the persistent kernel (one launch a step, programs a multiple of the SMs: ``2x`` is two an SM; the
mean of back-to-back launches: capturing a cooperative launch in a graph was not tried), and the same phases
as a launch a phase and layer in a CUDA graph (``bench_l2_prefetch.time_graph``: the median of five replays' means). The
read limit is the layers' weights and the context's K and V at the copy bandwidth measured in the run. The
projected step adds the LM head (cuBLAS, one row, in a graph) and the embedding row a step reads, against the
whole step's limit: that is the figure #17's batch-1 target names. Prints a line a measurement and one
``RESULT`` JSON line.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_engine  # noqa: E402
import bench_l2_prefetch  # noqa: E402
import persistent_decode as pd  # noqa: E402
from ptx_decode import programs_per_sm  # noqa: E402

BLOCK_SIZE = 16


def parse_configs(text: str, sms: int) -> list[dict]:
    """``programs:rows:k:warps[:l][:w][:pBYTES][:o][:B|:N]``: programs as a count or a multiple of the SMs
    (``2x``); ``l``
    keeps two K tiles in flight; ``p1024`` prefetches 1 KB of each row of the next phase's first tile before a
    barrier, ``o`` all o rows; ``w`` (with ``l``) loads the next phase's first weight tile between a barrier's
    arrival and its wait. Timing only (wrong results, not checked): ``B`` the barriers and no work, ``N``
    the work and no barriers."""
    configs = []
    for entry in text.split(","):
        programs, rows, k, warps, *extra = entry.split(":")
        count = int(programs[:-1]) * sms if programs.endswith("x") else int(programs)
        prefetch = next((int(e[1:]) for e in extra if e.startswith("p")), 0)
        diagnostic = "barriers" if "B" in extra else "no-barriers" if "N" in extra else ""
        tiles = dict(row_tile=int(rows), k_tile=int(k), num_warps=int(warps), prefetch=prefetch,
                     prefetch_o="o" in extra, pipeline="l" in extra, preload="w" in extra, diagnostic=diagnostic)
        configs.append(dict(name=entry, programs=count, tiles=tiles))
    return configs


def loop_time_ms(fn, iters: int) -> float:
    """Mean ms of ``fn`` called back to back (its launches queue ahead of the GPU)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def check_against_twin(stack, bufs, caches, block_table, rope, pos, x0, launch) -> float:
    """Relative max error of one step's residual against the twin; the K/V the step writes compared too."""
    k_ref, v_ref = caches[0].clone(), caches[1].clone()
    ref = pd.layer_stack_torch(x0, stack, k_ref, v_ref, block_table, *rope, pos)
    bufs.x.copy_(x0)
    launch()
    torch.cuda.synchronize()
    kv_error = max((caches[0].float() - k_ref.float()).abs().max().item(),
                   (caches[1].float() - v_ref.float()).abs().max().item())
    error = ((bufs.x - ref).abs().max() / ref.abs().max()).item()
    if not error < 1e-2 or not kv_error < 0.07:  # a bf16 K or V may round the other way: an ulp at |x| < 8
        sys.exit(f"the persistent kernel disagrees with its twin: residual {error:.2e}, K/V {kv_error:.3f}")
    return error


def lm_head_ms(hidden: int, vocab: int, iters: int) -> float:
    weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    ms = bench_l2_prefetch.time_graph(lambda: torch.nn.functional.linear(x, weight), replays=iters)
    del weight
    return ms


def auto_splits(context: int, programs: int, kv_heads: int) -> int:
    """A power of two: splits of at most 64 positions each, while every (KV head, split) item has a program."""
    splits = 1
    while (context + 1) / splits > 64 and kv_heads * splits * 2 <= programs:
        splits *= 2
    return splits


def measure_context(stack, caches, block_table, rope, context, configs, args, bandwidth) -> list[dict]:
    pos = context
    kv_read = stack.layers * (pos + 1) * stack.kv_heads * stack.head_dim * 2 * caches[0].element_size()
    limit_ms = 1e3 * (stack.weight_bytes() + kv_read) / bandwidth
    x0 = torch.randn(stack.hidden, device="cuda")
    rows = []
    for config in configs:
        splits = args.splits or auto_splits(context, config["programs"], stack.kv_heads)
        bufs = pd.StepBuffers.make(stack, splits, "cuda")
        tiles = config["tiles"]

        def persistent():
            return pd.launch_layer_stack(stack, bufs, *caches, block_table, *rope, pos, programs=config["programs"],
                                         cooperative=True, **tiles)
        try:
            compiled = persistent()
        except RuntimeError as error:  # the driver refused a grid it cannot hold at once
            print(f"context {context} {config['name']}: not run ({error})", flush=True)
            continue
        resident = torch.cuda.get_device_properties(0).multi_processor_count * programs_per_sm(
            compiled.n_regs, compiled.metadata.shared, compiled.metadata.num_warps)
        error = None if tiles["diagnostic"] else check_against_twin(stack, bufs, caches, block_table, rope, pos, x0,
                                                                     persistent)
        ms = loop_time_ms(persistent, args.iters)
        row = dict(config=config["name"], context=context, splits=splits, programs=config["programs"],
                   resident=resident, regs=compiled.n_regs, spills=compiled.n_spills, twin_error=error,
                   persistent_ms=ms, limit_ms=limit_ms, of_limit=limit_ms / ms)
        if args.launch_baseline and config is configs[0]:
            row["launch_per_phase_ms"] = bench_l2_prefetch.time_graph(
                lambda: pd.launch_layer_stack(stack, bufs, *caches, block_table, *rope, pos,
                                              programs=config["programs"], persistent=False, **tiles),
                replays=args.iters)
        print(f"context {context} {config['name']} ({config['programs']} programs, {resident} resident, "
              f"{compiled.n_regs} regs, {compiled.n_spills} spills, {splits} splits): {ms:.3f} ms, "
              f"{100 * limit_ms / ms:.1f}% of the layers' read limit ({limit_ms:.3f} ms); "
              + (f"twin {error:.1e}" if error is not None else "timing only, results not checked")
              + (f"; a launch a phase {row['launch_per_phase_ms']:.3f} ms" if "launch_per_phase_ms" in row else ""),
              flush=True)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--contexts", default="128,2048")
    # Row tiles that share the Llama shapes' rows out evenly: 16 rows over the SMs, 8 over twice as many.
    parser.add_argument("--configs", default="1x:16:512:8:l,2x:8:512:4:l,128:16:512:8:l,2x:8:512:4,"
                                               "2x:8:512:4:l:p1024,2x:8:512:4:l:o,1x:32:256:8:l,2x:8:512:4:l:B,"
                                               "2x:8:512:4:l:N")
    parser.add_argument("--splits", type=int, default=0, help="attention splits (0: at most 64 positions each, "
                        "while the programs last)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--layers", type=int, default=0, help="fewer layers than the shape's (0: all)")
    parser.add_argument("--no-launch-baseline", dest="launch_baseline", action="store_false")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_persistent_decode.py needs CUDA: the persistent kernel's barriers need every program "
                 "resident at once (the CPU interpreter runs them one after another)")
    config = json.loads((bench_engine.SHAPES / f"{args.shape}.json").read_text())
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
        configs = parse_configs(args.configs, torch.cuda.get_device_properties(0).multi_processor_count)
    except ValueError as error:
        parser.error(f"--contexts takes integers and --configs entries programs:rows:k:warps[:flags] "
                     f"(e.g. 2x:8:512:4:l): {error}")
    bandwidth = bench_engine.copy_bandwidth()
    stack = pd.random_stack(args.layers or config["num_hidden_layers"], hidden, config["intermediate_size"], heads,
                            config["num_key_value_heads"], head_dim, torch.bfloat16, "cuda",
                            eps=config["rms_norm_eps"])
    blocks = -(-(max(contexts) + 1) // BLOCK_SIZE) + 1
    cache_shape = (stack.layers, blocks, BLOCK_SIZE, stack.kv_heads, head_dim)
    caches = tuple(torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    block_table = torch.randperm(blocks, device="cuda")[:blocks - 1].to(torch.int32)
    rope = pd.rope_tables(max(contexts) + 1, head_dim, config.get("rope_theta", 10000.0), "cuda")
    rows = []
    for context in contexts:
        rows += measure_context(stack, caches, block_table, rope, context, configs, args, bandwidth)
    head_ms = lm_head_ms(hidden, config["vocab_size"], args.iters)
    step_bytes = stack.weight_bytes() + (config["vocab_size"] + 2) * hidden * 2  # + the final norm, an embedding row
    for row in rows:
        kv = row["limit_ms"] * bandwidth / 1e3 - stack.weight_bytes()
        step_limit = 1e3 * (step_bytes + kv) / bandwidth
        row.update(lm_head_ms=head_ms, step_ms=row["persistent_ms"] + head_ms, step_limit_ms=step_limit)
        print(f"context {row['context']} {row['config']}: projected step {row['step_ms']:.3f} ms (layers + LM head "
              f"{head_ms:.3f}), {100 * step_limit / row['step_ms']:.1f}% of the step's read limit "
              f"({step_limit:.3f} ms)", flush=True)
    print("RESULT " + json.dumps({"bench": "persistent_decode", "shape": args.shape, "device":
                                  torch.cuda.get_device_name(), "bandwidth": bandwidth, "rows": rows}), flush=True)


if __name__ == "__main__":
    main()
