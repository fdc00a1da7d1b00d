"""The grouped expert GEMM (mempath.kernels.moe_triton) swept over launch configurations, per shape.

    python benchmarks/bench_moe_gemm.py --out mempath/assets/moe_gemm_configs.json   # CUDA (~3 min on an H200)
    TRITON_INTERPRET=1 python benchmarks/bench_moe_gemm.py --tiny                     # CPU: the script end to end

The GEMMs are the two launches of ``triton_grouped_experts`` (gate/up: [E, 2I, h] times each
pair's token row; down: [E, h, I] times each pair's activation, weighted by the router) at the
Qwen3-30B-A3B and Mixtral-8x7B shapes, in bf16, with random expert ids (distinct per token):

- decode: 1, 2, 4 and 8 tokens (16-row blocks, 1-8 real rows: a read of the active experts'
  weights); the table's block_m 16 entries are per bucket of pairs (tokens x top_k rounded up to
  a power of two), each the fastest configuration at the largest batch in its bucket;
- prefill: 1024 tokens (64-row blocks for both models: Mixtral's 512 tokens x 2 are 1024 pairs,
  which still run 16-row blocks), its best configuration for block_m 64.

The sweep is in two stages: every tile (decode: block_n 16-128 x block_k 32-256; prefill:
32-128 x 32-128) at 4 warps (2 for 16 x 16) and 3 stages (2 for two K steps), then warps
(decode 2/4/8, prefill 4/8) x stages 2-5 on the two best tiles (prefill: the best one).
Configurations whose pipeline cannot fit in shared memory, with more stages than K steps or
more warps than the tile has MMA columns for are not tried; the second stage stops at each
shape's share of ``--budget-s``, the first at the whole. Each candidate is checked against a
per-expert torch matmul (a wrong or uncompilable one is dropped).

Timing: CUDA events over CUDA-graph replays, each graph one launch per layer over R layers'
weights (R so that R layers' active experts are at least three times the L2: the L2 is not
flushed, but no launch finds its weights there, as in a decode step). The bytes read are the
active experts' weights plus the activation rows, against the device read bandwidth measured
in the same run (a 4 GiB device-to-device copy, bytes read + written per second, as
benchmarks/bench_moe.py's pinned part counts it). One ``RESULT`` JSON line per (GEMM, batch),
and one per model for batch 1's two launches; ``--out`` writes the table the engine reads (a
point's ``table`` is the configuration that table launches there).

    python benchmarks/bench_moe_gemm.py --from-results RUN.jsonl --out TABLE   # no GPU: a table from a run's lines
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

from mempath.kernels.common import config_table_json, next_pow2  # noqa: E402
from mempath.kernels.moe_triton import (GroupedGemmConfig, _grouped_gemm, align_to_blocks,  # noqa: E402
                                        block_m_for, default_config, grouped_gemm_config)

CONFIGS = ROOT / "tests" / "data" / "configs"
# (experts, top_k, hidden, expert intermediate) of each model.
MODELS = {"qwen3-30b-a3b": ("qwen3-30b-a3b.json", "num_experts", "moe_intermediate_size"),
          "mixtral-8x7b": ("mixtral-8x7b-v0.1.json", "num_local_experts", "intermediate_size")}
# --tiny: Triton's interpreter on the CPU, in float16 (it multiplies bfloat16 tiles as raw bits).
TINY = {"tiny-a": (16, 4, 64, 48), "tiny-b": (8, 4, 32, 40)}
# (block_n, block_k, num_warps, num_stages) values the sweep combines, for 16-row and 64-row blocks.
DECODE_GRID = (16, 32, 64, 128), (32, 64, 128, 256), (2, 4, 8), (2, 3, 4, 5)
PREFILL_GRID = (32, 64, 128), (32, 64, 128), (4, 8), (2, 3, 4, 5)
TINY_GRID = (16, 64), (32, 64), (2, 4), (2, 3)


def model_shape(name: str) -> tuple[int, int, int, int]:
    file, experts_key, inter_key = MODELS[name]
    config = json.loads((CONFIGS / file).read_text())
    return config[experts_key], config["num_experts_per_tok"], config["hidden_size"], config[inter_key]


class Launch:
    """One layer's operands for one GEMM at one batch: weights, routed rows, the output."""

    def __init__(self, weights, tokens, top_k, gemm, dtype, device, gen):
        experts, n, k = weights.shape
        pairs = tokens * top_k
        self.weights, self.block_m, self.rows_per_a = weights, block_m_for(pairs), top_k if gemm == "gate_up" else 1
        ids = torch.rand(tokens, experts, generator=gen, device=device).topk(top_k, dim=-1).indices
        self.ids = ids.reshape(-1)
        self.pair_of_row, self.block_expert = align_to_blocks(ids, experts, self.block_m)
        rows = tokens if gemm == "gate_up" else pairs
        self.a = torch.randn(rows, k, generator=gen, device=device).to(dtype)
        self.router = torch.rand(pairs, generator=gen, device=device).to(dtype) if gemm == "down" else None
        self.out = torch.empty(pairs, n, dtype=dtype if gemm == "gate_up" else torch.float32, device=device)
        self.active = int(self.ids.unique().numel())
        self.bytes = (self.active * n * k + rows * k) * weights.element_size()

    def run(self, config: GroupedGemmConfig) -> None:
        _grouped_gemm(self.a, self.weights, self.out, self.pair_of_row, self.block_expert, self.block_m,
                      self.rows_per_a, self.router, config)

    def reference(self) -> torch.Tensor:
        """Each expert's pairs by a torch matmul in float32."""
        out = torch.empty(self.out.shape, dtype=torch.float32, device=self.out.device)
        rows = torch.arange(self.ids.numel(), device=self.ids.device) // self.rows_per_a
        for expert in self.ids.unique().tolist():
            pairs = (self.ids == expert).nonzero().flatten()
            part = self.a[rows[pairs]].float() @ self.weights[expert].float().t()
            out[pairs] = part * self.router[pairs, None].float() if self.router is not None else part
        return out


def fits(config: GroupedGemmConfig, n: int, k: int, block_m: int, smem: int) -> bool:
    """Whether a candidate is worth compiling: its pipeline fits in shared memory (16-bit tiles), it has
    no more stages than K steps nor more warps than MMA columns (m16n8 per warp), no tile wider than N or K."""
    steps = -(-k // config.block_k)
    return (config.num_stages * (block_m + config.block_n) * config.block_k * 2 <= smem
            and config.num_stages <= max(2, steps) and config.num_warps <= max(2, block_m * config.block_n // 128)
            and config.block_n <= max(16, 1 << (n - 1).bit_length())
            and config.block_k <= max(32, 1 << (k - 1).bit_length()))


def time_us(launches: list[Launch], config: GroupedGemmConfig, device: str) -> float:
    """Microseconds per launch: a graph of one launch per layer, replayed (CPU: one eager pass)."""
    if device == "cpu":
        start = time.perf_counter()
        for launch in launches:
            launch.run(config)
        return 1e6 * (time.perf_counter() - start) / len(launches)
    for launch in launches:  # eagerly first: anything left to compile or load happens outside the capture
        launch.run(config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch.run(config)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = min(50, max(3, int(2.0 / max(start.elapsed_time(end), 1e-3))))  # about 2 ms a sample
    samples = []
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(1e3 * start.elapsed_time(end) / (replays * len(launches)))
    del graph
    return sorted(samples)[1]


def check(launch: Launch, config: GroupedGemmConfig, expected: torch.Tensor) -> str | None:
    """None when the config compiles and gives the torch result (to bf16 rounding), else why not."""
    try:
        launch.out.fill_(float("nan"))
        launch.run(config)
        if launch.out.is_cuda:
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    err = (launch.out.float() - expected).abs().max().item()
    tol = 2e-2 * max(1.0, expected.abs().max().item())
    return None if err <= tol else f"max |error| {err:.3g} > {tol:.3g}"


class Sweep:
    """One GEMM (weights of R layers) at some batches sharing one block_m: candidates checked and timed."""

    def __init__(self, layers, batches, top_k, gemm, dtype, device, deadline, hard_deadline):
        gen = torch.Generator(device=device).manual_seed(len(batches) * 7 + top_k)
        self.points = {t: [Launch(w, t, top_k, gemm, dtype, device, gen) for w in layers] for t in batches}
        self.device, self.deadline, self.hard_deadline = device, deadline, hard_deadline
        self.times, self.dropped, self.skipped = {}, [], 0  # dropped: wrong or not compiled; skipped: no time
        first = self.points[max(batches)][0]
        self.n, self.k, self.block_m = first.weights.shape[1], first.weights.shape[2], first.block_m
        self.expected = first.reference()

    def trial(self, config: GroupedGemmConfig) -> None:
        if config in self.times or config in (c for c, _ in self.dropped):
            return
        error = check(self.points[max(self.points)][0], config, self.expected)
        if error:
            self.dropped.append((config, error))
            return
        self.times[config] = {t: time_us(launches, config, self.device) for t, launches in self.points.items()}

    def attempt(self, config: GroupedGemmConfig, deadline: float) -> None:
        if time.time() > deadline:
            self.skipped += 1
        else:
            self.trial(config)

    def ranked(self) -> list[GroupedGemmConfig]:
        return sorted(self.times, key=lambda c: sum(self.times[c].values()))

    def run(self, tiles_n, tiles_k, warps, stages, smem: int, keep: int = 2) -> GroupedGemmConfig:
        """Stage one: every tile at 4 warps (2 for 16 x 16) and 3 stages (2 for short K); stage two: warps x stages on the best ``keep``
        tiles, until this sweep's deadline (stage one until the run's). The default is always timed."""
        default = default_config(self.n, self.k)
        self.trial(default)
        for bn in tiles_n:
            for bk in tiles_k:
                first_stages = min(3, max(2, -(-self.k // bk)))
                config = GroupedGemmConfig(bn, bk, 4 if self.block_m * bn >= 512 else 2, first_stages)
                if fits(config, self.n, self.k, self.block_m, smem):
                    self.attempt(config, self.hard_deadline)
        for best in self.ranked()[:keep]:
            for w in warps:
                for s in stages:
                    config = GroupedGemmConfig(best.block_n, best.block_k, w, s)
                    if fits(config, self.n, self.k, self.block_m, smem):
                        self.attempt(config, self.deadline)
        return self.ranked()[0]


def expert_weights(experts, n, k, layers, dtype, device) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(n + k)
    return [(torch.randn(experts, n, k, generator=gen, device=device) * 0.05).to(dtype) for _ in range(layers)]


def layers_needed(bytes_per_launch: float, l2_bytes: int, device: str) -> int:
    return 1 if device == "cpu" else max(1, min(16, -(-3 * l2_bytes // max(1, int(bytes_per_launch)))))


def parse_config(text: str) -> GroupedGemmConfig:
    """``GroupedGemmConfig.describe``'s text back: "n64 k256 w4 s3"."""
    n, k, w, st = text.split()
    return GroupedGemmConfig(int(n[1:]), int(k[1:]), int(w[1:]), int(st[1:]))


def table_from_points(points: list[dict]) -> dict:
    """The engine's table from RESULT points: a decode point's (block_m 16) fastest configuration under
    its pairs bucket (of two points in a bucket, the one with more pairs), a prefill sweep's (block_m 64)
    configuration for every bucket. Other lines (batch-1 sums, other benches) are skipped."""
    table = {}
    for p in sorted((p for p in points if p.get("bench") == "moe_gemm" and "gemm" in p), key=lambda p: p["pairs"]):
        entries = table.setdefault(p["shape"], {})
        if p["block_m"] == 16:
            entries.setdefault("16", {})[str(next_pow2(p["pairs"]))] = parse_config(p["best_here"])
        else:
            entries[str(p["block_m"])] = parse_config(p["table"])
    return {shape: table[shape] for shape in sorted(table)}


def table_about(points: list[dict]) -> dict:
    """The table file's note of each shape's GEMM and model."""
    shapes = {}
    for p in points:
        if p.get("bench") == "moe_gemm" and "gemm" in p:
            shapes[p["shape"]] = f"{p['gemm']} ({p['model']})"
    return {shape: shapes[shape] for shape in sorted(shapes)}


def from_results(results: str, out: str | None, device_name: str | None) -> int:
    """--from-results: the table from an earlier run's RESULT lines, written to ``out``, no GPU."""
    points = [json.loads(line.split("RESULT ", 1)[1]) for line in Path(results).read_text().splitlines()
              if line.startswith("RESULT ")]
    table = table_from_points(points)
    if not table:
        print(f"bench_moe_gemm: {results} has no moe_gemm RESULT lines (bench_moe_gemm.py prints them): "
              "pass the output of a sweep")
        return 2
    text = config_table_json(table, device=device_name or "not recorded in the RESULT lines", dtype="bfloat16",
                               made_by=f"benchmarks/bench_moe_gemm.py --from-results {results}",
                               timing="CUDA events over CUDA-graph replays, weights rotated over layers (3x the L2)",
                               shapes=table_about(points))
    if out:
        Path(out).write_text(text)
        print(f"table written to {out}")
    else:
        print(text, end="")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--tokens", default="1,2,4,8", help="decode batches (16-row blocks)")
    parser.add_argument("--prefill-tokens", type=int, default=1024, help="0: no prefill point")
    parser.add_argument("--budget-s", type=float, default=170,
                        help="seconds: each shape's second stage stops at its share, the first stage at the whole")
    parser.add_argument("--out", help="write the best configurations here, the table the engine reads "
                                      "(e.g. mempath/assets/moe_gemm_configs.json)")
    parser.add_argument("--tiny", action="store_true", help="CPU, TRITON_INTERPRET=1: toy shapes, timings meaningless")
    parser.add_argument("--from-results", metavar="FILE",
                        help="no sweep: build the table from an earlier run's RESULT lines (to --out, else stdout)")
    parser.add_argument("--device-name", help="with --from-results: the device the run measured (the table's note)")
    args = parser.parse_args()
    if args.from_results:
        return from_results(args.from_results, args.out, args.device_name)
    started = time.time()
    if not args.tiny and not torch.cuda.is_available():
        print("bench_moe_gemm: no CUDA device; run `TRITON_INTERPRET=1 python benchmarks/bench_moe_gemm.py --tiny` "
              "to check the script on the CPU")
        return 0
    device, dtype = ("cpu", torch.float16) if args.tiny else ("cuda", torch.bfloat16)
    shapes = TINY if args.tiny else {name: model_shape(name) for name in args.models.split(",")}
    decode = [int(t) for t in args.tokens.split(",")] if not args.tiny else [1, 2]
    prefill = 300 if args.tiny and args.prefill_tokens else args.prefill_tokens
    if args.tiny:
        bandwidth, l2, smem, device_name = 1e9, 0, 1 << 20, "cpu (Triton's interpreter)"
        grids = {16: TINY_GRID, 64: TINY_GRID}
    else:
        from bench_engine import copy_bandwidth
        props = torch.cuda.get_device_properties(0)
        bandwidth, l2 = copy_bandwidth(), getattr(props, "L2_cache_size", 50 << 20)
        # Hopper's; where it is less, the candidates that do not fit fail to launch and are dropped.
        smem = getattr(props, "shared_memory_per_block_optin", 227 << 10)
        device_name = torch.cuda.get_device_name()
        grids = {16: DECODE_GRID, 64: PREFILL_GRID}
    print(f"{device_name}: read bandwidth {bandwidth / 1e12:.2f} TB/s (a device copy, read + written), "
          f"L2 {l2 >> 20} MiB, {dtype}; decode {decode}, prefill {prefill}")
    sweeps = [(model, gemm, batches) for model in shapes for gemm in ("gate_up", "down")
              for batches in ([decode] + ([[prefill]] if prefill else []))]
    table, results, batch1 = {}, [], {}
    for i, (model, gemm, batches) in enumerate(sweeps):
        experts, top_k, h, inter = shapes[model]
        n, k = (2 * inter, h) if gemm == "gate_up" else (h, inter)
        one_expert = n * k * 2
        layers = layers_needed(min(experts, min(batches) * top_k) * one_expert, l2, device)
        weights = expert_weights(experts, n, k, layers, dtype, device)
        deadline = started + args.budget_s * (i + 1) / len(sweeps)
        sweep = Sweep(weights, batches, top_k, gemm, dtype, device, deadline, started + args.budget_s)
        best = sweep.run(*grids[sweep.block_m], smem, keep=2 if sweep.block_m == 16 else 1)
        default = default_config(n, k)
        points = []
        for t, launches in sweep.points.items():
            nbytes = sum(launch.bytes for launch in launches) / len(launches)
            fastest = min(sweep.times, key=lambda c: sweep.times[c][t])
            points.append({"bench": "moe_gemm", "model": model, "gemm": gemm, "shape": f"{n}x{k}", "tokens": t,
                           "pairs": t * top_k, "block_m": sweep.block_m, "layers_rotated": layers,
                           "active_experts": sum(launch.active for launch in launches) / len(launches),
                           "bytes": nbytes, "best_here": fastest.describe(), "best_here_us": sweep.times[fastest][t],
                           "table": best.describe()})
        entries = table_from_points(points)[f"{n}x{k}"]
        table.setdefault(f"{n}x{k}", {}).update(entries)
        for point in points:
            t = point["tokens"]
            launched = grouped_gemm_config(n, k, point["pairs"], dtype, {f"{n}x{k}": entries})
            point.update(table=launched.describe(), table_us=sweep.times[launched][t], default=default.describe(),
                         default_us=sweep.times.get(default, {}).get(t, float("nan")))
            for key in ("best_here", "table", "default"):
                point[f"{key}_pct_of_read_bw"] = round(100 * point["bytes"] / (point[f"{key}_us"] * 1e-6) / bandwidth, 1)
            point.update(candidates=len(sweep.times), dropped=len(sweep.dropped), skipped_for_time=sweep.skipped)
            results.append(point)
            print("RESULT " + json.dumps(point), flush=True)
            if t == 1:
                batch1.setdefault(model, []).append(point)
        for config, why in sweep.dropped[:3]:
            print(f"  {model} {gemm} dropped {config.describe()}: {why}")
        del sweep, weights
        if device == "cuda":
            torch.cuda.empty_cache()
    print_summary(results, batch1, bandwidth)
    if args.out:
        Path(args.out).write_text(config_table_json(
            table, device=device_name, dtype=str(dtype).removeprefix("torch."),
            made_by=f"benchmarks/bench_moe_gemm.py --models {','.join(shapes)} --tokens {','.join(map(str, decode))} "
                    f"--prefill-tokens {prefill}{' --tiny' if args.tiny else ''}",
            timing="one eager pass (the interpreter)" if args.tiny else
            "CUDA events over CUDA-graph replays, weights rotated over layers (3x the L2)",
            shapes={f"{2 * s[3]}x{s[2]}": f"gate_up ({m})" for m, s in shapes.items()}
            | {f"{s[2]}x{s[3]}": f"down ({m})" for m, s in shapes.items()}))
        print(f"table written to {args.out}")
    print(f"{time.time() - started:.0f} s in all")
    return 0


def print_summary(results: list[dict], batch1: dict, bandwidth: float) -> None:
    """A table of the points, and batch 1's two launches per model against their read limit."""
    from bench_engine import print_table
    rows = [("model", "gemm", "tokens", "block_m", "MB read", "table", "us", "% of read bw", "default us",
             "% (default)", "best here", "us")]
    for p in results:
        rows.append((p["model"], p["gemm"], p["tokens"], p["block_m"], f"{p['bytes'] / 1e6:.1f}", p["table"],
                     f"{p['table_us']:.1f}", p["table_pct_of_read_bw"], f"{p['default_us']:.1f}",
                     p["default_pct_of_read_bw"], p["best_here"], f"{p['best_here_us']:.1f}"))
    print_table(rows)
    for model, points in batch1.items():
        nbytes = sum(p["bytes"] for p in points)
        line = {"bench": "moe_gemm", "model": model, "batch1_experts": True, "bytes": nbytes,
                "read_limit_us": 1e6 * nbytes / bandwidth, "table_us": sum(p["table_us"] for p in points),
                "default_us": sum(p["default_us"] for p in points)}
        line["table_pct_of_read_bw"] = round(100 * line["read_limit_us"] / line["table_us"], 1)
        line["default_pct_of_read_bw"] = round(100 * line["read_limit_us"] / line["default_us"], 1)
        print("RESULT " + json.dumps(line))


if __name__ == "__main__":
    sys.exit(main())
