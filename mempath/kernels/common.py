"""What the Triton kernels share: whether Triton is here, programmatic dependent launch, the
fp8 KV store, and small launch arithmetic.

Importing this module never fails: without Triton, ``HAS_TRITON`` is False and the
``@triton.jit`` helpers are not defined.
"""
import os

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


# Programmatic dependent launch (Hopper and later): a kernel may start while the
# one before it in the stream is finishing; it waits on the device
# (griddepcontrol.wait) before reading or writing anything that kernel touches.
# At batch 1 a decode step is ~390 kernels, most lasting a few microseconds, so
# their start-up is worth hiding. Set to False for A/B measurements.
USE_PDL = True
_PDL_DEVICES = {}


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
        interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # no griddepcontrol there
        _PDL_DEVICES[index] = not interpreted and torch.cuda.get_device_capability(index)[0] >= 9
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
