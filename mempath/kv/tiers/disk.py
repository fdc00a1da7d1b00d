"""The cold tier of the KV cache: one checksummed file per block on disk, and the write policy.

Blocks have the host tier's block-major layout (``mempath.kv.tiers.host``) and are
named by their chained content hash. Nothing here knows about requests: the tier
coordinator decides what moves where.

Write policy (``DiskBlockStore.write_through``):
  * write-back (default): a warm block reaches the disk only when it is evicted
    from host memory (``spill_to_disk``), so the disk sees each block at most once
    and only blocks that lived long enough to be evicted;
  * write-through: a block is written as soon as it lands in host memory
    (``write_through_block``), so an eviction from host memory is free (the disk
    already has it) at the cost of disk traffic for blocks that never get evicted.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import stat
import struct
import threading
import weakref
import zlib
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from mempath.kv.block_pool import hash_block
from mempath.kv.tiers.disk_dir import (BLOCK_NAME, LOCK_NAME, SHARD_NAME, TMP_NAME, layout_namespace, lock_namespace,
                                       make_private_dir, open_disk_root, read_failure_kind, unlock_namespace,
                                       write_failure_kind)
from mempath.kv.tiers.host import HostBlockStore
from mempath.safe_io import NotOurFile, open_regular, write_new_file

log = logging.getLogger(__name__)


def block_layout(fingerprint: str, block_shape, dtype: torch.dtype) -> str:
    """The string a disk file must carry to be readable by this engine.

    The fingerprint names the model (and anything else that changes the bytes,
    such as a quantised KV format); shape and dtype catch a changed block size or
    cache dtype even when the caller's fingerprint forgot them.
    """
    shape = "x".join(str(int(s)) for s in block_shape)
    return f"{fingerprint};dtype={str(dtype).removeprefix('torch.')};block={shape}"


def check_disk_tier_holds_a_block(capacity_bytes: int, file_nbytes: int, flag_gb: float | None = None,
                                  payload_only: bool = False) -> None:
    """Refuse a disk tier (``--disk-kv-gb``, ``flag_gb`` as given) too small for one block file of ``file_nbytes``;
    ``payload_only``: the figure is the block's K and V alone (start-up, before the weights and the file's header
    are known), which a file always exceeds."""
    if capacity_bytes < file_nbytes:
        given = capacity_bytes / (1 << 30) if flag_gb is None else flag_gb
        size = f"more than {file_nbytes} bytes (its K and V alone)" if payload_only else f"{file_nbytes} bytes"
        raise ValueError(f"--disk-kv-gb {given:g} holds no KV block: one block file is {size} "
                         f"({file_nbytes / (1 << 30):.6g} GiB); raise it or leave --disk-kv-path unset")


def _completed(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a writable uint8 array (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("disk I/O needs a contiguous CPU tensor")
    return t.view(-1).view(torch.uint8).numpy()



_MAGIC = b"MPKV"
_VERSION = 1
# magic, version, flags (0), payload length, hash length, layout length; then hash, layout.
_HEADER = struct.Struct("<4sHHQHH")
_TRAILER = struct.Struct("<I")  # crc32 of the payload
_SUFFIX = ".kv"
_HASH_NBYTES = len(hash_block(None, [0]))  # what names every block the engine stores


class DiskBlockStore:
    """The cold tier: one file per block, named by its hash, in this layout's namespace.

    ``path`` (``--disk-kv-path``) is shared with engines of other layouts, each in its
    own namespace (``mempath.kv.tiers.disk_dir``: the manifest, who may write it, how files
    are opened). The store lists, reads, evicts and deletes only inside its own
    namespace and only the names it writes (``SHARD_NAME``, ``BLOCK_NAME``,
    ``TMP_NAME``, ``LOCK_NAME``); anything else found there is left alone. One store at a time
    per namespace, across processes: it holds the namespace's lock (``lock_namespace``) from
    start-up until ``close``, and a second one is refused at start-up.

    File: header (magic, version, payload length, block hash, layout string)
    + payload (the block's bytes) + crc32 of the payload. crc32 rather than a
    cryptographic hash because it guards against torn writes and bit rot, not
    against an attacker (anyone who can write the file can re-sign it: the
    permissions keep others out), and it runs at ~3.5 GB/s on one core where
    blake2b runs at ~0.75 GB/s: faster than the disk (~1.5 GB/s), so checking is
    not the bottleneck of a read. Any mismatch (header, length, checksum) makes a
    read return False and deletes the file; the caller recomputes the block.

    Only regular files of this user are opened, never waiting (``open_regular``):
    a FIFO, directory or link where a block should be is a failed read and is left
    where it is. Every failure is counted by kind (``failures``, ``FAILURE_KINDS``);
    the first of each kind is one WARNING line, the rest and all tracebacks DEBUG.

    A file is written whole to a temporary name, then renamed over its final
    name, so a crash leaves either nothing or a complete file (or a temporary,
    removed at the next start). No fsync: the page cache coalesces the writes,
    and a file torn by a power cut fails its checksum.

    The index (hash -> file size, least recently used first) lives in memory and
    is rebuilt at start-up from the namespace: headers only, no payloads; the
    access order comes from the files' mtimes, which reads refresh.

    ``used_bytes`` counts whole files (header and checksum too) and room is made
    before a write is queued, so the namespace never holds more than
    ``capacity_bytes`` of block files. Files being written or read are never
    evicted.

    Thread safety: public methods may be called from one thread (the step loop)
    while the pool's workers run; the index is guarded by a lock.
    """

    def __init__(self, path, capacity_bytes: int, block_nbytes: int, write_through: bool = False, *,
                 fingerprint: str = "", block_shape=None, dtype: torch.dtype | None = None,
                 num_workers: int = 2):
        if block_shape is not None and dtype is not None:
            expected = math.prod(block_shape) * dtype.itemsize
            if expected != block_nbytes:
                raise ValueError(f"block_nbytes {block_nbytes} != {expected} for shape {block_shape} {dtype}")
        self.capacity_bytes = int(capacity_bytes)
        self.block_nbytes = int(block_nbytes)
        self.write_through = write_through
        self.layout = block_layout(fingerprint, block_shape or (block_nbytes,), dtype or torch.uint8)
        self._layout_bytes = self.layout.encode()
        self.path = open_disk_root(path, self.layout)
        self.namespace_path = os.path.join(self.path, layout_namespace(self.layout))
        # Before the index is rebuilt (which removes temporaries): a second engine of this layout
        # here would delete this one's blocks and writes in flight. Released by close(), or when
        # the store is collected or the process exits.
        self._unlock = weakref.finalize(self, unlock_namespace, lock_namespace(self.path, self.namespace_path))
        self.failures: Counter[str] = Counter()  # kind -> count (FAILURE_KINDS)
        self.blocks_written = 0  # block files that landed (a failed or skipped write is not one)
        self._lock = threading.RLock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, LRU first
        self._busy: Counter[bytes] = Counter()  # hash -> reads/writes in flight
        self._writing: dict[bytes, Future] = {}
        self._used = 0
        self._pool = ThreadPoolExecutor(max_workers=max(1, num_workers), thread_name_prefix="mempath-disk-kv")
        self._rebuild_index()

    @classmethod
    def for_host(cls, path, capacity_bytes: int, host: HostBlockStore, write_through: bool = False, *,
                 fingerprint: str = "", flag_gb: float | None = None) -> DiskBlockStore:
        """The engine's cold tier for ``host``'s blocks, of ``capacity_bytes`` (``--disk-kv-gb``,
        ``flag_gb`` as given, for the refusal).

        Refused, as the host tier refuses the same, before the directory is touched when no
        block's file fits: such a tier was accepted and never stored anything.
        """
        layout = block_layout(fingerprint, host.block_shape, host.dtype)
        file_nbytes = _HEADER.size + _HASH_NBYTES + len(layout.encode()) + host.block_nbytes + _TRAILER.size
        check_disk_tier_holds_a_block(capacity_bytes, file_nbytes, flag_gb)
        return cls(path, capacity_bytes, host.block_nbytes, write_through, fingerprint=fingerprint,
                   block_shape=host.block_shape, dtype=host.dtype)

    # ------------------------------------------------------------ layout of a file
    def path_for(self, block_hash: bytes) -> str:
        name = block_hash.hex()
        return os.path.join(self.namespace_path, name[:2], name + _SUFFIX)

    def file_nbytes(self, block_hash: bytes) -> int:
        return self._header_nbytes(block_hash) + self.block_nbytes + _TRAILER.size

    def _header_nbytes(self, block_hash: bytes) -> int:
        return _HEADER.size + len(block_hash) + len(self._layout_bytes)

    def _header(self, block_hash: bytes) -> bytes:
        return _HEADER.pack(_MAGIC, _VERSION, 0, self.block_nbytes, len(block_hash),
                            len(self._layout_bytes)) + block_hash + self._layout_bytes

    def _header_matches(self, f, block_hash: bytes) -> bool:
        expected = self._header(block_hash)
        return f.read(len(expected)) == expected

    # ------------------------------------------------------------ failures
    def record_failure(self, kind: str, message: str, *args, error: BaseException | None = None) -> None:
        """Count a failure of ``kind``; its first is one WARNING line, the rest (and every traceback) DEBUG."""
        with self._lock:
            self.failures[kind] += 1
            first = self.failures[kind] == 1
        text = message % args
        if first:
            log.warning("disk KV tier: %s (counted in stats()['tiers']['disk_failures']['%s']; further ones "
                        "are logged at DEBUG)", text, kind)
        log.debug("disk KV tier: %s [%s]", text, kind, exc_info=error)

    # ------------------------------------------------------------ start-up
    def _rebuild_index(self) -> None:
        """Index this layout's valid block files; remove only its own leftovers and torn blocks."""
        found, outcomes = [], Counter()
        for shard in self._list(self.namespace_path):
            if shard.name == LOCK_NAME:
                continue
            if not (SHARD_NAME.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False)):
                outcomes["left alone"] += 1
                continue
            for entry in self._list(shard.path):
                ours = entry.name.startswith(shard.name)
                if ours and TMP_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    self._discard(entry.path)  # a write cut short by a crash
                    outcomes["temporaries removed"] += 1
                elif ours and BLOCK_NAME.fullmatch(entry.name):
                    outcome, block = self._check_file(entry.path, entry.name[:-len(_SUFFIX)])
                    outcomes[outcome] += 1
                    if block is not None:
                        found.append(block)
                else:
                    outcomes["left alone"] += 1
        found.sort()  # by mtime: least recently used first
        for _, block_hash, size in found:
            self._index[block_hash] = size
            self._used += size
        evicted = self._evict_lru(self._used - self.capacity_bytes, nbytes=True)
        if found or outcomes:
            log.info("disk KV tier %s: %d blocks (%.2f GB) kept, %d evicted to fit %.2f GB%s", self.namespace_path,
                     len(self._index), self._used / 1e9, len(evicted), self.capacity_bytes / 1e9,
                     "".join(f", {n} {what}" for what, n in sorted(outcomes.items()) if what != "kept"))

    def _list(self, directory: str) -> list:
        try:
            with os.scandir(directory) as entries:
                return list(entries)
        except OSError as error:
            self.record_failure("read_error", "listing %s failed: %s", directory, error.strerror, error=error)
            return []

    def _check_file(self, file_path: str, hex_name: str):
        """(outcome, (mtime, hash, size) or None) for a file of a block's name. Reads the header only."""
        block_hash = bytes.fromhex(hex_name)
        try:
            f, st = open_regular(file_path)
            with f:
                valid = st.st_size == self.file_nbytes(block_hash) and self._header_matches(f, block_hash)
        except NotOurFile:
            return "left alone", None
        except OSError as error:
            self.record_failure(read_failure_kind(error), "reading %s failed: %s", file_path, error.strerror,
                                error=error)
            return "unreadable, left alone", None
        if not valid:
            self._discard(file_path)
            return "invalid removed", None
        return "kept", (st.st_mtime_ns, block_hash, st.st_size)

    def _discard(self, file_path: str) -> None:
        """Delete a file of the tier's naming in its namespace if it is a regular file of this user,
        as every file the tier writes is; anything else found there is left alone."""
        try:
            st = os.lstat(file_path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(file_path)
        except FileNotFoundError:
            pass
        except OSError as error:
            self.record_failure("cleanup_error", "removing %s failed: %s", file_path, error.strerror, error=error)

    # ------------------------------------------------------------ queries
    def contains(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._index

    __contains__ = contains

    def __len__(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    # ------------------------------------------------------------ eviction
    def touch(self, block_hashes) -> None:
        """Mark blocks used now: the last the least-recently-used eviction takes."""
        with self._lock:
            for block_hash in block_hashes:
                if block_hash in self._index:
                    self._index.move_to_end(block_hash)

    def evict(self, n: int) -> list[bytes]:
        """Delete up to n least recently used blocks that no read or write is using."""
        with self._lock:
            return self._evict_lru(n)

    def remove(self, block_hashes) -> None:
        """Delete blocks now (those in use are skipped)."""
        with self._lock:
            for block_hash in block_hashes:
                if block_hash in self._index and not self._busy[block_hash]:
                    self._drop(block_hash)

    def _evict_lru(self, amount: int, nbytes: bool = False) -> list[bytes]:
        """Evict blocks until ``amount`` blocks (or bytes, if nbytes) are gone."""
        evicted = []
        for block_hash in list(self._index):
            if amount <= 0:
                break
            if self._busy[block_hash]:
                continue
            size = self._drop(block_hash)
            evicted.append(block_hash)
            amount -= size if nbytes else 1
        return evicted

    def _drop(self, block_hash: bytes) -> int:
        size = self._index.pop(block_hash)
        self._used -= size
        self._busy.pop(block_hash, None)
        self._discard(self.path_for(block_hash))
        return size

    # ------------------------------------------------------------ writes
    def write_async(self, block_hash: bytes, cpu_tensor: torch.Tensor) -> Future:
        """Queue a block write. The future gives True once the file is in place, False if skipped or failed.

        The tensor must not change until the future is done (pin the host block:
        ``HostBlockStore.hold_until``). A block already on disk is not rewritten:
        same hash, same bytes. Room is made (LRU eviction) before the write is
        queued; if no room can be made the write is skipped.
        """
        payload = _byte_view(cpu_tensor)
        if payload.nbytes != self.block_nbytes:
            raise ValueError(f"block of {payload.nbytes} bytes, this store holds {self.block_nbytes}")
        size = self.file_nbytes(block_hash)
        with self._lock:
            if block_hash in self._index:
                return _completed(True)
            if size > self.capacity_bytes - self._used:
                self._evict_lru(size - (self.capacity_bytes - self._used), nbytes=True)
            if size > self.capacity_bytes - self._used:
                return _completed(False)
            self._index[block_hash] = size
            self._used += size
            self._busy[block_hash] += 1
            # Submitted under the lock, so the task's bookkeeping (which takes
            # the lock) runs after self._writing has its future.
            future = self._pool.submit(self._write_task, block_hash, payload)
            self._writing[block_hash] = future
        return future

    def _write_task(self, block_hash: bytes, payload: np.ndarray) -> bool:
        # Bookkeeping inside the task, not in a done-callback: a future's waiters
        # wake before its callbacks run, and must find the index settled.
        ok = False
        try:
            ok = self._write_file(block_hash, payload)
            return ok
        finally:
            with self._lock:
                self.blocks_written += ok
                self._writing.pop(block_hash, None)
                self._release(block_hash)
                if not ok and block_hash in self._index:
                    self._drop(block_hash)

    def _write_file(self, block_hash: bytes, payload: np.ndarray) -> bool:
        final = self.path_for(block_hash)
        try:
            make_private_dir(os.path.dirname(final))
            # One header, one large payload write, one trailer: sequential, no seeks.
            write_new_file(final, (self._header(block_hash), payload.data,
                                    _TRAILER.pack(zlib.crc32(payload.data))))
            return True
        except OSError as error:
            self.record_failure(write_failure_kind(error), "writing %s failed: %s; the block stays off disk",
                                final, error.strerror or error, error=error)
            return False

    def _release(self, block_hash: bytes) -> None:
        self._busy[block_hash] -= 1
        if self._busy[block_hash] <= 0:
            del self._busy[block_hash]

    # ------------------------------------------------------------ reads
    def read_async(self, block_hash: bytes, out_cpu_tensor: torch.Tensor) -> Future:
        """Queue a block read into ``out_cpu_tensor``. The future gives True if the block was read intact.

        False if the block is not here, its file is corrupted or truncated (then
        deleted), or what is in its place cannot be read (then left alone). On
        False the tensor's contents are undefined.
        """
        out = _byte_view(out_cpu_tensor)
        if out.nbytes != self.block_nbytes:
            raise ValueError(f"buffer of {out.nbytes} bytes, blocks here are {self.block_nbytes}")
        with self._lock:
            if block_hash not in self._index:
                return _completed(False)
            self._index.move_to_end(block_hash)
            self._busy[block_hash] += 1
            pending_write = self._writing.get(block_hash)
            return self._pool.submit(self._read_task, block_hash, out, pending_write)

    def _read_task(self, block_hash: bytes, out: np.ndarray, pending_write: Future | None) -> bool:
        ok = False
        try:
            ok = self._read_file(block_hash, out, pending_write)
            return ok
        finally:
            with self._lock:
                self._release(block_hash)
                if not ok and block_hash in self._index and not self._busy[block_hash]:
                    self._drop(block_hash)

    def _read_file(self, block_hash: bytes, out: np.ndarray, pending_write: Future | None) -> bool:
        if pending_write is not None:
            # The pool runs tasks in submission order, so this write is already
            # running on another worker: waiting cannot deadlock.
            pending_write.exception()  # a failed write leaves no file: the open below fails
        file_path = self.path_for(block_hash)
        try:
            f, st = open_regular(file_path)
            with f:
                intact = (st.st_size == self.file_nbytes(block_hash)
                          and self._header_matches(f, block_hash)
                          and f.readinto(out.data) == out.nbytes
                          and _read_crc(f) == zlib.crc32(out.data)
                          and f.read(1) == b"")
                if intact:
                    with contextlib.suppress(OSError):  # a read-only mount still serves reads
                        os.utime(f.fileno())  # the access order survives a restart
        except OSError as error:
            self.record_failure(read_failure_kind(error), "reading %s failed: %s; its tokens are recomputed",
                                file_path, error.strerror or error, error=error)
            return False
        if not intact:
            self.record_failure("read_corrupt", "%s is corrupted or truncated; removed, its tokens are recomputed",
                                file_path)
        return intact

    # ------------------------------------------------------------ calibration help
    def drop_page_cache(self, block_hashes) -> None:
        """Flush blocks to the device and drop them from the page cache, so the next read is cold."""
        for block_hash in block_hashes:
            fd = os.open(self.path_for(block_hash), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def flush(self) -> None:
        """Wait until every queued write is on disk (or has failed)."""
        with self._lock:
            pending = list(self._writing.values())
        for future in pending:
            future.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._unlock()  # once no write is running: another engine may now open the namespace

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_crc(f) -> int | None:
    raw = f.read(_TRAILER.size)
    return _TRAILER.unpack(raw)[0] if len(raw) == _TRAILER.size else None


# ---------------------------------------------------------------------------- write policy
def spill_to_disk(host: HostBlockStore, disk: DiskBlockStore | None, n: int) -> list[int]:
    """Evict up to n warm blocks by the host store's rule; return their ids.

    Write-back: a block the disk lacks is written first and its host block is
    freed once the write is done (it is unfindable meanwhile, but
    ``disk.contains`` already says yes and a read waits for the write).
    Write-through, or a block already on disk: freed at once. A block whose copy
    from the device is still on its way is pinned (TransferEngine), so never a victim.
    """
    victims = host.evict_candidates(n)
    for block_id in victims:
        block_hash = host.hash_of(block_id)
        host.uncache(block_id)
        if disk is None or disk.write_through or block_hash in disk:
            host.free([block_id])
        else:
            host.hold_until(disk.write_async(block_hash, host.storage[block_id]), [block_id], free=True)
    return victims


def write_through_block(host: HostBlockStore, disk: DiskBlockStore, block_id: int) -> Future | None:
    """Under write-through, copy a newly cached warm block to disk (call once its bytes are in place)."""
    block_hash = host.hash_of(block_id)
    if not disk.write_through or block_hash is None or block_hash in disk:
        return None
    future = disk.write_async(block_hash, host.storage[block_id])
    host.hold_until(future, [block_id])
    return future
