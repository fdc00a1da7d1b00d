"""Per-token fp8 quantization of a linear layer's input in one Triton kernel, alone or inside
the kernel that produces the input.

The twin is ``mempath.model.quant.quantize_rows`` (PyTorch: five elementwise kernels for
the scales and four for the values, ~1,100 launches in a Llama-8B decode step; this
kernel is one per layer). The arithmetic is the twin's, rounding for rounding: the row's
amax (exact in any dtype), floored at ``min_scale``, times float32(1 / 448) and each element
divided by that scale with IEEE division (``div_rn``, as PyTorch's CUDA division), then
clamped to ±448 and rounded to nearest even.

Where an fp8 projection's input comes out of an RMSNorm or a SiLU-and-mul, the quantization
can run inside that kernel (``triton_rms_norm_quant``, ``triton_silu_and_mul_quant``): the
16-bit activation is rounded as before, then quantized in registers, and only its fp8 values
and scales are written. No launch and no 16-bit round trip through memory for the quantization.
Each gives the bytes of the two launches it replaces; its twin is their twins one after the other
(bit for bit in bfloat16, where the 16-bit kernels match their twins: tests/test_fused_ops.py).
"""
import torch

from mempath.kernels.common import HAS_TRITON, next_pow2, pdl_options

if HAS_TRITON:
    import triton
    import triton.language as tl

    from mempath.kernels.common import pdl_wait
    from mempath.kernels.elementwise_triton import rms_norm_row, rms_norm_weight, silu_and_mul_row

    @triton.jit
    def _row_scale(amax, min_scale, FP8_MAX: tl.constexpr):
        """A row's scale from its amax (float32), as quantize_rows computes it."""
        return tl.maximum(amax, min_scale) * (1.0 / FP8_MAX)

    @triton.jit
    def _quantized(y, scale, dtype, FP8_MAX: tl.constexpr):
        """y / scale with IEEE division, clamped to the format's range and rounded to nearest even."""
        q = tl.math.div_rn(y.to(tl.float32), tl.zeros(y.shape, dtype=tl.float32) + scale)
        return tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX).to(dtype, fp_downcast_rounding="rtne")

    @triton.jit
    def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, stride_x, stride_res, stride_q, n_cols,
                               eps, min_scale, HAS_RESIDUAL: tl.constexpr, FP8_MAX: tl.constexpr,
                               BLOCK: tl.constexpr, PDL: tl.constexpr):
        """One row: the RMSNorm kernel's output (a whole row in registers), quantized per row."""
        row = tl.program_id(0).to(tl.int64)
        cols, mask, w = rms_norm_weight(w_ptr, n_cols, BLOCK)
        pdl_wait(PDL)
        y = rms_norm_row(x_ptr + row * stride_x + cols, res_ptr + row * stride_res + cols, w, mask, n_cols, eps,
                         HAS_RESIDUAL)
        scale = _row_scale(tl.max(tl.abs(y.to(tl.float32)), axis=0), min_scale, FP8_MAX)
        tl.store(scale_ptr + row, scale)
        tl.store(q_ptr + row * stride_q + cols, _quantized(y, scale, q_ptr.dtype.element_ty, FP8_MAX), mask=mask)

    @triton.jit
    def _silu_and_mul_quant_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n_cols, min_scale,
                                   FP8_MAX: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """One row: silu(gate) * up, its amax over the row, then its values quantized. A row of at most
        BLOCK columns is held in registers; a wider one is computed twice (its amax, then its values)."""
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        gate_ptrs = x_ptr + row * stride_x + cols
        if n_cols <= BLOCK:
            mask = cols < n_cols
            y = silu_and_mul_row(gate_ptrs, n_cols, mask)
            scale = _row_scale(tl.max(tl.abs(y.to(tl.float32)), axis=0), min_scale, FP8_MAX)
            tl.store(scale_ptr + row, scale)
            tl.store(q_ptr + row * stride_q + cols, _quantized(y, scale, q_ptr.dtype.element_ty, FP8_MAX), mask=mask)
            return
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            y = silu_and_mul_row(gate_ptrs + start, n_cols, start + cols < n_cols)
            amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
        scale = _row_scale(tl.max(amax, axis=0), min_scale, FP8_MAX)
        tl.store(scale_ptr + row, scale)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            y = silu_and_mul_row(gate_ptrs + start, n_cols, mask)
            tl.store(q_ptr + row * stride_q + start + cols, _quantized(y, scale, q_ptr.dtype.element_ty, FP8_MAX),
                     mask=mask)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n_cols, min_scale,
                              FP8_MAX: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < n_cols, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = _row_scale(tl.max(amax, axis=0), min_scale, FP8_MAX)
        tl.store(scale_ptr + row, scale)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0)
            tl.store(q_ptr + row * stride_q + start + cols, _quantized(x, scale, q_ptr.dtype.element_ty, FP8_MAX),
                     mask=mask)


def triton_quantize_rows(x: torch.Tensor, fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused twin of ``mempath.model.quant.quantize_rows`` for a 2-D ``x`` (rows of a linear's input):
    (float8_e4m3fn values, float32 scales [rows, 1])."""
    x = x if x.stride(-1) == 1 else x.contiguous()  # the kernel walks a row with unit stride
    rows, n_cols = x.shape
    q = torch.empty(rows, n_cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = min(4096, next_pow2(n_cols))
    _quantize_rows_kernel[(rows,)](x, q, scale, x.stride(0), q.stride(0), n_cols, min_scale, FP8_MAX=fp8_max,
                                   BLOCK=block, **pdl_options(x.device), num_warps=min(16, max(1, block // 256)))
    return q, scale


def triton_rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                          fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``triton_rms_norm`` (with a residual: updated in place), its output quantized per row as
    ``triton_quantize_rows`` does, in one launch: (float8_e4m3fn values, float32 scales [rows, 1],
    residual). Only the fp8 values and the scales are allocated."""
    n_cols = x.shape[-1]
    rows = x.numel() // n_cols
    q = torch.empty(rows, n_cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale, residual
    x2 = x.view(rows, n_cols)
    res2 = residual.view(rows, n_cols) if residual is not None else x2
    block = next_pow2(n_cols)
    _rms_norm_quant_kernel[(rows,)](
        x2, res2, weight, q, scale, x2.stride(0), res2.stride(0), q.stride(0), n_cols, eps, min_scale,
        HAS_RESIDUAL=residual is not None, FP8_MAX=fp8_max, BLOCK=block, **pdl_options(x.device),
        num_warps=min(16, max(1, block // 256)))
    return q, scale, residual


# The widest SiLU-and-mul row held in registers, computed once (16 warps, 75 registers a thread at this width
# for sm_90); a wider one is computed twice, 4,096 columns at a time.
SILU_QUANT_ONE_PASS_COLUMNS = 16384


def triton_silu_and_mul_quant(x: torch.Tensor, fp8_max: float, min_scale: float,
                              block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``triton_silu_and_mul`` of ``x = [gate | up]`` quantized per row as ``triton_quantize_rows`` does, in one
    launch: (float8_e4m3fn values [rows, n], float32 scales [rows, 1]); the 16-bit activation is never stored.
    ``block``: columns a step (a power of two; None: the whole row up to SILU_QUANT_ONE_PASS_COLUMNS)."""
    n_cols = x.shape[-1] // 2
    rows = x.numel() // x.shape[-1]
    q = torch.empty(rows, n_cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    x2 = x.view(rows, 2 * n_cols)
    if block is None:
        whole = next_pow2(n_cols)
        block = whole if whole <= SILU_QUANT_ONE_PASS_COLUMNS else 4096
    _silu_and_mul_quant_kernel[(rows,)](x2, q, scale, x2.stride(0), q.stride(0), n_cols, min_scale, FP8_MAX=fp8_max,
                                        BLOCK=block, **pdl_options(x.device), num_warps=min(16, max(1, block // 256)))
    return q, scale
