"""What diagnose measures with: host memory, live tensor bytes (CUDA allocator or a dispatch mode on
the CPU), and the recorder that takes them around each stage while a sampler thread draws the timeline.

How bytes are measured:

- CUDA: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` around each
  stage (the caching allocator's exact figure for live tensors).
- CPU: there is no allocator counter, so a dispatch mode counts the bytes of every
  storage an operator creates and subtracts them when the storage is freed: the
  same "live tensor bytes" figure. Process memory (RssAnon from /proc) is sampled
  too, for the host-side numbers.
"""
from __future__ import annotations

import gc
import threading
import time
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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

