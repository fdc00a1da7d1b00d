"""Memory planner: every pathway's bytes from a model's config.json, with no GPU needed.

`plan_memory` turns (config, dtype, device size, engine settings) into a `MemoryPlan`:
the byte formulas of mempath.memory.formulas, the device budget they leave for the KV
cache, the training figures (mempath.tools.training) and the advice
(mempath.tools.advice). `mempath plan` is mempath.tools.plan_cli.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mempath.constants import DEFAULT_BLOCK_SIZE, MAX_SIZE_BYTES, default_max_num_seqs
from mempath.memory.budget import ALLOCATION_ROUNDING, OUTSIDE_TORCH_GROWTH
from mempath.memory.formulas import (CUBLAS_WORKSPACE_BYTES_SM90, ModelShape, check_serving_settings,
                                     count_params, expert_bytes, fp8_projection_counts, read_shape, resolve_dtype,
                                     resolve_expert_cache_size, serving_figures, weight_bytes,
                                     ASSUMED_COPY_ISSUE_SECONDS, ASSUMED_CUT_SECONDS, ASSUMED_DEVICE_READ_BYTES_PER_S,
                                     ASSUMED_H2D_BYTES_PER_S, ASSUMED_HOST_READ_BYTES_PER_S, ASSUMED_HOST_SYNC_SECONDS,
                                     moe_offload_tokens_per_second)
from mempath.memory.ledger import format_bytes
from mempath.model.moe_host import check_cpu_experts
from mempath.tools.advice import advise
from mempath.tools.training import plan_training

DEFAULT_TRAIN_SEQ_LEN = 4096


@dataclass
class MemoryPlan:
    # model
    architecture: str
    dtype: str
    dtype_bytes: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    # weights, per pathway (parameters, then bytes in `dtype`)
    embedding_params: int
    attention_params: int
    mlp_params: int
    norm_params: int
    lm_head_params: int
    total_params: int
    embedding_bytes: int
    attention_bytes: int
    mlp_bytes: int
    norm_bytes: int
    lm_head_bytes: int
    weight_bytes: int
    # KV cache
    block_size: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    blocks_per_seq: int
    kv_bytes_per_seq: int
    # settings
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_mem_bytes: int | None
    gpu_memory_utilization: float
    cuda_graphs: bool
    fused_kernels: bool  # the activation peak assumes the fused CUDA path (else the PyTorch one)
    # workspace
    activation_peak_bytes: int
    logits_rows: int
    logits_bytes: int
    step_peak_bytes: int  # max(activation peak, sampling phase): what the engine's profile step measures
    step_largest_block_bytes: int  # the step's largest tensor, kept spare beside its peak (formulas)
    cuda_graph_batch: int
    cuda_graph_bytes: int
    context_bytes: int
    outside_torch_growth_bytes: int  # the engine's margin for what grows outside PyTorch while serving
    workspace_bytes: int
    # capacity (None without gpu_mem_bytes)
    budget_bytes: int | None = None
    kv_budget_bytes: int | None = None
    num_kv_blocks: int | None = None
    kv_capacity_tokens: int | None = None
    max_concurrency: int | None = None
    kv_bytes_wanted: int = 0
    fits: bool | None = None  # serving: at least one max-model-len sequence fits
    host_mem_bytes: int | None = None  # bounds the host KV tier the advice may propose
    kv_cache_dtype: str = "auto"  # auto: the model dtype; fp8*: one byte per element
    quantization: str | None = None  # fp8: the projections' weights in one byte (formulas.weight_bytes)
    # fp8: the projections (fused q/k/v and gate/up count as one) held in fp8, and those the checkpoint
    # keeps in the model dtype (its quantization_config; formulas.fp8_projection_counts)
    fp8_projections: int = 0
    unquantized_projections: int = 0
    # mixture of experts (zeros for a dense model); the routed experts are not in mlp_*
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_cache_size: int = 0  # experts per layer resident on the device
    expert_params: int = 0
    expert_bytes: int = 0  # every routed expert
    resident_expert_bytes: int = 0
    resident_weight_bytes: int = 0  # what the device holds: weight_bytes less the experts not resident
    host_expert_bytes: int = 0  # with fewer resident, host memory holds every expert (slots copy from it)
    active_params: int = 0  # parameters one token reads: all but the routed experts, plus k of them per layer
    # what a decode token reads of them: an untied embedding table gives one row (a tied one is the LM head)
    read_params_per_token: int = 0
    active_bytes: int = 0  # as the weights are held: fp8 projections one byte each, with their scales
    read_bytes_per_token: int = 0
    # batch-1 decode with fewer experts resident (None otherwise): the uniform router's hit rate
    # (resident fraction), the misses' copies at moe_h2d_bytes_per_s, the active weights' read
    moe_hit_rate: float | None = None
    moe_decode_tokens_per_s: float | None = None
    moe_h2d_bytes_per_s: float = ASSUMED_H2D_BYTES_PER_S
    moe_device_read_bytes_per_s: float = ASSUMED_DEVICE_READ_BYTES_PER_S
    # --moe-cpu-experts: under auto the prediction splits a layer's misses between the host (an expert's
    # row at moe_host_read_bytes_per_s) and the copies; always (eager decode) is not predicted
    moe_cpu_experts: str = "never"
    moe_host_read_bytes_per_s: float = ASSUMED_HOST_READ_BYTES_PER_S
    # training (zeros unless train=True)
    train: bool = False
    optimizer: str = "adamw-fp32"
    micro_batch: int = 1
    seq_len: int = 0
    checkpointing: str = "none"
    checkpoint_layers: list[int] = field(default_factory=list)
    lora_rank: int = 0
    lora_targets: list[str] = field(default_factory=list)
    trainable_params: int = 0
    train_weight_bytes: int = 0
    grad_bytes: int = 0
    master_weight_bytes: int = 0
    optimizer_bytes: int = 0
    activation_dtype_bytes: int = 0  # bytes of a training activation element: the forward's compute dtype
    activation_bytes_per_layer: int = 0
    train_activation_bytes: int = 0
    train_logits_bytes: int = 0
    train_total_bytes: int = 0
    train_fits: bool | None = None
    advice: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- config and sizes


def config_path(model: str | os.PathLike) -> Path:
    """Where a model's config.json is: in a model directory, the path itself, or the hub cache."""
    path = Path(model).expanduser()
    try:  # a name the filesystem cannot look up at all (too long, ...) raised OSError from is_dir()
        if path.is_dir():
            return path / "config.json"
        if not path.exists():
            return _cached_hub_config(str(model)) or path
    except OSError as error:
        raise unreadable_path(model, error) from None
    return path


def unreadable_path(model: str | os.PathLike, error: OSError) -> ValueError:
    """The one line for a model argument the filesystem refuses to look up, its name shortened."""
    name = os.fspath(model)
    shown = repr(name) if len(name) <= 80 else f"{name[:40]!r}... ({len(name)} characters)"
    return ValueError(f"cannot look for a model at {shown}: {error.strerror or error}; pass a model directory, "
                      f"a path to its config.json, or a hub id that is already downloaded")


def load_config(model: str | os.PathLike | dict) -> dict:
    """The config as a dict, from a dict, a model directory, a config.json path, or a
    Hugging Face hub id already in the local cache (no network)."""
    if isinstance(model, dict):
        return dict(model)
    path = config_path(model)
    if not path.exists():
        raise ValueError(
            f"no config.json at {path}: pass a model directory, a path to its config.json, "
            f"or a hub id that is already downloaded"
        )
    from mempath.model.loader import read_json_object
    return read_json_object(path, "a JSON object of model settings")


def _cached_hub_config(repo_id: str) -> Path | None:
    if repo_id.count("/") != 1:
        return None
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    snapshots = Path(hub) / ("models--" + repo_id.replace("/", "--")) / "snapshots"
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


_SIZE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")
# The prefix letter in any case, an optional i (powers of 1024), an optional B (b, when all is lowercase).
_UNIT = re.compile(r"^(?:([kmgt])(i?))?(B?)$", re.IGNORECASE)
UNITS = "B, K/KB/KiB, M/MB/MiB, G/GB/GiB or T/TB/TiB"


def parse_bytes(text: str | int, allow_zero: bool = False) -> int:
    """"80GiB" -> 85899345920, "24GB" -> 24000000000, "1.5T" -> 1.5e12, "123" -> 123.

    KiB/MiB/GiB/TiB (and Ki, Mi, ...) are powers of 1024; KB/MB/GB/TB and bare K/M/G/T
    are powers of 1000, as on GPU spec sheets. The prefix may be in either case; a capital
    prefix with a lowercase b (Gb, Mib) is bits and refused, as is any size above MAX_SIZE_BYTES
    (all lowercase, "80gb", is bytes: how sizes are often typed).
    """
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        if not match:
            raise ValueError(f"cannot read {text!r} as a size: write e.g. 80GiB, 24GB or a byte count "
                             f"(units: {UNITS})")
        number, unit = match.groups()
        parts = _UNIT.match(unit)
        if unit.endswith("b") and unit[:1].isupper() and _UNIT.match(unit[:-1] + "B"):
            prefix = unit[:-1]
            raise ValueError(f"{text!r} is in bits (a lowercase b): write {number}{prefix[:1].upper()}"
                             f"{prefix[1:].lower()}B for bytes (units: {UNITS})")
        if not parts:
            raise ValueError(f"cannot read {text!r} as a size: {unit!r} is not a unit; use {UNITS}")
        prefix, binary, _ = parts.groups()
        power = "kmgt".find(prefix.lower()) + 1 if prefix else 0
        size = float(number) * (1024 if binary else 1000) ** power
        if size > MAX_SIZE_BYTES:  # also a number too long for a float (inf)
            shown = repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"
            raise ValueError(f"{shown} is more than 1 PiB, which is no device's or host's memory: "
                             f"give it in GiB, e.g. 80GiB")
        value = int(size)
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"size {text!r} must be positive")
    return value


def parse_size_flag(flag: str, text: str, example: str = "80GiB", allow_zero: bool = False) -> int:
    """A size from the command line, which must name its unit: `--gpu-mem 80` meant 80 GiB, not bytes.
    ``allow_zero``: zero, the one size the same in every unit, may come without one."""
    if not str(text).strip():
        raise ValueError(f"{flag} is empty: give a size with its unit, e.g. {flag} {example}, or leave the flag out")
    if allow_zero and re.fullmatch(r"\s*0*\.?0*\s*", str(text)) and "0" in str(text):
        return 0
    if re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", str(text)):
        raise ValueError(f"{flag} {text.strip()} has no unit: write {text.strip()}GiB (or {text.strip()}GB, "
                         f"or {text.strip()}B for bytes)")
    try:
        return parse_bytes(text, allow_zero)
    except ValueError as error:
        if str(error).startswith("size "):  # "size '-1GiB' must be positive": the flag says which size
            raise ValueError(f"{flag} {text} must be positive: give a size such as {flag} {example}") from None
        raise ValueError(f"{flag}: {error}") from None


def detect_gpu_mem() -> int | None:
    """Total memory of the current CUDA device, or None when there is none."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


# ---------------------------------------------------------------- the plan


def _read_model_shape(model: str | dict, quantization: str | None):
    """The model's shape (with quantization applied) and where its config came from."""
    source = "config.json" if isinstance(model, dict) else str(config_path(model))
    shape = read_shape(load_config(model), source)
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be fp8 or None, got {quantization!r}")
    if quantization is not None:
        shape = dataclasses.replace(shape, quantization=quantization)
    return shape, source


def plan_memory(model: str | dict, *, dtype: str = "auto", gpu_mem_bytes: int | None = None,
                host_mem_bytes: int | None = None,
                gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                max_num_seqs: int | None = None, max_num_batched_tokens: int = 8192,
                block_size: int = DEFAULT_BLOCK_SIZE, cuda_graphs: bool = True,
                fused_kernels: bool = True, context_bytes: int = 0,
                cublas_workspace: int = CUBLAS_WORKSPACE_BYTES_SM90, train: bool = False,
                optimizer: str = "adamw-fp32", kv_cache_dtype: str = "auto",
                micro_batch: int = 1, seq_len: int | None = None, checkpointing: str = "none",
                checkpoint_layers=(), lora_rank: int = 0,
                lora_targets=("q_proj", "v_proj"), moe_expert_cache_size: int | None = None,
                quantization: str | None = None, moe_expert_cache_gb: float | None = None,
                moe_h2d_bytes_per_s: float = ASSUMED_H2D_BYTES_PER_S,
                moe_device_read_bytes_per_s: float = ASSUMED_DEVICE_READ_BYTES_PER_S,
                moe_cpu_experts: str = "never",
                moe_host_read_bytes_per_s: float = ASSUMED_HOST_READ_BYTES_PER_S) -> MemoryPlan:
    """Plan every pathway's bytes for serving (and, with train=True, training) a model.

    Capacity, when gpu_mem_bytes is given (no device is probed here; `run_plan` does
    that for the CLI):
        budget    = floor(gpu_mem · gpu_memory_utilization)
        kv budget = budget − weights − step peak − its largest block − CUDA graphs − context
                    − the engine's margin for growth outside PyTorch (OUTSIDE_TORCH_GROWTH)
        step peak = max(activation peak, final hidden states + logits + sampler)
        blocks    = floor(kv budget / block bytes); tokens = blocks · block_size
        max concurrency = blocks // ceil(max_model_len / block_size), which equals
                          tokens // max_model_len when max_model_len is a multiple of
                          block_size (a sequence holds whole blocks).
    Training (train=True) is planned for seq_len tokens per sequence, by default
    min(max_model_len, 4096), against the same budget; see plan_training.

    host_mem_bytes (the host's total memory) bounds the --cpu-kv-gb the advice proposes
    (HOST_KV_FRACTION of it); without it the advice proposes no host tier.

    context_bytes is what the caller knows must stay free for non-PyTorch memory (CUDA
    context, cuBLAS workspaces); it cannot be derived from the config, so it defaults
    to 0 and the headroom left by gpu_memory_utilization is expected to hold it.
    cublas_workspace is the bytes of one cuBLAS workspace (cublas_workspace_bytes gives
    it for a compute capability; the default is Hopper's; 0 for the CPU): one for the
    serving stream, counted in the step peak, and one for the graph-capture stream.

    Mixture-of-experts models: moe_expert_cache_size experts per layer stay on the
    device (None: all) and the KV budget is taken after the resident weights only
    (resident_weight_bytes); the others' bytes are in host memory. moe_expert_cache_gb
    gives the slots' device GiB instead, turned into experts per layer as the engine does.
    With fewer resident, moe_decode_tokens_per_s predicts batch-1 decode from the uniform
    router's hit rate (the resident fraction), moe_h2d_bytes_per_s for the misses' copies
    and moe_device_read_bytes_per_s for the active weights (moe_offload_tokens_per_second); with
    moe_cpu_experts="auto", some misses run on the host meanwhile (one expert's row reads its bytes at
    moe_host_read_bytes_per_s), split as the engine splits them; with "always" (eager decode) none.

    quantization="fp8" (or an fp8 checkpoint's quantization_config) counts the projections'
    weights as the engine holds them: one byte each plus a float32 scale per output channel, but
    for those the checkpoint keeps in the model dtype (ModelSpec.unquantized).
    """
    shape, source = _read_model_shape(model, quantization)
    dtype_name, b = resolve_dtype(dtype, shape)
    max_model_len = shape.max_model_len_limit if max_model_len is None else max_model_len
    if max_num_seqs is None:  # the engine's default for this device
        max_num_seqs = default_max_num_seqs(gpu_mem_bytes)
    _check_settings(shape, gpu_mem_bytes, host_mem_bytes, gpu_memory_utilization, max_model_len, max_num_seqs,
                    max_num_batched_tokens, block_size, context_bytes)

    params, pathway_bytes = count_params(shape), weight_bytes(shape, b)
    experts = _plan_experts(shape, b, params, pathway_bytes, moe_expert_cache_size, moe_expert_cache_gb,
                            source, (moe_h2d_bytes_per_s, moe_device_read_bytes_per_s, moe_host_read_bytes_per_s),
                            moe_cpu_experts)
    serving = serving_figures(_with_expert_slots(shape, experts), b, max_model_len=max_model_len,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              block_size=block_size, cuda_graphs=cuda_graphs, fused_kernels=fused_kernels,
                              cublas_workspace=cublas_workspace, kv_cache_dtype=kv_cache_dtype)

    plan = MemoryPlan(
        architecture=shape.architecture, dtype=dtype_name,
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, tied_embeddings=shape.tied_embeddings,
        embedding_params=params["embedding"], attention_params=params["attention"],
        mlp_params=params["mlp"], norm_params=params["norms"], lm_head_params=params["lm_head"],
        embedding_bytes=pathway_bytes["embedding"], attention_bytes=pathway_bytes["attention"],
        mlp_bytes=pathway_bytes["mlp"], norm_bytes=pathway_bytes["norms"], lm_head_bytes=pathway_bytes["lm_head"],
        gpu_mem_bytes=gpu_mem_bytes, host_mem_bytes=host_mem_bytes, kv_cache_dtype=kv_cache_dtype,
        quantization=shape.quantization, fp8_projections=sum(fp8_projection_counts(shape).values()),
        unquantized_projections=len(shape.unquantized),
        gpu_memory_utilization=gpu_memory_utilization, cuda_graphs=cuda_graphs, fused_kernels=fused_kernels,
        context_bytes=context_bytes, outside_torch_growth_bytes=OUTSIDE_TORCH_GROWTH,
        workspace_bytes=(serving.step_peak_bytes + serving.step_largest_block_bytes + serving.cuda_graph_bytes
                         + context_bytes + OUTSIDE_TORCH_GROWTH),
        **asdict(serving), **experts,
    )
    if gpu_mem_bytes is not None:
        _plan_capacity(plan)
    if train:
        _plan_training(plan, shape, optimizer=optimizer, micro_batch=micro_batch,
                       seq_len=min(max_model_len, DEFAULT_TRAIN_SEQ_LEN) if seq_len is None else seq_len,
                       checkpointing=checkpointing, checkpoint_layers=checkpoint_layers,
                       lora_rank=lora_rank, lora_targets=lora_targets)
    plan.advice = advise(plan, shape)
    return plan


def _with_expert_slots(shape: ModelShape, experts: dict) -> ModelShape:
    """The shape with its expert cache's slots when fewer experts are resident than all: the
    resident weights leave the others out and the activation peak counts the cache's waves
    (memory.formulas.resident_weight_bytes, moe_grouped_phase_bytes)."""
    slots = experts["expert_cache_size"] if experts["host_expert_bytes"] else 0
    return dataclasses.replace(shape, num_expert_slots=slots)


def _plan_capacity(plan: MemoryPlan) -> None:
    """The budget, the KV cache it leaves and how many sequences that holds."""
    plan.budget_bytes = int(plan.gpu_mem_bytes * plan.gpu_memory_utilization)
    plan.kv_budget_bytes = plan.budget_bytes - plan.resident_weight_bytes - plan.workspace_bytes
    # As the engine grants blocks: room left for the allocator's rounding of the cache's tensor.
    plan.num_kv_blocks = max(0, plan.kv_budget_bytes - ALLOCATION_ROUNDING) // plan.kv_bytes_per_block
    plan.kv_capacity_tokens = plan.num_kv_blocks * plan.block_size
    plan.max_concurrency = plan.num_kv_blocks // plan.blocks_per_seq
    plan.fits = plan.max_concurrency >= 1


def _plan_training(plan: MemoryPlan, shape: ModelShape, **settings) -> None:
    figures = plan_training(shape, plan.dtype_bytes, **settings)
    plan.train = True
    for key, value in figures.items():
        setattr(plan, key, value)
    if plan.budget_bytes is not None:
        plan.train_fits = plan.train_total_bytes <= plan.budget_bytes


def _per_token(shape: ModelShape, counts: dict[str, int], embedding_row: int) -> tuple[int, int]:
    """(what one token uses, what a decode token reads) of count_params' or weight_bytes' pathways: all but the
    routed experts plus k of them a layer; an untied embedding table gives one row (``embedding_row``)."""
    experts = counts["experts"]
    active = counts["total"] - experts + (experts // shape.num_experts * shape.num_experts_per_tok
                                          if shape.num_experts else 0)
    return active, active - (0 if shape.tied_embeddings else counts["embedding"] - embedding_row)


def _plan_experts(shape: ModelShape, b: int, params: dict[str, int], pathway_bytes: dict[str, int],
                  cache_size: int | None,
                  cache_gb: float | None, source: str, rates: tuple[float, float, float], cpu_experts: str) -> dict:
    """The plan's mixture-of-experts fields and active_params for any model. resident_weight_bytes is
    serving_figures' (from the shape's expert slots), the figure the out-of-memory advice spends too."""
    if cache_size is not None or cache_gb is not None:  # refused where start-up refuses it (fewer than top-k)
        cache_size = resolve_expert_cache_size(shape, b, cache_size, cache_gb, source) or shape.num_experts
    resident_all = cache_size is None or cache_size == shape.num_experts
    check_cpu_experts(cpu_experts, None if resident_all else cache_size,
                      None if shape.num_experts else f"{source} describes a dense model ({shape.architecture}, "
                                                     f"no MoE layer)")
    for name, rate in zip(("moe_h2d_bytes_per_s", "moe_device_read_bytes_per_s", "moe_host_read_bytes_per_s"),
                          rates):
        if not 0 < rate < math.inf:  # inf printed as "Infinity", which is no JSON
            raise ValueError(f"{name} must be > 0 bytes/s, got {rate!r}: give a finite rate")
    total, resident = expert_bytes(shape, b, cache_size)
    active_params, read_params = _per_token(shape, params, shape.hidden_size)
    active_bytes, read_bytes = _per_token(shape, pathway_bytes, shape.hidden_size * b)
    prediction = {"moe_h2d_bytes_per_s": rates[0], "moe_device_read_bytes_per_s": rates[1],
                  "moe_host_read_bytes_per_s": rates[2], "moe_cpu_experts": cpu_experts}
    if resident < total:
        hit_rate = cache_size / shape.num_experts  # the uniform router's: random weights route almost uniformly
        split = {} if cpu_experts != "auto" else dict(
            host_row_seconds=3 * shape.hidden_size * shape.moe_intermediate_size * b / rates[2],
            sync_seconds=ASSUMED_HOST_SYNC_SECONDS, issue_seconds=ASSUMED_COPY_ISSUE_SECONDS)
        prediction["moe_hit_rate"] = hit_rate
        if cpu_experts != "always":
            prediction["moe_decode_tokens_per_s"] = moe_offload_tokens_per_second(
                shape, b, hit_rate, rates[0], read_bytes / rates[1], ASSUMED_CUT_SECONDS, **split)
    return {**prediction,
        "num_experts": shape.num_experts,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "expert_cache_size": shape.num_experts if cache_size is None else cache_size,
        "expert_params": params["experts"],
        "expert_bytes": total,
        "resident_expert_bytes": resident,
        "host_expert_bytes": total if resident < total else 0,
        "active_params": active_params,
        "read_params_per_token": read_params,
        "active_bytes": active_bytes,
        "read_bytes_per_token": read_bytes,
    }


def _check_settings(shape, gpu_mem, host_mem, utilization, max_model_len, max_num_seqs,
                    max_num_batched_tokens, block_size, context_bytes):
    check_serving_settings(shape, max_model_len, max_num_seqs, max_num_batched_tokens, block_size)
    if block_size & (block_size - 1):  # as EngineConfig refuses it: the plan is of settings the engine runs
        raise ValueError(f"block_size must be a power of two, got {block_size}: use --block-size "
                         f"{DEFAULT_BLOCK_SIZE} (the default) or another power of two")
    if host_mem is not None and (not isinstance(host_mem, int) or host_mem <= 0):
        raise ValueError(f"host_mem_bytes must be a positive byte count, got {host_mem!r}")
    if gpu_mem is not None and (not isinstance(gpu_mem, int) or gpu_mem <= 0):
        raise ValueError(f"gpu_mem_bytes must be a positive byte count, got {gpu_mem!r} "
                         f"(parse_bytes('80GiB') reads sizes)")
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    if not isinstance(context_bytes, int) or context_bytes < 0:
        raise ValueError(f"context_bytes must be a byte count >= 0, got {context_bytes!r}")
    check_context_fits(gpu_mem, context_bytes)


def check_context_fits(gpu_mem: int | None, context_bytes: int) -> None:
    """Context memory is held back from the device's: as large as the device, it leaves a negative budget."""
    if gpu_mem is not None and context_bytes >= gpu_mem:
        raise ValueError(f"--context-mem {format_bytes(context_bytes)} is not less than --gpu-mem "
                         f"{format_bytes(gpu_mem)}: the context is held back from the device's memory, so give "
                         f"--context-mem less than --gpu-mem (e.g. 500MiB)")
