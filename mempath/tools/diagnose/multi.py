"""`mempath diagnose A B ...`: every model's pathways measured against its plan, and the shared KV pages.

The models start as `mempath serve A B` starts them (mempath/multi/startup.py), with every
start-up stage recorded under its model's name ("a: load weights") and the pool's one
allocation under "shared KV pages". Each model then runs the single-model probes alone
(run.py's measure_serving: the probe forward, KV growth, the leak check), so its section
has the rows a one-model report has; its KV row is its view of the shared pages. Last, a
short workload alternates between the models (each model's burst starts while the one
before it still runs) and the pool's split is read after every step: the pages each model
holds, their min/max/final, and whether every page is free at the end.
"""
from __future__ import annotations

import gc
import os
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from mempath.memory.ledger import format_bytes
from mempath.tools.diagnose.meters import CpuMeter, CudaMeter, Recorder, engine_stage_observer, read_host_memory
from mempath.tools.diagnose.probes import measure_bandwidth
from mempath.tools.diagnose.report import out_folder, write_report_files
from mempath.tools.diagnose.rows import Row

MiB = 1 << 20


class TenantRecorder:
    """One model's stages in the shared recorder: each named "model: stage"."""

    def __init__(self, recorder: Recorder, tenant: str):
        self.recorder, self.prefix = recorder, f"{tenant}: "

    def __getattr__(self, name):  # meter, samples, interval, now: the shared recorder's
        return getattr(self.recorder, name)

    def stage(self, name: str, pathway: str):
        return self.recorder.stage(self.prefix + name, pathway)

    def last(self, name: str):
        return self.recorder.last(self.prefix + name)

    @property
    def stages(self):
        return [s for s in self.recorder.stages if s.name.startswith(self.prefix)]


def diagnose_models(models: list[str], *, served_model_name: list[str] | None = None, kv_min_share: float = 0.0,
                    device: str = "auto", dtype: str = "auto", probe_tokens: int = 2048, probe_seqs: int = 8,
                    leak_requests: int = 8, growth_requests: int = 4, split_requests: int = 4,
                    out_dir: str | os.PathLike | None = "mempath-diagnose", bandwidth_bytes: int = 256 * MiB,
                    show_progress: bool = False, progress: Callable[[str], None] | None = None,
                    **engine_options) -> dict:
    """Start ``models`` (directories or NAME=DIR) on one device, measure each, run the alternating
    workload over the shared pool, and return the report dict (written to ``out_dir`` as
    diagnose.json and diagnose.html when given)."""
    from mempath.config import EngineConfig
    from mempath.multi.engine import MultiEngine
    from mempath.multi.pages import POOL_TENANT
    from mempath.multi.startup import build_engines
    from mempath.tools.diagnose.run import build_report, check_probe_counts, indexed_device, measure_serving

    check_probe_counts(probe_tokens, probe_seqs, leak_requests)
    pairs = checked_models(models, served_model_name)
    options = {**engine_options, "device": indexed_device(device), "dtype": dtype}
    config = EngineConfig.from_kwargs(pairs[0][1], **options)  # bad options: refused before anything loads
    torch_device = config.torch_device()
    plan = plan_pool(pairs, config, dtype, kv_min_share)  # and a --kv-min-share too large
    # --out is made now, and written to: a bad one is refused before the run, and a failed run removes it.
    with out_folder(out_dir):
        meter = CudaMeter(torch_device) if torch_device.type == "cuda" else CpuMeter()
        recorder = Recorder(meter, progress=progress)
        bandwidth = measure_bandwidth(torch_device, bandwidth_bytes)
        host_before = read_host_memory()
        recorder.start()
        try:
            with meter.active():
                engines, pool = build_engines(
                    pairs, options, show_progress, kv_min_share,
                    stage_for=lambda tenant: engine_stage_observer(TenantRecorder(recorder, tenant)))
                multi = MultiEngine(engines, pool)
                if out_dir is not None:
                    from mempath.tools.diagnose.report import require_plotting
                    require_plotting()
                sections = []
                for (name, path), engine in zip(pairs, engines.values()):
                    tenant = TenantRecorder(recorder, name)
                    measured = measure_serving(engine, path, tenant, torch_device, probe_tokens, probe_seqs,
                                               leak_requests, growth_requests)
                    measured["rows"] = _tenant_rows(measured["rows"], engine, measured["plan"], pool.num_pages)
                    section = build_report(f"{name} ({path})", engine.config, torch_device, tenant, host_before,
                                           bandwidth, measured)
                    sections.append({"name": name, **section})
                with recorder.stage(f"{POOL_TENANT}: alternating workload", "kv_cache"):
                    split = run_split_workload(multi, split_requests)
                shared = shared_pages_section(multi, plan, recorder.last(f"{POOL_TENANT}: kv allocation"), meter, split)
                del multi, engines, pool
                gc.collect()
        finally:
            recorder.stop()
        report = {"mempath_diagnose": 1, "models": sections, "shared_kv_pages": shared,
                  "device": sections[0]["device"], "files": {}}
        if out_dir is not None:
            if progress is not None:
                progress(f"mempath diagnose: {recorder.now():6.1f} s  writing the report to {out_dir}")
            write_report_files(write_multi_outputs, report, out_dir)
        return report


def checked_models(models: list[str], served_model_name: list[str] | None) -> list[tuple[str, str]]:
    """(name, directory) of each model, or the one-line ValueError of a bad argument, before anything loads."""
    from mempath.multi.names import served_models
    if len(models) < 2:
        raise ValueError("diagnose_models measures several models; measure one with diagnose()")
    pairs = served_models(models, served_model_name)
    for name, path in pairs:
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"model {name!r}: {path} has no config.json; give a model directory (DIR or NAME=DIR)")
    return pairs


def _tenant_rows(rows: list[Row], engine, plan, num_pages: int) -> list[Row]:
    """The single-model rows with the KV ones a model in the shared pool has: its blocks' view of
    every page (the pool's allocation is the shared section's row), no capacity of its own."""
    view = engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size()
    kv = Row("kv_cache (its view of the shared pages)", plan.kv_bytes_per_block * num_pages, view,
             f"plan: kv_bytes_per_block x {num_pages:,} pages (block {engine.config.block_size} tokens)",
             "tensor bytes of the model's KV view", "one block per page; the pages are the pool's one allocation")
    kept = [r for r in rows if r.pathway not in ("kv_cache", "kv_cache capacity")]
    at = next((i for i, r in enumerate(rows) if r.pathway == "kv_cache"), len(kept))
    return kept[:at] + [kv] + kept[at:]


# ---------------------------------------------------------------- the split over time

def run_split_workload(multi, requests_per_model: int) -> dict:
    """A burst of requests on each model in turn, each starting while the one before runs; the
    pages each model holds after every step."""
    from mempath.sampling import SamplingParams
    names = multi.names
    generator = torch.Generator().manual_seed(2)
    pages, samples = multi.pool, []
    bursts = []
    for name in names:
        engine = multi.engines[name]
        block, max_len = engine.config.block_size, engine.max_model_len
        prompt_len = max(1, min(2 * block + 3, max_len // 2))
        max_tokens = max(2, min(2 * block, max_len - prompt_len))
        per_request = engine.kv.blocks_for(prompt_len + max_tokens)
        count = max(1, min(requests_per_model, engine.config.max_num_seqs,
                           pages.num_pages // (len(names) * per_request) or 1))
        bursts.append((name, count, prompt_len, max_tokens))

    def step() -> None:
        multi.step()
        split = pages.split()
        samples.append([len(samples) + 1, *(split[n] for n in names), pages.pages.num_free])

    for name, count, prompt_len, max_tokens in bursts:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        vocab = multi.engines[name].spec.vocab_size
        for i in range(count):
            ids = torch.randint(0, vocab, (prompt_len,), generator=generator).tolist()
            multi.add_request(ids, params, f"diagnose-split-{name}-{i}", model=name)
        for _ in range(max(1, max_tokens // 2)):  # the next burst starts halfway through this one
            step()
    while multi.has_unfinished_requests():
        step()
    columns = ["step", *names, "free"]
    by_model = {}
    for i, name in enumerate(names, start=1):
        held = [s[i] for s in samples]
        by_model[name] = {"min": min(held), "max": max(held), "final": held[-1]}
    return {"columns": columns, "samples": samples, "by_model": by_model,
            "requests": {name: count for name, count, _, _ in bursts},
            "free_at_end": pages.pages.num_free, "all_free_at_end": pages.pages.num_used == 0,
            "num_cross_model_preemptions": multi.num_cross_preemptions}


# ---------------------------------------------------------------- the pool against its plan

def plan_pool(pairs: list[tuple[str, str]], config, dtype: str, kv_min_share: float):
    """`mempath plan A B`'s plan for these models and settings (``config``: the first model's)."""
    from mempath.tools.plan import detect_gpu_mem
    from mempath.tools.plan_multi import plan_models
    return plan_models([f"{name}={path}" for name, path in pairs], kv_min_share=kv_min_share,
                       block_size=config.block_size,
                       gpu_mem_bytes=detect_gpu_mem() if config.torch_device().type == "cuda" else None,
                       gpu_memory_utilization=config.gpu_memory_utilization,
                       num_gpu_blocks_override=config.num_gpu_blocks_override,
                       dtype=dtype, max_model_len=config.max_model_len,
                       max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                       cuda_graphs=not config.enforce_eager, kv_cache_dtype=config.kv_cache_dtype,
                       quantization=config.quantization, moe_expert_cache_size=config.moe_expert_cache_size,
                       moe_expert_cache_gb=config.moe_expert_cache_gb, moe_cpu_experts=config.moe_cpu_experts)


def shared_pages_section(multi, plan, allocation, meter, split: dict) -> dict:
    """The pool's pages, page bytes and each model's block size beside the plan's (``plan``: plan_pool's)."""
    from mempath.multi.pages import POOL_TENANT
    pool, first = multi.pool, multi.first
    config = first.config
    pages, pages_source = plan.num_pages, "plan: mempath plan A B's pages"
    if pages is None:  # the CPU: the engine's KV size in whole pages, the same formula the engine uses
        pages, pages_source = config.cpu_kv_cache_bytes // plan.page_bytes, "derived: cpu_kv_cache_bytes // page bytes"
    rows = [Row("shared KV pages", pages * plan.page_bytes, allocation.delta if allocation else None,
                f"{pages_source} ({pages:,}) x page bytes", f"{meter.source} of the pool's allocation",
                f"{pool.num_pages:,} pages of {format_bytes(pool.page_bytes)}"),
            Row("page", plan.page_bytes, pool.page_bytes, "plan: page_bytes (largest KV per token x block size)",
                "engine: the pool's page bytes")]
    models = {}
    for entry, (name, engine) in zip(plan.models, multi.engines.items()):
        block_bytes = engine.runner.kv_bytes_per_block()
        rows.append(Row(f"{name}: one block", entry.plan.kv_bytes_per_block, block_bytes,
                        f"plan: kv_bytes_per_block at block {entry.plan.block_size}",
                        "engine: the runner's bytes per block"))
        models[name] = {"block_size": engine.config.block_size, "planned_block_size": entry.plan.block_size,
                        "tokens_per_page": engine.config.block_size, "kv_bytes_per_block": block_bytes,
                        "page_fill": block_bytes / pool.page_bytes, "guaranteed_pages": pool.guaranteed(name),
                        "pages": split["by_model"][name]}
    ledgers = first.budget.ledgers
    return {"num_pages": pool.num_pages, "planned_num_pages": pages, "page_bytes": pool.page_bytes,
            "kv_min_share": pool.min_share, "rows": [asdict(r) for r in rows], "models": models,
            "split": split, "ledger": ledgers[POOL_TENANT].as_dict() if POOL_TENANT in ledgers else {},
            "plan": plan.to_dict()}


# ---------------------------------------------------------------- output

def write_multi_outputs(report: dict, out_dir: Path) -> None:
    from mempath.tools.diagnose.multi_report import write_multi_html
    from mempath.tools.diagnose.report import write_json
    out_dir.mkdir(parents=True, exist_ok=True)
    report["files"]["json"] = str(out_dir / "diagnose.json")
    report["files"]["html"] = str(out_dir / "diagnose.html")
    write_json(report, out_dir / "diagnose.json")
    write_multi_html(report, out_dir / "diagnose.html")
