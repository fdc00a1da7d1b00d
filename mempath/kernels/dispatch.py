"""Which kernels a model runs: the Triton ones or their PyTorch twins, chosen once per model.

The rule: a model is built with one :class:`Kernels` (``kernels_for(device)``: Triton on
CUDA when Triton is installed, else the PyTorch twins), and every op of every layer —
RMSNorm, rotary + KV write (with Qwen3's q/k norms), SiLU-and-mul, paged attention — goes
through it. Why one
object, chosen at build time, rather than a per-call test of each tensor's device:

- one place says which path runs, so the runner (which sizes the decode workspace and
  compiles the kernels only for the Triton path), the planner's figures and the model
  cannot disagree about it;
- a model built for one path keeps it, whatever tensor reaches an op (no silent
  fallback to the other path inside a step);
- tests and benchmarks swap a kernel by replacing a field of the model's Kernels (every
  layer holds the same instance) or of one layer's own copy (``dataclasses.replace``),
  never by patching module globals that every model shares; the next models on one
  device (issue #15) can each have their own.

Importing this module imports no Triton code (nor Triton) until a model on CUDA asks for it.
"""
import functools
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from mempath.constants import FP8_MAX, MIN_SCALE
from mempath.kernels.attention_torch import attend_torch
from mempath.kernels.elementwise_torch import (qk_norm_rope_and_store_torch, rms_norm_torch, rope_and_store_torch,
                                               silu_and_mul_torch)

log = logging.getLogger(__name__)

# Set to False to build models with the PyTorch twins on CUDA too (debugging, A/B measurements).
USE_TRITON = True


@dataclass
class Kernels:
    """One model's kernels. Signatures (the PyTorch twins' docstrings say what each computes):

    - ``rms_norm(x, weight, eps, residual=None, out=None) -> (out, new_residual)``; with a
      residual the Triton kernel updates it in place and writes into ``out`` (default ``x``);
    - ``rope_and_store(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> q``:
      q and k rotated, k and v stored in their slots (negative slots skipped);
    - ``qk_norm_rope_and_store(positions, q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache,
      slot_mapping) -> q``: the same after a per-head RMSNorm of q and k (Qwen3), one launch on Triton;
    - ``silu_and_mul(x) -> out``;
    - ``attention(q, k_cache, v_cache, meta, scale) -> out`` over the paged cache;
    - ``grouped_experts(x, router_weights, expert_ids, gate_up_proj, down_proj, silu_and_mul) -> out``:
      a MoE layer's experts with every expert resident, no host read (None: the PyTorch
      twin in mempath.model.moe, which reads the group sizes on the host);
    - ``moe_route(logits, top_k, norm_topk_prob, weights_dtype) -> (weights, ids)``: the router's
      softmax and top k in one launch, beside grouped_experts (None: ``route_torch``);
    - ``grouped_expert_pairs(x, router_weights, ids, gate_up_proj, down_proj, silu_and_mul) -> pairs``:
      grouped_experts before the sum over k (float32 [T·k, h]), over any stack of experts: an
      expert cache's slots (mempath.model.moe_slots; None: the cache runs the PyTorch twin);
    - ``sum_expert_pairs(pairs, top_k, dtype) -> out``: those pairs summed over k and cast, as
      grouped_experts sums them (None: ``moe_triton.sum_pairs``, its twin);
    - ``router_logits(x, weight) -> logits``: the router's ``F.linear`` at decode batches (at most
      ``moe_triton.ROUTER_KERNEL_MAX_ROWS`` tokens, 16-bit; None: ``F.linear`` always);
    - ``rms_norm_quant(x, weight, eps, residual=None) -> (fp8 values, scales, new_residual)`` and
      ``silu_and_mul_quant(x) -> (fp8 values, scales)``: rms_norm and silu_and_mul with their output
      quantized per row for an fp8 projection (``mempath.model.quant.Fp8Activation``; None: the
      projection quantizes its input itself).
    """

    rms_norm: Callable
    rope_and_store: Callable
    silu_and_mul: Callable
    attention: Callable
    qk_norm_rope_and_store: Callable
    triton: bool  # the Triton kernels (the runner sizes their decode workspace and compiles them)
    grouped_experts: Callable | None = None
    moe_route: Callable | None = None
    grouped_expert_pairs: Callable | None = None
    sum_expert_pairs: Callable | None = None
    router_logits: Callable | None = None
    rms_norm_quant: Callable | None = None
    silu_and_mul_quant: Callable | None = None


def torch_kernels() -> Kernels:
    return Kernels(rms_norm_torch, rope_and_store_torch, silu_and_mul_torch, attend_torch,
                   qk_norm_rope_and_store_torch, triton=False)


def triton_kernels() -> Kernels:
    from mempath.kernels.attention_triton import attend_triton
    from mempath.kernels.elementwise_triton import (qk_norm_rope_and_store_triton, rope_and_store_triton,
                                                    triton_rms_norm, triton_silu_and_mul)
    from mempath.kernels.moe_triton import (triton_grouped_expert_pairs, triton_grouped_experts, triton_route,
                                            triton_router_logits, triton_sum_pairs)
    from mempath.kernels.quant_triton import triton_rms_norm_quant, triton_silu_and_mul_quant
    fp8 = {"fp8_max": FP8_MAX, "min_scale": MIN_SCALE}
    return Kernels(triton_rms_norm, rope_and_store_triton, triton_silu_and_mul, attend_triton,
                   qk_norm_rope_and_store_triton, triton=True, grouped_experts=triton_grouped_experts,
                   moe_route=triton_route, grouped_expert_pairs=triton_grouped_expert_pairs,
                   sum_expert_pairs=triton_sum_pairs, router_logits=triton_router_logits,
                   rms_norm_quant=functools.partial(triton_rms_norm_quant, **fp8),
                   silu_and_mul_quant=functools.partial(triton_silu_and_mul_quant, **fp8))


def kernels_for(device: torch.device) -> Kernels:
    """A new Kernels for a model on ``device``: Triton on CUDA when it is installed."""
    if device.type != "cuda" or not USE_TRITON:
        return torch_kernels()
    from mempath.kernels.common import HAS_TRITON
    if not HAS_TRITON:
        log.warning("Triton is not installed: CUDA attention runs on the PyTorch reference path")
        return torch_kernels()
    return triton_kernels()

