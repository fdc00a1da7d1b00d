"""How fast a weight streams with almost no compute, by the width of a tile's rows (#20, #17).

    python benchmarks/bench_gemv_stream_probe.py        # CUDA (Hopper: TMA)

The bound for a one-row GEMV under bench_fp8_gemv.py's default timer (a CUDA graph of calls, each after an
L2-flushing write, less the writes): each Llama-3.1-8B fp8 projection's bytes, viewed as int32 words, summed a
row at a time by a TMA-pipelined kernel (a quarter of an instruction a byte) and by plain loads, over tiles
whose rows are 128 B to 1 KB wide. Against bench_gemv_tma.py's GEMV on the same bytes it tells whether the
GEMV is held back by its product or by the stream (BENCHMARKS.md, "The one-row GEMV's timers"). Prints lines.
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

import bench_fp8_gemv as bench  # noqa: E402


@triton.jit
def _stream_kernel(w_desc, out_ptr, K_WORDS, k_per_split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K_WORDS)
    acc = tl.zeros([BLOCK_N], dtype=tl.int32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([n0, k0])
        acc += tl.sum(w, axis=1)
    tl.atomic_add(out_ptr + n0 + tl.arange(0, BLOCK_N), acc, sem="relaxed")


@triton.jit
def _plain_kernel(w_ptr, out_ptr, K_WORDS, k_per_split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K_WORDS)
    acc = tl.zeros([BLOCK_N], dtype=tl.int32)
    for k0 in range(k_start, k_end, BLOCK_K):
        w = tl.load(w_ptr + rows[:, None] * K_WORDS + k0 + tl.arange(0, BLOCK_K)[None, :])
        acc += tl.sum(w, axis=1)
    tl.atomic_add(out_ptr + rows, acc, sem="relaxed")


def timed(best: list, name: str, fn) -> None:
    """Append (µs, name) of ``fn`` to ``best``; a launch that fails is printed and left out."""
    try:
        fn()
        best.append((bench.time_us(fn), name))
    except Exception as error:  # noqa: BLE001 - a tile that does not compile is dropped
        print(f"  {name}: {type(error).__name__} {str(error)[:100]}")


def main():
    out_rows = []
    for n, k in ((28672, 4096), (4096, 14336), (6144, 4096)):
        w = torch.randint(-2**31, 2**31 - 1, (n, k // 4), dtype=torch.int32, device="cuda")  # fp8 bytes as words
        nbytes = w.numel() * 4
        out = torch.zeros(n, dtype=torch.int32, device="cuda")
        best = []
        for bn, bk in ((32, 64), (16, 256), (32, 256), (8, 256), (64, 64), (16, 128), (64, 32)):
            kw = k // 4
            for split in (1, 2, 4):
                if kw % (bk * split):
                    continue
                for stages in (3, 4, 6):
                    desc = TensorDescriptor.from_tensor(w, [bn, bk])
                    timed(best, f"tma n{bn} row{bk * 4}B split{split} s{stages} w4",
                          lambda: _stream_kernel[(n // bn, split)](desc, out, kw, kw // split, BLOCK_N=bn, BLOCK_K=bk,
                                                                   STAGES=stages, num_warps=4))
                if split == 1:
                    for warps in (4, 8):
                        timed(best, f"plain n{bn} row{bk * 4}B w{warps}",
                              lambda: _plain_kernel[(n // bn, 1)](w, out, kw, kw, BLOCK_N=bn, BLOCK_K=bk,
                                                                  num_warps=warps))
        best.sort()
        print(f"{n}x{k} fp8 bytes {nbytes / 1e6:.1f} MB: " + "; ".join(f"{d} {t:.1f} us ({nbytes / t / 1e3:.0f} GB/s)"
                                                                   for t, d in best[:6]))
        by_row = {}
        for t, d in best:
            row = d.split()[2]
            by_row.setdefault(row, (t, d))
        print("   best by row width: " + "; ".join(f"{r}: {t:.1f} us ({nbytes / t / 1e3:.0f} GB/s)" for r, (t, d) in sorted(by_row.items())))
        out_rows.append(best[:6])
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = bench.time_us(lambda: dst.copy_(src))
    print(f"copy (read + write) {2 * src.numel() / us / 1e3:.0f} GB/s; read-only sum {src.numel() / bench.time_us(lambda: src.view(torch.int32).sum()) / 1e3:.0f} GB/s")


if __name__ == "__main__":
    main()
