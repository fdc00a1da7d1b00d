"""Linear layers at decode batch sizes (≤ 8 rows): a Triton kernel where it beats cuBLAS.

At batch 1 a linear layer reads its whole weight matrix to produce one row, so
its speed is the bandwidth at which it streams the weights. On the H200 cuBLAS
streams large matrices at ~4.1 TB/s but Llama-8B's qkv (50 MB) and o_proj
(34 MB) at only ~3.1 TB/s, and it adds a split-K reduction kernel to o_proj and
down_proj. The kernel here gives each program a slice of output columns and the
whole K reduction (no split-K, so no second kernel and a fixed summation order),
multiplying a 16-row tile of the input (padded) with tensor cores, and keeps
several weight tiles in flight.

Which kernel runs for which matrix shape is measured, not assumed: at start-up
:func:`choose_kernels` times cuBLAS and each candidate tile configuration on the
model's own weights (cycling through every layer's matrix of that shape, so the
50 MB L2 cache does not flatter either side) and records the winner per
(N, K, dtype). ``F.linear`` is this kernel's oracle; float32 weights always use
cuBLAS (the kernel's tensor-core products would round them to TF32).
"""
import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    HAS_TRITON = False

log = logging.getLogger(__name__)

# Rows (tokens) up to which the kernel may replace cuBLAS: the decode CUDA-graph
# buckets 1, 2, 4, 8. Its 16-row tile is mostly padding there, which costs nothing
# in a kernel bound by reading the weights.
MAX_ROWS = 8
_BLOCK_M = 16


class TileConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


CANDIDATES = (
    TileConfig(16, 256, 4, 4),
    TileConfig(16, 512, 4, 3),
    TileConfig(32, 256, 4, 4),
    TileConfig(32, 128, 4, 6),
    TileConfig(64, 128, 4, 4),
)

# False: choose_kernels keeps cuBLAS everywhere (A/B measurements).
ENABLED = True
# (N, K, dtype) -> the config chosen for rows <= MAX_ROWS; absent: cuBLAS.
CHOSEN: dict[tuple, TileConfig] = {}


if HAS_TRITON:

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                       HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        row_mask = rm < M
        col_mask = rn < N
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
        # The weight tile is read as [BLOCK_K, BLOCK_N]: column n of it is row n of W.
        w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=col_mask[None, :], other=0.0)
            else:
                k_mask = rk < K - k * BLOCK_K
                x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=col_mask[None, :] & k_mask[:, None], other=0.0)
            acc = tl.dot(x, w, acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  config: TileConfig) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most ``MAX_ROWS`` rows of x."""
    n, k = weight.shape
    rows = x.numel() // k
    if rows > MAX_ROWS:
        raise ValueError(f"triton_linear takes at most {MAX_ROWS} rows, got {rows}")
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    assert weight.stride(-1) == 1
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    out2 = out.view(rows, n)
    _linear_kernel[(triton.cdiv(n, config.block_n),)](
        x2, weight, bias if bias is not None else weight, out2, rows, n, k,
        x2.stride(0), weight.stride(0), out2.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0,
        BLOCK_M=_BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def kernel_for(x: torch.Tensor, weight: torch.Tensor) -> TileConfig | None:
    """The chosen config when the Triton kernel should run this product, else None."""
    if not CHOSEN or not x.is_cuda or x.numel() > MAX_ROWS * weight.shape[1]:
        return None
    return CHOSEN.get((weight.shape[0], weight.shape[1], weight.dtype))


def _time_per_pass(fn, weights: list, x: torch.Tensor, reps: int = 5) -> float:
    """Seconds for one call, averaged over passes through every weight of the shape."""
    for w in weights[:2]:
        fn(x, w)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        for w in weights:
            fn(x, w)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * len(weights))


def choose_kernels(model: torch.nn.Module, candidates=CANDIDATES) -> dict:
    """Time cuBLAS and each candidate on the model's linear weights; fill ``CHOSEN``.

    Returns {(N, K): (cuBLAS µs, best Triton µs, chosen config or None)} for the log.
    A candidate must beat cuBLAS at 1 row and at ``MAX_ROWS`` rows to be chosen.
    """
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    if not (ENABLED and HAS_TRITON):
        return {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.is_cuda:
            w = module.weight
            if w.dtype in (torch.bfloat16, torch.float16) and w.stride(-1) == 1:
                by_shape.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(w)
    report = {}
    for key, weights in by_shape.items():
        CHOSEN.pop(key, None)
        n, k, dtype = key
        timings = {}
        for rows in (1, MAX_ROWS):
            x = torch.randn(rows, k, device=weights[0].device, dtype=dtype)
            timings[("cublas", rows)] = _time_per_pass(lambda a, w: F.linear(a, w), weights, x)
            for cfg in candidates:
                timings[(cfg, rows)] = _time_per_pass(lambda a, w, c=cfg: triton_linear(a, w, None, c), weights, x)
        best = min(candidates, key=lambda c: timings[(c, 1)] + timings[(c, MAX_ROWS)])
        wins = all(timings[(best, r)] < timings[("cublas", r)] for r in (1, MAX_ROWS))
        if wins:
            CHOSEN[key] = best
        report[(n, k)] = (1e6 * timings[("cublas", 1)], 1e6 * timings[(best, 1)], best if wins else None)
        log.info("linear %dx%d at 1 row: cuBLAS %.1f µs (%.2f TB/s), Triton %s %.1f µs (%.2f TB/s) -> %s",
                 n, k, 1e6 * timings[("cublas", 1)], n * k * dtype.itemsize / timings[("cublas", 1)] / 1e12,
                 tuple(best), 1e6 * timings[(best, 1)], n * k * dtype.itemsize / timings[(best, 1)] / 1e12,
                 "Triton" if wins else "cuBLAS")
    return report
