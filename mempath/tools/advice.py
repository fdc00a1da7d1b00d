"""The planner's advice: what fits, what does not, and the flag with the number that would.

Read from a MemoryPlan (mempath.tools.plan) and the model's shape; every figure quoted
is the plan's own.
"""

from __future__ import annotations

import dataclasses
import math

from mempath.constants import DEFAULT_BLOCK_SIZE
from mempath.memory.formulas import ModelShape, decoder_peak_bytes_per_token, weight_bytes
from mempath.memory.ledger import format_bytes
from mempath.tools.training import plan_training

GiB = 1 << 30
# The most of the host's memory the advice proposes pinning for the host KV tier: vLLM
# refuses a --swap-space above 70% of the host's memory.
HOST_KV_FRACTION = 0.7


def advise(plan, shape: ModelShape) -> list[str]:
    lines = [_block_size_advice(plan)]
    if plan.max_num_batched_tokens < plan.max_model_len:
        lines.append(
            f"max-num-batched-tokens {plan.max_num_batched_tokens} < max-model-len "
            f"{plan.max_model_len}: longer prompts are prefilled in chunks of "
            f"{plan.max_num_batched_tokens} tokens")
    if plan.budget_bytes is None:
        lines.append(
            f"capacity needs --gpu-mem (no CUDA device visible): weights + workspace need "
            f"{format_bytes(plan.resident_weight_bytes + plan.workspace_bytes)} before any KV, and one "
            f"max-model-len {plan.max_model_len} sequence needs {format_bytes(plan.kv_bytes_per_seq)} of KV")
    else:
        lines += _capacity_advice(plan, shape)
    if plan.train:
        lines += _training_advice(plan, shape)
    return lines


def _block_size_advice(plan) -> str:
    which = "the default" if plan.block_size == DEFAULT_BLOCK_SIZE else f"chosen; the default is {DEFAULT_BLOCK_SIZE}"
    return (f"block size {plan.block_size} ({which}): one block holds {format_bytes(plan.kv_bytes_per_block)} of KV. "
            f"On an H200 (BENCHMARKS.md) 8 was the slowest and 16-256 were within noise for short and "
            f"long requests; larger blocks only waste more of each sequence's last block")


def _capacity_advice(plan, shape: ModelShape) -> list[str]:
    lines = []
    budget, b = plan.budget_bytes, plan.dtype_bytes
    headroom = plan.gpu_mem_bytes - budget
    if plan.resident_weight_bytes > budget:
        fix = (f"use --dtype bfloat16 ({format_bytes(plan.resident_weight_bytes // 2)} of weights)" if b == 4 else
               "use a GPU with more memory or a smaller model")
        fp8 = _fp8_weight_bytes(plan, shape)
        if fp8 is not None and fp8 < plan.resident_weight_bytes and b == 2:
            fix = f"use --quantization fp8 ({format_bytes(fp8)} of weights), or " + fix
        if plan.num_experts:
            fix += f", or keep fewer of the {plan.num_experts} experts per layer resident (moe_expert_cache_size)"
        return [f"does not fit: weights alone ({format_bytes(plan.resident_weight_bytes)}) exceed the budget "
                f"({format_bytes(budget)} = {format_bytes(plan.gpu_mem_bytes)} x {plan.gpu_memory_utilization}): {fix}"]

    free_for_kv = max(0, plan.kv_budget_bytes)
    if plan.max_concurrency == 0:
        fixed = plan.resident_weight_bytes + plan.logits_bytes + plan.cuda_graph_bytes + plan.context_bytes
        per_token_act = decoder_peak_bytes_per_token(plan)
        room = budget - fixed - plan.kv_bytes_per_seq
        if room >= per_token_act:
            lines.append(
                f"does not fit: activations at max-num-batched-tokens {plan.max_num_batched_tokens} "
                f"({format_bytes(plan.activation_peak_bytes)}) leave {format_bytes(free_for_kv)} for KV, less than one "
                f"max-model-len sequence ({format_bytes(plan.kv_bytes_per_seq)}): use "
                f"--max-num-batched-tokens {room // per_token_act}")
        fit_len = plan.kv_capacity_tokens
        # A running sequence's KV is all on the device: a host tier would not make it fit.
        fp8 = _fp8_kv_advice(plan, plan.kv_bytes_per_seq) if plan.kv_bytes_per_seq // b <= free_for_kv else ""
        lines.append(
            f"does not fit: one max-model-len {plan.max_model_len} sequence needs "
            f"{format_bytes(plan.kv_bytes_per_seq)} of KV; {format_bytes(free_for_kv)} is available: use "
            + (f"--max-model-len {fit_len}" if fit_len else "a GPU with more memory or a smaller model") + fp8)
        return lines

    if plan.kv_bytes_wanted > free_for_kv:
        lines.append(
            f"max-num-seqs {plan.max_num_seqs} at max-model-len {plan.max_model_len} needs "
            f"{format_bytes(plan.kv_bytes_wanted)} of KV; {format_bytes(free_for_kv)} is available: use "
            f"--max-num-seqs {plan.max_concurrency}" + _fp8_kv_advice(plan, plan.kv_bytes_wanted)
            + _fp8_weights_advice(plan, shape) + _host_tier_advice(plan, plan.kv_bytes_wanted - free_for_kv))
    else:
        lines.append(
            f"fits: max-num-seqs {plan.max_num_seqs} at max-model-len {plan.max_model_len} needs "
            f"{format_bytes(plan.kv_bytes_wanted)} of KV; {format_bytes(free_for_kv)} is available "
            f"({plan.max_concurrency} full-length sequences, {plan.kv_capacity_tokens:,} tokens)")
    lines.append(
        f"{format_bytes(headroom)} (1 - {plan.gpu_memory_utilization} of {format_bytes(plan.gpu_mem_bytes)}) stays "
        f"outside the budget for the CUDA context and allocator fragmentation, which the config "
        f"cannot tell; measure them with `mempath diagnose`")
    return lines


def _fp8_kv_advice(plan, kv_bytes: int) -> str:
    """--kv-cache-dtype fp8 where the cache is in the model dtype: one byte per element instead of b."""
    if plan.kv_cache_dtype != "auto" or plan.dtype_bytes == 1:
        return ""
    return (f", or --kv-cache-dtype fp8 ({format_bytes(kv_bytes // plan.dtype_bytes)} of KV for the same tokens; "
            f"its accuracy: docs/architecture.md)")


def _fp8_weight_bytes(plan, shape: ModelShape) -> int | None:
    """The resident weights with --quantization fp8, or None when they are fp8 already."""
    if plan.quantization is not None:
        return None
    fp8 = weight_bytes(dataclasses.replace(shape, quantization="fp8"), plan.dtype_bytes)["total"]
    return plan.resident_weight_bytes - (plan.weight_bytes - fp8)


def _fp8_weights_advice(plan, shape: ModelShape) -> str:
    """--quantization fp8 for a 16-bit model: the bytes it gives the KV cache (its accuracy: docs/quantization.md)."""
    fp8 = _fp8_weight_bytes(plan, shape)
    if fp8 is None or plan.dtype_bytes != 2:
        return ""
    return (f", or --quantization fp8 ({format_bytes(plan.resident_weight_bytes - fp8)} more for KV: "
            f"{format_bytes(fp8)} of weights; its accuracy: docs/quantization.md)")


def _host_tier_advice(plan, missing: int) -> str:
    """The --cpu-kv-gb that holds the sequences the device cannot, within what the host may pin."""
    if plan.host_mem_bytes is None:
        return ""
    pinnable = int(plan.host_mem_bytes * HOST_KV_FRACTION)
    why = "to keep the KV of the sequences that wait or are preempted instead of recomputing it"
    if _gib_ceil(missing) * GiB <= pinnable:
        return f", or --cpu-kv-gb {_gib_ceil(missing)} {why}"
    limit = f"more than {HOST_KV_FRACTION:.0%} of this host's {format_bytes(plan.host_mem_bytes)}"
    most = pinnable // GiB
    if most * GiB < plan.kv_bytes_per_seq:
        return f" (a host tier for the rest would need {format_bytes(missing)}, {limit})"
    return (f"; a host tier for the rest would need {format_bytes(missing)}, {limit}: --cpu-kv-gb {most} "
            f"holds {most * GiB // plan.kv_bytes_per_seq:,} of those sequences")


def _gib_ceil(n: int) -> int:
    # --cpu-kv-gb counts GiB (as vLLM's *-gb flags do); round up so the advice suffices.
    return max(1, math.ceil(n / GiB))


def _training_advice(plan, shape: ModelShape) -> list[str]:
    if plan.budget_bytes is None:
        return [f"training needs {format_bytes(plan.train_total_bytes)} per GPU; pass --gpu-mem to check the fit"]
    if plan.train_total_bytes <= plan.budget_bytes:
        return [f"training fits: {format_bytes(plan.train_total_bytes)} of {format_bytes(plan.budget_bytes)}"]
    current = dict(optimizer=plan.optimizer, micro_batch=plan.micro_batch, seq_len=plan.seq_len,
                   checkpointing=plan.checkpointing, checkpoint_layers=plan.checkpoint_layers,
                   lora_rank=plan.lora_rank, lora_targets=plan.lora_targets or ("q_proj", "v_proj"))
    options = []
    if plan.checkpointing != "full":
        options.append(("--checkpointing full", dict(checkpointing="full", checkpoint_layers=())))
    if plan.optimizer != "adamw-8bit":
        options.append(("--optimizer adamw-8bit", dict(optimizer="adamw-8bit")))
    if plan.lora_rank == 0:
        options.append(("--lora-rank 16", dict(lora_rank=16)))
    if plan.micro_batch > 1:
        options.append(("--micro-batch 1", dict(micro_batch=1)))
    options.append(("all of these", {k: v for _, o in options for k, v in o.items()}))
    fixes = []
    for flag, change in options:
        total = plan_training(shape, plan.dtype_bytes, **{**current, **change})["train_total_bytes"]
        fixes.append(f"{flag} -> {format_bytes(total)}{'' if total <= plan.budget_bytes else ' (still too big)'}")
    return [f"training does not fit: {format_bytes(plan.train_total_bytes)} needed, "
            f"{format_bytes(plan.budget_bytes)} available; " + "; ".join(fixes)]

