"""Out-of-memory explanations: which pathway overflowed, the ledger, and the fix that fits.

A bare ``torch.OutOfMemoryError`` says how many bytes one allocation wanted; it does
not say which consumer of memory was over its budget or what setting would have
fitted. ``oom_guard(stage, ledger, config)`` turns that error into a
``MempathOutOfMemoryError`` whose message names the pathway, shows the ledger
table and gives flags with numbers computed from the planner's formulas (memory/formulas.py) and the
figures at hand (bytes asked for, bytes free).

Stages and the pathway each one feeds:

    load           weights
    profile        activation_peak (the largest step, run once at start-up)
    kv_allocation  kv_cache
    step           activations of one serving step (the batch being run)
    cuda_graphs    cuda_graphs (decode graph capture)
"""
from __future__ import annotations

import dataclasses
import math
import re
from contextlib import contextmanager

from mempath.memory.formulas import (ModelShape, ServingFigures, decoder_peak_bytes_per_token,
                                     expert_cache_size_that_fits, load_bytes, load_device_bytes, logits_bytes,
                                     read_shape, resolve_dtype,
                                     resolve_expert_cache_size, serving_figures)
from mempath.memory.ledger import Ledger, format_bytes

GiB = 1 << 30

STAGE_PATHWAYS = {
    "load": "weights",
    "profile": "activation_peak",
    "kv_allocation": "kv_cache",
    "step": "activations",
    "cuda_graphs": "cuda_graphs",
}


class MempathOutOfMemoryError(RuntimeError):
    """Out of memory, with the explanation and the numbers behind it."""

    def __init__(self, explanation: str, *, stage: str, pathway: str,
                 requested_bytes: int | None = None, free_bytes: int | None = None):
        super().__init__(explanation)
        self.explanation = explanation
        self.stage = stage
        self.pathway = pathway
        self.requested_bytes = requested_bytes
        self.free_bytes = free_bytes


# ---------------------------------------------------------------- reading the torch error

_SIZE = r"([0-9]+(?:\.[0-9]+)?)\s*(bytes|B|KiB|MiB|GiB|TiB)"
_UNITS = {"b": 1, "bytes": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_oom_message(message: str) -> tuple[int | None, int | None]:
    """(bytes requested, bytes free) as written in a CUDA or CPU allocator error, else None.

    CUDA: "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which
    1.20 GiB is free." CPU: "DefaultCPUAllocator: can't allocate memory: you tried to
    allocate 123456 bytes."
    """
    def find(pattern):
        match = re.search(pattern, message, re.IGNORECASE)
        if not match:
            return None
        number, unit = match.groups()
        return int(float(number) * _UNITS[unit.lower()])

    requested = find(r"tried to allocate\s+" + _SIZE)
    free = find(r"of which\s+" + _SIZE + r"\s+is free")
    return requested, free


def is_out_of_memory(error: BaseException) -> bool:
    import torch
    if isinstance(error, torch.OutOfMemoryError):
        return True
    # The CPU allocator raises a plain RuntimeError.
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


# ---------------------------------------------------------------- explaining

def explain_oom(stage: str, ledger: Ledger, requested_bytes: int | None, free_bytes: int | None,
                config, *, dtype: str | None = None, total_bytes: int | None = None) -> str:
    """Why the allocation of `stage` failed, the ledger, and fixes computed from the numbers.

    `config` is an EngineConfig (or any object with its fields). `dtype` is the dtype the
    engine resolved ("bfloat16", ...); by default it is resolved as the engine does.
    `total_bytes` is the device's capacity; without it the capacity-based fixes are left out.
    """
    pathway = STAGE_PATHWAYS.get(stage, stage)
    plan = _plan_for(config, dtype)
    lines = [f"out of memory in stage {stage!r}: the {pathway} pathway exceeded its budget"]
    if requested_bytes is not None or free_bytes is not None:
        asked = format_bytes(requested_bytes) if requested_bytes is not None else "an unknown amount"
        free = format_bytes(free_bytes) if free_bytes is not None else "an unknown amount"
        lines.append(f"  one allocation asked for {asked}; {free} was free on the device")
    fixes = _fixes(stage, plan, config, dtype, ledger, requested_bytes, free_bytes, total_bytes)
    lines.append("")
    lines.append("memory by pathway at the time (mempath ledger):")
    table = ledger.table() if ledger.entries else "(nothing recorded yet)"
    lines += ["  " + row for row in table.splitlines()]
    lines.append("")
    if fixes:
        lines.append("what would have fitted:")
        lines += [f"  - {fix}" for fix in fixes]
    else:
        lines.append("no setting of this engine fits it: use a device with more free memory")
    return "\n".join(lines)


def _plan_for(config, dtype: str | None) -> ServingFigures | None:
    """The planner's figures for the engine's settings, or None if the config cannot be read."""
    try:
        shape, dtype_bytes = _shape_for(config, dtype)
        max_model_len = getattr(config, "max_model_len", None)
        return serving_figures(
            shape, dtype_bytes,
            max_model_len=shape.max_model_len_limit if max_model_len is None else max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size, cuda_graphs=not getattr(config, "enforce_eager", True),
            kv_cache_dtype=getattr(config, "kv_cache_dtype", "auto"))  # an fp8 cache's blocks are 1 B an element
    except (ValueError, OSError):
        return None


def _shape_for(config, dtype: str | None) -> tuple[ModelShape, int]:
    """The model's shape as the engine holds it (fp8 weights, the expert cache's slots) and its dtype's bytes."""
    from mempath.model.loader import read_config
    shape = read_shape(read_config(config.model))
    if getattr(config, "quantization", None):  # fp8 weights: the bytes the engine holds
        shape = dataclasses.replace(shape, quantization=config.quantization)
    _, dtype_bytes = resolve_dtype(dtype or _engine_dtype(config), shape)
    # Resolved as start-up resolves it: with an expert cache the device holds only the resident
    # experts, and a step holds the cache's slot waves (serving_figures reads both from the shape).
    slots = resolve_expert_cache_size(shape, dtype_bytes, getattr(config, "moe_expert_cache_size", None),
                                      getattr(config, "moe_expert_cache_gb", None), str(config.model))
    return dataclasses.replace(shape, num_expert_slots=slots or 0), dtype_bytes


def _expert_cache_fixes(config, dtype: str | None, plan: ServingFigures, free) -> list[str]:
    """A MoE model whose load overflows ``free``: the most experts a layer whose load fits, spending what the
    loader's own check spends (formulas.load_bytes, load_device_bytes), so the size named is one it accepts."""
    if free is None or plan.resident_weight_bytes <= free:
        return []
    try:
        shape, dtype_bytes = _shape_for(config, dtype)
        named = _checkpoint_dtype(config)
        checkpoint_bytes = 4 if named is None else named.itemsize  # none named: float32, as the loader reads it
    except (ValueError, OSError):
        return []
    size = shape.num_expert_slots or None
    on_device = load_device_bytes(load_bytes(shape, dtype_bytes, plan.max_model_len, checkpoint_bytes, size))
    fits = expert_cache_size_that_fits(shape, dtype_bytes, on_device, free, size)
    if fits is None:
        return []
    gb = getattr(config, "moe_expert_cache_gb", None)
    instead = f" in place of --moe-expert-cache-gb {gb:g}" if gb is not None else ""
    return [f"--moe-expert-cache-size {fits} or less{instead}: experts a layer on the device, the others in pinned "
            f"host memory (docs/moe.md); the KV cache needs room too, which `mempath plan` with the flag shows"]


def _checkpoint_dtype(config):
    from mempath.model.loader import checkpoint_dtype, read_config
    return checkpoint_dtype(read_config(config.model))


def _engine_dtype(config) -> str:
    # Resolve "auto" the way the engine does, so the figures are those of the dtype it runs.
    return str(config.torch_dtype(_checkpoint_dtype(config))).removeprefix("torch.")


def _fixes(stage, plan, config, dtype, ledger, requested, free, total) -> list[str]:
    if plan is None:
        return []
    if stage == "load":
        # In bfloat16 a --moe-expert-cache-gb holds more experts: that dtype's own figures, not half.
        return (_weight_fixes(plan, free, _plan_for(config, "bfloat16") if plan.dtype_bytes == 4 else None)
                + _expert_cache_fixes(config, dtype, plan, free))
    if stage == "kv_allocation":
        return _kv_fixes(plan, config, ledger, requested, free, total)
    if stage in ("profile", "step"):
        return _activation_fixes(plan, config, requested, free)
    if stage == "cuda_graphs":
        return [f"--enforce-eager: no decode graphs (the planner puts their pool at "
                f"{format_bytes(plan.cuda_graph_bytes)} for batch <= {plan.cuda_graph_batch}), "
                f"or a lower --max-num-seqs for smaller graphs"]
    return []


def _weight_fixes(plan, free, bfloat16) -> list[str]:
    need = plan.resident_weight_bytes
    fixes = []
    if bfloat16 is not None:
        fixes.append(f"--dtype bfloat16: weights need {format_bytes(bfloat16.resident_weight_bytes)} "
                     f"instead of {format_bytes(need)} (planner: {plan.total_params:,} parameters x 2 B"
                     + (", less the experts left in host memory)" if need < plan.weight_bytes else ")"))
    if free is not None and need > free:
        fixes.append(f"the weights need {format_bytes(need)} and {format_bytes(free)} is free: free "
                     f"{format_bytes(need - free)} on the device (other processes show in "
                     f"`nvidia-smi`) or use a device with more memory")
    return fixes


def _kv_fixes(plan, config, ledger, requested, free, total) -> list[str]:
    per_block = plan.kv_bytes_per_block
    blocks_wanted = requested // per_block if requested else None
    fixes = []
    if free is None:
        return fixes
    fit_blocks = free // per_block
    fit_tokens = fit_blocks * plan.block_size
    wanted_text = (f"{blocks_wanted:,} KV blocks ({format_bytes(requested)})"
                   if blocks_wanted else "the KV cache")
    fixes.append(f"{wanted_text} were asked for; {format_bytes(free)} is free, which holds "
                 f"{fit_blocks:,} blocks of {format_bytes(per_block)} ({fit_tokens:,} tokens): "
                 f"use --num-gpu-blocks-override {fit_blocks}" if fit_blocks else
                 f"{wanted_text} were asked for and not one block ({format_bytes(per_block)}) fits "
                 f"in the {format_bytes(free)} that is free")
    if total and requested and requested > free:
        # The engine sizes KV as total x utilization minus what is in use; lower it by the deficit.
        utilization = config.gpu_memory_utilization - (requested - free) / total
        utilization = math.floor(utilization * 100) / 100
        if utilization > 0:
            fixes.append(f"--gpu-memory-utilization {utilization:.2f} (from "
                         f"{config.gpu_memory_utilization}) leaves the {format_bytes(requested - free)} "
                         f"that something outside the budget holds")
    concurrency = fit_blocks // plan.blocks_per_seq
    wanted_seqs = config.max_num_seqs
    if fit_blocks and concurrency < wanted_seqs:
        fixes.append(
            f"max-num-seqs {wanted_seqs} at max-model-len {plan.max_model_len} needs "
            f"{format_bytes(wanted_seqs * plan.kv_bytes_per_seq)} of KV; {format_bytes(free)} is free: "
            + (f"use --max-num-seqs {concurrency}" if concurrency else
               f"use --max-model-len {fit_tokens}")
            + _offload_hint(config, wanted_seqs * plan.kv_bytes_per_seq - free))
    return fixes


def _activation_fixes(plan, config, requested, free) -> list[str]:
    """Shrink the step until its activations and logits fit in what is free.

    The step needs at least the planner's figure and at least the failing allocation;
    activations grow with the step's tokens (linearly in the planner's model, faster with a
    non-flash attention), so the planner's figures are spent from free x planned / need.
    Each setting offered is the largest whose planned step fits in that budget: fewer
    tokens per step while every sequence still gets one, else fewer sequences too.
    """
    per_token = decoder_peak_bytes_per_token(plan)
    planned = plan.activation_peak_bytes + plan.logits_bytes
    need = max(planned, requested or 0)
    tokens_now, rows_now = plan.max_num_batched_tokens, plan.logits_rows
    fixes = [f"a step of max-num-batched-tokens {tokens_now} needs {format_bytes(planned)} of "
             f"activations and logits by the planner ({format_bytes(per_token)} per token + "
             f"{rows_now} rows of logits and sampling)"
             + (f"; the failing allocation alone asked for {format_bytes(requested)}"
                if requested and requested > planned else "")]
    if free is None:
        return fixes
    if free >= need:
        fixes.append(f"{format_bytes(free)} is free, more than the step needs: the memory was held "
                     f"elsewhere when it failed (see the ledger); lower --gpu-memory-utilization to "
                     f"leave more room outside the KV cache")
        return fixes
    # In the planner's units, so that its figures can be spent.
    budget = free * planned // need

    def fits(seqs: int, tokens: int) -> bool:
        return _step_bytes(plan, seqs, tokens) <= budget

    tokens = _largest(lambda t: fits(rows_now, t), rows_now, tokens_now - 1)
    if tokens is not None:
        fixes.append(f"{format_bytes(free)} is free: use --max-num-batched-tokens {tokens} "
                     f"({format_bytes(_step_bytes(plan, rows_now, tokens))} by the planner"
                     + (f", scaled by the {format_bytes(requested)} the failing allocation asked for)"
                        if need > planned else ")"))
        seqs = _largest(lambda s: fits(s, tokens_now), 1, rows_now - 1)
        if seqs is not None:
            fixes.append(f"or --max-num-seqs {seqs}: {seqs} logit rows take "
                         f"{format_bytes(_logits_bytes(plan, seqs))} instead of {format_bytes(plan.logits_bytes)}")
        return fixes
    seqs = _largest(lambda s: fits(s, s), 1, rows_now - 1)
    if seqs is None:
        fixes.append(f"not even one token's activations and logits row "
                     f"({format_bytes(_step_bytes(plan, 1, 1))}) fit in the {format_bytes(free)} that "
                     f"is free: lower --gpu-memory-utilization so the KV cache leaves room"
                     + (", or use --dtype bfloat16" if plan.dtype_bytes == 4 else ""))
        return fixes
    tokens = _largest(lambda t: fits(seqs, t), seqs, tokens_now)
    fixes.append(f"{format_bytes(free)} is free and {rows_now} logit rows alone take "
                 f"{format_bytes(plan.logits_bytes)}: use --max-num-seqs {seqs} "
                 f"--max-num-batched-tokens {tokens}")
    return fixes


def _logits_bytes(plan, rows: int) -> int:
    return logits_bytes(plan, rows, plan.dtype_bytes)  # reads only the vocabulary size


def _step_bytes(plan, seqs: int, tokens: int) -> int:
    """The planner's activations and logits for a step of `tokens` tokens over at most `seqs` sequences."""
    return tokens * decoder_peak_bytes_per_token(plan) + _logits_bytes(plan, min(seqs, tokens))


def _largest(fits, lo: int, hi: int) -> int | None:
    """The largest n in [lo, hi] with fits(n), where fits holds up to some n and not after; None if not at lo."""
    if lo > hi or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _offload_hint(config, deficit: int) -> str:
    # Only name a host-KV flag this engine really has.
    if hasattr(config, "cpu_kv_gb"):
        return f" or --cpu-kv-gb {max(1, math.ceil(deficit / GiB))}"
    return ""


# ---------------------------------------------------------------- the guard

def _device_memory(config) -> tuple[int | None, int | None]:
    import torch
    try:
        device = config.torch_device()
    except (AttributeError, RuntimeError):
        return None, None
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, None
    free, total = torch.cuda.mem_get_info(device)
    return free, total


@contextmanager
def oom_guard(stage: str, ledger: Ledger, config, *, requested_bytes: int | None = None,
              dtype: str | None = None):
    """Turn an out-of-memory error inside the block into MempathOutOfMemoryError.

    The free figure is read from the error message (the allocator's view at the moment
    of failure) and otherwise from the device after the failure.
    """
    try:
        yield
    except Exception as error:  # noqa: BLE001 - only OOMs are converted, the rest re-raised
        if isinstance(error, MempathOutOfMemoryError) or not is_out_of_memory(error):
            raise
        asked, free = parse_oom_message(str(error))
        device_free, total = _device_memory(config)
        asked = asked if asked is not None else requested_bytes
        free = free if free is not None else device_free
        explanation = explain_oom(stage, ledger, asked, free, config, dtype=dtype, total_bytes=total)
        raise MempathOutOfMemoryError(explanation, stage=stage, pathway=STAGE_PATHWAYS.get(stage, stage),
                                      requested_bytes=asked, free_bytes=free) from error
