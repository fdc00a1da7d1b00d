"""Does an L2 prefetch in a decode step's memory-idle gaps make the next projection faster? (#17, #20)

    python benchmarks/bench_l2_prefetch.py --layers 16      # CUDA

A batch-1 decode layer is four weight reads (q/k/v, o, gate/up, down) with gaps between them in
which the memory bus idles: rotary + KV write and attention before o, a norm before gate/up, SiLU
before down, a norm before the next layer's q/k/v. This chain is those four projections of the
Llama-3.1-8B shape, each layer with its own weights (together far past the L2), and the gaps as
spin kernels (``torch.cuda._sleep``) of ``--attention-us`` and ``--gap-us``, in one CUDA graph.
Variants prefetch the next projection's first bytes (the kernel below) when a
projection ends: on the step's stream (it then delays the gap's kernel by its own run) or on a
side stream forked there (joined once, at the end). The projections run as the engine runs them at
one row: the dense table's GEMV where it lists the shape (else F.linear), or with ``--dtypes fp8``
the fp8 GEMV's table. Prints a table and one ``RESULT`` JSON line.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mempath.kernels.common import pdl_options, pdl_wait  # noqa: E402
from mempath.kernels.fp8_gemv_triton import Fp8Gemv, load_dense_table  # noqa: E402
from mempath.model.quant import quantize_rows  # noqa: E402

# The prefetch: a hint, ``prefetch.global.L2`` one 128-byte line per lane (``policy`` evict_last: with
# that eviction priority), or Hopper's ``cp.async.bulk.prefetch.L2`` of BULK_BYTES per lane (``bulk``).
# It reads into no register and writes nothing. It stays here, not in mempath.kernels: it measured no
# faster (BENCHMARKS.md, "An L2 prefetch in the decode step's gaps").
LINE_BYTES = 128  # one L2 cache line
LINES_PER_PROGRAM = 512  # 64 KiB a program
BULK_BYTES = 4096  # one cp.async.bulk prefetch a lane (the kernel's instruction spells it)


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, LINES: tl.constexpr, LINE: tl.constexpr, BULK: tl.constexpr,
                        POLICY: tl.constexpr, PDL: tl.constexpr):
    # Weights are never written by a step, but a kernel launched with PDL must wait before it
    # ends, or the kernel after it would not wait for the one before (kernels.common.use_pdl).
    pdl_wait(PDL)
    offs = (tl.program_id(0).to(tl.int64) * LINES + tl.arange(0, LINES)) * LINE
    offs = tl.minimum(offs, nbytes - LINE)  # the tail's lanes prefetch the last line again
    if BULK:
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 4096;\n\tmov.u32 $0, 0;",
                                  "=r,l", [ptr + offs], dtype=tl.int32, is_pure=False, pack=1)
    elif POLICY == "evict_last":
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [ptr + offs], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [ptr + offs], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(weight: torch.Tensor, nbytes: int | None = None, bulk: bool = False, policy: str = "normal",
                num_warps: int = 4) -> None:
    """Prefetch the first ``nbytes`` (default all) of a contiguous CUDA tensor into L2."""
    if policy not in ("normal", "evict_last"):
        raise ValueError(f"l2_prefetch: policy must be normal or evict_last, got {policy!r}")
    total = weight.numel() * weight.element_size()
    line = BULK_BYTES if bulk else LINE_BYTES
    nbytes = total if nbytes is None else min(int(nbytes), total)
    nbytes -= nbytes % line
    if nbytes <= 0:
        return
    raw = weight.detach().reshape(-1).view(torch.uint8)
    lines = 32 * num_warps if bulk else LINES_PER_PROGRAM  # a bulk prefetch a lane; lines several a lane
    grid = (triton.cdiv(nbytes // line, lines),)
    _l2_prefetch_kernel[grid](raw, nbytes, LINES=lines, LINE=line, BULK=bulk, POLICY=policy,
                              **pdl_options(weight.device), num_warps=num_warps)


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ORDER = ["qkv", "o", "gate_up", "down"]


def sleep_cycles_per_us() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    torch.cuda.synchronize()
    return 1_000_000 / (start.elapsed_time(end) * 1000)


class Layers:
    def __init__(self, dtype: str, layers: int):
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.fp8 = dtype == "fp8"
        self.w, self.scale = [], []
        for _ in range(layers + 1):  # one more q/k/v: the last layer prefetches the next one's
            ws, ss = {}, {}
            for name, (n, k) in SHAPES.items():
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                if self.fp8:
                    w, s = quantize_rows(w)
                    ss[name] = s
                ws[name] = w
            self.w.append(ws)
            self.scale.append(ss)
        if self.fp8:
            self.gemv = Fp8Gemv(28672, torch.device("cuda"))
        else:
            self.gemv = Fp8Gemv(28672, torch.device("cuda"), table=load_dense_table())
        self.x = {name: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for name, (n, k) in SHAPES.items()}

    def project(self, layer: int, name: str):
        w = self.w[layer][name]
        n, k = SHAPES[name]
        if self.fp8:
            return self.gemv(self.x[name], w, self.scale[layer][name], None, self.gemv.config(n, k, 1))
        config = self.gemv.tabled_config(n, k, 1)
        if config is None:
            return F.linear(self.x[name], w)
        return self.gemv(self.x[name], w, None, None, config)

    def describe(self) -> dict:
        return dict(self.gemv.chosen)


def build(layers: Layers, count: int, variant: dict, gaps_cycles: dict, side: torch.cuda.Stream):
    """The chain's graph for one variant: {"where": none|main|side, "cap": bytes, "bulk", "policy"}."""
    main = torch.cuda.current_stream()
    forked = False
    for layer in range(count):
        for i, name in enumerate(ORDER):
            if variant.get("skip_gemv") is None:
                layers.project(layer, name)
            nxt_layer, nxt = (layer, ORDER[i + 1]) if i + 1 < len(ORDER) else (layer + 1, ORDER[0])
            weight = layers.w[nxt_layer][nxt]
            if variant["where"] != "none" and nxt in variant.get("targets", ORDER):
                cap = variant["cap"]
                if variant["where"] == "side":
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        l2_prefetch(weight, cap, bulk=variant.get("bulk", False), policy=variant.get("policy", "normal"))
                    forked = True
                else:
                    l2_prefetch(weight, cap, bulk=variant.get("bulk", False), policy=variant.get("policy", "normal"))
            torch.cuda._sleep(gaps_cycles["attention" if name == "qkv" else "gap"])
    if forked:
        main.wait_stream(side)


def time_graph(fn, repeats: int = 5, replays: int = 20) -> float:
    """Median ms of one run of ``fn`` captured in a CUDA graph."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--attention-us", default="6", help="comma-separated gap before o_proj, µs")
    parser.add_argument("--gap-us", type=float, default=1.5, help="the other gaps (norms, SiLU), µs")
    parser.add_argument("--caps-mb", default="8,16,32,64", help="bytes prefetched per projection, MB")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_l2_prefetch needs CUDA")
    cycles = sleep_cycles_per_us()
    side = torch.cuda.Stream()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, L2 {getattr(props, 'L2_cache_size', 0) / 2**20:.0f} MiB, sleep {cycles:.0f} cycles/µs")
    results = []
    for dtype in args.dtypes.split(","):
        layers = Layers(dtype, args.layers)
        weight_bytes = sum(layers.w[0][n].numel() * layers.w[0][n].element_size() for n in ORDER)
        for attention_us in (float(a) for a in args.attention_us.split(",")):
            gaps = {"attention": int(attention_us * cycles), "gap": int(args.gap_us * cycles)}
            variants = [{"name": "gaps only", "where": "none", "skip_gemv": True},
                        {"name": "no prefetch", "where": "none"}]
            for cap in (int(float(c) * 2**20) for c in args.caps_mb.split(",")):
                mb = cap // 2**20
                variants += [{"name": f"side {mb} MB", "where": "side", "cap": cap},
                             {"name": f"main {mb} MB", "where": "main", "cap": cap},
                             {"name": f"side {mb} MB o only", "where": "side", "cap": cap, "targets": ["o"]},
                             {"name": f"side {mb} MB evict_last", "where": "side", "cap": cap, "policy": "evict_last"},
                             {"name": f"side {mb} MB bulk", "where": "side", "cap": cap, "bulk": True}]
            base = None
            print(f"\n{dtype}, attention gap {attention_us} µs, other gaps {args.gap_us} µs, "
                  f"{weight_bytes / 1e6:.0f} MB of weights a layer; {layers.describe()}")
            print(f"{'variant':28} {'µs/layer':>9} {'vs none':>8}")
            for v in variants:
                ms = time_graph(lambda: build(layers, args.layers, v, gaps, side))
                per_layer = ms * 1000 / args.layers
                if v["name"] == "no prefetch":
                    base = per_layer
                rel = f"{per_layer - base:+.1f}" if base is not None and v["name"] != "no prefetch" else ""
                print(f"{v['name']:28} {per_layer:9.1f} {rel:>8}")
                results.append({"dtype": dtype, "attention_us": attention_us, "gap_us": args.gap_us,
                                "variant": v["name"], "us_per_layer": round(per_layer, 2),
                                "weight_bytes_per_layer": weight_bytes})
        del layers
        torch.cuda.empty_cache()
    print("RESULT " + json.dumps({"bench": "l2_prefetch", "device": props.name, "layers": args.layers,
                                  "results": results}))


if __name__ == "__main__":
    main()
