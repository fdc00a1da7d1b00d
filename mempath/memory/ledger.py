"""The Ledger: one place that knows the bytes of every memory pathway.

Every figure carries how it was obtained: ``measured`` (allocation deltas or
tensor sizes read at run time) or ``derived`` (computed from measured figures).
The start-up log, ``mempath diagnose`` and ``/metrics`` all read from here.
"""
from dataclasses import dataclass, field


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

    def record(self, pathway: str, nbytes: int, device: str, source: str = "measured",
               detail: str = "") -> None:
        self.entries[pathway] = Entry(pathway, int(nbytes), device, source, detail)

    def get(self, pathway: str) -> int:
        entry = self.entries.get(pathway)
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
