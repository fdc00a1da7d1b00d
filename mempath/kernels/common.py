"""What the Triton kernels share: whether Triton is here, programmatic dependent launch, the
fp8 KV store, small launch arithmetic, and the reading and writing of measured launch tables.

Importing this module never fails: without Triton, ``HAS_TRITON`` is False and the
``@triton.jit`` helpers are not defined.
"""
import json
import os
from dataclasses import asdict, fields
from pathlib import Path

import torch

from mempath.kernels.attention_torch import is_fp8

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:  # pragma: no cover - Triton before 3.4
    HAS_PDL = False

def kv_fp8_max(cache_dtype: torch.dtype) -> float:
    """The ``KV_FP8_MAX`` constexpr of the KV-write kernels: the fp8 format's largest finite
    value, 0.0 for a cache that is not fp8."""
    return float(torch.finfo(cache_dtype).max) if is_fp8(cache_dtype) else 0.0


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def table_path(path: str | os.PathLike | None, env: str, shipped: Path, sweep: str) -> Path:
    """Which launch table to read: ``path``, else the file the environment variable ``env`` names, else
    the shipped one. Only the shipped table may be absent (not swept yet: the loaders read it as {});
    one given or named that does not exist is one line naming it and ``sweep``, the command that writes one."""
    from_env = path is None and os.environ.get(env)
    chosen = Path(path or from_env or shipped)
    if chosen != shipped and not chosen.exists():
        named = f"{env} names {chosen}" if from_env else f"the table {chosen}"
        raise ValueError(f"{named}, which does not exist: point it at a table ({sweep} --out FILE writes one)"
                         f"{' or unset it' if from_env else ''}")
    return chosen


def read_table_file(path: Path, remake: str) -> dict:
    """A launch table file's JSON object ({} when there is no file); not JSON, or no "configs" object
    in it, is one line naming the file and ``remake``, the command that rewrites it."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e}): rewrite it with {remake} or delete it") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("configs", {}), dict):
        raise ValueError(f'{path}: the table must be a JSON object with a "configs" object: rewrite it with {remake}')
    return raw


def load_config_table(path: Path, config_type: type, key_name: str, remake: str) -> dict[str, dict[str, object]]:
    """{"NxK": {key: config_type(**entry)}} from a table file's "configs"; {} when there is no file.

    Every problem is one line naming the file, the shape and key, and the fix: ``key_name`` is
    what the inner keys are ("bucket", "block_m"), ``remake`` the command that rewrites the table.
    A config type's own ValueError (from ``__post_init__``) is passed on prefixed with its place.
    """
    raw = read_table_file(path, remake)
    table = {}
    for shape, entries in raw.get("configs", {}).items():
        if not isinstance(entries, dict):
            raise ValueError(f"{path}: {shape} must map {key_name} to configurations, got {entries!r}")
        table[shape] = {key: read_config(entry, config_type, f"{path}: {shape} {key_name} {key}")
                        for key, entry in entries.items()}
    return table


def read_config(entry, config_type: type, where: str):
    """``config_type(**entry)`` for one table entry; a problem is one line starting with ``where``."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object of fields, got {entry!r}")
    known = {f.name for f in fields(config_type)}
    unknown = set(entry) - known
    if unknown:
        raise ValueError(f"{where} has unknown fields {sorted(unknown)}: the fields are {sorted(known)}")
    try:
        return config_type(**entry)
    except ValueError as e:  # the config's own check (__post_init__), prefixed with its place
        raise ValueError(f"{where}: {e}") from e


def config_table_json(configs: dict[str, dict[str, object]], **about) -> str:
    """A table file's text: ``about`` (device, how it was made) beside the configs: each a dataclass,
    or one level of keys to dataclasses (e.g. buckets); one configuration a line, so a sweep's diff
    reads per entry."""
    lines = [json.dumps({**about, "configs": {}}, indent=1)[:-len('{}\n}')] + "{"]
    for i, (shape, entries) in enumerate(configs.items()):
        lines.append(f'  "{shape}": {{')
        parts = []
        for key, entry in entries.items():
            if isinstance(entry, dict):
                inner = ",\n".join(f'    "{k}": {json.dumps(asdict(c))}' for k, c in entry.items())
                parts.append(f'   "{key}": {{\n{inner}\n   }}')
            else:
                parts.append(f'   "{key}": {json.dumps(asdict(entry))}')
        lines.append(",\n".join(parts))
        lines.append("  }" + ("," if i < len(configs) - 1 else ""))
    return "\n".join(lines) + "\n }\n}\n"


# Programmatic dependent launch (Hopper and later): a kernel may start while the
# one before it in the stream is finishing; it waits on the device
# (griddepcontrol.wait) before reading or writing anything that kernel touches.
# At batch 1 a decode step is ~390 kernels, most lasting a few microseconds, so
# their start-up is worth hiding. Set to False for A/B measurements.
USE_PDL = True
_PDL_DEVICES = {}


def interpreted() -> bool:
    """Whether Triton runs its kernels in the interpreter (TRITON_INTERPRET): no PTX is compiled there."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_pdl(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use programmatic dependent launch.

    Every kernel launched this way calls ``pdl_wait`` before its first access to
    activations, the KV cache or the step's inputs; only weights and constant tables
    may be read before it (a kernel that skips the wait could finish before its
    predecessor, and the one after it would then not wait for that predecessor).
    """
    if not (USE_PDL and HAS_TRITON and HAS_PDL and device.type == "cuda"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PDL_DEVICES:  # once per device: this runs at every kernel launch
        # No griddepcontrol in the interpreter.
        _PDL_DEVICES[index] = not interpreted() and torch.cuda.get_device_capability(index)[0] >= 9
    return _PDL_DEVICES[index]


def pdl_options(device: torch.device) -> dict:
    """Launch arguments for a kernel with a ``PDL`` constexpr. ``launch_pdl`` is passed only
    when on: Triton versions (and backends) without it reject the keyword."""
    return {"PDL": True, "launch_pdl": True} if use_pdl(device) else {"PDL": False}


if HAS_TRITON:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait for the previous kernel's writes, then let the next kernel launch."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def to_cache_dtype(x, cache_dtype, KV_FP8_MAX: tl.constexpr):
        """``x`` as ``attention_torch.quantize_kv`` stores it: for an fp8 cache (KV_FP8_MAX > 0)
        clamped to the format's finite range, then rounded to nearest even; otherwise a plain cast."""
        if KV_FP8_MAX > 0:
            x = tl.minimum(tl.maximum(x.to(tl.float32), -KV_FP8_MAX), KV_FP8_MAX)
            return x.to(cache_dtype, fp_downcast_rounding="rtne")
        return x.to(cache_dtype)
