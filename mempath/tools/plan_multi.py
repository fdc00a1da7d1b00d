"""`mempath plan A B ...`: the memory plan of several models on one device (docs/multi_model.md).

Each model is planned as `plan_memory` plans it, at the block size the shared pool gives
it (mempath/multi/layout.py: one block per page); the device then holds every model's
resident weights, step peak and CUDA graphs, the context once (it is the process's), and
what is left becomes whole pages of the one shared KV pool, as mempath/multi/startup.py
sizes it. Each model's KV is given twice: the tokens it could hold with the pool to
itself, and those of its `kv_min_share` guarantee, which the others can never take.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mempath.constants import DEFAULT_BLOCK_SIZE, default_max_num_seqs
from mempath.memory.budget import ALLOCATION_ROUNDING, OUTSIDE_TORCH_GROWTH
from mempath.memory.ledger import format_bytes
from mempath.multi.experts import options_by_model
from mempath.multi.layout import page_layout
from mempath.multi.names import served_models
from mempath.multi.pages import check_min_share
from mempath.tools.plan import MemoryPlan, check_context_fits, plan_memory, unreadable_path

# cuMemGetAllocationGranularity's answer on the H200 (2026-12-02: a 16,060,522,496-byte
# model's arena was 16,062,087,168 bytes, 7,659 x 2 MiB).
ARENA_GRANULARITY = 2 << 20


@dataclass
class ModelInPool:
    name: str
    plan: MemoryPlan  # the model alone, at its block size in the pool, without capacity figures
    device_bytes: int  # resident weights + step peak + CUDA graphs: what it holds besides KV
    page_fill: float  # the fraction of a page one of its blocks fills
    kv_tokens_alone: int | None = None  # the whole pool as its blocks
    kv_tokens_guaranteed: int | None = None  # its kv_min_share of the pages
    host_weight_copy_bytes: int = 0  # --sleep-offload-weights: the pinned copy of its weights' arena


@dataclass
class MultiPlan:
    models: list[ModelInPool]
    page_bytes: int
    kv_min_share: float
    context_bytes: int
    gpu_mem_bytes: int | None
    gpu_memory_utilization: float
    budget_bytes: int | None = None
    pool_bytes: int | None = None  # what the budget leaves for the pool (before whole pages)
    num_pages: int | None = None
    guaranteed_pages: int | None = None
    fits: bool | None = None  # every model can hold one max-model-len sequence in the whole pool
    sleep_offload_weights: bool = False
    advice: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_models(models: list[str], *, served_model_name: list[str] | None = None, kv_min_share: float = 0.0,
                block_size: int = DEFAULT_BLOCK_SIZE, gpu_mem_bytes: int | None = None,
                gpu_memory_utilization: float = 0.9, context_bytes: int = 0,
                num_gpu_blocks_override: int | None = None, sleep_offload_weights: bool = False,
                **settings) -> MultiPlan:
    """Plan ``models`` (directories or configs, ``NAME=DIR`` as `mempath serve` reads them) on one
    device. ``settings``: plan_memory's serving keywords, the same for every model (as the engine
    takes one value of each for all), but for the expert cache's (moe_expert_cache_size, _gb,
    moe_cpu_experts): the mixture-of-experts models', refused as start-up refuses them
    (mempath/multi/experts.py), so a MoE model's device bytes are its resident experts'.
    ``num_gpu_blocks_override``: the number of pages, as the engine's; else, with
    ``gpu_mem_bytes``, what the budget leaves::

        pages = (budget − Σ (weights + step peak + CUDA graphs) − context − growth outside PyTorch) // page bytes

    ``sleep_offload_weights``: each model's pinned host copy of its weights, allocated at
    start-up (mempath/multi/sleep.py): the weights rounded up to ARENA_GRANULARITY.
    """
    _check_pool_settings(models, kv_min_share, num_gpu_blocks_override, sleep_offload_weights, settings)
    check_context_fits(gpu_mem_bytes, context_bytes)
    try:
        pairs = served_models(models, served_model_name)
    except OSError as error:  # NAME=DIR is told from a path by looking the path up, which a long name fails
        raise unreadable_path(error.filename or "", error) from None
    if settings.get("max_num_seqs") is None:  # the engine's default for this device, as plan_memory's
        settings["max_num_seqs"] = default_max_num_seqs(gpu_mem_bytes)
    # The expert cache's settings are the MoE models' (mempath/multi/experts.py), as start-up gives them.
    common = {name: dict(own, gpu_memory_utilization=gpu_memory_utilization)
              for name, own in options_by_model(pairs, settings, shape_of=_plan_shape).items()}
    per_token = [plan_memory(path, block_size=block_size, **common[name]).kv_bytes_per_token for name, path in pairs]
    page_bytes, block_sizes = page_layout(per_token, block_size)
    entries = []
    for (name, path), size in zip(pairs, block_sizes):
        plan = plan_memory(path, block_size=size, **common[name])
        entries.append(ModelInPool(name, plan, plan.resident_weight_bytes + plan.step_peak_bytes
                                   + plan.step_largest_block_bytes + plan.cuda_graph_bytes,
                                   plan.kv_bytes_per_block / page_bytes))
        if sleep_offload_weights:
            entries[-1].host_weight_copy_bytes = -(-plan.resident_weight_bytes // ARENA_GRANULARITY) * ARENA_GRANULARITY
    result = MultiPlan(entries, page_bytes, kv_min_share, context_bytes, gpu_mem_bytes, gpu_memory_utilization,
                       sleep_offload_weights=sleep_offload_weights)
    if gpu_mem_bytes is not None:
        result.budget_bytes = int(gpu_mem_bytes * gpu_memory_utilization)
        result.pool_bytes = (result.budget_bytes - sum(m.device_bytes for m in entries) - context_bytes
                             - OUTSIDE_TORCH_GROWTH)
        result.num_pages = max(0, result.pool_bytes - ALLOCATION_ROUNDING) // page_bytes  # as multi/startup.py
    budget_pages = result.num_pages
    if num_gpu_blocks_override is not None:
        result.num_pages = num_gpu_blocks_override
    if result.num_pages is not None:
        _plan_pool(result)
    if budget_pages is not None and result.num_pages > budget_pages:
        # As the one-model plan treats what the device cannot hold: planned, with the advice that says so.
        result.fits = False
        result.advice.append(f"--num-gpu-blocks-override {result.num_pages} asks for more pages than the budget "
                             f"leaves ({budget_pages:,} pages): the pool's allocation would run out of device "
                             f"memory; use --num-gpu-blocks-override {budget_pages} or less, or drop the flag")
    return result


def _check_pool_settings(models, kv_min_share, num_gpu_blocks_override, sleep_offload_weights, settings) -> None:
    """What start-up (EngineConfig, PagePool) refuses of the shared pool's settings, refused here the same way."""
    if len(models) < 2:
        raise ValueError("plan_models plans several models; plan one with plan_memory")
    check_min_share(kv_min_share, len(models))
    if num_gpu_blocks_override is not None and (not isinstance(num_gpu_blocks_override, int)
                                                or num_gpu_blocks_override < 1):
        raise ValueError(f"num_gpu_blocks_override must be >= 1, got {num_gpu_blocks_override}: give the pool's "
                         f"pages, or drop --num-gpu-blocks-override for what the budget leaves")
    if sleep_offload_weights and (settings.get("moe_expert_cache_size") is not None
                                  or settings.get("moe_expert_cache_gb") is not None):
        # EngineConfig._validate_expert_cache's reason, word for word (tests/test_plan_bad_input.py compares them)
        raise ValueError("--sleep-offload-weights moves whole models' weights; with experts in host memory "
                         "(moe_expert_cache_size / moe_expert_cache_gb) leave it off")


def _plan_shape(model: str):
    """A model's shape and config source as plan_memory reads them (a directory, a config.json, a cached hub id)."""
    from mempath.memory.formulas import read_shape
    from mempath.tools.plan import config_path, load_config
    source = str(config_path(model))
    return read_shape(load_config(model), source), source


def _plan_pool(result: MultiPlan) -> None:
    result.guaranteed_pages = int(result.kv_min_share * result.num_pages)  # PagePool.guaranteed
    for m in result.models:
        m.kv_tokens_alone = result.num_pages * m.plan.block_size
        m.kv_tokens_guaranteed = result.guaranteed_pages * m.plan.block_size
    result.fits = all(result.num_pages >= m.plan.blocks_per_seq for m in result.models)
    if result.num_pages < 1:
        result.advice.append(f"no KV page fits: the models' weights and workspaces take the budget; raise "
                             f"--gpu-memory-utilization, plan fewer or smaller models, or --dtype bfloat16")
    elif not result.fits:
        short = [m.name for m in result.models if result.num_pages < m.plan.blocks_per_seq]
        result.advice.append(f"{', '.join(short)} cannot hold one --max-model-len sequence even with the whole "
                             f"pool: lower --max-model-len")


def _row(label: str, n: int) -> str:
    return f"  {label:<44}{format_bytes(n):>12}  {n:>19,} B"


def format_multi_plan(p: MultiPlan) -> str:
    out = [f"mempath plan: {len(p.models)} models on one device, one KV pool of {format_bytes(p.page_bytes)} pages", ""]
    for m in p.models:
        q = m.plan
        out += [f"{m.name}: {q.architecture}, {q.dtype}, {q.num_layers} layers, "
                f"{format_bytes(q.kv_bytes_per_token)} KV per token, block {q.block_size} tokens "
                f"({m.page_fill:.0%} of a page)",
                _row("weights" + (f" (resident: {q.expert_cache_size} of {q.num_experts} experts/layer)"
                                  if q.num_experts else ""), q.resident_weight_bytes),
                _row("activation peak (one layer)", q.activation_peak_bytes),
                _row("step peak (+ cuBLAS workspace)", q.step_peak_bytes),
                _row("its largest block, kept spare", q.step_largest_block_bytes),
                _row(f"CUDA graphs (batch <= {q.cuda_graph_batch})" if q.cuda_graphs else "CUDA graphs (off)",
                     q.cuda_graph_bytes),
                _row("total besides KV", m.device_bytes), ""]
    out += ["the process, once", _row("context (given; not derivable)", p.context_bytes),
            _row("kept for growth outside PyTorch", OUTSIDE_TORCH_GROWTH), ""]
    if p.sleep_offload_weights:
        out += ["host memory, pinned at start-up (--sleep-offload-weights)",
                *[_row(f"{m.name}: its weights' copy while asleep", m.host_weight_copy_bytes) for m in p.models],
                _row("total", sum(m.host_weight_copy_bytes for m in p.models)), ""]
    if p.num_pages is None:
        out += ["capacity: needs --gpu-mem (no CUDA device visible)", ""]
    else:
        out += _pool_lines(p)
    if p.advice:
        out += ["advice"] + [f"  - {line}" for line in p.advice]
    return "\n".join(out)


def _pool_lines(p: MultiPlan) -> list[str]:
    out = []
    if p.budget_bytes is not None:
        out += [f"capacity (gpu-mem {format_bytes(p.gpu_mem_bytes)} x {p.gpu_memory_utilization})",
                _row("budget", p.budget_bytes),
                *[_row(f"- {m.name}", m.device_bytes) for m in p.models],
                _row("- context", p.context_bytes),
                _row("= shared KV pool", p.pool_bytes)]
    else:
        out.append("capacity (--num-gpu-blocks-override)")
    out += [f"  {'KV pages':<44}{p.num_pages:>12,}",
            f"  {f'guaranteed per model (kv-min-share {p.kv_min_share})':<44}{p.guaranteed_pages:>12,}", "",
            f"  {'KV tokens':<28}{'pool alone':>16}{'guaranteed':>16}"]
    out += [f"  {m.name:<28}{m.kv_tokens_alone:>16,}{m.kv_tokens_guaranteed:>16,}" for m in p.models]
    return out + [""]
