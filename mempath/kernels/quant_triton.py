"""Per-token fp8 quantization of a linear layer's input in one Triton kernel.

The twin is ``mempath.model.quant.quantize_rows`` (PyTorch: five elementwise kernels for
the scales and four for the values, ~1,100 launches in a Llama-8B decode step; this
kernel is one per layer). The arithmetic is the twin's, rounding for rounding: the row's
amax (exact in any dtype), floored at ``min_scale``, times float32(1 / 448) and each element
divided by that scale with IEEE division (``div_rn``, as PyTorch's CUDA division), then
clamped to ±448 and rounded to nearest even.
"""
import torch

from mempath.kernels.common import HAS_TRITON, next_pow2, pdl_options

if HAS_TRITON:
    import triton
    import triton.language as tl

    from mempath.kernels.common import pdl_wait

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
        scale = tl.maximum(tl.max(amax, axis=0), min_scale) * (1.0 / FP8_MAX)
        tl.store(scale_ptr + row, scale)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0)
            y = tl.math.div_rn(x.to(tl.float32), tl.zeros([BLOCK], dtype=tl.float32) + scale)
            y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + row * stride_q + start + cols, y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
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
