"""The warm tier of the KV cache: a fixed number of pinned host blocks, reserved once.

A block in every tier holds the same bytes: K and V of ``block_size`` tokens for
every layer, laid out block-major ``[num_layers, 2, block_size, num_kv_heads,
head_dim]`` so one block is one contiguous chunk (one copy, one file write).

Blocks are found by the chained content hash of ``mempath.kv.block_pool.hash_block``.
Nothing here knows about requests: the tier coordinator decides what moves where;
the stores keep the bytes, the indexes and the capacity limits honest.
"""
from __future__ import annotations

import math

import numpy as np
import torch


def block_shape_of(kv_cache: torch.Tensor) -> tuple[int, ...]:
    """The block-major shape of one block of a device cache ``[L, 2, N, bs, H, D]``."""
    num_layers, two, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return (num_layers, two, block_size, num_kv_heads, head_dim)


class HostBlockStore:
    """The warm tier: a fixed number of blocks in one host tensor, reserved once.

    Every block is in one of three states: *free*; *owned* (allocated, no hash:
    whoever allocated it decides when to free it, e.g. a swapped-out request's
    partial block); *cached* (allocated with a hash: findable by ``lookup`` and a
    candidate for eviction). A *pinned* block (``pin``; a transfer or a disk
    write is reading or writing it) is never evicted nor freed.

    Eviction rule: evict the cached, unpinned blocks of lowest

        score = last_access + hit_weight * log2(1 + hits)

    where ``last_access`` is a logical clock that advances by one on every
    ``insert`` and ``touch``, and ``hits`` counts the touches since insertion.
    In words: least recently used first, but a block that was hit h times is
    kept as if it had been used ``hit_weight * log2(1 + h)`` accesses later than
    it really was. The log makes the credit for popularity grow slowly, so a
    block hit a thousand times long ago still ages out eventually. The default
    weight is a quarter of the capacity: one hit buys a quarter of a full turn
    of the cache. Ties go to the lower block id.
    """

    def __init__(self, num_blocks: int, block_shape, dtype: torch.dtype, *,
                 pin_memory: bool | None = None, hit_weight: float | None = None):
        if num_blocks < 1:
            raise ValueError(f"a host block store needs at least one block, got {num_blocks}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.block_shape = tuple(int(s) for s in block_shape)
        self.dtype = dtype
        self.num_blocks = num_blocks
        # Reserved once: pinning is slow (page-locking every page) and must not
        # happen on the serving path.
        self.storage = torch.empty((num_blocks, *self.block_shape), dtype=dtype, pin_memory=pin_memory)
        self.block_nbytes = self.storage[0].numel() * self.storage.element_size()
        self.hit_weight = float(num_blocks) / 4 if hit_weight is None else float(hit_weight)

        self._free = np.ones(num_blocks, dtype=bool)
        self._pins = np.zeros(num_blocks, dtype=np.int64)
        self._last_access = np.zeros(num_blocks, dtype=np.float64)
        self._hits = np.zeros(num_blocks, dtype=np.int64)
        self._hash: list[bytes | None] = [None] * num_blocks
        self._index: dict[bytes, int] = {}
        self._clock = 0
        # (future-like, block ids, free afterwards): released by reap() once done().
        self._holds: list[tuple[object, list[int], bool]] = []

    @classmethod
    def for_cache(cls, kv_cache: torch.Tensor, capacity_bytes: int, flag_gb: float | None = None,
                  **kwargs) -> HostBlockStore:
        """As many blocks of the device cache's shape as fit in capacity_bytes (``--cpu-kv-gb``,
        ``flag_gb`` as given, for the refusal)."""
        shape = block_shape_of(kv_cache)
        block_nbytes = math.prod(shape) * kv_cache.element_size()
        check_host_tier_holds_a_block(capacity_bytes, block_nbytes, flag_gb)
        return cls(int(capacity_bytes // block_nbytes), shape, kv_cache.dtype, **kwargs)

    # ------------------------------------------------------------ capacity
    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    @property
    def num_free(self) -> int:
        self.reap()
        return int(self._free.sum())

    @property
    def num_freeing(self) -> int:
        """Blocks that come free when their pending disk writes end (write-back spills)."""
        self.reap()
        return sum(len(ids) for _, ids, free in self._holds if free)

    @property
    def used_bytes(self) -> int:
        return (self.num_blocks - int(self._free.sum())) * self.block_nbytes

    def allocate(self, n: int) -> list[int] | None:
        """n free blocks, or None if fewer are free (nothing is evicted here).

        Prefers the first run of n consecutive ids, then the longest runs: a
        transfer moves each run of consecutive host blocks in one copy.
        """
        self.reap()
        free_ids = np.flatnonzero(self._free)
        if n > len(free_ids):
            return None
        if n == 0:
            return []
        ids = _take_runs(free_ids, n)
        self._free[ids] = False
        return [int(i) for i in ids]

    def free(self, block_ids) -> None:
        """Return blocks to the free list, dropping their hashes."""
        for block_id in block_ids:
            if self._free[block_id]:
                raise RuntimeError(f"host KV block {block_id} freed twice")
            if self._pins[block_id]:
                raise RuntimeError(f"host KV block {block_id} freed while pinned")
            self.uncache(block_id)
            self._free[block_id] = True

    # ------------------------------------------------------------ hash index
    def insert(self, block_hash: bytes, block_id: int) -> bool:
        """Make an allocated block findable by its content hash. False if the hash is already here."""
        if self._free[block_id]:
            raise RuntimeError(f"host KV block {block_id} is not allocated")
        if block_hash in self._index or self._hash[block_id] is not None:
            return False
        self._index[block_hash] = block_id
        self._hash[block_id] = block_hash
        self._hits[block_id] = 0
        self._last_access[block_id] = self._tick()
        return True

    def uncache(self, block_id: int) -> None:
        """Forget a block's hash; the block stays allocated (owned) until freed."""
        block_hash = self._hash[block_id]
        if block_hash is not None:
            del self._index[block_hash]
            self._hash[block_id] = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self._index.get(block_hash)

    def cached_blocks(self) -> list[tuple[int, bytes]]:
        """(block id, hash) of every findable block."""
        return [(block_id, block_hash) for block_hash, block_id in self._index.items()]

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash[block_id]

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def touch(self, block_id: int) -> None:
        """Record a hit: the block was found and used."""
        self._hits[block_id] += 1
        self._last_access[block_id] = self._tick()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def scores(self, block_ids) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64)
        return self._last_access[ids] + self.hit_weight * np.log2(1.0 + self._hits[ids])

    def evict_candidates(self, n: int) -> list[int]:
        """Up to n cached, unpinned blocks, lowest score (first to evict) first."""
        self.reap()
        cached = np.fromiter((i for i in self._index.values() if not self._pins[i]), dtype=np.int64)
        if len(cached) == 0 or n <= 0:
            return []
        cached.sort()  # a stable sort below then breaks ties by block id
        order = np.argsort(self.scores(cached), kind="stable")[:n]
        return [int(i) for i in cached[order]]

    # ------------------------------------------------------------ pins
    def pin(self, block_ids) -> None:
        for block_id in block_ids:
            if self._free[block_id]:
                raise RuntimeError(f"host KV block {block_id} pinned while free")
            self._pins[block_id] += 1

    def unpin(self, block_ids) -> None:
        for block_id in block_ids:
            if self._pins[block_id] <= 0:
                raise RuntimeError(f"host KV block {block_id} unpinned more often than pinned")
            self._pins[block_id] -= 1

    def is_pinned(self, block_id: int) -> bool:
        return bool(self._pins[block_id])

    def hold_until(self, pending, block_ids, free: bool = False) -> None:
        """Pin blocks until ``pending.done()`` (a Future or a Transfer), then unpin (and free).

        Released lazily by reap(), which allocate(), num_free and
        evict_candidates() call, so completion never runs on a worker thread
        and the bookkeeping stays single-threaded.
        """
        block_ids = list(block_ids)
        self.pin(block_ids)
        self._holds.append((pending, block_ids, free))
        self.reap()

    def reap(self) -> None:
        if not self._holds:
            return
        still = []
        for pending, block_ids, free in self._holds:
            if pending.done():
                self.unpin(block_ids)
                if free:
                    self.free(block_ids)
            else:
                still.append((pending, block_ids, free))
        self._holds = still

    def block(self, block_id: int) -> torch.Tensor:
        return self.storage[block_id]

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        assert (self._pins >= 0).all(), "negative pin count"
        assert not (self._pins[self._free] > 0).any(), "a free block is pinned"
        for block_hash, block_id in self._index.items():
            assert self._hash[block_id] == block_hash and not self._free[block_id]
        assert sum(h is not None for h in self._hash) == len(self._index)
        assert self.used_bytes <= self.capacity_bytes


def _run_bounds(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start positions and lengths of the runs of consecutive ids in ``ids`` (non-empty)."""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    return starts, np.diff(np.concatenate((starts, [len(ids)])))


def contiguous_runs(ids) -> list[tuple[int, int, int]]:
    """(position in ids, first id, length) of each run of consecutive ids, in order."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) == 0:
        return []
    starts, lengths = _run_bounds(ids)
    return [(int(s), int(ids[s]), int(n)) for s, n in zip(starts, lengths)]


def _take_runs(free_ids: np.ndarray, n: int) -> np.ndarray:
    """n ids from a sorted array of free ids, in as few consecutive runs as is cheap to find."""
    starts, lengths = _run_bounds(free_ids)
    fitting = np.flatnonzero(lengths >= n)
    if len(fitting):
        s = starts[fitting[0]]
        return free_ids[s:s + n]
    picked, need = [], n
    for run in np.argsort(-lengths, kind="stable"):
        take = min(need, lengths[run])
        picked.append(free_ids[starts[run]:starts[run] + take])
        need -= take
        if need == 0:
            break
    return np.sort(np.concatenate(picked))


def check_host_tier_holds_a_block(capacity_bytes: int, block_nbytes: int, flag_gb: float | None = None) -> None:
    """Refuse a host tier (``--cpu-kv-gb``, ``flag_gb`` as given) too small for one KV block of ``block_nbytes``:
    at start-up before the weights load (engine.startup, from config.json), and again when the tier opens."""
    if capacity_bytes < block_nbytes:
        # As given: capacity_bytes rounds a tiny flag down to 0, which the user never wrote.
        given = capacity_bytes / (1 << 30) if flag_gb is None else flag_gb
        raise ValueError(f"--cpu-kv-gb {given:g} holds no KV block: one block is "
                         f"{block_nbytes} bytes ({block_nbytes / (1 << 30):.6g} GiB); raise it or set 0")
