"""`mempath plan MODEL ...`: the plan as a terminal table (or JSON), and its flags."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from mempath.constants import DEFAULT_BLOCK_SIZE
from mempath.engine_flags import add_memory_arguments, add_refused_arguments
from mempath.memory.formulas import (ASSUMED_CUT_SECONDS, ASSUMED_DEVICE_READ_BYTES_PER_S, ASSUMED_H2D_BYTES_PER_S,
                                     ASSUMED_HOST_READ_BYTES_PER_S)
from mempath.memory.ledger import format_bytes
from mempath.tools.plan import MemoryPlan, detect_gpu_mem, parse_size_flag, plan_memory
from mempath.tools.training import CHECKPOINTING, OPTIMIZERS


def _row(label: str, n: int, params: int | None = None) -> str:
    count = f"{params:>16,}" if params is not None else " " * 16
    return f"  {label:<34}{count}  {format_bytes(n):>12}  {n:>19,} B"


def _quantization_text(p: MemoryPlan) -> str:
    """The title's words on fp8 projections, and how many the checkpoint keeps in the model dtype."""
    if not p.quantization:
        return ""
    text = ", projections in fp8 (1 B/weight + a float32 scale per output channel)"
    if p.unquantized_projections:
        total = p.fp8_projections + p.unquantized_projections
        text += (f"; {p.unquantized_projections} of the {total} stay in {p.dtype}, as the checkpoint's "
                 f"quantization_config keeps them")
    return text


def format_plan(plan: MemoryPlan) -> str:
    p = plan
    out = [
        f"mempath plan: {p.architecture}, {p.dtype} ({p.dtype_bytes} B/element)" + _quantization_text(p),
        f"  {p.num_layers} layers, hidden {p.hidden_size}, {p.num_heads} heads "
        f"({p.num_kv_heads} KV, head dim {p.head_dim}), intermediate {p.intermediate_size}, "
        f"vocab {p.vocab_size}, embeddings {'tied' if p.tied_embeddings else 'untied'}",
        "",
        f"{'weights':<36}{'params':>16}  {'size':>12}  {'bytes':>21}",
        _row("embedding", p.embedding_bytes, p.embedding_params),
        _row("attention", p.attention_bytes, p.attention_params),
        _row("mlp" + (" (dense layers, routers)" if p.num_experts else ""), p.mlp_bytes, p.mlp_params),
        *([_row(f"experts ({p.num_experts}/layer, {p.num_experts_per_tok} active)",
                p.expert_bytes, p.expert_params)] if p.num_experts else []),
        _row("norms", p.norm_bytes, p.norm_params),
        _row("lm head" + (" (tied: no extra bytes)" if p.tied_embeddings else ""),
             p.lm_head_bytes, p.lm_head_params),
        _row("total", p.weight_bytes, p.total_params),
        *([_row(f"on the device ({p.expert_cache_size} experts/layer)", p.resident_weight_bytes),
           _row("in host memory (every expert)", p.host_expert_bytes),
           _row("active (k experts/layer)", p.active_bytes, p.active_params),
           _row("read per decode token (one embedding row)" if not p.tied_embeddings else "read per decode token",
                p.read_bytes_per_token, p.read_params_per_token)]
          if p.num_experts else []),
        *([_moe_decode_line(p)] if p.moe_hit_rate is not None else []),
        "",
        "KV cache",
        _row("per token", p.kv_bytes_per_token),
        _row(f"per block ({p.block_size} tokens)", p.kv_bytes_per_block),
        _row(f"per sequence ({p.max_model_len} tokens)", p.kv_bytes_per_seq),
        _row(f"max-num-seqs {p.max_num_seqs} at full length", p.kv_bytes_wanted),
        "",
        f"workspace (max-num-batched-tokens {p.max_num_batched_tokens}, max-num-seqs {p.max_num_seqs})",
        _row("activation peak (one layer)", p.activation_peak_bytes),
        _row(f"logits + sampler ({p.logits_rows} rows)", p.logits_bytes),
        _row("step peak (+ cuBLAS workspace)", p.step_peak_bytes),
        _row("its largest block, kept spare", p.step_largest_block_bytes),
        _row(f"CUDA graphs (batch <= {p.cuda_graph_batch})" if p.cuda_graphs else "CUDA graphs (off)",
             p.cuda_graph_bytes),
        _row("context (given; not derivable)", p.context_bytes),
        _row("kept for growth outside PyTorch", p.outside_torch_growth_bytes),
        _row("total", p.workspace_bytes),
        "",
    ]
    out += _capacity_lines(p) + (_training_lines(p) if p.train else [])
    out.append("advice")
    out += [f"  - {line}" for line in p.advice]
    return "\n".join(out)


def _moe_decode_line(p: MemoryPlan) -> str:
    if p.moe_decode_tokens_per_s is None:
        return "  batch-1 decode not predicted: --moe-cpu-experts always decodes eagerly (auto or never are predicted)"
    host = ("" if p.moe_cpu_experts != "auto" else
            f"; auto: some misses run on the host meanwhile, its reads at {p.moe_host_read_bytes_per_s / 1e9:.1f} GB/s "
            f"(--host-read-gbps; an H200 host's)")
    return (f"  predicted batch-1 decode {p.moe_decode_tokens_per_s:.1f} tok/s: hit rate {p.moe_hit_rate:.0%} = "
            f"the resident fraction {p.expert_cache_size}/{p.num_experts} (the uniform router's; a router with "
            f"locality hits more), misses copied at {p.moe_h2d_bytes_per_s / 1e9:.0f} GB/s pinned host->device, "
            f"{p.moe_device_read_bytes_per_s / 1e9:.0f} GB/s device read for the weights a token reads, not overlapped "
            f"(--h2d-gbps, --device-read-gbps), and {ASSUMED_CUT_SECONDS * 1e6:.0f} us a MoE layer for the decode "
            f"graph's host step (measured on an H200){host}")


def _capacity_lines(p: MemoryPlan) -> list[str]:
    if p.budget_bytes is None:
        return ["capacity: needs --gpu-mem (no CUDA device visible)", ""]
    return [
        f"capacity (gpu-mem {format_bytes(p.gpu_mem_bytes)} x {p.gpu_memory_utilization})",
        _row("budget", p.budget_bytes),
        _row("- weights" + (" (resident)" if p.num_experts else ""), p.resident_weight_bytes),
        _row("- workspace", p.workspace_bytes),
        _row("= KV budget", p.kv_budget_bytes),
        f"  {'KV blocks':<34}{p.num_kv_blocks:>16,}",
        f"  {'KV tokens':<34}{p.kv_capacity_tokens:>16,}",
        f"  {f'max concurrency at {p.max_model_len}':<34}{p.max_concurrency:>16,}",
        "",
    ]


def _training_lines(p: MemoryPlan) -> list[str]:
    setup = f"{p.optimizer}, micro-batch {p.micro_batch}, seq-len {p.seq_len}, checkpointing {p.checkpointing}"
    if p.checkpoint_layers:
        setup += f" (layers {_layer_ranges(p.checkpoint_layers)})"
    if p.lora_rank:
        setup += f", LoRA r={p.lora_rank} on {','.join(p.lora_targets)}"
    bits = "fp32" if p.activation_dtype_bytes == 4 else f"{8 * p.activation_dtype_bytes}-bit"
    return [
        f"training ({setup})",
        f"  {'trainable params':<34}{p.trainable_params:>16,}",
        _row("weights", p.train_weight_bytes),
        _row("gradients", p.grad_bytes),
        _row("fp32 master weights", p.master_weight_bytes),
        _row("optimizer moments", p.optimizer_bytes),
        _row(f"activations per layer ({bits})", p.activation_bytes_per_layer),
        _row("activations", p.train_activation_bytes),
        _row(f"logits ({bits} + fp32 log-softmax)", p.train_logits_bytes),
        _row("total", p.train_total_bytes),
        "",
    ]


def _layer_ranges(layers) -> str:
    runs, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            runs.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(runs)


# ---------------------------------------------------------------- CLI


MAX_LAYERS = 1 << 16


def parse_layers(text: str) -> list[int]:
    """"0,2,4" or "0-15,20" -> layer indices."""
    layers = []
    for part in filter(None, (s.strip() for s in text.split(","))):
        try:
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"cannot read layer list {text!r}: write e.g. 0,2,4 or 0-15") from None
        if last < first:
            raise ValueError(f"layer range {part!r} runs backwards: write {last}-{first}")
        if last >= MAX_LAYERS:  # listed one by one below: a typo's range filled the memory first
            raise ValueError(f"checkpoint layers {part!r} out of range: no model has {last + 1} layers; give the "
                             f"model's layer indices")
        layers += range(first, last + 1)
    return layers


# Training flags default to None, so that one given without --train is told from one left out; the
# defaults plan_training gets.
TRAINING_DEFAULTS = {"optimizer": "adamw-fp32", "micro_batch": 1, "seq_len": None, "checkpointing": "none",
                     "checkpoint_layers": "", "lora_rank": 0, "lora_targets": "q_proj,v_proj"}
# The MoE prediction's rates: (argument, plan_memory keyword, default bytes/s). None when not given, as above.
RATES = (("h2d_gbps", "moe_h2d_bytes_per_s", ASSUMED_H2D_BYTES_PER_S),
         ("device_read_gbps", "moe_device_read_bytes_per_s", ASSUMED_DEVICE_READ_BYTES_PER_S),
         ("host_read_gbps", "moe_host_read_bytes_per_s", ASSUMED_HOST_READ_BYTES_PER_S))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="+",
                        help="model directory, config.json, or a cached hub id; several (NAME=DIR as `mempath "
                             "serve` reads them): their plan on one device, with one shared KV pool")
    add_memory_arguments(parser)
    add_refused_arguments(parser)  # as serve and diagnose: -tp 2 says why, not "unrecognized arguments"
    parser.add_argument("--kv-min-share", type=float, default=0.0,
                        help="several models: the fraction of the KV pool each model is guaranteed")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="several models: the number of KV pages, instead of what the budget leaves")
    parser.add_argument("--sleep-offload-weights", action="store_true",
                        help="several models: count each model's pinned host copy of its weights (serve's flag)")
    parser.add_argument("--gpu-mem", default=None,
                        help="device memory with its unit, e.g. 80GiB, 24GB or 85899345920B; a bare "
                             "number is refused (default: the CUDA device's)")
    parser.add_argument("--context-mem", default="0",
                        help="non-PyTorch memory to hold back (CUDA context etc.) with its unit, e.g. 500MiB")
    # argparse took "-1GiB" for an option and answered "--gpu-mem: expected one argument" under its usage;
    # read as a value it gets the size's own line (Python 3.13's matcher reads it so already).
    parser._negative_number_matcher = re.compile(r"^-\.?\d")
    parser.add_argument("--train", action="store_true", help="also plan training memory")
    parser.add_argument("--optimizer", default=None, choices=list(OPTIMIZERS),
                        help="with --train (default: adamw-fp32)")
    parser.add_argument("--micro-batch", type=int, default=None, help="with --train (default: 1)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="with --train (default: max-model-len, at most 4096)")
    parser.add_argument("--checkpointing", default=None, choices=list(CHECKPOINTING),
                        help="with --train (default: none)")
    parser.add_argument("--checkpoint-layers", default=None, help="with --checkpointing selective: e.g. 0,2,4 or 0-15")
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="with --train: LoRA's rank (default: 0, a full fine-tune)")
    parser.add_argument("--lora-targets", default=None,
                        help="with --lora-rank: comma list or all-linear (default: q_proj,v_proj)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--h2d-gbps", default=None,
                        help="MoE with fewer experts resident: pinned host-to-device GB/s for the predicted "
                             f"decode tok/s (default: an H200's, {ASSUMED_H2D_BYTES_PER_S / 1e9:g}; "
                             "benchmarks/bench_moe.py measures it)")
    parser.add_argument("--device-read-gbps", default=None,
                        help="the device's weight-read GB/s for the same prediction (default: an H200's copy "
                             f"rate as bench_moe.py measured it, {ASSUMED_DEVICE_READ_BYTES_PER_S / 1e9:g})")
    parser.add_argument("--host-read-gbps", default=None,
                        help="with --moe-cpu-experts auto: the GB/s at which the host reads an expert's weights "
                             f"to run a miss (default: an H200 host's, {ASSUMED_HOST_READ_BYTES_PER_S / 1e9:g}; "
                             "bench_moe.py's host_row_us measures it)")


def run_plan(args: argparse.Namespace) -> int:
    try:
        training, rates = _training_options(args), _rates(args)
        gpu_mem = parse_size_flag("--gpu-mem", args.gpu_mem) if args.gpu_mem is not None else detect_gpu_mem()
        context = parse_size_flag("--context-mem", args.context_mem, "500MiB", allow_zero=True)
        if len(args.model) > 1:
            return run_multi_plan(args, gpu_mem, context, rates)
        if args.kv_min_share or args.num_gpu_blocks_override is not None or args.sleep_offload_weights:
            raise ValueError("--kv-min-share, --num-gpu-blocks-override and --sleep-offload-weights plan several "
                             "models (mempath plan A B ...)")
        _check_one_model(args.model[0])
        import psutil
        plan = plan_memory(
            args.model[0], dtype=args.dtype, gpu_mem_bytes=gpu_mem, host_mem_bytes=psutil.virtual_memory().total,
            gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=DEFAULT_BLOCK_SIZE if args.block_size == "auto" else args.block_size,
            cuda_graphs=not args.enforce_eager, context_bytes=context,
            kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, train=args.train, **training,
            moe_expert_cache_size=args.moe_expert_cache_size, moe_expert_cache_gb=args.moe_expert_cache_gb,
            moe_cpu_experts=args.moe_cpu_experts, **rates)
        _check_rates_apply(args, [plan])
    except ValueError as e:
        print(f"mempath plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0


def _training_options(args: argparse.Namespace) -> dict:
    """plan_memory's training keywords; a training flag without --train is refused, as the plan would drop it."""
    given = {name: getattr(args, name) for name in TRAINING_DEFAULTS if getattr(args, name) is not None}
    if given and not args.train:
        name, value = next(iter(given.items()))
        raise ValueError(f"{_flag(name)} {value} given without --train: it plans training, so add --train "
                         f"(one model) or drop the flag")
    if "lora_targets" in given and not given.get("lora_rank"):
        raise ValueError(f"--lora-targets {given['lora_targets']} given without --lora-rank: add --lora-rank R "
                         f"(e.g. 16) for LoRA, or drop --lora-targets for a full fine-tune")
    options = {**TRAINING_DEFAULTS, **given}
    options["checkpoint_layers"] = parse_layers(options["checkpoint_layers"])
    return options


def _rates(args: argparse.Namespace) -> dict:
    """plan_memory's MoE rates in bytes/s from the GB/s flags: finite and above 0, or JSON would hold Infinity."""
    rates = {}
    for name, keyword, default in RATES:
        text = getattr(args, name)
        if text is None:
            rates[keyword] = default
            continue
        try:
            rate = float(text) * 1e9
        except ValueError:
            rate = math.nan
        if not 0 < rate < math.inf:
            raise ValueError(f"{_flag(name)} {text} is not a finite rate above 0: give GB/s, e.g. "
                             f"{_flag(name)} {default / 1e9:g}")
        rates[keyword] = rate
    return rates


def _check_rates_apply(args: argparse.Namespace, plans: list[MemoryPlan]) -> None:
    """A rate flag is refused where no plan's prediction reads it, as --moe-cpu-experts is without misses."""
    predicted = [p for p in plans if p.moe_decode_tokens_per_s is not None]
    for name, _, _ in RATES:
        text = getattr(args, name)
        if text is None or (predicted if name != "host_read_gbps" else
                            [p for p in predicted if p.moe_cpu_experts == "auto"]):
            continue
        given = f"{_flag(name)} {text}"
        if not any(p.num_experts for p in plans):
            models = " or ".join(sorted({p.architecture for p in plans}))
            raise ValueError(f"{given} is a rate of the predicted decode of a mixture-of-experts model with fewer "
                             f"experts resident (--moe-expert-cache-size), and {models} has no experts: drop the flag")
        if all(p.moe_hit_rate is None for p in plans):
            raise ValueError(f"{given}: every expert is resident, so none misses and no decode is predicted: drop "
                             f"the flag or keep fewer experts on the device (--moe-expert-cache-size)")
        if not predicted:
            raise ValueError(f"{given}: --moe-cpu-experts always decodes eagerly, which is not predicted: drop the "
                             f"flag, or use --moe-cpu-experts auto or never")
        raise ValueError(f"{given} is the host's rate for the misses --moe-cpu-experts auto runs there: add "
                         f"--moe-cpu-experts auto or drop the flag")


def _check_one_model(model: str) -> None:
    """NAME=DIR is `mempath serve`'s syntax for one of several models (multi/names.split_model_arg): alone, the
    name would be read as part of a path that does not exist."""
    name, sep, path = model.partition("=")
    try:
        exists = Path(model).exists()
    except OSError:  # config_path gives the one line for a name the filesystem cannot look up
        return
    if sep and name and "/" not in name and not exists:
        raise ValueError(f"{model}: NAME=DIR names one of several models planned together (mempath plan A=DIR1 "
                         f"B=DIR2); plan one model as mempath plan {path}")


def run_multi_plan(args: argparse.Namespace, gpu_mem: int | None, context: int, rates: dict) -> int:
    """`mempath plan A B ...`: serving only (ValueErrors go to run_plan's one line)."""
    from mempath.tools.plan_multi import format_multi_plan, plan_models
    if args.train:
        raise ValueError("--train plans one model: give one model")
    plan = plan_models(args.model, kv_min_share=args.kv_min_share, gpu_mem_bytes=gpu_mem, context_bytes=context,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       num_gpu_blocks_override=args.num_gpu_blocks_override,
                       sleep_offload_weights=args.sleep_offload_weights,
                       block_size=DEFAULT_BLOCK_SIZE if args.block_size == "auto" else args.block_size,
                       dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, cuda_graphs=not args.enforce_eager,
                       kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                       moe_expert_cache_size=args.moe_expert_cache_size,
                       moe_expert_cache_gb=args.moe_expert_cache_gb, moe_cpu_experts=args.moe_cpu_experts, **rates)
    _check_rates_apply(args, [m.plan for m in plan.models])
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_multi_plan(plan))
    return 0
