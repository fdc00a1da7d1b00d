"""`mempath diagnose MODEL`: measure every memory pathway and put it beside the plan.

The engine is built and driven on the device at hand while a recorder takes
allocation deltas around each stage (load weights, KV allocation, embedding,
one decoder layer, the whole forward, logits, KV growth while generating and,
with --train, gradients and AdamW state of the transformers model). Each
measured figure sits next to the planner's prediction with its error, plus the
things a plan cannot know: fragmentation, memory outside PyTorch, leaks, the
host peak while loading and host<->device bandwidth.

How bytes are measured:

- CUDA: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` around each
  stage (the caching allocator's exact figure for live tensors).
- CPU: there is no allocator counter, so a dispatch mode counts the bytes of every
  storage an operator creates and subtracts them when the storage is freed: the
  same "live tensor bytes" figure. Process memory (RssAnon from /proc) is sampled
  too, for the host-side numbers.

Every figure carries its source; nothing is filled in by assumption.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mempath.memory.ledger import format_bytes

log = logging.getLogger(__name__)

MiB = 1 << 20


# ---------------------------------------------------------------- host memory

def read_host_memory() -> dict[str, int]:
    """This process's resident memory: rss, rss_anon (heap, tensors) and rss_file (mmaps)."""
    try:
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    fields[key] = int(value.split()[0]) * 1024
        return {"rss": fields["VmRSS"], "rss_anon": fields["RssAnon"], "rss_file": fields["RssFile"]}
    except (OSError, KeyError, ValueError):
        import psutil
        info = psutil.Process().memory_info()
        # Without /proc the anonymous share is unknown; rss is the closest figure.
        return {"rss": info.rss, "rss_anon": info.rss, "rss_file": 0}


# ---------------------------------------------------------------- meters

class TensorBytesTracker(TorchDispatchMode):
    """Live bytes of CPU storages created by operators while active, and their peak.

    An output whose storage belongs to one of the operator's inputs (a view, an
    in-place op) allocated nothing; any other new storage is counted once and
    uncounted when it is freed.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t.untyped_storage(), inputs)
        return out

    def _track(self, storage, inputs: set[int]) -> None:
        nbytes = storage.nbytes()
        key = id(storage)
        if nbytes == 0 or storage.data_ptr() in inputs or key in self._tracked:
            return
        with self._lock:
            self._tracked.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._tracked.discard(key)
            self.live -= nbytes


class CudaMeter:
    kind = "cuda"
    source = "allocation delta (torch.cuda.memory_allocated)"
    peak_source = "peak allocation (torch.cuda.max_memory_allocated)"

    def __init__(self, device: torch.device):
        self.device = device

    @contextmanager
    def active(self):
        yield

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


class CpuMeter:
    kind = "cpu"
    source = "live tensor bytes delta (dispatch tracker)"
    peak_source = "peak live tensor bytes (dispatch tracker)"

    def __init__(self):
        self.tracker = TensorBytesTracker()

    @contextmanager
    def active(self):
        with self.tracker:
            yield

    @contextmanager
    def paused(self):
        """Leave tracking for code that must not run under a dispatch mode."""
        from torch.utils._python_dispatch import _pop_mode_temporarily
        with _pop_mode_temporarily():
            yield

    def sync(self) -> None:
        gc.collect()

    def allocated(self) -> int:
        return self.tracker.live

    def reset_peak(self) -> None:
        self.tracker.peak = self.tracker.live

    def peak(self) -> int:
        return self.tracker.peak


# ---------------------------------------------------------------- the recorder

@dataclass
class StageRecord:
    name: str
    pathway: str
    t_start: float
    t_end: float
    allocated_start: int
    allocated_end: int
    peak: int
    host_start: int
    host_peak: int

    @property
    def delta(self) -> int:
        return self.allocated_end - self.allocated_start

    @property
    def peak_delta(self) -> int:
        return self.peak - self.allocated_start


class Recorder:
    """Stage deltas plus a timeline sampled by a background thread.

    progress, if given, receives one line as each stage starts: a run takes minutes on
    a CPU, and a silent one looks hung.
    """

    def __init__(self, meter, interval: float = 0.002, progress: Callable[[str], None] | None = None):
        self.meter = meter
        self.interval = interval
        self.progress = progress
        self.stages: list[StageRecord] = []
        self.samples: list[tuple[float, int, int, str]] = []  # (t, device bytes, host rss_anon, stage)
        self.current: str = "idle"
        self._stage_open = False
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mempath-diagnose-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def sample(self) -> None:
        self.samples.append((self.now(), self.meter.allocated(),
                             read_host_memory()["rss_anon"], self.current))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except RuntimeError:  # the CUDA context may be torn down at exit
                return

    @contextmanager
    def stage(self, name: str, pathway: str):
        """Measure one stage. Nested stages are folded into the enclosing one."""
        if self._stage_open:
            yield
            return
        self._stage_open = True
        if self.progress is not None:
            self.progress(f"mempath diagnose: {self.now():6.1f} s  {name}")
        self.meter.sync()
        start, host_start, t_start = self.meter.allocated(), read_host_memory()["rss_anon"], self.now()
        self.meter.reset_peak()
        self.current = name
        self.sample()
        try:
            yield
        finally:
            self.meter.sync()
            end, peak, t_end = self.meter.allocated(), max(self.meter.peak(), start), self.now()
            self.sample()
            host_peak = max([s[2] for s in self.samples if s[0] >= t_start] + [host_start])
            self.current = "idle"
            self._stage_open = False
            self.stages.append(StageRecord(name, pathway, t_start, t_end, start, end, peak,
                                           host_start, host_peak))

    def last(self, name: str) -> StageRecord | None:
        matches = [s for s in self.stages if s.name == name]
        return matches[-1] if matches else None


def engine_stage_observer(recorder: Recorder):
    """The engine's start-up observer: each stage that fills a pathway becomes a measured stage."""
    def observe(name: str, pathway: str | None):
        return recorder.stage(name, pathway) if pathway is not None else nullcontext()
    return observe


# ---------------------------------------------------------------- comparison rows

@dataclass
class Row:
    pathway: str
    predicted: int | None
    measured: int | None
    predicted_source: str
    measured_source: str
    detail: str = ""
    error_pct: float | None = field(default=None)

    def __post_init__(self):
        if self.predicted and self.measured is not None:
            self.error_pct = round(100.0 * (self.measured - self.predicted) / self.predicted, 2)


def weight_rows(plan, model, meter, load: StageRecord | None) -> list[Row]:
    """Each weight pathway of the plan against the bytes of the loaded parameters."""
    groups = {"embedding": 0, "attention": 0, "mlp": 0, "norms": 0, "lm_head": 0}
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue  # a tied head shares the embedding's storage
        seen.add(id(p))
        groups[_weight_group(name)] += p.numel() * p.element_size()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    rows = [Row(f"weights.{group}", getattr(plan, f"{'norm' if group == 'norms' else group}_bytes"),
                nbytes, f"plan: {'norm' if group == 'norms' else group}_bytes", "parameter tensor bytes")
            for group, nbytes in groups.items()]
    if load is not None:
        rows.append(Row("weights", plan.weight_bytes, load.delta - buffers, "plan: weight_bytes",
                        f"{meter.source} of the load stage minus buffers",
                        f"load delta {format_bytes(load.delta)}, buffers {format_bytes(buffers)}"))
    spec = model.spec
    positions = model.model.rotary.max_positions
    rows.append(Row("rotary tables", 2 * positions * spec.head_dim * 4, buffers,
                    f"derived: cos+sin, {positions} positions x head_dim {spec.head_dim} x fp32 "
                    f"(not in the plan)", "buffer tensor bytes"))
    return rows


def _weight_group(name: str) -> str:
    if "embed_tokens" in name:
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if "norm" in name:
        return "norms"
    if ".self_attn." in name:
        return "attention"
    return "mlp"


# ---------------------------------------------------------------- probe workload

def _probe_batch(engine, num_tokens: int, num_seqs: int):
    """The engine's probe prefill (its profile step's sampling settings), on random tokens."""
    generator = torch.Generator().manual_seed(0)
    return engine.probes.batch(num_tokens, num_seqs, lambda n: torch.randint(
        0, engine.spec.vocab_size, (n,), generator=generator).tolist())


def probe_capacity(engine) -> int:
    """Tokens the probe may lay on the KV pool (one block of slack per sequence)."""
    return max(1, (engine.kv.num_blocks - 8) * engine.config.block_size)


def measure_forward(engine, recorder: Recorder, num_tokens: int, num_seqs: int) -> dict:
    """Embedding, one decoder layer, the whole forward and the logits, stage by stage."""
    engine.kv.pool.reset_prefix_cache()  # the probe overwrites blocks: none may stay findable
    batch = _probe_batch(engine, num_tokens, num_seqs)
    runner, model = engine.runner, engine.model
    with torch.inference_mode():
        input_ids, positions, meta, rows = runner.prepare(batch, {id(r) for r in batch.requests})
        with recorder.stage("embedding forward", "embedding"):
            hidden = model.model.embed_tokens(input_ids)
        embed = recorder.last("embedding forward")
        with recorder.stage("decoder layer 0", "activation_peak"):
            layer_out = model.model.layers[0](positions, hidden, None, meta)
        layer = recorder.last("decoder layer 0")
        del hidden, layer_out
        with recorder.stage("decoder forward", "activation_peak"):
            hidden = model(input_ids, positions, meta)
        with recorder.stage("logits + sampler", "logits"):
            logits = model.compute_logits(hidden[rows])
            runner.sampler(logits, [r.params for r in batch.requests], [None] * len(batch.requests))
            del logits
        del hidden
    forward = recorder.last("decoder forward")
    return {
        "tokens": num_tokens, "sequences": num_seqs,
        "embedding": embed.delta,
        # Relative to before the embedding, so the residual stream is counted as the plan does.
        "layer_peak": layer.peak - embed.allocated_start,
        "forward_peak": forward.peak_delta,
        "logits_peak": recorder.last("logits + sampler").peak_delta,
    }


def measure_kv_growth(engine, recorder: Recorder, plan, num_requests: int, prompt_len: int,
                      max_tokens: int) -> list[dict]:
    """Blocks in use after every step of a generation, against the count the tokens need."""
    from mempath.sampling import SamplingParams
    bytes_per_block = engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size() \
        // engine.kv.num_blocks
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):  # distinct prompts: no prefix sharing to blur the count
        ids = torch.randint(0, engine.spec.vocab_size, (prompt_len,), generator=generator).tolist()
        engine.add_request(ids, params, f"diagnose-growth-{i}")
    steps = []
    with recorder.stage("kv growth (generation)", "kv_cache"):
        while engine.has_unfinished_requests():
            engine.step()
            live = [r for r in engine.outputs.requests.values() if r.block_table]
            blocks_needed = sum(engine.kv.blocks_for(r.num_computed_tokens) for r in live)
            steps.append({
                "step": len(steps) + 1,
                "tokens": sum(r.num_computed_tokens for r in live),
                "predicted_bytes": blocks_needed * plan.kv_bytes_per_block,
                "measured_bytes": engine.stats()["kv_blocks_used"] * bytes_per_block,
                "allocated_bytes": recorder.meter.allocated(),
            })
    return steps


def measure_leak(engine, recorder: Recorder, num_requests: int, prompt_len: int) -> dict:
    """Run identical requests one at a time; allocated bytes must not grow per request."""
    from mempath.sampling import SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, prompt_len + 1))
    prompt = [t % engine.spec.vocab_size for t in prompt]
    after, host_after = [], []
    with recorder.stage("leak check", "leak"):
        for i in range(num_requests):
            engine.add_request(prompt, params, f"diagnose-leak-{i}")
            while engine.has_unfinished_requests():
                engine.step()
            recorder.meter.sync()
            after.append(recorder.meter.allocated())
            host_after.append(read_host_memory()["rss_anon"])
    # The first request warms lazily built state (kernels, workspaces); fit from the second.
    fit = after[1:] if len(after) > 2 else after
    slope = _slope(fit)
    blocks_used = engine.stats()["kv_blocks_used"]
    growth = fit[-1] - fit[0]
    return {
        "requests": num_requests,
        "allocated_after_each": after,
        "slope_bytes_per_request": slope,
        "growth_bytes": growth,
        "host_rss_anon_after_each": host_after,
        "host_slope_bytes_per_request": _slope(host_after[1:] if len(host_after) > 2 else host_after),
        "kv_blocks_used_after": blocks_used,
        "source": recorder.meter.source + "; host: RssAnon (noisy: allocator caches)",
        "verdict": ("leak: allocated bytes grow by %s per request" % format_bytes(slope)
                    if growth > 0 and slope > 0 else "no leak: allocated bytes are flat after warm-up")
                   + ("" if blocks_used == 0 else f"; {blocks_used} KV blocks still in use"),
        "ok": growth <= 0 and blocks_used == 0,
    }


def _slope(values: list[int]) -> float:
    """Least-squares slope of values against their index."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


# ---------------------------------------------------------------- training

def measure_training(model_dir: str, recorder: Recorder, device: torch.device, seq_len: int) -> dict:
    """One forward+backward+AdamW step of the transformers model, in float32.

    float32 weights, grads and moments are the planner's `adamw-fp32` setting, so every
    figure has an exact prediction to meet.
    """
    from transformers import AutoModelForCausalLM
    loader = recorder.meter.paused() if isinstance(recorder.meter, CpuMeter) else _nothing()
    with recorder.stage("train: load", "train_weights"):
        with loader:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in params}.values())
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=generator).to(device)
    with recorder.stage("train: forward", "train_activations"):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    forward = recorder.last("train: forward")
    with recorder.stage("train: backward", "gradients"):
        loss.backward()
        del loss
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    optimizer = torch.optim.AdamW(params, lr=1e-5, foreach=False)
    with recorder.stage("train: optimizer step", "optimizer_state"):
        optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                for t in s.values() if isinstance(t, torch.Tensor))
    backward, step = recorder.last("train: backward"), recorder.last("train: optimizer step")
    result = {
        "seq_len": seq_len,
        "weights_tensor_bytes": weights,
        "activations": forward.delta,  # what the forward kept alive for the backward
        "forward_peak": forward.peak_delta,
        # After backward the saved activations are gone: what stays, relative to before the
        # forward, is the gradients.
        "gradients": backward.allocated_end - forward.allocated_start,
        "gradients_tensor_bytes": grads,
        "backward_peak": backward.peak - forward.allocated_start,
        "optimizer_state": step.delta,
        "optimizer_state_tensor_bytes": state,
    }
    del optimizer, model, params, input_ids
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


@contextmanager
def _nothing():
    yield


# ---------------------------------------------------------------- device-level figures

def measure_fragmentation(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"available": False, "reason": "n/a: no CUDA (the CPU allocator keeps no such counters)"}
    stats = torch.cuda.memory_stats(device)
    reserved = stats.get("reserved_bytes.all.current", 0)
    allocated = stats.get("allocated_bytes.all.current", 0)
    return {
        "available": True,
        "source": "torch.cuda.memory_stats",
        "reserved_bytes": reserved,
        "allocated_bytes": allocated,
        "reserved_minus_allocated": reserved - allocated,
        "inactive_split_bytes": stats.get("inactive_split_bytes.all.current", 0),
        "num_alloc_retries": stats.get("num_alloc_retries", 0),
        "num_ooms": stats.get("num_ooms", 0),
        "num_device_alloc": stats.get("num_device_alloc", 0),
        "num_device_free": stats.get("num_device_free", 0),
    }


def measure_outside_torch(device: torch.device, meter) -> dict:
    host = read_host_memory()
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        return {
            "available": True,
            "source": "derived: device used (cudaMemGetInfo) - torch reserved",
            "device_total": total, "device_used": total - free, "torch_reserved": reserved,
            "outside_torch": total - free - reserved,
            "note": "CUDA context, cuBLAS/NCCL workspaces, and other processes on the device",
        }
    return {
        "available": True,
        "source": "derived: process RssAnon - live tensor bytes created during this run",
        "host_rss_anon": host["rss_anon"], "tensor_bytes": meter.allocated(),
        "outside_torch": host["rss_anon"] - meter.allocated(),
        "note": "interpreter, libraries, allocator caches and tensors made before the run; "
                "untouched tensor pages are counted as tensor bytes but not as RSS",
    }


def measure_bandwidth(device: torch.device, nbytes: int = 256 * MiB, repeats: int = 5) -> dict:
    """Best-of-N host<->device copy rate, pinned and pageable, in GB/s (1e9 B/s)."""
    if device.type != "cuda":
        return {"available": False, "reason": "n/a: no CUDA"}
    result = {"available": True, "bytes": nbytes, "repeats": repeats,
              "source": "measured: CUDA events around one copy, best of the repeats"}
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for pinned in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)  # touch every page so the copy does not pay for page faults
        kind = "pinned" if pinned else "pageable"
        result[f"h2d_{kind}_gbps"] = _copy_rate(lambda: device_buffer.copy_(host, non_blocking=pinned),
                                                nbytes, repeats, device)
        result[f"d2h_{kind}_gbps"] = _copy_rate(lambda: host.copy_(device_buffer, non_blocking=pinned),
                                                nbytes, repeats, device)
        del host
    del device_buffer
    torch.cuda.empty_cache()
    return result


def _copy_rate(copy, nbytes: int, repeats: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        copy()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return round(nbytes / best / 1e9, 2)


def read_pcie_link(device: torch.device) -> dict:
    """Current and maximum PCIe link width and speed, from sysfs or nvidia-smi."""
    if device.type != "cuda":
        return {"available": False, "reason": "n/a: no CUDA"}
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    address = None
    if hasattr(props, "pci_bus_id"):
        address = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        sysfs = Path("/sys/bus/pci/devices") / address
        names = ("current_link_width", "current_link_speed", "max_link_width", "max_link_speed")
        if all((sysfs / n).exists() for n in names):
            link = {n: (sysfs / n).read_text().strip() for n in names}
            return {"available": True, "source": f"sysfs {sysfs}", "pci_address": address, **link}
    if shutil.which("nvidia-smi"):
        query = "pcie.link.width.current,pcie.link.gen.current,pcie.link.width.max,pcie.link.gen.max"
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader",
                                  "-i", str(index)], capture_output=True, text=True, timeout=20)
            width, gen, max_width, max_gen = [v.strip() for v in out.stdout.strip().split(",")]
            return {"available": True, "source": "nvidia-smi", "pci_address": address,
                    "current_link_width": width, "current_link_gen": gen,
                    "max_link_width": max_width, "max_link_gen": max_gen}
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
    return {"available": False, "reason": "the system exposes no PCIe link information",
            "pci_address": address}


# ---------------------------------------------------------------- the whole run

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
    from mempath.memory.plan import cublas_workspace_bytes, detect_gpu_mem, plan_memory

    from mempath.model.llama import ModelSpec
    from mempath.model.loader import read_config

    config = EngineConfig.from_kwargs(model_dir, device=_indexed(device), dtype=dtype, **engine_options)
    # A broken config.json is refused before anything is measured.
    ModelSpec.from_hf_config(read_config(config.model), source=str(Path(config.model) / "config.json"))
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
                from mempath.memory.report import require_plotting
                require_plotting()
            dtype_name = engine.dtype_name
            gpu_mem = detect_gpu_mem() if torch_device.type == "cuda" else None
            fused = engine.runner.use_triton  # which elementwise path the forward takes
            workspace = 0  # no cuBLAS on the CPU
            if torch_device.type == "cuda":
                workspace = cublas_workspace_bytes(torch.cuda.get_device_capability(torch_device)[0])
            serving_plan = plan_memory(
                model_dir, dtype=dtype_name, gpu_mem_bytes=gpu_mem, cublas_workspace=workspace,
                gpu_memory_utilization=config.gpu_memory_utilization,
                max_model_len=engine.max_model_len, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens, block_size=config.block_size,
                cuda_graphs=not config.enforce_eager, fused_kernels=fused)
            seqs = max(1, min(probe_seqs, config.max_num_seqs, probe_tokens))
            # The step buffers hold max-num-batched-tokens tokens and max-model-len per sequence.
            tokens = max(seqs, min(probe_tokens, config.max_num_batched_tokens, probe_capacity(engine),
                                   seqs * engine.max_model_len))
            probe_plan = plan_memory(model_dir, dtype=dtype_name, max_model_len=engine.max_model_len,
                                     cublas_workspace=0,  # the probe's rows are deltas: the workspace exists
                                     max_num_seqs=seqs, max_num_batched_tokens=tokens,
                                     block_size=config.block_size, cuda_graphs=False, fused_kernels=fused)
            forward = measure_forward(engine, recorder, tokens, seqs)
            growth = _run_growth(engine, recorder, serving_plan, growth_requests)
            leak = measure_leak(engine, recorder, leak_requests,
                                prompt_len=min(3 * config.block_size + 1, engine.max_model_len - 8))
            fragmentation = measure_fragmentation(torch_device)
            outside = measure_outside_torch(torch_device, meter)
            rows = _rows(engine, serving_plan, probe_plan, recorder, forward, growth)
            ledger = engine.ledger.as_dict()
            stats = engine.stats()
            del engine
            gc.collect()
            if torch_device.type == "cuda":
                torch.cuda.empty_cache()
            training = None
            if train:
                train_len = max(1, min(probe_tokens, serving_plan.max_model_len))
                train_plan = plan_memory(model_dir, dtype="float32", max_model_len=serving_plan.max_model_len,
                                         train=True, optimizer="adamw-fp32", seq_len=train_len)
                training = measure_training(model_dir, recorder, torch_device, train_len)
                rows += _train_rows(train_plan, training, meter)
    finally:
        recorder.stop()
    report = {
        "mempath_diagnose": 1,
        "model": str(model_dir),
        "device": _describe_device(torch_device),
        "dtype": dtype_name,
        "settings": {k: v for k, v in asdict(config).items() if k != "model"},
        "measurement": {"device_bytes": meter.source, "peaks": meter.peak_source,
                        "host": "RssAnon from /proc/self/status (psutil rss without /proc)"},
        "pathways": [asdict(r) for r in rows],
        "stages": [{**asdict(s), "delta": s.delta, "peak_delta": s.peak_delta} for s in recorder.stages],
        "timeline": {"columns": ["t_seconds", "device_bytes", "host_rss_anon", "stage"],
                     "samples": downsample(recorder.samples, 4000)},
        "probe": forward,
        "kv_growth": growth,
        "leak": leak,
        "fragmentation": fragmentation,
        "outside_torch": outside,
        "host": _host_figures(recorder, host_before),
        "bandwidth": bandwidth,
        "pcie": read_pcie_link(torch_device),
        "training": training,
        "engine_stats": stats,
        "ledger": ledger,
        "plan": serving_plan.to_dict(),
        "snapshot": "n/a: no CUDA" if torch_device.type != "cuda" else None,
        "files": {},
    }
    if out_dir is not None:
        if progress is not None:
            progress(f"mempath diagnose: {recorder.now():6.1f} s  writing the report to {out_dir}")
        _write_outputs(report, Path(out_dir), snapshot and torch_device.type == "cuda")
    return report


def _indexed(device: str) -> str:
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


def _rows(engine, plan, probe_plan, recorder, forward, growth) -> list[Row]:
    meter = recorder.meter
    rows = weight_rows(plan, engine.model, meter, recorder.last("load weights"))
    kv = recorder.last("kv allocation")
    num_blocks = engine.kv.num_blocks
    rows.append(Row("kv_cache", plan.kv_bytes_per_block * num_blocks, kv.delta if kv else None,
                    f"plan: kv_bytes_per_block x {num_blocks:,} engine blocks",
                    f"{meter.source} of the KV allocation"))
    if plan.num_kv_blocks is not None:
        rows.append(Row("kv_cache capacity", plan.num_kv_blocks * plan.kv_bytes_per_block,
                        num_blocks * plan.kv_bytes_per_block,
                        f"plan: {plan.num_kv_blocks:,} blocks (device memory x utilization - weights - workspace)",
                        f"engine: {num_blocks:,} blocks after its profile step"))
    graphs = engine.ledger.entries.get("cuda_graphs")
    if graphs is not None:
        rows.append(Row("cuda_graphs", plan.cuda_graph_bytes, graphs.bytes,
                        f"plan: cuda_graph_bytes (batch <= {plan.cuda_graph_batch})",
                        f"engine ledger: {graphs.detail}"))
    for name in ("step_buffers", "non_torch"):  # figures the plan has no formula for
        entry = engine.ledger.entries.get(name)
        if entry is not None:
            rows.append(Row(name, None, entry.bytes, "not in the plan", f"engine ledger ({entry.source})",
                            entry.detail))
    if "activation_peak" in engine.ledger.entries:
        rows.append(Row("activation_peak (engine profile step)",
                        plan.step_peak_bytes, engine.ledger.get("activation_peak"),
                        f"plan: step_peak_bytes at {plan.max_num_batched_tokens} tokens, "
                        f"{plan.logits_rows} sampled rows",
                        "engine ledger (peak allocation of its profile step)"))
    tokens, h, b = forward["tokens"], probe_plan.hidden_size, probe_plan.dtype_bytes
    rows += [
        Row("embedding (forward output)", tokens * h * b, forward["embedding"],
            f"derived from plan: {tokens} tokens x hidden {h} x {b} B", meter.source),
        Row("decoder layer peak", probe_plan.activation_peak_bytes, forward["layer_peak"],
            f"plan: activation_peak_bytes at {tokens} tokens",
            f"{meter.peak_source} over layer 0, from before the embedding"),
        Row("decoder forward peak", probe_plan.activation_peak_bytes, forward["forward_peak"],
            f"plan: activation_peak_bytes at {tokens} tokens", f"{meter.peak_source} over the forward"),
        Row("logits", probe_plan.logits_bytes, forward["logits_peak"],
            f"plan: logits_bytes ({probe_plan.logits_rows} rows: lm_head output + sampler peak)",
            f"{meter.peak_source} over lm_head + sampler"),
    ]
    if growth:
        top = max(growth, key=lambda s: s["measured_bytes"])
        rows.append(Row("kv growth (peak during generation)", top["predicted_bytes"], top["measured_bytes"],
                        "plan: kv_bytes_per_block x blocks the live tokens need",
                        "engine: kv_blocks_used x KV tensor bytes per block",
                        f"step {top['step']}, {top['tokens']} tokens in the cache"))
    return rows


def _train_rows(plan, training: dict, meter) -> list[Row]:
    return [
        Row("train.weights", plan.train_weight_bytes, training["weights_tensor_bytes"],
            "plan: train_weight_bytes (adamw-fp32)", "parameter tensor bytes"),
        Row("train.gradients", plan.grad_bytes, training["gradients"], "plan: grad_bytes (adamw-fp32)",
            f"{meter.source} from before the forward to after the backward",
            f"tensor bytes of .grad: {format_bytes(training['gradients_tensor_bytes'])}"),
        Row("train.optimizer_state", plan.optimizer_bytes, training["optimizer_state"],
            "plan: optimizer_bytes (adamw-fp32, 8 B/param)", f"{meter.source} of the first AdamW step",
            f"tensor bytes of the state: {format_bytes(training['optimizer_state_tensor_bytes'])}"),
        Row("train.activations", plan.train_activation_bytes + plan.train_logits_bytes,
            training["activations"], f"plan: train_activation_bytes + train_logits_bytes at "
            f"seq-len {plan.seq_len}", f"{meter.source} across the forward (kept for the backward)",
            "the plan's figure is an estimate: Korthikanti et al.'s bytes for a 16-bit GPT layer with "
            "dropout masks and the attention score matrix, not a count of this model's saved tensors; "
            "negative: the model kept less than that"),
    ]


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
    from mempath.memory.report import write_html, write_json
    out_dir.mkdir(parents=True, exist_ok=True)
    if snapshot:
        path = out_dir / "memory_snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        report["snapshot"] = str(path)
        report["files"]["snapshot"] = str(path)
    report["files"]["json"] = str(out_dir / "diagnose.json")
    report["files"]["html"] = str(out_dir / "diagnose.html")
    write_json(report, out_dir / "diagnose.json")
    write_html(report, out_dir / "diagnose.html")


# ---------------------------------------------------------------- CLI

def add_diagnose_arguments(parser: argparse.ArgumentParser) -> None:
    from mempath.cli import add_engine_arguments
    parser.add_argument("model", help="model directory (config.json + safetensors)")
    add_engine_arguments(parser, model_flag=False)
    parser.add_argument("--train", action="store_true",
                        help="also measure gradients and AdamW state (transformers model, float32)")
    parser.add_argument("--probe-tokens", type=int, default=2048, help="tokens in the probe forward")
    parser.add_argument("--probe-seqs", type=int, default=8, help="sequences the probe tokens are split into")
    parser.add_argument("--leak-requests", type=int, default=8, help="identical requests for the leak check")
    parser.add_argument("--out", dest="out_dir", default="mempath-diagnose",
                        help="folder for diagnose.json and diagnose.html")
    parser.add_argument("--snapshot", action="store_true",
                        help="also dump a CUDA memory snapshot for pytorch.org/memory_viz")
    parser.add_argument("--open", action="store_true", help="open the HTML report in a browser")


def run_diagnose(args: argparse.Namespace) -> int:
    from mempath.memory.oom import MempathOutOfMemoryError
    from mempath.memory.report import format_table
    from mempath.cli import engine_options
    options = engine_options(args)
    device, dtype = options.pop("device"), options.pop("dtype")
    try:
        report = diagnose(args.model, device=device, dtype=dtype, train=args.train,
                          probe_tokens=args.probe_tokens, probe_seqs=args.probe_seqs,
                          leak_requests=args.leak_requests, out_dir=args.out_dir,
                          snapshot=args.snapshot, show_progress=True,
                          progress=lambda line: print(line, file=sys.stderr, flush=True), **options)
    except MempathOutOfMemoryError as error:
        print(f"mempath diagnose: {error}", file=sys.stderr)
        return 3
    except ValueError as error:
        print(f"mempath diagnose: error: {error}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.open and report["files"].get("html"):
        import webbrowser
        webbrowser.open(Path(report["files"]["html"]).resolve().as_uri())
    return 0
