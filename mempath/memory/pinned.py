"""Page-locked host memory on huge pages, for host stores the host itself also reads.

``torch.empty(..., pin_memory=True)`` comes from the driver's page-locked allocator, in
4 KiB pages. The copy engine does not mind; the host does when it multiplies by those
bytes: an offloaded expert that ``--moe-cpu-experts auto`` runs on the host reads 9.4 MB
(the Qwen3-30B-A3B shape) through a fresh TLB entry every 4 KiB. Here the bytes are an
anonymous mapping advised for transparent huge pages (2 MiB; where the kernel's THP
setting is ``always`` or ``madvise``), then registered with the driver
(``cudaHostRegister``): the copy engine reads them as it reads any pinned memory.

The registration ends when the returned tensor is collected, after the device has
finished its work and before the bytes are unmapped. A view that outlives the tensor
keeps the bytes mapped but no longer pinned (its non-blocking copies become synchronous);
the expert store keeps its tensors as long as the cache. A failed registration is
raised: the model does not load. Without CUDA the tensor is ordinary host memory on the
same mapping.
"""
from __future__ import annotations

import math
import mmap
import weakref

import torch


def transparent_huge_pages() -> str:
    """The kernel's THP mode (always, madvise, never), or "unknown" where it cannot be read."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "unknown"


def huge_page_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor on an anonymous mapping advised for huge pages."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP in this kernel or platform: ordinary pages, same bytes
        pass
    # frombuffer keeps the mapping alive as long as any view of the tensor is.
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


def pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised page-locked host tensor on huge pages (ordinary host memory without CUDA)."""
    tensor = huge_page_empty(shape, dtype)
    if not torch.cuda.is_available() or tensor.numel() == 0:
        return tensor
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister of {tensor.numel() * tensor.element_size()} host bytes failed "
                           f"(CUDA error {int(status)}): free host memory, or keep more experts on the device "
                           f"(--moe-expert-cache-size)")
    weakref.finalize(tensor, _unregister, tensor.data_ptr())
    return tensor


def _unregister(address: int) -> None:
    # Copies from these bytes may still be running (a prefetch, a non-blocking slot fill): the
    # driver's own pinned allocator waits for them before it frees, so this does too.
    try:
        torch.cuda.synchronize()
    except RuntimeError:  # CUDA already torn down (interpreter exit): nothing can be copying
        pass
    torch.cuda.cudart().cudaHostUnregister(address)
