"""The fp8 GEMV: a small batch times a float8_e4m3fn weight with per-output-channel scales.

At decode batches (at most ``GEMV_MAX_ROWS`` rows) a linear layer is a read of its weight:
``torch._scaled_mm`` plus the per-token quantization of its input cost more than the halved
read saves (BENCHMARKS.md, "fp8 weights"). Two of this kernel's products leave the activations
in the model dtype (weight-only): each program loads an fp8 tile [BLOCK_N, BLOCK_K] of the
weight (stored as the loader stores it: row-major [out, in], one row per output channel),
converts it and multiplies it with the rows of x, accumulating in float32, and applies the
channel's scale (and the bias) once at the end. Its PyTorch twin is ``mempath.model.quant.fp8_gemv_torch``.

The same kernel takes a 16-bit weight without scales (``weight_scale`` None; twin ``F.linear``):
the dense GEMV of bf16/fp16 models at decode batches (``mempath.model.quant.set_dense_gemv``),
where the table measured it faster than cuBLAS, e.g. loading its first weight tiles before the
PDL wait (``prefetch``), which a library kernel cannot (BENCHMARKS.md, "the dense GEMV").

Three products and a way to load: ``USE_DOT`` multiplies on the tensor cores (the weight tile converted to x's
dtype, exact for e4m3 in bf16 and fp16, times x transposed, at least 16 rows padded); with
``QUANT_X`` too, x is quantized to e4m3 in groups of ``QUANT_X_GROUP`` along K (each row's
group its own scale, DeepSeek-V3's 1 x 128 activation tiles) and the fp8 weight tile goes to
the fp8 tensor cores as it was loaded: no per-element conversion of the weight (measured on
the H200: slower at one row, faster at 9-16; BENCHMARKS.md). The third way multiplies and adds
in float32 registers (better at one or two rows than the bf16 tensor cores). At one row that way
accumulates a [BLOCK_N, BLOCK_K] float32 tile and sums it over K after the loop;
``GemvConfig.sum_k_each_step`` instead sums each step's product over K at once (row by row), so
the accumulator is [rows, BLOCK_N] and fewer registers per thread may let more programs share an
SM: an option of the sweep, off in the shipped table until an H200 sweep measures it.
``GemvConfig.tma`` (one row, Hopper): the same multiply-adds summed each step, but each weight tile
reaches shared memory by a TMA copy, ``num_stages`` in flight a program, where the other products'
loads go to registers, one tile at a time (``_fp8_gemv_tma_kernel``; ``tma_fits`` says where it runs,
elsewhere the tiles take the registers' product).

The K dimension can be split over ``split_k`` programs per tile of N so that a 4096 x 4096
layer still fills every SM; the splits' float32 partial sums meet in a workspace allocated
once per model (:class:`GemvWorkspace`, ``memory.formulas.fp8_gemv_workspace_bytes``), either

- atomically ("atomic"): each split writes its partials into its own slice of the workspace, then
  counts itself in on the tile's counter; the last to arrive adds the slices up in split order,
  zeroes them and the counter for the next call, and writes the output: one launch; or
- in two passes: each split stores its partials in its own slice, a second kernel sums them.

Both add the splits in the same order, so a call gives the same bits every run (until 2026-12-06
the atomic way added each split into one sum as it arrived, and a greedy decode could differ from
run to run).

Nothing is allocated but the output, and nothing is read back to the host, so CUDA graphs
capture it. Block sizes, the split, warps and stages are arguments (:class:`GemvConfig`); the
best per layer shape and batch bucket are read from a JSON table
(``mempath/assets/fp8_gemv_configs.json``, written by benchmarks/bench_fp8_gemv.py), with a
heuristic for shapes it does not list.
"""
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mempath.constants import FP8_MAX, MIN_SCALE
from mempath.kernels.common import HAS_TRITON, interpreted, load_config_table, next_pow2, pdl_options, table_path
from mempath.kernels.common import config_table_json as table_json  # noqa: F401 - the fp8 table's writer
from mempath.memory.formulas import FP8_GEMV_MIN_BLOCK_N, FP8_GEMV_WORKSPACE_ROWS, fp8_gemv_workspace_bytes

TensorDescriptor = None  # triton's host-side TMA descriptor (3.3 and later); without it no tma configuration runs
if HAS_TRITON:
    import triton
    import triton.language as tl

    from mempath.kernels.common import pdl_wait
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        pass

# Batches up to this many rows run the GEMV (when the table does not send a bucket to
# _scaled_mm); larger ones run Hopper's fp8 matmul with quantized activations.
GEMV_MAX_ROWS = 16
DEFAULT_TABLE = Path(__file__).resolve().parents[1] / "assets" / "fp8_gemv_configs.json"
TABLE_ENV = "MEMPATH_FP8_GEMV_CONFIGS"  # another table's path, e.g. one just swept
# The 16-bit weights' table (mempath.model.quant.set_dense_gemv): only shapes and buckets where the GEMV
# measured faster than cuBLAS (benchmarks/bench_dense_gemv.py); no heuristic for the others.
DENSE_TABLE = DEFAULT_TABLE.with_name("dense_gemv_configs.json")
DENSE_TABLE_ENV = "MEMPATH_DENSE_GEMV_CONFIGS"
# tl.dot needs at least 16 rows on each side.
DOT_MIN_ROWS = 16
# quantize_x: the K width of one activation scale, and so the configuration's block_k.
QUANT_X_GROUP = 128
# A TMA copy's box: at most this many elements along each side.
TMA_MAX_BOX = 256


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration. ``kernel`` "scaled_mm" sends the bucket to torch._scaled_mm; "gemm" to the fp8
    GEMM where its table lists the bucket, else to this kernel with the entry's tile (model.quant.gemv_table_for)."""
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = False
    reduce: str = "atomic"  # or "two_pass"
    prefetch: bool = False  # the next weight tile loaded during the current one's product
    # Multiply-adds only: each K step's product summed over K at once, so the accumulator is
    # [rows, BLOCK_N] rather than a [BLOCK_N, BLOCK_K] tile: fewer registers, which may fit more
    # programs per SM (the sweep decides).
    sum_k_each_step: bool = False
    # The tensor cores in fp8: x quantized per row in groups of QUANT_X_GROUP (= block_k) along K.
    quantize_x: bool = False
    # One row only: each weight tile reaches shared memory by a TMA copy, pipelined num_stages deep (the loads of
    # the other products go to registers, one tile in flight a program); multiply-adds summed over K each step.
    tma: bool = False
    kernel: str = "gemv"

    def __post_init__(self):
        if self.kernel not in ("gemv", "scaled_mm", "gemm") or self.reduce not in ("atomic", "two_pass"):
            raise ValueError(f"fp8 GEMV config: kernel must be gemv, scaled_mm or gemm and reduce atomic or two_pass, "
                             f"got {self.kernel!r}, {self.reduce!r}")
        if self.block_n < FP8_GEMV_MIN_BLOCK_N or self.block_n & (self.block_n - 1) or self.block_k < 16 \
                or self.block_k & (self.block_k - 1) or self.split_k < 1:
            raise ValueError(f"fp8 GEMV config: block_n (>= {FP8_GEMV_MIN_BLOCK_N}) and block_k (>= 16) must be "
                             f"powers of two and split_k >= 1, got {self}")
        if self.use_dot and self.sum_k_each_step:
            raise ValueError("fp8 GEMV config: sum_k_each_step is for the multiply-add product: "
                             "set use_dot or sum_k_each_step false")
        if self.tma and (self.use_dot or self.quantize_x or self.prefetch or self.sum_k_each_step
                         or self.reduce != "atomic" or self.block_n > TMA_MAX_BOX or self.block_k > TMA_MAX_BOX):
            raise ValueError(f"fp8 GEMV config: tma is its own one-row product with an atomic split: set use_dot, "
                             f"quantize_x, prefetch and sum_k_each_step false, reduce atomic, block_n and block_k "
                             f"at most {TMA_MAX_BOX}; got {self}")
        if self.quantize_x and (not self.use_dot or self.block_k != QUANT_X_GROUP or self.prefetch):
            raise ValueError(f"fp8 GEMV config: quantize_x is a tensor-core product with one activation scale a "
                             f"block of K: set use_dot true, block_k {QUANT_X_GROUP} and prefetch false, "
                             f"or quantize_x false")

    def describe(self) -> str:
        if self.kernel == "scaled_mm":
            return "_scaled_mm"
        if self.kernel == "gemm":
            return "the fp8 GEMM"
        product = "dot-fp8" if self.quantize_x else "dot" if self.use_dot else "tma" if self.tma else "fma"
        return (f"gemv {product} n{self.block_n} k{self.block_k} split{self.split_k}"
                f"{' ' + self.reduce if self.split_k > 1 else ''} w{self.num_warps} s{self.num_stages}"
                f"{' prefetch' if self.prefetch else ''}{' sum-k-each-step' if self.sum_k_each_step else ''}")


def row_bucket(rows: int) -> int:
    """The batch bucket a row count is configured by: the next power of two."""
    return next_pow2(rows)


def heuristic_config(n: int, k: int, rows: int, num_sms: int) -> GemvConfig:
    """A configuration for a shape the table does not list (the shape not measured): multiply-adds
    at one row, the bf16/fp16 tensor cores in tiles of 64 outputs by 128 of K up to 8 rows, and the
    fp8 tensor cores in tiles of 128 outputs, 8 warps and 4 stages at 9-16 rows (where the H200 sweep
    chose them for all four Llama-3.1-8B projections, 2026-12-03); K split until the grid covers the
    SMs twice (each split at least 512 wide)."""
    fp8_dot = rows > 8
    block_n = 128 if fp8_dot else 64
    split = 1
    while -(-n // block_n) * split < 2 * num_sms and k // (2 * split) >= 512 and split < 16:
        split *= 2
    if fp8_dot:
        return GemvConfig(block_n=block_n, block_k=QUANT_X_GROUP, split_k=split, use_dot=True, quantize_x=True,
                          num_warps=8, num_stages=4)
    return GemvConfig(block_n=block_n, block_k=128, split_k=split, use_dot=rows > 1, num_warps=4, num_stages=3)


def load_table(path: str | os.PathLike | None = None) -> dict[str, dict[str, GemvConfig]]:
    """{"NxK": {bucket: GemvConfig}} from a table file (``TABLE_ENV`` or the shipped one by default)."""
    path = table_path(path, TABLE_ENV, DEFAULT_TABLE, "benchmarks/bench_fp8_gemv.py")
    return load_config_table(path, GemvConfig, "bucket", "benchmarks/bench_fp8_gemv.py")


def load_dense_table(path: str | os.PathLike | None = None) -> dict[str, dict[str, GemvConfig]]:
    """The 16-bit weights' table (``DENSE_TABLE_ENV`` or the shipped one by default)."""
    path = table_path(path, DENSE_TABLE_ENV, DENSE_TABLE, "benchmarks/bench_dense_gemv.py")
    table = load_config_table(path, GemvConfig, "bucket", "benchmarks/bench_dense_gemv.py --out FILE")
    for shape, buckets in table.items():
        for bucket, config in buckets.items():
            # Both are fp8 weights' choices: a bucket cuBLAS wins is left out of this table instead.
            if config.kernel != "gemv" or config.quantize_x:
                raise ValueError(f"{path}: {shape} bucket {bucket}: a 16-bit weight's table lists only the GEMV "
                                 f"without quantize_x, got {config.describe()}: remove the entry (cuBLAS runs "
                                 f"that bucket) or rewrite the table with benchmarks/bench_dense_gemv.py")
    return table


class GemvWorkspace:
    """The split-K partial sums (float32, FP8_GEMV_WORKSPACE_ROWS rows of the widest layer: a split
    of a call's rows a slice) and one arrival counter per tile of the widest layer, shared by every
    fp8 layer of a model: layers run one after another on one stream. Zero between calls."""

    def __init__(self, max_out_features: int, device: torch.device):
        self.max_out_features = max_out_features
        self.partials = torch.zeros(FP8_GEMV_WORKSPACE_ROWS * max_out_features, dtype=torch.float32, device=device)
        self.counters = torch.zeros(-(-max_out_features // FP8_GEMV_MIN_BLOCK_N), dtype=torch.int32, device=device)
        assert self.nbytes() == fp8_gemv_workspace_bytes(max_out_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.partials, self.counters))


def fitted_split(config: GemvConfig, rows: int, n: int, k: int, workspace: GemvWorkspace) -> int:
    """config.split_k, lowered to what the workspace holds (each split keeps its rows · N partials)
    and to at most one BLOCK_K step per split."""
    split = min(config.split_k, max(1, -(-k // config.block_k)))
    split = min(split, workspace.partials.numel() // (rows * n))
    return max(1, split)


if HAS_TRITON:

    @triton.jit
    def _load_weight_tile(w_ptr, offs_n, n_mask, k0, k_end, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          EVEN: tl.constexpr):
        """w[offs_n, k0:k0 + BLOCK_K] in fp8; zeros past k_end (and past N unless EVEN)."""
        k = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + k[None, :]
        if EVEN:  # whole tiles: the mask is one predicate per tile, so the loads stay vectorized
            return tl.load(w_ptrs, mask=(tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.int32) + k0) < k_end, other=0.0)
        return tl.load(w_ptrs, mask=n_mask[:, None] & (k < k_end)[None, :], other=0.0)

    @triton.jit
    def _row_products_summed_over_k(w, x_ptr, M, k, k_end, stride_xm, BLOCK_M: tl.constexpr,
                                    BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
        """[BLOCK_M, BLOCK_N]: each row of x times the weight tile, summed over this step's K.

        Row by row, so the converted tile is the only [BLOCK_N, BLOCK_K] value in registers: no
        tile-sized accumulator and no [BLOCK_M, BLOCK_N, BLOCK_K] product."""
        w = w.to(tl.float32)
        offs_m = tl.arange(0, BLOCK_M)
        sums = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for m in tl.static_range(BLOCK_M):
            row_mask = (tl.zeros_like(k) + m) < M  # the rows past M that BLOCK_M pads to read nothing
            if not EVEN:
                row_mask = row_mask & (k < k_end)
            x = tl.load(x_ptr + m * stride_xm + k, mask=row_mask, other=0.0).to(tl.float32)
            row = tl.sum(w * x[None, :], axis=1)
            if BLOCK_M == 1:
                sums += row[None, :]
            else:
                sums += tl.where(offs_m[:, None] == m, row[None, :], 0.0)
        return sums

    @triton.jit
    def _partial_product(x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, M, k_start, k_end, stride_xm, stride_wn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         USE_DOT: tl.constexpr, EVEN: tl.constexpr, PREFETCH: tl.constexpr,
                         SUM_K_EACH_STEP: tl.constexpr, QUANT_X: tl.constexpr, FP8_MAX: tl.constexpr,
                         MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
        """sum over k in [k_start, k_end) of x[m, k] · w[n, k], float32 [BLOCK_M, BLOCK_N].

        With PREFETCH the next weight tile is loaded while the current one is multiplied (two
        tiles in registers), and the first one before the wait for the previous kernel: weights
        are never written by a step, so they may be read while it finishes. SUM_K_EACH_STEP
        (multiply-adds only) sums each step's product over K at once."""
        offs_k = tl.arange(0, BLOCK_K)
        if PREFETCH:
            w_next = _load_weight_tile(w_ptr, offs_n, n_mask, k_start, k_end, stride_wn, BLOCK_N, BLOCK_K, EVEN)
        pdl_wait(PDL)
        if USE_DOT:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        elif BLOCK_M == 1 and not SUM_K_EACH_STEP:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # summed over K once, after the loop
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if PREFETCH:
                w = w_next
                w_next = _load_weight_tile(w_ptr, offs_n, n_mask, k0 + BLOCK_K, k_end, stride_wn, BLOCK_N, BLOCK_K,
                                           EVEN)
            else:
                w = _load_weight_tile(w_ptr, offs_n, n_mask, k0, k_end, stride_wn, BLOCK_N, BLOCK_K, EVEN)
            k = k0 + offs_k
            if SUM_K_EACH_STEP:
                acc += _row_products_summed_over_k(w, x_ptr, M, k, k_end, stride_xm, BLOCK_M, BLOCK_N, EVEN)
            else:
                x_ptrs = x_ptr + offs_m[:, None] * stride_xm + k[None, :]
                if EVEN:
                    x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
                else:
                    x = tl.load(x_ptrs, mask=m_mask[:, None] & (k < k_end)[None, :], other=0.0)
                if QUANT_X:  # the arithmetic of quant.quantize_rows over this block of K, row by row
                    xf = x.to(tl.float32)
                    x_scale = tl.maximum(tl.max(tl.abs(xf), axis=1), MIN_SCALE) * (1.0 / FP8_MAX)
                    xq = tl.minimum(tl.maximum(tl.math.div_rn(xf, x_scale[:, None]), -FP8_MAX), FP8_MAX)
                    xq = xq.to(w.dtype, fp_downcast_rounding="rtne")
                    acc += tl.dot(w, tl.trans(xq)) * x_scale[None, :]
                elif USE_DOT:  # [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M]: the weight is the wide operand
                    acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
                elif BLOCK_M == 1:
                    acc += w.to(tl.float32) * x.to(tl.float32)
                else:
                    acc += tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
        if USE_DOT:
            return tl.trans(acc)
        elif BLOCK_M == 1 and not SUM_K_EACH_STEP:
            return tl.reshape(tl.sum(acc, axis=1), [1, BLOCK_N])
        else:
            return acc

    @triton.jit
    def _store_scaled(acc, scale_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_om,
                      HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr):
        """out[m, n] = acc · scale[n] (+ bias[n]), in out's dtype (a 16-bit weight has no scale)."""
        y = acc
        if HAS_SCALE:
            y = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _store_or_add_split(acc, scale_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr, offs_m, offs_n, m_mask, n_mask,
                            pid_n, pid_k, M, N, split_k, stride_om, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                            TWO_PASS: tl.constexpr, SPLIT_PAD: tl.constexpr):
        """A program's [BLOCK_M, BLOCK_N] partial product: stored scaled when K is not split; else stored in the
        split's slice of the workspace, where the reduce kernel sums the slices (TWO_PASS) or the last split to
        arrive on the tile's counter does, in split order, and stores the sums scaled. Either way the sums are
        added in the same order every call: the same bits every run, in both ways."""
        tile = offs_m[:, None] * N + offs_n[None, :]
        tile_mask = m_mask[:, None] & n_mask[None, :]
        if split_k == 1:
            _store_scaled(acc, scale_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_om, HAS_BIAS,
                          HAS_SCALE)
        else:
            if TWO_PASS:
                tl.store(ws_ptr + pid_k * M * N + tile, acc, mask=tile_mask)
            else:
                # The slice is written with atomics at the device's scope, each added into a zero (0 + x is x).
                # The barrier orders every thread's writes before the counter's release by one thread (release
                # is cumulative in PTX; CUTLASS's split-K semaphore relies on the same); a fence in every
                # thread was slower and changed no result (BENCHMARKS.md, twenty-fifth session). The last
                # split in reads the slices from L2 after its acquire.
                tl.atomic_add(ws_ptr + pid_k * M * N + tile, acc, mask=tile_mask, sem="relaxed")
                tl.debug_barrier()
                arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
                if arrived == split_k - 1:
                    # Unrolled, with no store between them, so every slice's load is in flight at once; from
                    # L2 (.cg: this SM's L1 may hold an earlier call's values). Then zeroed for the next call.
                    total = tl.zeros_like(acc)
                    for s in tl.static_range(SPLIT_PAD):
                        in_split = tile_mask & ((tl.zeros_like(tile) + s) < split_k)
                        total += tl.load(ws_ptr + s * M * N + tile, mask=in_split, other=0.0, cache_modifier=".cg")
                    # Triton may give the zeroing stores another layout than the loads, so another thread could
                    # zero an element before its load is done (it did, for the dot tiles of 8 warps where N is
                    # not a multiple of BLOCK_N): every load done before any store.
                    tl.debug_barrier()
                    for s in tl.static_range(SPLIT_PAD):
                        in_split = tile_mask & ((tl.zeros_like(tile) + s) < split_k)
                        tl.store(ws_ptr + s * M * N + tile, tl.zeros_like(total), mask=in_split)
                    tl.atomic_xchg(count_ptr + pid_n, 0)
                    _store_scaled(total, scale_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_om,
                                  HAS_BIAS, HAS_SCALE)

    @triton.jit(do_not_specialize=["M", "split_k"])
    def _fp8_gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, k_per_split,
                         split_k, stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                         TWO_PASS: tl.constexpr, EVEN: tl.constexpr, PREFETCH: tl.constexpr,
                         SUM_K_EACH_STEP: tl.constexpr, QUANT_X: tl.constexpr, FP8_MAX: tl.constexpr,
                         MIN_SCALE: tl.constexpr, PDL: tl.constexpr, HAS_SCALE: tl.constexpr,
                         SPLIT_PAD: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        n_mask = offs_n < N
        m_mask = offs_m < M
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        acc = _partial_product(x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, M, k_start, k_end, stride_xm,
                               stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, EVEN, PREFETCH, SUM_K_EACH_STEP,
                               QUANT_X, FP8_MAX, MIN_SCALE, PDL)
        _store_or_add_split(acc, scale_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr, offs_m, offs_n, m_mask, n_mask,
                            pid_n, pid_k, M, N, split_k, stride_om, HAS_BIAS, HAS_SCALE, TWO_PASS, SPLIT_PAD)

    @triton.jit(do_not_specialize=["split_k"])
    def _fp8_gemv_tma_kernel(x_ptr, w_desc, scale_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr, N, K, k_per_split,
                             split_k, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             STAGES: tl.constexpr, PDL: tl.constexpr, HAS_SCALE: tl.constexpr,
                             SPLIT_PAD: tl.constexpr):
        """One row of x times the weight, whose [BLOCK_N, BLOCK_K] tiles the TMA copies into shared memory
        (zeros past N and K), STAGES deep; the multiply-adds summed over K each step, then the same epilogue."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, 1)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        pdl_wait(PDL)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
            k = k0 + tl.arange(0, BLOCK_K)
            w = w_desc.load([n0, k0]).to(tl.float32)
            x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        _store_or_add_split(tl.reshape(acc, [1, BLOCK_N]), scale_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr, offs_m,
                            offs_n, offs_m < 1, offs_n < N, pid_n, pid_k, 1, N, split_k, N, HAS_BIAS, HAS_SCALE,
                            False, SPLIT_PAD)

    @triton.jit(do_not_specialize=["M", "split_k"])
    def _fp8_gemv_reduce_kernel(ws_ptr, scale_ptr, bias_ptr, out_ptr, M, N, split_k, stride_om,
                                HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
                                HAS_SCALE: tl.constexpr):
        """The second pass: out[m] = the splits' partial sums, scaled."""
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        pdl_wait(PDL)
        acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
        for s in range(0, split_k):
            part = ws_ptr + (s * M + m) * N + offs_n
            acc += tl.load(part, mask=n_mask, other=0.0)[None, :]
            tl.store(part, tl.zeros([BLOCK_N], dtype=tl.float32), mask=n_mask)  # zero again, as the atomic way does
        offs_m = m + tl.arange(0, 1)
        _store_scaled(acc, scale_ptr, bias_ptr, out_ptr, offs_m, offs_n, offs_m < M, n_mask, stride_om, HAS_BIAS,
                      HAS_SCALE)


def triton_fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                    bias: torch.Tensor | None, workspace: GemvWorkspace, config: GemvConfig) -> torch.Tensor:
    """x [rows, K] (model dtype) times ``weight`` [N, K] float8_e4m3fn scaled per row by ``weight_scale``
    [N, 1] float32, plus ``bias``: [rows, N] in x's dtype. Allocates only the output. With
    ``weight_scale`` None the weight is 16-bit (x's dtype), read as it is: F.linear's arithmetic."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if config.tma and not tma_fits(weight, rows):
        config = without_tma(config)
    # tl.dot of float32 would be tf32, and quantize_x of float32 x differs from its twin on the H200 in a few
    # roundings (not understood; the engine gives float32 activations to _scaled_mm): float32 x multiply-adds.
    use_dot = config.use_dot and x.dtype in (torch.bfloat16, torch.float16)
    block_m = max(DOT_MIN_ROWS, next_pow2(rows)) if use_dot else next_pow2(rows)
    split = fitted_split(config, rows, n, k, workspace)
    k_per_split = -(-(-(-k // split)) // config.block_k) * config.block_k
    split = -(-k // k_per_split)  # no split left without work
    if split > 1 and (rows * n > workspace.partials.numel() or n > workspace.max_out_features):
        raise ValueError(f"GEMV: {rows} rows x {n} outputs split {split} ways do not fit the workspace of "
                         f"{workspace.max_out_features} outputs (at most {GEMV_MAX_ROWS} rows)")
    two_pass = config.reduce == "two_pass" and split > 1
    even = k % config.block_k == 0 and n % config.block_n == 0
    pdl = pdl_options(x.device)
    has_bias, has_scale = bias is not None, weight_scale is not None
    weight_scale = weight_scale if has_scale else weight
    grid = (triton.cdiv(n, config.block_n), split)
    if config.tma:
        _fp8_gemv_tma_kernel[grid](x, TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k]),
                                   weight_scale, bias if has_bias else weight_scale, out, workspace.partials,
                                   workspace.counters, n, k, k_per_split, split, HAS_BIAS=has_bias,
                                   BLOCK_N=config.block_n, BLOCK_K=config.block_k, STAGES=config.num_stages, **pdl,
                                   HAS_SCALE=has_scale, SPLIT_PAD=next_pow2(split),
                                   num_warps=config.num_warps)
        return out
    _fp8_gemv_kernel[grid](x, weight, weight_scale, bias if has_bias else weight_scale, out, workspace.partials,
                           workspace.counters, rows, n, k, k_per_split, split, x.stride(0), weight.stride(0),
                           out.stride(0), HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=config.block_n,
                           BLOCK_K=config.block_k, USE_DOT=use_dot, TWO_PASS=two_pass, EVEN=even,
                           PREFETCH=config.prefetch, SUM_K_EACH_STEP=config.sum_k_each_step,
                           QUANT_X=use_dot and config.quantize_x, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, **pdl,
                           HAS_SCALE=has_scale, SPLIT_PAD=next_pow2(split) if split > 1 and not two_pass else 1,
                           num_warps=config.num_warps, num_stages=config.num_stages)
    if two_pass:
        block = 256
        _fp8_gemv_reduce_kernel[(triton.cdiv(n, block), rows)](
            workspace.partials, weight_scale, bias if has_bias else weight_scale, out, rows, n, split, out.stride(0),
            HAS_BIAS=has_bias, BLOCK_N=block, **pdl, HAS_SCALE=has_scale, num_warps=4)
    return out


_TMA_DEVICES: dict[int, bool] = {}


def tma_fits(weight: torch.Tensor, rows: int) -> bool:
    """Whether a tma configuration can run: one row, a triton with host-side TMA descriptors, a device with the
    TMA (Hopper on; or Triton's interpreter), and a weight the TMA can address (16-byte aligned rows)."""
    if rows != 1 or TensorDescriptor is None or weight.stride(1) != 1:
        return False
    if weight.is_cuda:
        index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
        if index not in _TMA_DEVICES:  # once a device: this runs at every eager launch of a tma configuration
            _TMA_DEVICES[index] = interpreted() or torch.cuda.get_device_capability(index)[0] >= 9
        if not _TMA_DEVICES[index]:
            return False
    return weight.data_ptr() % 16 == 0 and weight.stride(0) * weight.element_size() % 16 == 0


def without_tma(config: GemvConfig) -> GemvConfig:
    """The same tiles through the multiply-add product summed each step (where tma_fits says no)."""
    return dataclasses.replace(config, tma=False, sum_k_each_step=True)


class Fp8Gemv:
    """The GEMV path of a model's fp8 layers: one workspace, the configuration table, and what ran
    (``chosen``: "NxK bucket B" -> the configuration's description, filled as buckets are first
    launched: eagerly or while CUDA graphs are captured)."""

    def __init__(self, max_out_features: int, device: torch.device, table: dict | None = None):
        self.workspace = GemvWorkspace(max_out_features, device)
        self.table = load_table() if table is None else table
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        self.chosen: dict[str, str] = {}
        self._configs: dict[tuple[int, int, int], GemvConfig | None] = {}

    def config(self, n: int, k: int, rows: int) -> GemvConfig:
        bucket = row_bucket(rows)
        key = (n, k, bucket)
        if key not in self._configs:
            config = self.table.get(f"{n}x{k}", {}).get(str(bucket)) or heuristic_config(n, k, rows, self.num_sms)
            self._configs[key] = config
            self.chosen[f"{n}x{k} rows<={bucket}"] = config.describe()
        return self._configs[key]

    def tabled_config(self, n: int, k: int, rows: int) -> GemvConfig | None:
        """The table's configuration for a 16-bit layer (the dense GEMV): None where the table lists
        none for the bucket (cuBLAS was faster there) or where it splits K wider than the workspace."""
        bucket = row_bucket(rows)
        key = (n, k, bucket)
        if key not in self._configs:
            config = self.table.get(f"{n}x{k}", {}).get(str(bucket))
            if config is not None and config.split_k > 1 and n > self.workspace.max_out_features:
                config = None
            self._configs[key] = config
            self.chosen[f"{n}x{k} rows<={bucket}"] = config.describe() if config else "cuBLAS (F.linear)"
        return self._configs[key]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                 bias: torch.Tensor | None, config: GemvConfig) -> torch.Tensor:
        if config.tma and not tma_fits(weight, x.shape[0]):
            config = without_tma(config)
            self.chosen[f"{weight.shape[0]}x{weight.shape[1]} rows<={row_bucket(x.shape[0])}"] = \
                f"{config.describe()} (the table's tma cannot run here)"
        return triton_fp8_gemv(x, weight, weight_scale, bias, self.workspace, config)
