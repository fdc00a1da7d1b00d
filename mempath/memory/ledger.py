"""The Ledger: one place that knows the bytes of every memory pathway.

Every figure carries how it was obtained: ``measured`` (allocation deltas or
tensor sizes read at run time) or ``derived`` (computed from measured figures).
The start-up log, ``mempath diagnose`` and ``/metrics`` all read from here.
"""
import enum
from dataclasses import dataclass, field


class Pathway(str, enum.Enum):
    """Every consumer of memory the engine accounts for."""
    WEIGHTS = "weights"
    STEP_BUFFERS = "step_buffers"  # static step inputs and the decode split workspace
    TORCH_OTHER = "torch_other"  # PyTorch's other start-up holdings: model buffers, allocator rounding
    ACTIVATION_PEAK = "activation_peak"  # the largest step's temporaries, as the allocator reserves them
    ACTIVATION_SPARE = "activation_spare"  # a spare segment of a step's largest tensor (fragmentation)
    KV_CACHE = "kv_cache"
    CUDA_GRAPHS = "cuda_graphs"  # the captured decode graphs' memory pool
    CUDA_GRAPHS_DRIVER = "cuda_graphs_driver"  # the captured graphs' driver memory (what the driver keeps is non_torch)
    NON_TORCH = "non_torch"  # device memory outside PyTorch: context, kernel modules, other processes
    OUTSIDE_TORCH_GROWTH = "outside_torch_growth"  # room kept for what grows outside PyTorch while serving
    KV_CPU = "kv_cpu"  # the host KV tier
    KV_DISK = "kv_disk"  # the disk KV tier
    KV_TRANSFER_STAGING = "kv_transfer_staging"  # the tiers' device staging buffers
    EXPERT_CACHE = "expert_cache"  # MoE expert slots on the device, when fewer than all experts are resident
    EXPERT_HOST = "expert_host"  # every expert's weights in host memory, the slots' source
    WEIGHTS_HOST = "weights_host"  # an asleep model's weights in host memory (--sleep-offload-weights)

    def __str__(self) -> str:
        return self.value


@dataclass
class Entry:
    pathway: str
    bytes: int
    device: str
    source: str  # measured | derived
    detail: str = ""


@dataclass
class Ledger:
    entries: dict[str, Entry] = field(default_factory=dict)

    def record(self, pathway: Pathway | str, nbytes: int, device: str, source: str = "measured",
               detail: str = "") -> None:
        name = Pathway(pathway).value  # a name that is no pathway is a bug here, not a new row
        self.entries[name] = Entry(name, int(nbytes), device, source, detail)

    def discard(self, pathway: Pathway | str) -> None:
        self.entries.pop(Pathway(pathway).value, None)

    def get(self, pathway: Pathway | str) -> int:
        entry = self.entries.get(Pathway(pathway).value)
        return entry.bytes if entry else 0

    def total(self, device: str | None = None) -> int:
        return sum(e.bytes for e in self.entries.values() if device is None or e.device == device)

    def as_dict(self) -> dict[str, dict]:
        return {name: {"bytes": e.bytes, "device": e.device, "source": e.source, "detail": e.detail}
                for name, e in self.entries.items()}

    def table(self) -> str:
        rows = [("pathway", "device", "bytes", "size", "source", "detail")]
        for e in self.entries.values():
            rows.append((e.pathway, e.device, f"{e.bytes:,}", format_bytes(e.bytes), e.source, e.detail))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
