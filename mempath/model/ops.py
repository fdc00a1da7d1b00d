"""The decoder's elementwise work: RMSNorm (with the residual add), rotary embedding
and SiLU-and-multiply.

Each function has a plain PyTorch body, which runs on the CPU and is the oracle,
and a fused Triton kernel (mempath.model.triton_ops) used for CUDA tensors. The
fused kernels round exactly where the PyTorch versions do (to the activation
dtype after the normalisation, after each product of the rotation, after the
activation), so bf16 outputs agree with transformers, not just approximately.
"""
import torch
import torch.nn.functional as F

# Set to False to run the PyTorch bodies on CUDA too (debugging, A/B measurements).
USE_TRITON = True
# Rotary and the KV write as one kernel (False: two; for A/B measurements).
FUSE_ROPE_AND_STORE = True


def _fused(x: torch.Tensor) -> bool:
    if not (USE_TRITON and x.is_cuda):
        return False
    from mempath.model import triton_ops
    return triton_ops.HAS_TRITON


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None):
    """RMSNorm of ``x`` (of ``x + residual`` when given). Returns ``(out, new_residual)``.

    With a residual, the fused kernel writes the sum into ``residual`` and the
    normalised values into ``out`` (default: ``x``): no new memory in the step loop.
    The PyTorch twin ignores ``out`` (callers use the returned tensor).
    """
    if _fused(x):
        from mempath.model.triton_ops import triton_rms_norm
        return triton_rms_norm(x, weight, eps, residual, out)
    return rms_norm_torch(x, weight, eps, residual)


def rms_norm_torch(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), residual


def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor):
    """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` by their positions (neox layout).

    ``cos``/``sin`` are float32 ``[max_positions, D]`` tables. The fused kernel
    rotates in place; the PyTorch body returns new tensors.
    """
    if _fused(q):
        from mempath.model.triton_ops import triton_rope
        triton_rope(positions, q, k, cos, sin)
        return q, k
    return apply_rope_torch(positions, q, k, cos, sin)


def apply_rope_torch(positions, q, k, cos, sin):
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def rope_and_store(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, write_kv_fn):
    """Rotate q and k, then store k and v into their cache slots; returns the rotated q.

    On CUDA one fused kernel does all of it, with the Triton KV write's layout (the
    cache ``[num_blocks, block_size, H, D]``, contiguous; negative slots skipped), and
    ``write_kv_fn`` is not called; otherwise the rotary twin, then ``write_kv_fn``
    (the PyTorch or the Triton KV write).
    """
    if _fused(q) and FUSE_ROPE_AND_STORE:
        from mempath.model.triton_ops import triton_rope_and_store
        triton_rope_and_store(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        return q
    return rope_and_store_torch(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, write_kv_fn)


def rope_and_store_torch(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, write_kv_fn):
    q, k = apply_rope(positions, q, k, cos, sin)
    write_kv_fn(k, v, k_cache, v_cache, slot_mapping)
    return q


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dimension."""
    if _fused(x):
        from mempath.model.triton_ops import triton_silu_and_mul
        return triton_silu_and_mul(x)
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
