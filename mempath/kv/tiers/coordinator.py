"""TierCoordinator: the device block pool backed by a warm (host) and a cold (disk) tier.

The device pool (``BlockPool``) stays the only place the model reads KV from.
This class moves blocks around it; the KV manager calls it and writes what it
decides into the requests (nothing here writes a request's fields):

  * demotion: before the pool hands out free blocks that still hold cached
    content, that content is copied to the host tier (one batched transfer) and
    indexed there by its hash; when the host tier needs room, its eviction rule
    picks victims and the disk tier takes them (write-back or write-through);
  * promotion: a new request whose next blocks are found in the host or disk tier
    gets device blocks and an asynchronous load; the scheduler keeps it in a
    "loading" state until the blocks land, then runs it with those tokens computed;
  * swap: a preempted request's blocks go to host blocks it owns and come back
    when it resumes.

Whether moving beats recomputing is decided by ``CostModel`` (``kv/tiers/cost.py``)
from rates measured at start-up (docs/tiers.md has the formulas). On the CPU the
"device" is the CPU and every transfer completes at once, but the same code and
states run.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from mempath.kv.block_pool import BlockPool
from mempath.kv.tiers.cost import CostModel
from mempath.kv.tiers.disk import DiskBlockStore, spill_to_disk, write_through_block
from mempath.kv.tiers.disk_dir import FAILURE_KINDS
from mempath.kv.tiers.host import HostBlockStore
from mempath.kv.tiers.transfer import Transfer, TransferEngine

log = logging.getLogger(__name__)

GPU, CPU, DISK = "gpu", "cpu", "disk"  # tier names; "gpu" is the device tier (the CPU in CI)
# A load's disk reads are abandoned (its blocks recomputed) this long after it started,
# plus four times the cost model's estimate for them: generous for a busy disk, and
# the most a hung one (a dead NFS server, a failing drive) can hold a request back.
DISK_READ_DEADLINE_S = 10.0
# Closing writes the cached blocks the disk lacks for this long at most (a server's shutdown has a grace period).
PERSIST_DEADLINE_S = 30.0


# Blocks per direction in the device staging buffers of tier transfers (the engine
# reserves them in its KV budget).
STAGING_BLOCKS = 64


@dataclass
class Load:
    """Blocks on their way to the device for one request (a promotion or a swap-in).

    ``gpu_ids[i]`` becomes block ``first + i`` of the request's block table, where
    ``first`` is the number of device-cached blocks it already held.
    """
    request: object
    gpu_ids: list[int]
    hashes: list[bytes | None]  # registered on the device once landed (None: swap-in)
    sources: list[str]  # tier each block comes from, for the hit counters
    num_tokens: int  # computed tokens once landed (swap-in); promotions derive it
    transfers: list[Transfer] = field(default_factory=list)
    reads: list[tuple[Future, int, int]] = field(default_factory=list)  # (read, host id, position)
    swap_host_ids: list[int] = field(default_factory=list)  # freed once landed
    num_valid: int = 0  # positions [0, num_valid) hold good KV; the rest are dropped at landing
    started: float = field(default_factory=time.perf_counter)
    deadline: float = float("inf")  # perf_counter time after which unfinished disk reads are abandoned


@dataclass(frozen=True)
class TierConfig:
    """What the tiers are built from: the device cache they copy blocks out of and into, and the flags."""
    kv_cache: torch.Tensor
    cpu_bytes: int  # --cpu-kv-gb
    disk_path: str | None = None  # --disk-kv-path
    disk_bytes: int = 0  # --disk-kv-gb
    write_through: bool = False  # --disk-write-policy
    fingerprint: str = ""  # names the model whose blocks the disk tier may keep
    preemption_mode: str = "auto"
    # --cpu-kv-gb and --disk-kv-gb as given, for the refusals (the bytes above round a tiny one to 0).
    cpu_gb: float | None = None
    disk_gb: float | None = None


class TierCoordinator:
    def __init__(self, pool: BlockPool, block_size: int, config: TierConfig):
        self.pool = pool
        self.block_size = block_size
        self.preemption_mode = config.preemption_mode
        self.host = HostBlockStore.for_cache(config.kv_cache, config.cpu_bytes, flag_gb=config.cpu_gb)
        self.block_nbytes = self.host.block_nbytes
        self.disk = None
        if config.disk_path:
            self.disk = DiskBlockStore.for_host(config.disk_path, config.disk_bytes, self.host, config.write_through,
                                                fingerprint=config.fingerprint, flag_gb=config.disk_gb)
        self.transfer = TransferEngine(config.kv_cache, self.host,
                                       staging_blocks=min(STAGING_BLOCKS, pool.num_blocks))
        self.rates: dict = {}
        self.cost = CostModel(block_size, self.block_nbytes, self.rates)
        self.counters: Counter[str] = Counter()
        self.read_deadline_s = DISK_READ_DEADLINE_S
        # Device → host copies in flight: (transfer, host ids, write through once done).
        self._d2h: list[tuple[Transfer, set[int], list[int]]] = []
        # Reads abandoned at their deadline and still running: while any is, the disk is
        # not asked for more (they would queue behind it and time out in turn).
        self._overdue_reads: list[Future] = []
        self._probe_blocks_written = 0
        self._closed = False

    def calibrate(self, measure_prefill) -> dict:
        """Measure the cost model's rates (``CostModel.calibrate``); ``measure_prefill()`` returns tokens/s."""
        rates = self.cost.calibrate(self.transfer, self.disk, measure_prefill)
        if self.disk is not None:  # the probe's blocks moved nothing
            self._probe_blocks_written = self.disk.blocks_written
        return rates

    # ------------------------------------------------------------ device allocation
    def allocate_device(self, n: int) -> list[int]:
        """pool.allocate(n), after copying the cached content it would destroy to the host tier."""
        self.demote(n)
        return self.pool.allocate(n)

    def demote(self, n: int) -> None:
        victims = [(b, h) for b, h in self.pool.next_evictions(n) if h not in self.host]
        if not victims:
            return
        host_ids = self._allocate_host(len(victims))
        self.counters["demotions_dropped"] += len(victims) - len(host_ids)
        victims = victims[:len(host_ids)]
        if not victims:
            return
        transfer = self.transfer.device_to_host([b for b, _ in victims], host_ids)
        # Only the gather must be over before the blocks are overwritten, not the PCIe copy.
        transfer.make_current_stream_wait()
        for (_, block_hash), host_id in zip(victims, host_ids):
            self.host.insert(block_hash, host_id)
        self.counters["demoted_blocks"] += len(victims)
        write_after = host_ids if self.disk is not None and self.disk.write_through else []
        self._d2h.append((transfer, set(host_ids), write_after))
        self.reap()

    def _allocate_host(self, n: int) -> list[int]:
        """Up to n host blocks, evicting warm blocks to disk (or dropping them) to make room."""
        ids = self.host.allocate(n)
        if ids is not None:
            return ids
        # Blocks already on their way to disk will come free: spill only beyond them, or
        # each call for the same shortfall would evict another batch of warm blocks.
        shortfall = n - self.host.num_free - self.host.num_freeing
        if shortfall > 0:
            self._spill(shortfall)
        ids = self.host.allocate(n)
        # Blocks spilled under write-back come free only when their disk writes end.
        # Waiting for the disk here stalled every step behind it (H200 multi-turn run:
        # turn TTFT twice recompute-only's); the step loop takes what is free instead,
        # and the demotions that find no room are dropped (counted): a cache may forget.
        return ids if ids is not None else self.host.allocate(self.host.num_free)

    def _spill(self, n: int) -> None:
        victims = spill_to_disk(self.host, self.disk, n)
        self.counters["host_evictions"] += len(victims)

    def reap(self) -> None:
        """Retire finished device → host copies; under write-through, send their blocks to disk."""
        still = []
        for transfer, host_ids, write_after in self._d2h:
            if not transfer.done():
                still.append((transfer, host_ids, write_after))
                continue
            for host_id in write_after:
                if self.host.hash_of(host_id) is not None:
                    write_through_block(self.host, self.disk, host_id)
        self._d2h = still

    def _wait_for_d2h(self, host_ids) -> None:
        """A block copied down moments ago may still be on its way: let it arrive before reading it."""
        wanted = set(host_ids)
        for transfer, ids, _ in self._d2h:
            if wanted & ids:
                transfer.wait()

    # ------------------------------------------------------------ promotion
    def locate(self, block_hash: bytes) -> tuple[str, int | bytes] | None:
        block_id = self.pool.lookup(block_hash)
        if block_id is not None:
            return GPU, block_id
        host_id = self.host.lookup(block_hash)
        if host_id is not None:
            return CPU, host_id
        if self.disk is not None and not self._disk_stalled() and block_hash in self.disk:
            return DISK, block_hash
        return None

    def _disk_stalled(self) -> bool:
        if self._overdue_reads:
            self._overdue_reads = [f for f in self._overdue_reads if not f.done()]
        return bool(self._overdue_reads)

    @staticmethod
    def being_loaded(found: list, hashes: list[bytes], loads) -> bool:
        """Whether a host or disk block of ``found`` (with these hashes) is on its way to the
        device in one of ``loads`` (for another request)."""
        wanted = {h for (tier, _), h in zip(found, hashes) if tier != GPU}
        return bool(wanted) and any(h in wanted for load in loads
                                    for h, tier in zip(load.hashes, load.sources) if tier != GPU)

    def worth_loading(self, found: list) -> tuple[list, list]:
        """The leading part of ``found`` that is faster to load than to recompute, and the
        choices behind it (for :meth:`record_choices` once the request is admitted).

        Per block, loading from a tier costs a fixed amount and recomputing costs
        block_size tokens, so the choice is made per tier and the prefix is cut at
        the first block of a tier not worth loading.
        """
        num_host = sum(t == CPU for t, _ in found)
        num_disk = sum(t == DISK for t, _ in found)
        choices = []
        for tier, n_host, n_disk in ((CPU, num_host, 0), (DISK, 0, num_disk)):
            n = n_host + n_disk
            if n:
                load, recompute = self.cost.load_s(n_host, n_disk), self.cost.recompute_s(n * self.block_size)
                choices.append((tier, n, load, recompute))
        verdict = {tier: load < recompute for tier, _, load, recompute in choices}
        for i, (tier, _) in enumerate(found):
            if tier != GPU and not verdict[tier]:
                return found[:i], choices
        return found, choices

    def record_choices(self, request_id: str, choices: list) -> None:
        """Count and log the load-or-recompute choices of an admitted request (once: a
        request blocked at the head of the queue is weighed again at every step)."""
        for tier, n, load, recompute in choices:
            loaded = load < recompute
            self.counters["decided_load" if loaded else "decided_recompute"] += 1
            log.info("request %s: %d blocks (%d tokens, %d bytes) in %s: load %.3f ms, recompute %.3f ms: %s",
                     request_id, n, n * self.block_size, n * self.block_nbytes, tier, load * 1e3,
                     recompute * 1e3, "load" if loaded else "recompute")

    def start_promotion(self, request, cached: list[int], found: list) -> Load | None:
        """Take device blocks for ``found`` and start loading them; None if they don't fit.

        ``cached`` are the device blocks of the request's leading prefix; ``found``
        the (tier, id-or-hash) of the blocks after it, as ``locate`` gave them. The
        request's blocks are then ``cached + load.gpu_ids``.
        """
        on_device = cached + [b for t, b in found if t == GPU]
        needed = sum(t != GPU for t, _ in found)
        taken = sum(1 for b in set(on_device) if self.pool.ref_counts[b] == 0)
        if needed > self.pool.num_free - taken:
            return None
        self.pool.touch(on_device)
        host_hits = [b for t, b in found if t == CPU]
        self.host.pin(host_hits)  # no eviction may take them while device blocks are made
        try:
            fresh = iter(self.allocate_device(needed))
            gpu_ids = [b if t == GPU else next(fresh) for t, b in found]
            disk_hits = [(i, b) for i, (t, b) in enumerate(found) if t == DISK]
            read_ids = self._allocate_host(len(disk_hits))
        finally:
            self.host.unpin(host_hits)
        load = Load(request, gpu_ids, list(request.block_hashes[len(cached):len(cached) + len(found)]),
                    [t for t, _ in found], 0, num_valid=len(found))
        pairs = [(b, g) for (t, b), g in zip(found, gpu_ids) if t == CPU]
        if pairs:
            for host_id, _ in pairs:
                self.host.touch(host_id)
            self._launch_h2d(load, [h for h, _ in pairs], [g for _, g in pairs])
        if len(read_ids) < len(disk_hits):  # the host tier had no room to stage them all
            load.num_valid = disk_hits[len(read_ids)][0]
        for (pos, block_hash), host_id in zip(disk_hits, read_ids):
            load.reads.append((self.disk.read_async(block_hash, self.host.block(host_id)), host_id, pos))
        if load.reads:
            load.deadline = load.started + self.read_deadline_s + 4 * self.cost.load_s(0, len(load.reads))
        return load

    def _launch_h2d(self, load: Load, host_ids: list[int], gpu_ids: list[int]) -> None:
        self._wait_for_d2h(host_ids)
        load.transfers.append(self.transfer.host_to_device(host_ids, gpu_ids))

    def _settle_reads(self, load: Load, abandon: bool) -> int | None:
        """Finish the load's disk reads that are over and, if ``abandon``, give up on the rest;
        None while some are still running (and not abandoned), else how many were given up."""
        states = [(read, read[0].done()) for read in load.reads]
        if not abandon and not all(done for _, done in states):
            return None
        load.reads = []
        late = [read for read, done in states if not done]
        for future, host_id, pos in late:
            load.num_valid = min(load.num_valid, pos)
            # The worker still writes into the host block: it is freed when the read ends.
            self.host.hold_until(future, [host_id], free=True)
        self._finish_reads(load, [read for read, done in states if done])
        return len(late)

    def _finish_reads(self, load: Load, reads: list) -> None:
        """Reads are over: cut the prefix at the first bad block, send the good ones up."""
        results = [(future.exception() is None and future.result(), host_id, pos) for future, host_id, pos in reads]
        for ok, _, pos in results:
            if ok:
                self.counters["disk_to_cpu_blocks"] += 1
            else:
                self.counters["disk_read_failures"] += 1
                load.num_valid = min(load.num_valid, pos)
        up = [(host_id, load.gpu_ids[pos]) for ok, host_id, pos in results if ok and pos < load.num_valid]
        if up:
            self._launch_h2d(load, [h for h, _ in up], [g for _, g in up])
        # Good blocks read from disk are warm now; failed (or duplicate) ones are freed.
        for ok, host_id, pos in results:
            if ok and self.host.insert(load.hashes[pos], host_id):
                continue
            if self.host.is_pinned(host_id):
                self.host.hold_until(load.transfers[-1], [host_id], free=True)
            else:
                self.host.free([host_id])

    def poll(self, load: Load) -> bool:
        """True once every block of the load has landed on the device (or its reads were abandoned)."""
        if load.reads:
            expired = time.perf_counter() >= load.deadline
            overdue = [future for future, _, _ in load.reads if not future.done()] if expired else []
            abandoned = self._settle_reads(load, abandon=expired)
            if abandoned is None:
                return False
            if abandoned:
                self._overdue_reads += overdue
                self.counters["disk_read_failures"] += abandoned
                self.disk.record_failure(
                    "read_timeout", "%d block reads for request %s were not done %.1f s after they started; "
                    "abandoned, their tokens are recomputed", abandoned, load.request.request_id,
                    load.deadline - load.started)
        return all(t.done() for t in load.transfers)

    def wait(self, load: Load) -> None:
        """Block until the load lands, or until its deadline abandons its disk reads."""
        pending = [future for future, _, _ in load.reads if not future.done()]
        if pending:
            concurrent.futures.wait(pending, timeout=max(0.0, load.deadline - time.perf_counter()))
        if self.poll(load):
            for transfer in load.transfers:
                transfer.wait()

    def land(self, load: Load) -> None:
        """The load's good blocks are on the device: count the hits, then give back a swap's
        host blocks, or put the loaded blocks in the device prefix cache.

        The caller has already freed the device blocks past ``num_valid``.
        """
        for tier in load.sources[:load.num_valid]:
            if tier != GPU:
                self.counters[f"hits_{tier}"] += 1
        if load.swap_host_ids:
            self.host.free(load.swap_host_ids)
            self.counters["swap_ins"] += 1
            return
        for block_id, block_hash in zip(load.gpu_ids[:load.num_valid], load.hashes):
            self.pool.cache(block_id, block_hash)
        if load.num_valid < len(load.gpu_ids):
            self.counters["recomputed_after_failed_load_blocks"] += len(load.gpu_ids) - load.num_valid
        log.debug("request %s: %d blocks landed in %.3f ms", load.request.request_id, load.num_valid,
                  (time.perf_counter() - load.started) * 1e3)

    def cancel(self, load: Load) -> None:
        """The request went away mid-load: let the copies finish, give back the host blocks
        (those of unfinished disk reads once the reads end).

        The caller frees the device blocks (they are in the request's block table).
        """
        self._settle_reads(load, abandon=True)  # an abort does not wait for the disk
        for transfer in load.transfers:
            transfer.wait()
        if load.swap_host_ids:
            self.host.free(load.swap_host_ids)

    # ------------------------------------------------------------ swap
    def should_swap(self, request, num_blocks: int) -> bool:
        """Swap or recompute a preempted request; logs the numbers behind the choice."""
        if self.preemption_mode == "recompute" or num_blocks == 0:
            return False
        swap, recompute = self.cost.swap_s(num_blocks), self.cost.recompute_s(request.num_computed_tokens)
        choice = self.preemption_mode == "swap" or swap < recompute
        log.info("preempting %s: %d tokens, %d blocks (%d bytes): swap %.3f ms, recompute %.3f ms: %s%s",
                 request.request_id, request.num_computed_tokens, num_blocks, num_blocks * self.block_nbytes,
                 swap * 1e3, recompute * 1e3, "swap" if choice else "recompute",
                 " (forced)" if self.preemption_mode == "swap" else "")
        return choice

    def preempt(self, request, block_ids: list[int]) -> list[int] | None:
        """Swap a preempted request's blocks out if that beats recomputing them and the host has
        room: the host blocks now holding them; None if they are to be recomputed (counted)."""
        host_ids = self.swap_out(request, block_ids) if self.should_swap(request, len(block_ids)) else None
        if host_ids is None:
            self.counters["recompute_preemptions"] += 1
        return host_ids

    def swap_out(self, request, block_ids: list[int]) -> list[int] | None:
        """Copy the blocks to host blocks the request owns (returned); None (nothing copied) if no room."""
        host_ids = self._allocate_host(len(block_ids))
        if len(host_ids) < len(block_ids):
            self.host.free(host_ids)
            log.info("no host room to swap %s (%d blocks): recompute instead", request.request_id, len(block_ids))
            return None
        transfer = self.transfer.device_to_host(block_ids, host_ids)
        transfer.make_current_stream_wait()
        self._d2h.append((transfer, set(host_ids), []))
        self.counters["swap_outs"] += 1
        return host_ids

    def start_swap_in(self, request, host_ids: list[int], num_tokens: int) -> Load | None:
        """Take device blocks for a swapped-out request's host blocks and start copying them up;
        None if they don't fit. The request's blocks are then ``load.gpu_ids``."""
        if len(host_ids) > self.pool.num_free:
            return None
        gpu_ids = self.allocate_device(len(host_ids))
        load = Load(request, gpu_ids, [None] * len(gpu_ids), [], num_tokens,
                    swap_host_ids=host_ids, num_valid=len(gpu_ids))
        self._launch_h2d(load, host_ids, gpu_ids)
        return load

    def release_swap(self, host_ids: list[int]) -> None:
        """A swapped-out request finished without resuming (aborted): free its host blocks."""
        self._wait_for_d2h(host_ids)
        self.host.free(host_ids)

    # ------------------------------------------------------------ visibility
    def stats(self) -> dict:
        self.reap()
        c, nb, t = self.counters, self.block_nbytes, self.transfer.stats()
        host, disk = self.host, self.disk
        written = 0 if disk is None else disk.blocks_written - self._probe_blocks_written
        return {
            "enabled": True,
            "block_nbytes": nb,
            "cpu": {"capacity_bytes": host.capacity_bytes, "used_bytes": host.used_bytes,
                    "capacity_blocks": host.num_blocks, "used_blocks": host.num_blocks - host.num_free,
                    "cached_blocks": len(host._index)},
            "disk": None if disk is None else {
                "path": disk.path, "capacity_bytes": disk.capacity_bytes, "used_bytes": disk.used_bytes,
                "blocks": disk.num_blocks, "write_policy": "write-through" if disk.write_through else "write-back"},
            # The pool counts its hits in tokens, as vLLM's prefix cache counters; the tiers count blocks.
            "hits_blocks": {GPU: self.pool.num_hits // self.block_size, CPU: c["hits_cpu"], DISK: c["hits_disk"]},
            "moved": {
                "gpu_to_cpu": {"blocks": t["d2h_blocks"], "bytes": t["d2h_bytes"], "seconds": t["d2h_seconds"]},
                "cpu_to_gpu": {"blocks": t["h2d_blocks"], "bytes": t["h2d_bytes"], "seconds": t["h2d_seconds"]},
                "cpu_to_disk": {"blocks": written, "bytes": written * nb},
                "disk_to_cpu": {"blocks": c["disk_to_cpu_blocks"], "bytes": c["disk_to_cpu_blocks"] * nb},
            },
            "demoted_blocks": c["demoted_blocks"],
            "demotions_dropped": c["demotions_dropped"],
            "host_evictions": c["host_evictions"],
            "swaps": c["swap_outs"],
            "swap_ins": c["swap_ins"],
            "recompute_preemptions": c["recompute_preemptions"],
            "decisions": {"load": c["decided_load"], "recompute": c["decided_recompute"]},
            "disk_read_failures": c["disk_read_failures"],
            "disk_failures": {} if disk is None else {kind: disk.failures[kind] for kind in FAILURE_KINDS},
            "recomputed_after_failed_load_blocks": c["recomputed_after_failed_load_blocks"],
            "rates": dict(self.rates),
        }

    def close(self) -> None:
        """Persist what the disk lacks, then let the queued writes finish and release the directory, whatever
        persisting raises. A second call does nothing."""
        if self.disk is None or self._closed:
            return
        self._closed = True
        try:
            self.persist()
        except Exception:  # the writes queued so far still finish, and the directory's lock is released
            log.exception("disk KV tier: writing the cached blocks at close failed; the tier keeps what it had")
        finally:
            self.disk.flush()
            self.disk.close()

    def persist(self) -> int:
        """Write to disk what the host tier and the device pool cache and the disk lacks, so that an engine
        opened later on the same --disk-kv-path finds it (the disk otherwise gets only what the device and
        host tiers evict); as many as the disk holds, heads of prompts first. Returns the blocks written."""
        disk, host = self.disk, self.host
        before, start = disk.blocks_written, time.perf_counter()
        for transfer, _, _ in self._d2h:
            transfer.wait()
        self.reap()
        # A restart finds a prompt's blocks only up to its first missing one, so parents go before children: the
        # host tier's blocks (the device pool evicted them: heads of prompts whose tails it may hold), then the
        # pool's, each in the order they filled. As many as the disk holds, those it has already among them,
        # touched, so that no block written here evicts another; a close cut short keeps the heads.
        chosen = {}  # hash -> (the host tier, or None for the device pool; block id)
        for tier, block_id, block_hash in ([(host, b, h) for b, h in host.cached_blocks()]
                                           + [(None, b, h) for h, b in self.pool.cached.items()]):
            chosen.setdefault(block_hash, (tier, block_id))
        most = disk.capacity_bytes // disk.file_nbytes(next(iter(chosen))) if chosen else 0
        chosen = dict(itertools.islice(chosen.items(), most))
        disk.touch([h for h in chosen if h in disk])
        device = [(b, h) for h, (tier, b) in chosen.items() if tier is None and h not in disk]
        for block_hash, (tier, block_id) in chosen.items():
            if tier is host and block_hash not in disk:
                host.hold_until(disk.write_async(block_hash, host.storage[block_id]), [block_id])
        disk.flush()
        spill_to_disk(host, None, host.num_blocks)  # written or not kept: freed to stage through
        while device and time.perf_counter() - start < PERSIST_DEADLINE_S:
            host_ids = host.allocate(min(len(device), host.num_free)) if host.num_free else None
            if not host_ids:
                break  # every host block is held (a swapped request's): nothing to stage through
            batch, device = device[:len(host_ids)], device[len(host_ids):]
            self.transfer.device_to_host([b for b, _ in batch], host_ids).wait()
            for (_, block_hash), host_id in zip(batch, host_ids):
                host.hold_until(disk.write_async(block_hash, host.storage[host_id]), [host_id], free=True)
            disk.flush()
            host.reap()
        written = disk.blocks_written - before
        if device:
            log.warning("disk KV tier: %d cached blocks not written at close: writing stops after %.0f s",
                        len(device), PERSIST_DEADLINE_S)
        if written:
            log.info("disk KV tier: %d cached blocks written at close (%.1f MiB, %.2f s)", written,
                     written * self.block_nbytes / (1 << 20), time.perf_counter() - start)
        return written
