"""PyTorch's allocator cap on a CUDA device while engines use it.

An engine keeps device use within its budget through ``set_per_process_memory_fraction``,
which is process-wide and outlives the engine. Each engine holds the device's cap; when
the last engine on a device is closed or collected, the cap from before the first one is
put back, so what runs in the process afterwards (transformers beside a benchmark, a
second engine with other settings, the user's own code) gets the device as it was.
"""
import threading
from typing import Callable

import torch

_lock = threading.Lock()
# device index -> [engines holding the cap, the fraction before the first of them]
_holders: dict[int, list] = {}


def _fraction(index: int) -> float:
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
    return get(index) if get is not None else 1.0


def hold_device_cap(device: torch.device) -> Callable[[], None]:
    """Count one more engine on ``device``; the function returned gives its hold back (once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        entry = _holders.setdefault(index, [0, None])
        if entry[0] == 0:
            entry[1] = _fraction(index)
        entry[0] += 1
    released = False

    def release() -> None:
        nonlocal released
        with _lock:
            if released:
                return
            released = True
            entry[0] -= 1
            if entry[0] == 0:
                del _holders[index]
                torch.cuda.set_per_process_memory_fraction(entry[1], index)

    return release
