"""Fused Triton kernels for the decoder's elementwise work (twins in elementwise_torch.py).

Each kernel reads its inputs once and writes once, replacing the 5-15 small
kernels the PyTorch expressions launch; with CUDA graphs removing launch costs,
what is left per layer is mostly these kernels' count and memory traffic.
"""
import torch

from mempath.kernels.attention_triton import triton_write_kv
from mempath.kernels.common import HAS_TRITON, kv_fp8_max, next_pow2, pdl_options

# Rotary and the KV write as one kernel (False: two; for A/B measurements).
FUSE_ROPE_AND_STORE = True
# Qwen3's per-head q/k norms inside that kernel (False: two norm kernels before it; A/B).
FUSE_QK_NORM = True

if HAS_TRITON:
    import triton
    import triton.language as tl

    from mempath.kernels.common import pdl_wait, to_cache_dtype

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_out, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        # All loads issued up front: at one row per step the kernel is load latency.
        # The weight is constant, so it is read while the previous kernel finishes.
        cols, mask, w = rms_norm_weight(w_ptr, n_cols, BLOCK)
        pdl_wait(PDL)
        y = rms_norm_row(x_ptr + row * stride_x + cols, res_ptr + row * stride_res + cols, w, mask, n_cols, eps,
                         HAS_RESIDUAL)
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rms_norm_weight(w_ptr, n_cols, BLOCK: tl.constexpr):
        """(cols, mask, the norm's weight) of a row held whole in registers."""
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        return cols, mask, tl.load(w_ptr + cols, mask=mask, other=0.0)

    @triton.jit
    def rms_norm_row(x_ptrs, res_ptrs, w, mask, n_cols, eps, HAS_RESIDUAL: tl.constexpr):
        """The RMSNorm of the row at ``x_ptrs``, in its dtype, rounded where ``rms_norm_torch`` rounds; with
        HAS_RESIDUAL, of ``x + residual``, which is stored back into the residual row (``res_ptrs``) first."""
        x = tl.load(x_ptrs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptrs, mask=mask, other=0.0)
            # Round the sum to the activation dtype, as `x + residual` does in PyTorch.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(res_ptrs, x, mask=mask)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, axis=0) / n_cols
        normed = (xf * (1.0 / tl.sqrt(variance + eps))).to(x.dtype)
        return (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)

    @triton.jit
    def _cos_sin(pos_ptr, cos_ptr, sin_ptr, t, stride_cos, dtype, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
        """Token t's cos and sin rows, as float32 values of the activation dtype."""
        pos = tl.load(pos_ptr + t)
        d = tl.arange(0, HALF_PAD)
        dmask = d < HALF
        # The tables are float32; PyTorch casts them to the activation dtype first.
        c = tl.load(cos_ptr + pos * stride_cos + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_cos + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)
        return c, s

    @triton.jit
    def _rotate(x1, x2, c, s, dtype):
        """x*cos + rotate_half(x)*sin for the two halves, each product rounded like the PyTorch expression."""
        a1 = (x1 * c[None, :]).to(dtype).to(tl.float32)
        b1 = (-x2 * s[None, :]).to(dtype).to(tl.float32)
        a2 = (x2 * c[None, :]).to(dtype).to(tl.float32)
        b2 = (x1 * s[None, :]).to(dtype).to(tl.float32)
        return (a1 + b1).to(dtype), (a2 + b2).to(dtype)

    @triton.jit
    def _rotate_heads(src, stride_src, dst, stride_dst, n_heads, c, s, dtype, norm_w, eps,
                      HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
                      DST_FP8_MAX: tl.constexpr, NORM: tl.constexpr):
        """Rotate one token's heads from ``src`` into ``dst`` (may be the same rows), rounded
        to the activation ``dtype`` and then stored in ``dst``'s dtype (quantized as the KV
        write does when ``dst`` is an fp8 cache). With ``NORM``, each head is first
        RMS-normalised with the ``2 * HALF``-wide weight ``norm_w``, rounded where
        ``rms_norm_torch`` rounds (Qwen3's q_norm / k_norm)."""
        d = tl.arange(0, HALF_PAD)
        heads = tl.arange(0, HEADS_PAD)
        mask = (heads[:, None] < n_heads) & (d[None, :] < HALF)
        src_ptr = src + heads[:, None] * stride_src + d[None, :]
        x1 = tl.load(src_ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            w1 = tl.load(norm_w + d, mask=d < HALF, other=0.0).to(tl.float32)
            w2 = tl.load(norm_w + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
            variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
            inv = 1.0 / tl.sqrt(variance + eps)
            x1 = (w1[None, :] * (x1 * inv[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x2 = (w2[None, :] * (x2 * inv[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        y1, y2 = _rotate(x1, x2, c, s, dtype)
        dst_ptr = dst + heads[:, None] * stride_dst + d[None, :]
        tl.store(dst_ptr, to_cache_dtype(y1, dst.dtype.element_ty, DST_FP8_MAX), mask=mask)
        tl.store(dst_ptr + HALF, to_cache_dtype(y2, dst.dtype.element_ty, DST_FP8_MAX), mask=mask)

    @triton.jit
    def _rope_store_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                           stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
                           stride_block, stride_token, block_size, num_q_heads, num_kv_heads, q_norm_ptr,
                           k_norm_ptr, eps, HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
                           KV_HEADS_PAD: tl.constexpr, KV_FP8_MAX: tl.constexpr, QK_NORM: tl.constexpr,
                           PDL: tl.constexpr):
        # One program per token: (normalise and) rotate its q heads in place, rotate its
        # k heads into the k cache and copy its v heads into the v cache (the rotated k is
        # never written back to the qkv buffer: only the cache reads it).
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        dtype = q_ptr.dtype.element_ty
        c, s = _cos_sin(pos_ptr, cos_ptr, sin_ptr, t, stride_cos, dtype, HALF, HALF_PAD)
        q = q_ptr + t * stride_qt
        _rotate_heads(q, stride_qh, q, stride_qh, num_q_heads, c, s, dtype, q_norm_ptr, eps,
                      HALF, HALF_PAD, HEADS_PAD, 0.0, QK_NORM)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            # The block stride is its own argument: a shared page pool (mempath/multi) lays every
            # layer of a block in one page, so a layer's blocks are a page apart, not a block.
            cache_offset = (slot // block_size) * stride_block + (slot % block_size) * stride_token
            _rotate_heads(k_ptr + t * stride_kt, stride_kh, k_cache_ptr + cache_offset, 2 * HALF,
                          num_kv_heads, c, s, dtype, k_norm_ptr, eps, HALF, HALF_PAD, KV_HEADS_PAD, KV_FP8_MAX,
                          QK_NORM)
            d = tl.arange(0, HALF_PAD)
            heads = tl.arange(0, KV_HEADS_PAD)
            mask = (heads[:, None] < num_kv_heads) & (d[None, :] < HALF)
            cache_dtype = v_cache_ptr.dtype.element_ty
            vsrc = v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :]
            vdst = v_cache_ptr + cache_offset + heads[:, None] * (2 * HALF) + d[None, :]
            tl.store(vdst, to_cache_dtype(tl.load(vsrc, mask=mask), cache_dtype, KV_FP8_MAX), mask=mask)
            tl.store(vdst + HALF, to_cache_dtype(tl.load(vsrc + HALF, mask=mask), cache_dtype, KV_FP8_MAX), mask=mask)

    @triton.jit
    def _rope_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                     stride_cos, num_q_heads, num_k_heads,
                     HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        dtype = q_ptr.dtype.element_ty
        c, s = _cos_sin(pos_ptr, cos_ptr, sin_ptr, t, stride_cos, dtype, HALF, HALF_PAD)
        q, k = q_ptr + t * stride_qt, k_ptr + t * stride_kt
        _rotate_heads(q, stride_qh, q, stride_qh, num_q_heads, c, s, dtype, q_ptr, 0.0,
                      HALF, HALF_PAD, HEADS_PAD, 0.0, False)
        _rotate_heads(k, stride_kh, k, stride_kh, num_k_heads, c, s, dtype, k_ptr, 0.0,
                      HALF, HALF_PAD, HEADS_PAD, 0.0, False)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = silu_and_mul_row(x_ptr + row * stride_x + cols, n_cols, mask)
        tl.store(out_ptr + row * stride_out + cols, y, mask=mask)

    @triton.jit
    def silu_and_mul_row(gate_ptrs, n_cols, mask):
        """silu(gate) * up for the columns at ``gate_ptrs`` (up is ``n_cols`` further), in the
        activation dtype, rounded after the activation and after the product as ``silu_and_mul_torch``."""
        gate = tl.load(gate_ptrs, mask=mask, other=0.0)
        up = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                    out: torch.Tensor | None = None):
    """Fused twin of ``elementwise_torch.rms_norm_torch``; with a residual, updates it in place and writes
    the normalised values into ``out`` (default ``x``, dead once added to the residual)."""
    n_cols = x.shape[-1]
    rows = x.numel() // n_cols
    if rows == 0:
        return x, residual
    if residual is not None:
        out = x if out is None else out
        res = residual
    else:
        out = torch.empty_like(x)
        res = x
    x2, out2, res2 = x.view(rows, n_cols), out.view(rows, n_cols), res.view(rows, n_cols)
    block = next_pow2(n_cols)
    _rms_norm_kernel[(rows,)](
        x2, res2, weight, out2, x2.stride(0), res2.stride(0), out2.stride(0), n_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, **pdl_options(x.device),
        num_warps=min(16, max(1, block // 256)))
    return out, residual


# The rotary kernels round each product to the activation dtype before the sum, as
# the PyTorch expression does; they are compiled without multiply-add contraction
# (enable_fp_fusion=False) so that the compiler cannot skip a rounding.


def triton_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> None:
    """Fused twin of ``elementwise_torch.apply_rope_torch``, rotating q and k in place."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        positions, q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        num_q_heads, k.shape[1], HALF=half, HALF_PAD=next_pow2(half),
        HEADS_PAD=next_pow2(max(num_q_heads, k.shape[1])), **pdl_options(q.device), num_warps=4,
        enable_fp_fusion=False)


def triton_rope_and_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, qk_norm: tuple | None = None) -> None:
    """Fused twin of ``elementwise_torch.rope_and_store_torch``: q rotated in place, rotated k and v in their slots
    (quantized as ``attention_torch.quantize_kv`` does for an fp8 cache). ``qk_norm``: ``(q_weight,
    k_weight, eps)``, Qwen3's per-head RMSNorm of q and k first (the twin is
    ``qk_norm_rope_and_store_torch``; q holds the normalised, rotated values after).

    One launch where rotary + KV write took two (and with the q/k norms, five: each norm
    also needed a copy of its strided heads): at batch 1 these kernels last a few
    microseconds each, so the launch, not the bytes, is the cost.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and cos.stride(1) == 1
    assert v.shape == k.shape == (num_tokens, num_kv_heads, head_dim)
    assert positions.shape == slot_mapping.shape == (num_tokens,)
    assert positions.is_contiguous() and slot_mapping.is_contiguous()
    assert k_cache.shape[-2:] == (num_kv_heads, head_dim) and k_cache.stride()[1:] == (num_kv_heads * head_dim, head_dim, 1)
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride() and v_cache.dtype == k_cache.dtype
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (q, k, 0.0)
    assert qk_norm is None or q_weight.shape == k_weight.shape == (head_dim,)
    half = head_dim // 2
    _rope_store_kernel[(num_tokens,)](
        positions, q, k, v, cos, sin, slot_mapping, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.shape[1], num_q_heads, num_kv_heads, q_weight, k_weight, eps,
        HALF=half, HALF_PAD=next_pow2(half), HEADS_PAD=next_pow2(num_q_heads),
        KV_HEADS_PAD=next_pow2(num_kv_heads), KV_FP8_MAX=kv_fp8_max(k_cache.dtype), QK_NORM=qk_norm is not None,
        **pdl_options(q.device), num_warps=4,
        enable_fp_fusion=False)


def rope_and_store_triton(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """``triton_rope_and_store``, or with FUSE_ROPE_AND_STORE off ``triton_rope`` then
    ``triton_write_kv``; returns the rotated q (the Kernels calling convention)."""
    if FUSE_ROPE_AND_STORE:
        triton_rope_and_store(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    else:
        triton_rope(positions, q, k, cos, sin)
        triton_write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def qk_norm_rope_and_store_triton(positions, q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache,
                                  slot_mapping) -> torch.Tensor:
    """Twin of ``elementwise_torch.qk_norm_rope_and_store_torch``: one launch (with
    FUSE_QK_NORM or FUSE_ROPE_AND_STORE off, the two norms then ``rope_and_store_triton``); returns q."""
    if FUSE_QK_NORM and FUSE_ROPE_AND_STORE:
        triton_rope_and_store(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, (q_weight, k_weight, eps))
        return q
    q = triton_rms_norm(q.reshape(-1, q.shape[-1]), q_weight, eps)[0].view(q.shape)
    k = triton_rms_norm(k.reshape(-1, k.shape[-1]), k_weight, eps)[0].view(k.shape)
    return rope_and_store_triton(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def triton_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n_cols = x.shape[-1] // 2
    rows = x.numel() // x.shape[-1]
    out = torch.empty(*x.shape[:-1], n_cols, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    x2, out2 = x.view(rows, 2 * n_cols), out.view(rows, n_cols)
    block = min(1024, next_pow2(n_cols))
    _silu_and_mul_kernel[(rows, triton.cdiv(n_cols, block))](
        x2, out2, x2.stride(0), out2.stride(0), n_cols, BLOCK=block, **pdl_options(x.device),
        num_warps=4)
    return out
