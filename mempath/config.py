"""EngineConfig: every engine knob in one place, validated once."""
import math
import os
import typing
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from mempath import constants
from mempath.constants import DEFAULT_BLOCK_SIZE as AUTO_BLOCK_SIZE  # what --block-size auto picks
from mempath.constants import DEFAULT_GPU_MEMORY_UTILIZATION, MAX_SIZE_GIB, as_kind
from mempath.engine.spec.config import parse_speculative_config
from mempath.memory.budget import check_host_room
from mempath.memory.formulas import check_expert_cache_gb, check_expert_cache_size

_DTYPES = {alias: getattr(torch, name) for alias, name in constants.DTYPE_ALIASES.items()}
KV_CACHE_DTYPES = {alias: getattr(torch, name) for alias, name in constants.KV_CACHE_DTYPES.items()}


def check_expert_cache_options(size, gb, cpu_experts: str = "never") -> None:
    """The expert cache's model-free checks (one model's EngineConfig, or several models' shared options
    before any config.json is read: mempath/multi/experts.py); the size against a model's experts is start-up's."""
    if size is not None and gb is not None:
        raise ValueError("moe_expert_cache_size and moe_expert_cache_gb both given: give the experts per "
                         "layer or the GiB for them, not both")
    if size is not None:
        check_expert_cache_size(size)
    if gb is not None:
        check_expert_cache_gb(gb)
    if cpu_experts not in ("never", "auto", "always"):
        raise ValueError(f"moe_cpu_experts must be never, auto or always, got {cpu_experts!r}")


PATH_FIELDS = ("model", "tokenizer", "disk_kv_path", "generation_config")
# Fields whose own checks refuse any other type, naming the values they take.
OWN_TYPE_CHECKS = ("kv_cache_dtype", "quantization", "moe_expert_cache_size", "moe_expert_cache_gb",
                   "speculative_config")
_KINDS = {bool: "true or false", int: "a whole number", float: "a number", str: "a string", dict: "a dict",
          type(None): "None"}


def lookup(path) -> tuple[bool, bool]:
    """(is a directory, is a file) for ``path``; both False for a name the filesystem cannot look up at all
    (longer than a path may be, say), which callers then treat as no such path."""
    try:
        found = Path(path)
        return found.is_dir(), found.is_file()
    except OSError:
        return False, False


def check_field_types(config) -> None:
    """ValueError naming the first field whose value is not of its annotated type: checked before any range
    check reads it, as "4" compared with a number raised a TypeError, a 2.5 reached torch.zeros after the
    weights loaded, and "false" was a true flag. numpy's scalars become Python's."""
    for item in fields(config):
        if item.name in OWN_TYPE_CHECKS:
            continue
        value, kinds = getattr(config, item.name), typing.get_args(item.type) or (item.type,)
        if value is None and type(None) in kinds:
            continue
        taken = next((v for v in (as_kind(value, kind) for kind in kinds if kind is not type(None))
                      if v is not None), None)
        if taken is None:
            wanted = " or ".join(_KINDS.get(kind, getattr(kind, "__name__", str(kind))) for kind in kinds)
            raise ValueError(f"{item.name} must be {wanted}, got {value!r}"[:200])
        setattr(config, item.name, taken)


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto: the checkpoint's dtype on CUDA, float32 on the CPU
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    block_size: int | str = 16  # tokens per KV block, a power of two, or "auto" (AUTO_BLOCK_SIZE)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # None: constants.default_max_num_seqs of the device (1024 on a GPU of 70 GiB or more, else 256).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    # Bytes of KV cache when the device is the CPU (vLLM's VLLM_CPU_KVCACHE_SPACE).
    cpu_kv_cache_bytes: int = 1 << 30
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no CUDA graphs (they are only used on CUDA)
    # Launch the next decode step before reading the current one's tokens, so the host's
    # bookkeeping overlaps the device's work (vLLM's --async-scheduling); docs/architecture.md.
    async_scheduling: bool = True
    # auto: read the checkpoint; dummy: random weights of the right shapes (benchmarks,
    # needs only config.json), as vLLM's --load-format dummy.
    load_format: str = "auto"
    # Largest number of top logprobs a request may ask for; bounds the sampler's work.
    max_logprobs: int = 20
    # KV tiers (docs/tiers.md). Off by default: nothing is allocated and the step loop
    # does no extra work. GiB of pinned host memory for the warm tier, reserved at start-up.
    cpu_kv_gb: float = 0.0
    disk_kv_path: str | None = None  # the cold tier's directory (needs cpu_kv_gb > 0)
    disk_kv_gb: float = 0.0
    disk_write_policy: str = "write-back"  # write-back | write-through
    # How a preempted request gives its blocks back: auto (swap or recompute, whichever
    # the calibrated cost model says is faster), recompute, or swap (needs cpu_kv_gb).
    preemption_mode: str = "auto"
    # auto: K and V in the model dtype; fp8 (= fp8_e4m3) or fp8_e5m2: one byte per element,
    # twice the blocks in the same memory (docs/architecture.md, "fp8 KV cache").
    kv_cache_dtype: str = "auto"
    # The tokenizer's directory (vLLM's --tokenizer); None: the model directory.
    tokenizer: str | None = None
    # Where default sampling parameters come from (vLLM's --generation-config): auto (the model's
    # generation_config.json), vllm (none: SamplingParams' defaults) or a directory holding one.
    generation_config: str = "auto"
    # False: a prompt is prefilled in one step, never split across steps (it waits for a step
    # with room for all of it); needs max_num_batched_tokens >= max_model_len.
    enable_chunked_prefill: bool = True
    # Speculative decoding as vLLM spells it: {"model": DIR, "num_speculative_tokens": K} or
    # {"method": "ngram", ...} (docs/speculative.md); parsed into a SpeculativeConfig.
    speculative_config: dict | str | None = None
    # fp8: the q/k/v, o, gate/up and down projections quantized to float8_e4m3fn at load,
    # per-channel weight and per-token activation scales (docs/quantization.md); None: as
    # the checkpoint is (an fp8 checkpoint's quantization_config is read without it).
    quantization: str | None = None
    # Mixture-of-experts models (docs/moe.md): experts per MoE layer resident on the device,
    # the rest in pinned host memory and copied into slots when routed (None: all resident);
    # or the same as device GiB for the slots, which start-up turns into experts per layer.
    moe_expert_cache_size: int | None = None
    moe_expert_cache_gb: float | None = None
    # Where a missed expert runs (docs/moe.md): never (copied into a slot), always (on the host,
    # from its pinned copy) or auto (the cheaper by a cost model measured at start-up).
    moe_cpu_experts: str = "never"
    # The weights in one arena (mempath/memory/arena.py) whose device bytes can be released
    # and taken back at the same addresses: set for every model by --sleep-offload-weights
    # (mempath/multi/sleep.py), so an asleep model's weights can wait in host memory.
    weights_arena: bool = False

    def __post_init__(self):
        for name in PATH_FIELDS:  # a pathlib.Path is a path too; the engine keeps strings
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        check_field_types(self)
        constants.check_seed(self.seed)
        if self.block_size == "auto":
            self.block_size = AUTO_BLOCK_SIZE
        if not isinstance(self.block_size, int):
            raise ValueError(f"block_size must be a power of two or 'auto', got {self.block_size!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(set(_DTYPES))}, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(chunking_needs_budget(self.max_num_batched_tokens, self.max_model_len))
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            raise ValueError(f"tokenizer {self.tokenizer!r} is not a directory; give the directory holding "
                             f"tokenizer.json / tokenizer_config.json")
        if self.kv_cache_dtype not in ("auto", *KV_CACHE_DTYPES):  # a tuple: a list given is refused, not hashed
            raise ValueError(f"kv_cache_dtype must be auto, {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 (or None: as the checkpoint is), got {self.quantization!r}")
        self._validate_expert_cache()
        self._check_device()
        if self.max_num_seqs is None:
            self.max_num_seqs = constants.default_max_num_seqs(self._gpu_total_bytes())
        self._validate_tiers()
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.speculative_config is not None and self.tiers_enabled:
            raise ValueError("speculative decoding with KV tiers is not supported yet (the tiers hold the "
                             "target's KV only): drop speculative_config or cpu_kv_gb")

    def _gpu_total_bytes(self) -> int | None:
        """Total memory of the CUDA device this engine will run on (None on the CPU)."""
        if self.device == "auto" and not torch.cuda.is_available() or torch.device(
                "cuda" if self.device == "auto" else self.device).type == "cpu":
            return None
        device = torch.device("cuda" if self.device == "auto" else self.device)
        return torch.cuda.get_device_properties(device.index or 0).total_memory

    def _check_device(self) -> None:
        """Refuse here, with the fix, a device torch would fail on later with a traceback."""
        if self.device == "auto":
            return
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if device.type == "cpu":
            return
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise ValueError(f"device {self.device}: this PyTorch ({torch.__version__}) is a CPU build: use "
                             f"--device cpu, or install a CUDA build (MEMPATH_TORCH=cuda scripts/install.sh "
                             f"after pip uninstall torch)")
        if not torch.cuda.is_available():
            raise ValueError(f"device {self.device}: PyTorch sees no CUDA device (driver, or "
                             f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {self.device}: PyTorch sees {count} CUDA device(s), cuda:0 to "
                             f"cuda:{count - 1}")

    def _validate_expert_cache(self) -> None:
        """The model-free checks; start-up checks the size against the model's experts (model/moe.py)."""
        if as_kind(self.moe_expert_cache_size, int) is not None:  # numpy's integers, as every other field's
            self.moe_expert_cache_size = as_kind(self.moe_expert_cache_size, int)
        size, gb = self.moe_expert_cache_size, self.moe_expert_cache_gb
        check_expert_cache_options(size, gb, self.moe_cpu_experts)
        if self.weights_arena and (size is not None or gb is not None):
            raise ValueError("--sleep-offload-weights moves whole models' weights; with experts in host memory "
                             "(moe_expert_cache_size / moe_expert_cache_gb) leave it off")

    def _validate_tiers(self) -> None:
        for flag, gb in (("--cpu-kv-gb", self.cpu_kv_gb), ("--disk-kv-gb", self.disk_kv_gb)):
            # nan compares false with everything (the tiers were silently off) and inf overflowed
            # int() once the weights had loaded.
            if not math.isfinite(gb):
                raise ValueError(f"{flag} {gb:g} is not a finite size: give GiB as a number (0: no such tier)")
            if gb > MAX_SIZE_GIB:
                raise ValueError(f"{flag} {gb:g} is more than 1 PiB, which is no host's memory or disk: give GiB "
                                 f"(0: no such tier)")
        if self.cpu_kv_cache_bytes < 1:
            raise ValueError(f"cpu_kv_cache_bytes must be >= 1 (bytes of host memory for a CPU engine's KV cache), "
                             f"got {self.cpu_kv_cache_bytes}")
        if self.cpu_kv_gb < 0 or self.disk_kv_gb < 0:
            raise ValueError(f"cpu_kv_gb and disk_kv_gb must be >= 0, got {self.cpu_kv_gb}, {self.disk_kv_gb}")
        if self.disk_write_policy not in ("write-back", "write-through"):
            raise ValueError(f"disk_write_policy must be write-back or write-through, "
                             f"got {self.disk_write_policy!r}")
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError(f"preemption_mode must be auto, recompute or swap, got {self.preemption_mode!r}")
        if isinstance(self.disk_kv_path, str) and not self.disk_kv_path.strip():
            raise ValueError("--disk-kv-path is empty; name a directory for the disk KV tier, or leave the flag out")
        if self.disk_kv_path and not (self.disk_kv_gb > 0 and self.cpu_kv_gb > 0):
            raise ValueError("the disk KV tier needs disk_kv_gb > 0 and a host tier to stage through "
                             "(cpu_kv_gb > 0)")
        if self.disk_kv_gb > 0 and not self.disk_kv_path:
            raise ValueError("disk_kv_gb is set but disk_kv_path is not: name the cold tier's directory")
        if self.preemption_mode == "swap" and self.cpu_kv_gb <= 0:
            raise ValueError("preemption_mode swap needs a host tier to swap to: set cpu_kv_gb > 0")
        # Without prefix caching no block has a hash: nothing can be found in a lower tier.
        if self.disk_kv_path and not self.enable_prefix_caching:
            raise ValueError("the disk KV tier holds prefix-cached blocks: it needs enable_prefix_caching")
        if self.cpu_kv_gb > 0 and not self.enable_prefix_caching and self.preemption_mode == "recompute":
            raise ValueError("cpu_kv_gb would never be used: without enable_prefix_caching the host tier only "
                             "holds swapped requests, and preemption_mode is recompute")
        if self.cpu_kv_gb > 0:
            # Before the weights load: the tier is reserved whole at start-up (pinned on CUDA), and one larger
            # than the host crashed there, after the weights had loaded.
            check_host_room(self.cpu_kv_gb * (1 << 30), f"--cpu-kv-gb {self.cpu_kv_gb:g}", "a host KV tier")
        if self.disk_kv_path:
            # Here, before the weights load: a path the tier would refuse fails in a second, not minutes.
            from mempath.kv.tiers.disk_dir import check_disk_kv_path, check_disk_room
            check_disk_kv_path(self.disk_kv_path)
            check_disk_room(self.disk_kv_path, int(self.disk_kv_gb * (1 << 30)), self.disk_kv_gb)

    @property
    def tiers_enabled(self) -> bool:
        return self.cpu_kv_gb > 0

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {sorted(known - {'model'})}")
        return cls(model=model, **kwargs)

    def torch_device(self) -> torch.device:
        name = self.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(name)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """What the model computes in: --dtype, or for auto float32 on the CPU and elsewhere the checkpoint's
        dtype; where config.json names none, 16 bits as vLLM's auto and mempath plan count it: bfloat16, or
        float16 on a GPU without bfloat16."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        device = self.torch_device()
        if device.type == "cpu":
            return torch.float32
        if checkpoint_dtype is not None:
            return checkpoint_dtype
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """What the KV cache stores: the model dtype unless kv_cache_dtype names an fp8 format."""
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype, model_dtype)


def chunking_needs_budget(max_num_batched_tokens: int, max_model_len: int) -> str:
    return (f"enable_chunked_prefill off prefills a prompt in one step, so max_num_batched_tokens "
            f"({max_num_batched_tokens}) must be >= max_model_len ({max_model_len}): raise "
            f"--max-num-batched-tokens or lower --max-model-len")


# ---------------------------------------------------------------- CPU threads

_THREADS_CHOSEN: int | None = None  # what choose_cpu_threads set, so a second call leaves it alone


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """Cores' worth of CPU time this process's cgroup may use (cpu.max, or cfs quota in v1), or None."""
    path = ""
    try:
        for line in Path(proc_cgroup).read_text().splitlines():
            if line.startswith("0::"):
                path = line[3:].strip().rstrip("/")
    except OSError:
        pass
    candidates = [(f"{root}{path}/cpu.max", None), (f"{root}/cpu.max", None),
                  (f"{root}/cpu/cpu.cfs_quota_us", f"{root}/cpu/cpu.cfs_period_us"),
                  (f"{root}/cpu,cpuacct/cpu.cfs_quota_us", f"{root}/cpu,cpuacct/cpu.cfs_period_us")]
    for quota_file, period_file in candidates:
        try:
            fields = Path(quota_file).read_text().split()
            if period_file is not None:
                fields.append(Path(period_file).read_text().strip())
        except OSError:
            continue
        if len(fields) < 2 or fields[0] in ("max", "-1"):
            return None
        return int(fields[0]) / int(fields[1])
    return None


def _proc_stat_cpus(text: str) -> dict[int, tuple[int, int]]:
    """cpu index -> (idle + iowait jiffies, all jiffies) from /proc/stat's text."""
    cpus = {}
    for line in text.splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            counts = [int(v) for v in values[:8]]  # user .. steal; guest time is inside user
            cpus[int(name[3:])] = (counts[3] + counts[4], sum(counts))
    return cpus


def busy_cores(before: str, after: str, cpus) -> float:
    """Cores of `cpus` kept busy between two /proc/stat readings."""
    start, end = _proc_stat_cpus(before), _proc_stat_cpus(after)
    busy = 0.0
    for cpu in cpus:
        if cpu in start and cpu in end and end[cpu][1] > start[cpu][1]:
            busy += 1 - (end[cpu][0] - start[cpu][0]) / (end[cpu][1] - start[cpu][1])
    return busy


def measure_cpu_use(interval: float = 0.1) -> dict:
    """The cores this process may use and how many of them other work keeps busy right now."""
    import math
    import time
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    figures = {"affinity": len(cpus), "quota": quota, "busy": None}
    figures["cores"] = len(cpus) if quota is None else max(1, min(len(cpus), math.floor(quota)))
    try:
        before = Path("/proc/stat").read_text()
        time.sleep(interval)  # this thread sleeps: what stays busy is other work
        figures["busy"] = busy_cores(before, Path("/proc/stat").read_text(), cpus)
    except OSError:
        pass
    return figures


def pick_cpu_threads(cores: int, affinity: int, busy: float | None, torch_default: int) -> int:
    """Threads for the CPUs other work leaves idle, never more than the cores allowed or torch's default.

    OpenMP threads wait for each other at every operator, so one that shares its core with
    other work holds all of them up: on a busy machine fewer threads than cores run faster.
    """
    idle = affinity if busy is None else round(max(0.0, affinity - busy))
    return max(1, min(cores, idle, torch_default))


def choose_cpu_threads() -> str:
    """Set torch's CPU thread count from the cores actually available; returns the log line.

    The user's choice wins: OMP_NUM_THREADS or MKL_NUM_THREADS in the environment, or a
    torch.set_num_threads that changed torch's default.
    """
    global _THREADS_CHOSEN
    current = torch.get_num_threads()
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if os.environ.get(variable):
            return f"CPU threads: {current}, as {variable}={os.environ[variable]} says"
    if _THREADS_CHOSEN is not None:
        return f"CPU threads: {current}" + ("" if current == _THREADS_CHOSEN else ", as torch.set_num_threads chose")
    import psutil
    torch_default = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if current != torch_default:
        return f"CPU threads: {current}, as torch.set_num_threads chose"
    use = measure_cpu_use()
    threads = pick_cpu_threads(use["cores"], use["affinity"], use["busy"], torch_default)
    torch.set_num_threads(threads)
    _THREADS_CHOSEN = threads
    quota = "none" if use["quota"] is None else f"{use['quota']:g} cores"
    busy = "unknown" if use["busy"] is None else f"{use['busy']:.1f}"
    return (f"CPU threads: {threads} (torch's default {torch_default}; this process may use {use['cores']} "
            f"cores: affinity {use['affinity']}, cgroup quota {quota}; {busy} of them busy with other work "
            f"at start-up). OMP_NUM_THREADS or torch.set_num_threads overrides")
