"""The tiers' cost model and the start-up measurements it runs on.

``CostModel`` weighs moving blocks against recomputing them from rates measured
once at start-up (``CostModel.calibrate``): device↔host bytes/s and the disk's
write and cold-read bytes/s through the tiers' own code (``measure_transfer_rates``),
the fixed latency of one transfer, and the prefill rate the caller measures
(docs/tiers.md has the formulas).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mempath.kv.tiers.disk import DiskBlockStore
    from mempath.kv.tiers.transfer import TransferEngine

log = logging.getLogger(__name__)

# Used when the disk tier is too full at start-up to hold the calibration probe.
ASSUMED_DISK_BYTES_PER_S = 0.5e9
# A calibration probe of the disk tier not done by then is given up (start-up goes on with
# the assumed disk rate) rather than hanging the start-up on a disk that does not answer.
DISK_PROBE_TIMEOUT_S = 30.0


class CostModel:
    """Load-or-recompute and swap-or-recompute, from rates measured at start-up.

    Loading n blocks of B bytes from the host costs ``latency + n·B/h2d``; from
    disk ``latency + n·B/disk_read + n·B/h2d``; recomputing them costs
    ``n·block_size / prefill_tokens_per_s``. A swap costs the copy out and back,
    ``2·latency + n·B/d2h + n·B/h2d``, against recomputing the tokens it holds.
    The fixed latency is why short requests recompute and long ones swap.
    """

    def __init__(self, block_size: int, block_nbytes: int, rates: dict):
        self.block_size = block_size
        self.block_nbytes = block_nbytes
        self.rates = rates

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens / self.rates["prefill_tokens_per_s"]

    def load_s(self, num_host: int, num_disk: int) -> float:
        r, b = self.rates, self.block_nbytes
        return (r["transfer_latency_s"] + (num_host + num_disk) * b / r["h2d_bytes_per_s"]
                + num_disk * b / r["disk_read_bytes_per_s"])

    def swap_s(self, num_blocks: int) -> float:
        r, nbytes = self.rates, num_blocks * self.block_nbytes
        return 2 * r["transfer_latency_s"] + nbytes / r["d2h_bytes_per_s"] + nbytes / r["h2d_bytes_per_s"]

    def calibrate(self, transfer: TransferEngine, disk: DiskBlockStore | None, measure_prefill) -> dict:
        """Measure transfer, disk and prefill rates; ``measure_prefill()`` returns tokens/s."""
        probe_disk = None
        probe = 8
        if disk is not None:
            # The probe must not evict blocks kept from an earlier run.
            room = (disk.capacity_bytes - disk.used_bytes) // disk.file_nbytes(bytes(16))
            probe = int(min(probe, room))
            probe_disk = disk if probe > 0 else None
        rates = measure_transfer_rates(transfer, probe_disk, probe_blocks=min(64, transfer.num_device_blocks),
                                       disk_probe_blocks=max(probe, 1))
        self.rates.update({k: v for k, v in rates.items() if k.endswith("_bytes_per_s")})
        self.rates.setdefault("disk_read_bytes_per_s", ASSUMED_DISK_BYTES_PER_S)
        self.rates["transfer_latency_s"] = measure_latency(transfer)
        self.rates["prefill_tokens_per_s"] = float(measure_prefill())
        log.info("KV tiers calibrated: h2d %.2f GB/s, d2h %.2f GB/s, disk read %.2f GB/s%s, "
                 "transfer latency %.1f us, prefill %.0f tokens/s",
                 self.rates["h2d_bytes_per_s"] / 1e9, self.rates["d2h_bytes_per_s"] / 1e9,
                 self.rates["disk_read_bytes_per_s"] / 1e9,
                 "" if probe_disk is not None or disk is None else " (assumed: no room for the probe)",
                 self.rates["transfer_latency_s"] * 1e6, self.rates["prefill_tokens_per_s"])
        return dict(self.rates)


def measure_latency(transfer: TransferEngine) -> float:
    """The fixed cost of one transfer: the fastest of a few one-block round trips, halved."""
    host = transfer.host
    host_ids = host.allocate(1)
    best = float("inf")
    try:
        for _ in range(5):
            start = time.perf_counter()
            transfer.device_to_host([0], host_ids).wait()
            transfer.host_to_device(host_ids, [0]).wait()
            best = min(best, (time.perf_counter() - start) / 2)
    finally:
        host.free(host_ids)
    return best


def measure_transfer_rates(transfer: TransferEngine, disk: DiskBlockStore | None = None, probe_blocks: int = 64,
                           disk_probe_blocks: int = 8) -> dict:
    """Measure bytes/s of each path through the transfer engine's own code; log and return them.

    For start-up, before serving: it copies the first device blocks to free
    host blocks and back (their contents are unchanged), and writes probe
    blocks to the disk tier, reads them back cold, and deletes them. Disk
    writes are timed up to fsync (the sustained rate, not the page cache's).
    """
    host, block_nbytes = transfer.host, transfer.block_nbytes
    result = {"block_nbytes": block_nbytes}
    cpu_ids = host.allocate(min(probe_blocks, transfer.num_device_blocks, host.num_free)) or []
    hung = []
    try:
        if cpu_ids:
            gpu_ids = list(range(len(cpu_ids)))
            transfer.device_to_host(gpu_ids[:1], cpu_ids[:1]).wait()  # first-call overheads
            result["probe_blocks"] = len(cpu_ids)
            result["d2h_bytes_per_s"] = _rate(len(cpu_ids) * block_nbytes,
                                              lambda: transfer.device_to_host(gpu_ids, cpu_ids).wait())
            result["h2d_bytes_per_s"] = _rate(len(cpu_ids) * block_nbytes,
                                              lambda: transfer.host_to_device(cpu_ids, gpu_ids).wait())
            if disk is not None:
                rates, hung = _measure_disk(transfer, disk, cpu_ids[:disk_probe_blocks])
                result.update(rates)
    finally:
        # A probe still running writes into its host block: that one is freed when it ends.
        host.free([c for c in cpu_ids if c not in {c for _, c in hung}])
        for future, c in hung:
            host.hold_until(future, [c], free=True)
    log.info("KV transfer calibration: %s", ", ".join(
        f"{k} {v / 1e9:.2f} GB/s" for k, v in result.items() if k.endswith("_bytes_per_s")))
    return result


def _measure_disk(transfer: TransferEngine, disk: DiskBlockStore, cpu_ids: list[int]) -> tuple[dict, list]:
    """Disk write and cold read rates, and the (probe, host id) pairs still running if it gave up."""
    hashes = [hashlib.blake2b(f"mempath-calibration-{os.getpid()}-{i}".encode(), digest_size=16).digest()
              for i in range(len(cpu_ids))]
    storage = transfer.host.storage
    nbytes = len(cpu_ids) * transfer.block_nbytes
    futures = []
    try:
        def write():
            futures[:] = [disk.write_async(h, storage[c]) for h, c in zip(hashes, cpu_ids)]
            if not all(f.result(timeout=DISK_PROBE_TIMEOUT_S) for f in futures):
                raise RuntimeError("the disk KV tier has no room for the calibration probe, or cannot write it")
            disk.drop_page_cache(hashes)

        def read():
            futures[:] = [disk.read_async(h, storage[c]) for h, c in zip(hashes, cpu_ids)]
            if not all(f.result(timeout=DISK_PROBE_TIMEOUT_S) for f in futures):
                raise RuntimeError("the disk KV tier failed to read back its calibration probe")

        return {"disk_write_bytes_per_s": _rate(nbytes, write),
                "disk_read_bytes_per_s": _rate(nbytes, read)}, []
    except (RuntimeError, OSError, concurrent.futures.TimeoutError) as e:
        log.warning("disk KV calibration skipped: %s", str(e) or type(e).__name__)
        return {}, [(f, c) for f, c in zip(futures, cpu_ids) if not f.done()]
    finally:
        disk.remove(hashes)


def _rate(nbytes: int, fn) -> float:
    start = time.perf_counter()
    fn()
    return nbytes / max(time.perf_counter() - start, 1e-9)
