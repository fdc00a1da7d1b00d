"""TransferEngine: moves KV blocks between the device cache and the host store.

The device cache is one tensor ``[L, 2, N, bs, H, D]``: a block is scattered over
2·L slices of it (one per layer and K/V), each only ``bs·H·D`` elements (32 KiB
for Llama-3.1-8B in bf16). Copying those slices one by one means thousands of
small PCIe copies, which reach about half the bandwidth of large ones (ANCHORS.md:
28 vs 53 GB/s at 256 KiB, worse when smaller). So a batch of blocks moves as:

  device → host: one indexed gather on the device (``index_select`` over the
  cache seen as rows of ``bs·H·D``) into a contiguous block-major device staging
  buffer, then one copy per run of consecutive host block ids;
  host → device: one copy per run of consecutive host ids into the staging
  buffer, then one indexed scatter (``index_copy_``) into the cache.

The host store allocates consecutive ids when it can, so a batch is usually one
copy. There is no pinned host staging buffer: gathering scattered host blocks
into one would be a CPU memcpy (~10 GB/s) on the step loop's thread, or a
thread waiting on CUDA events; a scattered host batch costs one copy per block
instead, and a block-sized copy (≥ 1 MiB for real models) is already large.

On CUDA each direction has its own staging buffer and two streams of its own,
one for the PCIe copies and one for the gather/scatter kernels, so the step loop
only launches work and polls events; nothing here blocks the host unless
``wait()`` is called. A batch larger than half the staging buffer moves in
half-buffer chunks that alternate between the halves: chunk i+1's PCIe copy runs
while chunk i is scattered (or gathered), so the copy engine never waits for a
kernel, which may itself wait for SMs busy with a prefill. Both streams have the
high priority, so those kernels take the next free SMs. On the CPU (CI) the same
chunks run synchronously.
"""
from __future__ import annotations

import contextlib
import time

import torch

from mempath.kv.tiers.host import HostBlockStore, block_shape_of, contiguous_runs

D2H, H2D = "d2h", "h2d"


class Transfer:
    """One launched batch of block copies. Poll ``done()`` from the step loop."""

    def __init__(self, engine: TransferEngine, direction: str, num_blocks: int, cpu_ids: list[int]):
        self.direction = direction
        self.num_blocks = num_blocks
        self.nbytes = num_blocks * engine.block_nbytes
        self._engine = engine
        self._cpu_ids = cpu_ids
        self._finished = False
        self._started_at = time.perf_counter()
        self.seconds: float | None = None
        # Set on CUDA only: when the copies end, when the current stream may
        # proceed, and the timing pair.
        self._done_event: torch.cuda.Event | None = None
        self._release_event: torch.cuda.Event | None = None
        self._timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._keep: list[torch.Tensor] = []  # index tensors the device may still read

    def done(self) -> bool:
        if not self._finished and (self._done_event is None or self._done_event.query()):
            self._finish()
        return self._finished

    def wait(self) -> None:
        if not self._finished:
            if self._done_event is not None:
                self._done_event.synchronize()
            self._finish()

    def make_current_stream_wait(self) -> None:
        """Order the current stream after this transfer, without blocking the host.

        Host → device: afterwards the current stream may read the destination
        blocks. Device → host: afterwards it may overwrite the source blocks
        (only the gather must be over, not the PCIe copy).
        """
        if self._release_event is not None:
            torch.cuda.current_stream(self._engine.device).wait_event(self._release_event)

    def _finish(self) -> None:
        self._finished = True
        if self._timing is not None:
            start, end = self._timing
            self.seconds = start.elapsed_time(end) / 1e3
        elif self.seconds is None:
            self.seconds = time.perf_counter() - self._started_at
        self._keep.clear()
        self._engine._complete(self)


class TransferEngine:
    def __init__(self, device_kv_cache: torch.Tensor, host_store: HostBlockStore, staging_blocks: int = 64):
        cache = device_kv_cache
        if cache.dim() != 6 or cache.shape[1] != 2:
            raise ValueError(f"expected a cache [L, 2, N, bs, H, D], got {tuple(cache.shape)}")
        if not cache.is_contiguous():
            raise ValueError("the device KV cache must be contiguous")
        block_shape = block_shape_of(cache)
        if tuple(host_store.block_shape) != block_shape or host_store.dtype != cache.dtype:
            raise ValueError(f"host blocks {host_store.block_shape} {host_store.dtype} do not match "
                             f"device blocks {block_shape} {cache.dtype}")
        self.kv_cache = cache
        self.host = host_store
        self.device = cache.device
        self.num_device_blocks = cache.shape[2]
        self.block_nbytes = host_store.block_nbytes
        self.staging_blocks = max(1, int(staging_blocks))
        num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = cache.shape
        self._slices_per_block = 2 * num_layers
        # The cache as rows of one (layer, K/V, block) slice each: row m*N + b is
        # slice m of block b, and a block-major staging buffer is the same rows
        # ordered block first. One index_select / index_copy_ moves a whole chunk.
        self._cache_rows = cache.view(2 * num_layers * num_blocks, block_size * num_kv_heads * head_dim)
        self._slice_offsets = torch.arange(2 * num_layers, device=self.device, dtype=torch.int64) * num_blocks
        self._cuda = self.device.type == "cuda"
        self._staging = {d: torch.empty((self.staging_blocks, *block_shape), dtype=cache.dtype, device=self.device)
                         for d in (D2H, H2D)}
        # Per direction: (PCIe copy stream, gather/scatter kernel stream).
        self._streams = ({d: (torch.cuda.Stream(self.device, priority=-1), torch.cuda.Stream(self.device, priority=-1))
                          for d in (D2H, H2D)} if self._cuda else {})
        # Per direction and staging half: the event after which the half may be refilled,
        # and which half the next chunk takes. Kept across transfers: a transfer's first
        # chunk must not overwrite a half the previous one is still copying or scattering.
        self._half_free = {d: [None, None] for d in (D2H, H2D)}
        self._next_half = {D2H: 0, H2D: 0}
        self._stats = {d: {"transfers": 0, "blocks": 0, "bytes": 0, "seconds": 0.0} for d in (D2H, H2D)}
        self._in_flight = 0

    @property
    def staging_nbytes(self) -> int:
        """Device bytes of the staging buffers (for the memory ledger)."""
        return sum(t.numel() * t.element_size() for t in self._staging.values())

    # ------------------------------------------------------------ launching
    def device_to_host(self, gpu_ids, cpu_ids) -> Transfer:
        """Copy device blocks gpu_ids[i] into host blocks cpu_ids[i], ordered after the current stream."""
        return self._launch(D2H, list(gpu_ids), list(cpu_ids))

    def host_to_device(self, cpu_ids, gpu_ids) -> Transfer:
        """Copy host blocks cpu_ids[i] into device blocks gpu_ids[i], ordered after the current stream.

        Call ``make_current_stream_wait()`` (or ``wait()``) before the model reads them.
        """
        return self._launch(H2D, list(gpu_ids), list(cpu_ids))

    def _launch(self, direction: str, gpu_ids: list[int], cpu_ids: list[int]) -> Transfer:
        self._check_ids(gpu_ids, cpu_ids)
        transfer = Transfer(self, direction, len(gpu_ids), cpu_ids)
        # The host blocks must stay put until the copies are over.
        self.host.pin(cpu_ids)
        self._in_flight += 1
        if not self._cuda:
            self._copy_chunks(direction, gpu_ids, cpu_ids, transfer)
            transfer.done()
            return transfer
        copy_stream, kernel_stream = self._streams[direction]
        # Both streams start after the work queued so far on the current stream:
        # a D2H then sees the step's K/V writes; an H2D does not overwrite blocks
        # that queued kernels still read.
        current = torch.cuda.current_stream(self.device)
        copy_stream.wait_stream(current)
        kernel_stream.wait_stream(current)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # Timed on the copy stream from where this transfer may start: after the work
        # queued on the current stream and after the previous transfer's copies, so the
        # windows of back-to-back transfers do not overlap (a D2H's first gather may run
        # ahead into the half the previous transfer is not using; an isolated one's is inside).
        start.record(copy_stream)
        release = self._copy_chunks(direction, gpu_ids, cpu_ids, transfer)
        # The last work is a scatter (H2D) or a PCIe copy (D2H).
        end.record(kernel_stream if direction == H2D else copy_stream)
        transfer._timing = (start, end)
        transfer._done_event = end
        transfer._release_event = release if direction == D2H else end
        return transfer

    def _check_ids(self, gpu_ids: list[int], cpu_ids: list[int]) -> None:
        if len(gpu_ids) != len(cpu_ids):
            raise ValueError(f"{len(gpu_ids)} device blocks but {len(cpu_ids)} host blocks")
        if gpu_ids and not (0 <= min(gpu_ids) and max(gpu_ids) < self.num_device_blocks):
            raise IndexError(f"device block id out of range [0, {self.num_device_blocks})")
        if cpu_ids and not (0 <= min(cpu_ids) and max(cpu_ids) < self.host.num_blocks):
            raise IndexError(f"host block id out of range [0, {self.host.num_blocks})")

    def _copy_chunks(self, direction: str, gpu_ids: list[int], cpu_ids: list[int], transfer: Transfer):
        """Queue the chunks (on the direction's two streams on CUDA); return an event after
        the last device gather (CUDA D2H), after which the source blocks may be overwritten."""
        staging = self._staging[direction]
        storage = self.host.storage
        copy_stream, kernel_stream = self._streams.get(direction, (None, None))
        with _on(kernel_stream):
            gpu = torch.as_tensor(gpu_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        transfer._keep.append(gpu)
        halves = 2 if self._cuda and self.staging_blocks >= 2 else 1
        chunk = self.staging_blocks // halves
        half_free = self._half_free[direction]
        last_gather = None
        for lo in range(0, len(gpu_ids), chunk):
            hi = min(lo + chunk, len(gpu_ids))
            k = hi - lo
            half = self._next_half[direction]
            self._next_half[direction] = (half + 1) % halves
            buffer = staging[half * chunk:half * chunk + k]
            with _on(kernel_stream):
                rows = (gpu[lo:hi, None] + self._slice_offsets[None, :]).view(-1)
            staged_rows = buffer.view(k * self._slices_per_block, -1)
            runs = contiguous_runs(cpu_ids[lo:hi])
            if direction == D2H:
                with _on(kernel_stream):
                    _wait(kernel_stream, half_free[half])
                    torch.index_select(self._cache_rows, 0, rows, out=staged_rows)
                    gathered = _record(kernel_stream)
                with _on(copy_stream):
                    _wait(copy_stream, gathered)
                    for pos, first, n in runs:
                        storage[first:first + n].copy_(buffer[pos:pos + n], non_blocking=True)
                    half_free[half] = _record(copy_stream)
                last_gather = gathered
            else:
                with _on(copy_stream):
                    _wait(copy_stream, half_free[half])
                    for pos, first, n in runs:
                        buffer[pos:pos + n].copy_(storage[first:first + n], non_blocking=True)
                    copied = _record(copy_stream)
                with _on(kernel_stream):
                    _wait(kernel_stream, copied)
                    self._cache_rows.index_copy_(0, rows, staged_rows)
                    half_free[half] = _record(kernel_stream)
        return last_gather

    def _complete(self, transfer: Transfer) -> None:
        self.host.unpin(transfer._cpu_ids)
        self._in_flight -= 1
        s = self._stats[transfer.direction]
        s["transfers"] += 1
        s["blocks"] += transfer.num_blocks
        s["bytes"] += transfer.nbytes
        s["seconds"] += transfer.seconds or 0.0

    # ------------------------------------------------------------ reporting
    def stats(self) -> dict:
        """Blocks, bytes and seconds moved per direction (completed transfers), and bytes/s."""
        out = {"in_flight": self._in_flight}
        for direction, s in self._stats.items():
            for key, value in s.items():
                out[f"{direction}_{key}"] = value
            out[f"{direction}_bytes_per_s"] = s["bytes"] / s["seconds"] if s["seconds"] > 0 else 0.0
        return out


def _on(stream):
    """``torch.cuda.stream(stream)`` on CUDA; nothing on the CPU (stream None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _record(stream):
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _wait(stream, event) -> None:
    if stream is not None and event is not None:
        stream.wait_event(event)
