"""One range of device memory whose bytes can be given back and taken again at the same addresses.

An asleep model's weights (``--sleep-offload-weights``, mempath/multi/sleep.py) go to host
memory and their device bytes back to the device; on waking they return. Its CUDA graphs
were captured against the weights' addresses, so the weights must come back where they
were. On CUDA the arena is the driver's virtual memory management (cuMemAddressReserve,
cuMemCreate, cuMemMap: what vLLM's sleep mode does through its CuMemAllocator): the
address range stays reserved while the physical memory behind it is released. Elsewhere
(the CPU, which has no graphs) the arena is one PyTorch storage resized to nothing and
back: every view of it follows the storage, wherever its new bytes are.

Arena bytes on CUDA are outside PyTorch's allocator: ``mapped_bytes()`` is what start-up
subtracts from the device's used memory before calling the rest "outside PyTorch".
"""
from __future__ import annotations

import ctypes
import math
import weakref

import torch

ALIGNMENT = 256  # each view starts on a multiple of this many bytes (any dtype's alignment)

_mapped = 0  # bytes of physical device memory mapped into arenas, process-wide


def mapped_bytes() -> int:
    """Device bytes the process's CUDA arenas hold now (0 while every one is released)."""
    return _mapped


class ArenaError(RuntimeError):
    """A driver call the arena needs failed: the message names the call and the fix; ``failure`` the call and
    the driver's error name alone (``cuMemCreate failed (CUDA_ERROR_OUT_OF_MEMORY)``)."""

    def __init__(self, message: str, failure: str | None = None):
        super().__init__(message)
        self.failure = failure or message


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemAllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _CUmemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _CUmemAllocFlags)]


class _CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", _CUmemLocation), ("flags", ctypes.c_int)]


_ALLOCATION_PINNED, _LOCATION_DEVICE, _ACCESS_READWRITE = 1, 1, 3
_driver = None


def _cuda():
    global _driver
    if _driver is None:
        try:
            _driver = ctypes.CDLL("libcuda.so.1")
        except OSError as error:
            raise ArenaError(f"the CUDA driver library (libcuda.so.1) did not load ({error}): "
                             f"--sleep-offload-weights needs it; leave the option off") from error
    return _driver


def _check(result: int, call: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _cuda().cuGetErrorName(result, ctypes.byref(name))
        failure = f"{call} failed ({(name.value or b'?').decode()})"
        raise ArenaError(f"{failure}: the device cannot keep weights at fixed addresses while they sleep; leave "
                         f"--sleep-offload-weights off", failure)


class _CudaArrayInterface:
    """A raw device range as PyTorch can view it without copying (torch.as_tensor); every view's
    storage holds it, so the range is freed once the last view is gone."""

    def __init__(self, pointer: int, size: int, state: dict):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (pointer, False),
                                         "version": 3, "strides": None}
        weakref.finalize(self, _free_range, pointer, size, state).atexit = False


def _free_range(pointer: int, size: int, state: dict) -> None:
    global _mapped
    cu = _cuda()
    try:
        torch.cuda.synchronize()  # kernels still queued may read the range
    except RuntimeError:
        pass  # the process is ending: the driver frees what is left
    if state["handle"] is not None:
        cu.cuMemUnmap(ctypes.c_ulonglong(pointer), ctypes.c_size_t(size))
        cu.cuMemRelease(ctypes.c_ulonglong(state["handle"]))
        state["handle"] = None
        _mapped -= size
    cu.cuMemAddressFree(ctypes.c_ulonglong(pointer), ctypes.c_size_t(size))


class DeviceArena:
    """CUDA: a reserved address range with physical memory mapped behind it while awake."""

    def __init__(self, nbytes: int, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.synchronize(index)  # the runtime's primary context is current on this thread
        self.device = torch.device("cuda", index)
        cu = _cuda()
        self.prop = _CUmemAllocationProp()
        self.prop.type = _ALLOCATION_PINNED
        self.prop.location = _CUmemLocation(_LOCATION_DEVICE, index)
        granularity = ctypes.c_size_t()
        _check(cu.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self.prop), 0),
               "cuMemGetAllocationGranularity")
        self.nbytes = max(1, math.ceil(nbytes / granularity.value)) * granularity.value
        pointer = ctypes.c_ulonglong()
        _check(cu.cuMemAddressReserve(ctypes.byref(pointer), ctypes.c_size_t(self.nbytes),
                                      ctypes.c_size_t(granularity.value), ctypes.c_ulonglong(0),
                                      ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        self.pointer = pointer.value
        self.state = {"handle": None}  # the physical memory's handle while mapped; shared with the finalizer
        self.map()
        self.tensor = torch.as_tensor(_CudaArrayInterface(self.pointer, self.nbytes, self.state), device=self.device)

    @property
    def is_mapped(self) -> bool:
        return self.state["handle"] is not None

    def map(self) -> None:
        """Physical memory behind the range again (its bytes undefined until written)."""
        global _mapped
        if self.is_mapped:
            return
        cu = _cuda()
        handle = ctypes.c_ulonglong()
        _check(cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.nbytes), ctypes.byref(self.prop),
                              ctypes.c_ulonglong(0)), "cuMemCreate")
        result = cu.cuMemMap(ctypes.c_ulonglong(self.pointer), ctypes.c_size_t(self.nbytes), ctypes.c_size_t(0),
                             handle, ctypes.c_ulonglong(0))
        if result != 0:
            cu.cuMemRelease(handle)
            _check(result, "cuMemMap")
        access = _CUmemAccessDesc(_CUmemLocation(_LOCATION_DEVICE, self.device.index), _ACCESS_READWRITE)
        _check(cu.cuMemSetAccess(ctypes.c_ulonglong(self.pointer), ctypes.c_size_t(self.nbytes),
                                 ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")
        self.state["handle"] = handle.value
        _mapped += self.nbytes

    def unmap(self) -> None:
        """Give the physical memory back to the device; the addresses stay reserved."""
        global _mapped
        if not self.is_mapped:
            return
        torch.cuda.synchronize(self.device)  # nothing queued may still read it
        cu = _cuda()
        _check(cu.cuMemUnmap(ctypes.c_ulonglong(self.pointer), ctypes.c_size_t(self.nbytes)), "cuMemUnmap")
        _check(cu.cuMemRelease(ctypes.c_ulonglong(self.state["handle"])), "cuMemRelease")
        self.state["handle"] = None
        _mapped -= self.nbytes


class StorageArena:
    """Elsewhere: one PyTorch storage, resized to nothing while unmapped (views follow it)."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        self.nbytes = max(1, nbytes)
        self.tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.is_mapped = True

    def map(self) -> None:
        if not self.is_mapped:
            self.tensor.untyped_storage().resize_(self.nbytes)
            self.is_mapped = True

    def unmap(self) -> None:
        if self.is_mapped:
            self.tensor.untyped_storage().resize_(0)
            self.is_mapped = False


def make_arena(nbytes: int, device: torch.device) -> DeviceArena | StorageArena:
    return DeviceArena(nbytes, device) if device.type == "cuda" else StorageArena(nbytes, device)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def view(arena: DeviceArena | StorageArena, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over the arena's bytes from ``offset`` (a multiple of ALIGNMENT)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return arena.tensor[offset:offset + nbytes].view(dtype).view(shape)
