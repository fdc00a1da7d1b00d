"""Start-up of several models on one device: every model's parts, one budget, one KV page pool.

Each model is a tenant of one DeviceBudget and goes through engine/startup.py's stages
with its own runner, graphs and sampler. The stages that size and allocate the KV cache
run once for all of them: every model's other pathways are granted first (on CUDA each
model's profile step measures its own peak), then what the budget leaves becomes whole
pages of one shared pool (mempath/multi/pages.py), one allocation, which every model's
KV cache views (mempath/multi/layout.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
from typing import Callable

from mempath.config import EngineConfig
from mempath.engine.engine import LLMEngine
from mempath.engine.startup import Startup, StageObserver, larger_block_fix, no_observer
from mempath.kv.manager import KVCacheManager
from mempath.memory.budget import ALLOCATION_ROUNDING, check_host_room
from mempath.memory.ledger import Pathway, format_bytes
from mempath.multi.experts import expert_cache_line, options_by_model
from mempath.multi.layout import allocate_pages, attach_pages, kv_bytes_per_token, page_layout
from mempath.multi.pages import POOL_TENANT, PagePool, TenantPages, check_min_share

log = logging.getLogger(__name__)


@contextlib.contextmanager
def naming_the_model(name: str):
    """A model's own refusal (its config.json, its max_model_len) names which of the several it is."""
    try:
        yield
    except ValueError as error:
        if len(error.args) == 1 and isinstance(error.args[0], str):
            error.args = (f"model {name!r}: {error.args[0]}",)
        raise


class TenantStartup(Startup):
    """One model of several: its KV manager works over its view of the shared pool, and the
    allocator's cap is set once, after the last model (build_engines)."""
    pages: TenantPages

    def make_kv_manager(self, num_blocks: int) -> KVCacheManager:
        seed = hashlib.blake2b(self.tenant.encode(), digest_size=16).digest()
        return KVCacheManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching,
                              pool=self.pages, hash_seed=seed)

    def cap_device_memory(self) -> None:
        pass


def refuse_unshared_options(config: EngineConfig) -> None:
    """Options whose memory is not yet carved from the shared pool: one line each."""
    if config.tiers_enabled:
        raise ValueError("the KV tiers (cpu_kv_gb, disk_kv_path) serve one model; with several models "
                         "leave them off (--cpu-kv-gb 0)")
    if config.speculative_config is not None:
        raise ValueError("speculative_config serves one model; with several models leave it off")


def build_engines(models: list[tuple[str, str]], options: dict, show_progress: bool = True,
                  kv_min_share: float = 0.0, stage_for: Callable[[str], StageObserver] = lambda tenant: no_observer,
                  ) -> tuple[dict[str, LLMEngine], PagePool]:
    """``models``: (served name, directory) pairs; ``options``: EngineConfig's fields, for all of them (the
    expert cache's for the mixture-of-experts models only: multi/experts.py);
    ``stage_for(tenant)``: the start-up observer of a model's stages, or of the pool's (POOL_TENANT).

    Async scheduling is off: a model's tokens are read back before the next model steps, so
    that the victim policy may preempt any model's requests (none has a step in flight).
    """
    check_min_share(kv_min_share, len(models))  # before any model loads
    options = {**options, "async_scheduling": False}
    per_model = options_by_model(models, options)  # the expert cache's options: the MoE models' (experts.py)
    configs = [EngineConfig.from_kwargs(path, **per_model[name]) for name, path in models]
    for config in configs:
        refuse_unshared_options(config)
    with naming_the_model(models[0][0]):
        first = TenantStartup(configs[0], stage_for(models[0][0]), tenant=models[0][0])
    startups = [first]
    for (name, _), config in zip(models[1:], configs[1:]):
        with naming_the_model(name):
            startups.append(TenantStartup(config, stage_for(name), budget=first.budget, tenant=name))
    per_token = [kv_bytes_per_token(s.spec, s.config.kv_torch_dtype(s.dtype)) for s in startups]
    page_bytes, block_sizes = page_layout(per_token, configs[0].block_size)
    for startup, block_size in zip(startups, block_sizes):
        startup.config = dataclasses.replace(startup.config, block_size=block_size)
    for startup in startups:
        startup.prepare(show_progress)
    num_pages = size_page_pool(startups, page_bytes)
    pool = PagePool(num_pages, page_bytes, kv_min_share)
    with first._guard("kv_allocation", requested_bytes=num_pages * page_bytes), \
            stage_for(POOL_TENANT)("kv allocation", Pathway.KV_CACHE.value):
        pages = allocate_pages(num_pages, page_bytes, first.device)
    first.budget.grant(POOL_TENANT, Pathway.KV_CACHE, pages.numel(), "measured",
                       f"{num_pages} pages of {format_bytes(page_bytes)}, every model's blocks")
    for startup in startups:
        attach_pages(startup.runner, pages)
        startup.pages = pool.view(startup.tenant)
    for startup in startups:  # every view first: a model's share of the pool counts the others' guarantees
        startup.finish(num_pages)
    if first.device.type == "cuda":
        Startup.cap_device_memory(first)  # the process's figure, granted once: to the first model
        for startup in startups[1:]:
            startup.ledger.discard(Pathway.NON_TORCH)
    log.info("KV page pool: %d pages of %s; block sizes %s", num_pages, format_bytes(page_bytes),
             ", ".join(f"{s.tenant} {s.config.block_size}" for s in startups))
    line = expert_cache_line(startups)
    if line is not None:
        log.info("%s", line)
    engines = {s.tenant: LLMEngine(s.config, parts=s) for s in startups}
    return engines, pool


def size_page_pool(startups: list[TenantStartup], page_bytes: int) -> int:
    """Pages the pool holds: the override, the CPU KV size, or on CUDA what the budget leaves
    once every model's profile step has granted its pathways."""
    config, on_cpu = startups[0].config, startups[0].device.type != "cuda"
    override = config.num_gpu_blocks_override
    if override is not None:
        if on_cpu:
            check_host_room(override * page_bytes, f"--num-gpu-blocks-override {override}", "a KV page pool")
        return override
    if on_cpu:
        num_pages = config.cpu_kv_cache_bytes // page_bytes
        check_host_room(num_pages * page_bytes, f"--cpu-kv-cache-bytes {config.cpu_kv_cache_bytes}", "a KV page pool")
    else:
        for i, startup in enumerate(startups):
            startup.size_kv_cache()  # profiles the model and grants it every pathway but KV
            startup.ledger.discard(Pathway.KV_CACHE)
            if i:  # room for what grows outside PyTorch is the process's: granted once
                startup.ledger.discard(Pathway.OUTSIDE_TORCH_GROWTH)
        # One tensor, which the allocator may round up (budget.ALLOCATION_ROUNDING): room left for that.
        num_pages = max(0, startups[0].budget.remaining() - ALLOCATION_ROUNDING) // page_bytes
    if num_pages < 1:
        raise ValueError(f"no memory is left for the shared KV pool (one page needs {format_bytes(page_bytes)}); "
                         + (f"raise --cpu-kv-cache-bytes{larger_block_fix(config.block_size)}" if on_cpu else
                            "raise --gpu-memory-utilization or serve fewer or smaller models"))
    return num_pages

