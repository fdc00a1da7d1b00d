"""`mempath diagnose MODEL`: measure every memory pathway and put it beside the plan.

The engine is built and driven on the device at hand while a recorder (meters.py)
takes allocation deltas around each stage (load weights, KV allocation, embedding,
one decoder layer, the whole forward, logits, KV growth while generating and,
with --train, gradients and AdamW state of the transformers model; probes.py).
Each measured figure sits next to the planner's prediction with its error
(rows.py), plus the things a plan cannot know: fragmentation, memory outside
PyTorch, leaks, the host peak while loading and host<->device bandwidth.
The report is written by report.py.

Every figure carries its source; nothing is filled in by assumption.
"""
from __future__ import annotations

import gc
import os
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from mempath.tools.diagnose.meters import CpuMeter, CudaMeter, Recorder, engine_stage_observer, read_host_memory
from mempath.tools.diagnose.probes import (measure_bandwidth, measure_forward, measure_fragmentation,
                                           measure_kv_growth, measure_leak, measure_outside_torch,
                                           measure_training, probe_capacity, read_pcie_link)
from mempath.tools.diagnose.rows import comparison_rows, train_rows


MiB = 1 << 20


# ---------------------------------------------------------------- the whole run

def check_probe_counts(probe_tokens, probe_seqs, leak_requests) -> None:
    """Refused before anything loads: --leak-requests 0 failed after the whole run, --probe-tokens -5 ran as 1."""
    for flag, value, least in (("--probe-tokens", probe_tokens, 1), ("--probe-seqs", probe_seqs, 1),
                               ("--leak-requests", leak_requests, 2)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{flag} {value!r} must be an integer of at least {least}"
                             + (" (the leak check compares requests after the first)" if least == 2 else ""))


def diagnose(model_dir: str, *, device: str = "auto", dtype: str = "auto", train: bool = False,
             probe_tokens: int = 2048, probe_seqs: int = 8, leak_requests: int = 8,
             growth_requests: int = 4, out_dir: str | os.PathLike | None = "mempath-diagnose",
             snapshot: bool = False, bandwidth_bytes: int = 256 * MiB, show_progress: bool = False,
             progress: Callable[[str], None] | None = None, **engine_options) -> dict:
    """Build the engine on `device`, run the probe workload, and return the report dict.

    With out_dir, diagnose.json and diagnose.html (and memory_snapshot.pickle with
    snapshot=True on CUDA) are written there and their paths recorded under "files".
    progress receives one line per stage as it starts.
    """
    from mempath.config import EngineConfig
    from mempath.engine.engine import LLMEngine
    from mempath.model.spec import ModelSpec
    from mempath.model.loader import read_config

    from mempath.tools.diagnose.report import out_folder, write_report_files

    check_probe_counts(probe_tokens, probe_seqs, leak_requests)
    config = EngineConfig.from_kwargs(model_dir, device=indexed_device(device), dtype=dtype, **engine_options)
    # A broken config.json is refused before anything is measured, and before --out is made.
    ModelSpec.from_hf_config(read_config(config.model), source=str(Path(config.model) / "config.json"))
    # --out is made now, and written to: a bad one is refused before the run, and a failed run removes it.
    with out_folder(out_dir, snapshot):
        torch_device = config.torch_device()
        meter = CudaMeter(torch_device) if torch_device.type == "cuda" else CpuMeter()
        recorder = Recorder(meter, progress=progress)
        # The link is measured first, alone: measured at the end, inside the memory-history
        # recording, the H200's pinned host->device rate read 29.6 GB/s instead of ~54.
        if progress is not None and torch_device.type == "cuda":
            progress(f"mempath diagnose: {recorder.now():6.1f} s  host<->device bandwidth")
        bandwidth = measure_bandwidth(torch_device, bandwidth_bytes)
        if snapshot and torch_device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        host_before = read_host_memory()
        recorder.start()
        try:
            with meter.active():
                engine = LLMEngine(config, show_progress=show_progress, stage=engine_stage_observer(recorder))
                if out_dir is not None:  # after the load (a broken model is refused first), before measuring
                    from mempath.tools.diagnose.report import require_plotting
                    require_plotting()
                measured = measure_serving(engine, model_dir, recorder, torch_device, probe_tokens, probe_seqs,
                                           leak_requests, growth_requests)
                del engine
                gc.collect()
                if torch_device.type == "cuda":
                    torch.cuda.empty_cache()
                if train:
                    _measure_training(measured, model_dir, recorder, torch_device, probe_tokens)
        finally:
            recorder.stop()
        report = build_report(model_dir, config, torch_device, recorder, host_before, bandwidth, measured)
        if out_dir is not None:
            if progress is not None:
                progress(f"mempath diagnose: {recorder.now():6.1f} s  writing the report to {out_dir}")
            cuda_snapshot = snapshot and torch_device.type == "cuda"
            write_report_files(lambda r, folder: _write_outputs(r, folder, cuda_snapshot), report, out_dir)
        return report


def build_report(model_dir, config, torch_device: torch.device, recorder: Recorder, host_before: dict,
            bandwidth: dict, measured: dict) -> dict:
    return {
        "mempath_diagnose": 1,
        "model": str(model_dir),
        "device": _describe_device(torch_device),
        "dtype": measured["dtype"],
        "settings": {k: v for k, v in asdict(config).items() if k != "model"},
        "measurement": {"device_bytes": recorder.meter.source, "peaks": recorder.meter.peak_source,
                        "host": "RssAnon from /proc/self/status (psutil rss without /proc)"},
        "pathways": [asdict(r) for r in measured["rows"]],
        "stages": [{**asdict(s), "delta": s.delta, "peak_delta": s.peak_delta} for s in recorder.stages],
        "timeline": {"columns": ["t_seconds", "device_bytes", "host_rss_anon", "stage"],
                     "samples": downsample(recorder.samples, 4000)},
        **{key: measured[key] for key in ("probe", "kv_growth", "leak", "fragmentation", "outside_torch")},
        "host": _host_figures(recorder, host_before),
        "bandwidth": bandwidth,
        "pcie": read_pcie_link(torch_device),
        **{key: measured[key] for key in ("training", "engine_stats", "ledger")},
        "plan": measured["plan"].to_dict(),
        "snapshot": "n/a: no CUDA" if torch_device.type != "cuda" else None,
        "files": {},
    }


def measure_serving(engine, model_dir, recorder: Recorder, torch_device: torch.device, probe_tokens: int,
                     probe_seqs: int, leak_requests: int, growth_requests: int) -> dict:
    """The probe forward, KV growth, the leak check and the device-level figures, with the plans they
    are compared with; the engine's ledger and stats."""
    from mempath.memory.formulas import cublas_workspace_bytes
    from mempath.model.moe import expert_cache_stats
    from mempath.tools.plan import detect_gpu_mem, plan_memory

    config, meter = engine.config, recorder.meter
    dtype_name = engine.dtype_name
    gpu_mem = detect_gpu_mem() if torch_device.type == "cuda" else None
    fused = engine.runner.use_triton  # which elementwise path the forward takes
    workspace = 0  # no cuBLAS on the CPU
    if torch_device.type == "cuda":
        workspace = cublas_workspace_bytes(torch.cuda.get_device_capability(torch_device)[0])
    # What the engine holds, for both plans: its fp8 weights, its KV dtype and its expert slots (whose waves
    # add to the forward's temporaries).
    engine_settings = dict(dtype=dtype_name, max_model_len=engine.max_model_len, block_size=config.block_size,
                           fused_kernels=fused, quantization=config.quantization,
                           kv_cache_dtype=config.kv_cache_dtype,
                           moe_expert_cache_size=expert_cache_stats(engine.model).get("num_slots"))
    serving_plan = plan_memory(
        model_dir, gpu_mem_bytes=gpu_mem, cublas_workspace=workspace,
        gpu_memory_utilization=config.gpu_memory_utilization, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, cuda_graphs=not config.enforce_eager,
        **engine_settings)
    seqs = max(1, min(probe_seqs, config.max_num_seqs, probe_tokens))
    # The step buffers hold max-num-batched-tokens tokens and max-model-len per sequence.
    tokens = max(seqs, min(probe_tokens, config.max_num_batched_tokens, probe_capacity(engine),
                           seqs * engine.max_model_len))
    probe_plan = plan_memory(model_dir, cublas_workspace=0,  # the probe's rows are deltas: the workspace exists
                             max_num_seqs=seqs, max_num_batched_tokens=tokens, cuda_graphs=False,
                             **engine_settings)
    forward = measure_forward(engine, recorder, tokens, seqs)
    growth = _run_growth(engine, recorder, serving_plan, growth_requests)
    leak = measure_leak(engine, recorder, leak_requests,
                        prompt_len=min(3 * config.block_size + 1, engine.max_model_len - 8))
    fragmentation = measure_fragmentation(torch_device)
    outside = measure_outside_torch(torch_device, meter)
    return {"dtype": dtype_name, "plan": serving_plan, "probe": forward, "kv_growth": growth, "leak": leak,
            "fragmentation": fragmentation, "outside_torch": outside,
            "rows": comparison_rows(engine, serving_plan, probe_plan, recorder, forward, growth),
            "ledger": engine.ledger.as_dict(), "engine_stats": engine.stats(), "training": None}


def _measure_training(measured: dict, model_dir, recorder: Recorder, torch_device: torch.device,
                      probe_tokens: int) -> None:
    """--train: gradients and AdamW state of the transformers model, beside the float32 training plan."""
    from mempath.tools.plan import plan_memory

    max_model_len = measured["plan"].max_model_len
    train_len = max(1, min(probe_tokens, max_model_len))
    train_plan = plan_memory(model_dir, dtype="float32", max_model_len=max_model_len,
                             train=True, optimizer="adamw-fp32", seq_len=train_len)
    measured["training"] = measure_training(model_dir, recorder, torch_device, train_len)
    measured["rows"] += train_rows(train_plan, measured["training"], recorder.meter)


def indexed_device(device: str) -> str:
    """"cuda" or "auto" on a CUDA machine as "cuda:N": the engine's set_device needs an index."""
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return device


def _run_growth(engine, recorder, plan, num_requests: int) -> list[dict]:
    """KV growth over a generation that crosses block boundaries, sized to fit the pool."""
    block = engine.config.block_size
    prompt_len = max(1, min(2 * block + 3, engine.max_model_len // 2))
    max_tokens = max(1, min(2 * block, engine.max_model_len - prompt_len))
    per_request = engine.kv.blocks_for(prompt_len + max_tokens)
    num_requests = max(1, min(num_requests, engine.config.max_num_seqs, engine.kv.num_blocks // per_request,
                              engine.config.max_num_batched_tokens // prompt_len or 1))
    return measure_kv_growth(engine, recorder, plan, num_requests, prompt_len, max_tokens)


def _host_figures(recorder: Recorder, before: dict) -> dict:
    load = recorder.last("load weights")
    figures = {"source": "RssAnon sampled every %.0f ms" % (recorder.interval * 1000),
               "rss_anon_before": before["rss_anon"], "rss_file_before": before["rss_file"]}
    if load is not None:
        figures.update(load_rss_anon_start=load.host_start, load_rss_anon_peak=load.host_peak,
                       load_peak_increase=load.host_peak - load.host_start)
    try:
        import resource
        # ru_maxrss is in KiB on Linux: the process's lifetime peak, including before the run.
        figures["process_max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        pass
    return figures


def _describe_device(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": props.name, "total_memory": props.total_memory,
                "torch": torch.__version__, "cuda": torch.version.cuda}
    import platform
    import psutil
    return {"type": "cpu", "name": platform.processor() or platform.machine(),
            "total_memory": psutil.virtual_memory().total, "torch": torch.__version__}


def downsample(samples: list[tuple], limit: int) -> list[list]:
    """At most `limit` samples, keeping each bucket's highest device figure and every stage change."""
    if len(samples) <= limit:
        return [list(s) for s in samples]
    size = -(-len(samples) // limit)
    kept = []
    for i in range(0, len(samples), size):
        bucket = samples[i:i + size]
        stages = {s[3] for s in bucket}
        if len(stages) > 1:  # keep one peak per stage so short stages stay visible
            for stage in stages:
                kept.append(max((s for s in bucket if s[3] == stage), key=lambda s: s[1]))
            kept.sort(key=lambda s: s[0])
        else:
            kept.append(max(bucket, key=lambda s: s[1]))
    return [list(s) for s in kept]


def _write_outputs(report: dict, out_dir: Path, snapshot: bool) -> None:
    from mempath.tools.diagnose.report import write_html, write_json
    out_dir.mkdir(parents=True, exist_ok=True)
    if snapshot:
        path = out_dir / "memory_snapshot.pickle"
        try:
            torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        report["snapshot"] = str(path)
        report["files"]["snapshot"] = str(path)
    report["files"]["json"] = str(out_dir / "diagnose.json")
    report["files"]["html"] = str(out_dir / "diagnose.html")
    write_json(report, out_dir / "diagnose.json")
    write_html(report, out_dir / "diagnose.html")
