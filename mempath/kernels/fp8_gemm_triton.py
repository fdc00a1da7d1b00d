"""The fp8 GEMM: a per-token quantized input times a float8_e4m3fn weight, both with row-wise scales.

Above the GEMV's batches an fp8 projection multiplies an ``Fp8Activation`` (values e4m3 [rows, K],
one float32 scale a row) by its weight (e4m3 [N, K] row-major, one float32 scale an output channel)
on Hopper's fp8 tensor cores. ``torch._scaled_mm`` does that with a library kernel whose tile does
not follow the batch; this kernel does the same arithmetic (the fp8 products summed in float32,
times the row's scale and the channel's, plus the bias, rounded once to the model dtype) with the
tiles a measured table gives each projection shape and batch bucket
(``mempath/assets/fp8_gemm_configs.json``, written by ``benchmarks/bench_fp8_gemm.py``). A bucket
the table does not list runs ``_scaled_mm``: the kernel runs only where it measured faster.
Its PyTorch twin is ``mempath.model.quant.fp8_linear_quantized_torch``.

Two tile orders: a wide batch tiles the rows by BLOCK_M (the tensor cores' M, at least 64 rows);
a batch of a few dozen rows is better multiplied swapped (``swap_ab``): the weight's channels take
the tensor cores' M and the rows their N (as few as 16), so no tile is mostly padding. (K split
over programs, their float32 sums meeting in the GEMV's workspace, measured slower at 32 rows on every
Llama-3.1-8B projection: BENCHMARKS.md, "The fp8 GEMM".)
"""
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mempath.kernels.common import HAS_TRITON, load_config_table, next_pow2, pdl_options, table_path

if HAS_TRITON:
    import triton
    import triton.language as tl

    from mempath.kernels.common import pdl_wait

DEFAULT_TABLE = Path(__file__).resolve().parents[1] / "assets" / "fp8_gemm_configs.json"
TABLE_ENV = "MEMPATH_FP8_GEMM_CONFIGS"  # another table's path, e.g. one just swept
# The largest bucket a table keys: batches above it take the largest bucket's entry.
MAX_BUCKET = 8192
# K summed on the fp8 tensor cores between additions to the float32 accumulator, at most (_scaled_mm's interval).
PROMOTE_K = 128


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the fp8 GEMM (tile sizes in the output's rows and channels)."""
    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8  # row tiles that walk the channel tiles together, so weight tiles are reused from L2
    swap_ab: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"fp8 GEMM config: {name} must be a power of two >= 16, got {value}")
        if self.group_m < 1:
            raise ValueError(f"fp8 GEMM config: group_m must be >= 1, got {self.group_m}")
        if self.num_warps not in (4, 8):
            raise ValueError(f"fp8 GEMM config: num_warps must be 4 or 8, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"fp8 GEMM config: num_stages must be 1-8, got {self.num_stages}")

    def describe(self) -> str:
        order = "swap " if self.swap_ab else ""
        return (f"gemm {order}m{self.block_m} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}"
                f" g{self.group_m}")


def row_bucket(rows: int) -> int:
    """The batch bucket a row count is configured by: the next power of two, at most MAX_BUCKET."""
    return min(next_pow2(rows), MAX_BUCKET)


def load_table(path: str | os.PathLike | None = None) -> dict[str, dict[str, GemmConfig]]:
    """{"NxK": {bucket: GemmConfig}} from a table file (``TABLE_ENV`` or the shipped one by default)."""
    path = table_path(path, TABLE_ENV, DEFAULT_TABLE, "benchmarks/bench_fp8_gemm.py")
    table = load_config_table(path, GemmConfig, "bucket", "benchmarks/bench_fp8_gemm.py --out FILE")
    for shape, buckets in table.items():
        for bucket in buckets:
            if not bucket.isdigit() or row_bucket(int(bucket)) != int(bucket):
                raise ValueError(f"{path}: {shape} bucket {bucket!r} is no batch bucket (a power of two up to "
                                 f"{MAX_BUCKET}), so no batch would use it: rewrite the table with "
                                 f"benchmarks/bench_fp8_gemm.py --out FILE")
    return table


if HAS_TRITON:

    @triton.jit
    def _store_scaled(acc, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_om,
                      HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr):
        """out[m, n] = acc · x_scale[m] · w_scale[n] (+ bias[n]), in out's dtype; ``acc`` is [n, m] when swapped."""
        x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)
        w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
        if SWAP_AB:
            y = acc * x_scale[None, :] * w_scale[:, None]
            if HAS_BIAS:
                y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
            tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])
        else:
            y = acc * x_scale[:, None] * w_scale[None, :]
            if HAS_BIAS:
                y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
            tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit(do_not_specialize=["M"])
    def _fp8_gemm_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                         stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr,
                         PROMOTE_K: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        pdl_wait(PDL)
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            # Hopper's warpgroup fp8 products sum in less than float32: every PROMOTE_K of K the sums are
            # added to the float32 accumulator (max_num_imprecise_acc), as _scaled_mm's default does every 128.
            if SWAP_AB:  # [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M]: the channels are the tensor cores' M
                acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE_K)
            else:
                acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE_K)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        _store_scaled(acc, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_om,
                      HAS_BIAS, SWAP_AB)


def triton_fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, dtype: torch.dtype, config: GemmConfig) -> torch.Tensor:
    """``xq`` [rows, K] float8_e4m3fn with ``x_scale`` [rows, 1] float32, times ``weight`` [N, K]
    float8_e4m3fn with ``weight_scale`` [N, 1] float32, plus ``bias``: [rows, N] in ``dtype``.
    Allocates only the output; nothing is read back to the host, so CUDA graphs capture it."""
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    rows, k = xq.shape
    n = weight.shape[0]
    # The kernel reads a scale a row and a weight row's K contiguously.
    x_scale, weight_scale = x_scale.reshape(rows).contiguous(), weight_scale.reshape(n).contiguous()
    if weight.stride(1) != 1:
        raise ValueError(f"fp8 GEMM: the weight must be row-major [out, in] (stride {tuple(weight.stride())}): "
                         f"pass weight.contiguous()")
    out = torch.empty(rows, n, dtype=dtype, device=xq.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, config.block_m) * triton.cdiv(n, config.block_n),)
    _fp8_gemm_kernel[grid](xq, x_scale, weight, weight_scale, bias if bias is not None else weight_scale, out,
                           rows, n, k, xq.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                           BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                           GROUP_M=config.group_m, SWAP_AB=config.swap_ab,
                           PROMOTE_K=min(config.block_k, PROMOTE_K), **pdl_options(xq.device),
                           num_warps=config.num_warps, num_stages=config.num_stages)
    return out


class Fp8Gemm:
    """The table's choice per projection shape and batch bucket: a GemmConfig, or None where the
    table lists none (``torch._scaled_mm`` runs the bucket), and the launch. ``chosen`` records what ran."""

    def __init__(self, table: dict | None = None):
        self.table = load_table() if table is None else table
        self.chosen: dict[str, str] = {}
        self._configs: dict[tuple[int, int, int], GemmConfig | None] = {}

    def config(self, n: int, k: int, rows: int) -> GemmConfig | None:
        bucket = row_bucket(rows)
        key = (n, k, bucket)
        if key not in self._configs:
            config = self.table.get(f"{n}x{k}", {}).get(str(bucket))
            self._configs[key] = config
            self.chosen[f"{n}x{k} rows<={bucket}"] = config.describe() if config else "_scaled_mm"
        return self._configs[key]

    def __call__(self, xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype, config: GemmConfig) -> torch.Tensor:
        return triton_fp8_gemm(xq, x_scale, weight, weight_scale, bias, dtype, config)
