"""The decoder's elementwise work in plain PyTorch: RMSNorm (with the residual add),
rotary embedding (+ the KV write; + Qwen3's per-head q/k RMSNorm before it) and SiLU-and-multiply.

The CPU path and the oracle of the fused Triton kernels (elementwise_triton.py), which
round exactly where these bodies do (to the activation dtype after the normalisation,
after each product of the rotation, after the activation), so bf16 outputs agree with
transformers, not just approximately.
"""
import torch
import torch.nn.functional as F

from mempath.kernels.attention_torch import write_kv


def rms_norm_torch(x, weight, eps, residual=None, out=None):
    """RMSNorm of ``x`` (of ``x + residual`` when given). Returns ``(out, new_residual)``.

    ``out`` is ignored (it is where the fused kernel may write; callers use the returned tensor).
    """
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), residual


def apply_rope_torch(positions, q, k, cos, sin):
    """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` by their positions (neox layout); new tensors.

    ``cos``/``sin`` are float32 ``[max_positions, D]`` tables.
    """
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def rope_and_store_torch(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    """Rotate q and k, then store k and v into their cache slots; returns the rotated q."""
    q, k = apply_rope_torch(positions, q, k, cos, sin)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def qk_norm_rope_and_store_torch(positions, q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache,
                                 slot_mapping):
    """Per-head RMSNorm of ``q [T, H, D]`` and ``k [T, Hkv, D]`` (Qwen3's q_norm / k_norm, one
    ``D``-wide weight each), then ``rope_and_store_torch``; returns the rotated q."""
    q = rms_norm_torch(q, q_weight, eps)[0]
    k = rms_norm_torch(k, k_weight, eps)[0]
    return rope_and_store_torch(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu_and_mul_torch(x):
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
