"""BlockPool: the physical KV blocks of one tier, their ref counts and the prefix cache.

A block is free when no request references it. A free block may still hold
cached content (it has a hash): it stays findable by that hash until the pool
hands it out again, least recently freed first. So a finished conversation's
KV survives until memory is actually needed.
"""
import hashlib
import itertools
from collections import OrderedDict

import numpy as np


def hash_block(parent: bytes | None, token_ids) -> bytes:
    """Chained content hash of a full block: depends on every token before it too.

    A stable digest rather than Python's hash(), so the same prefix hashes the
    same in every process (a later tier keeps blocks on disk across restarts).
    """
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        # Free blocks in eviction order (first = next to be reused).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # The prefix cache's counters, in tokens (KVCacheManager._count_prefix_query).
        self.num_hits = 0
        self.num_queries = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_held_by_others(self) -> int:
        """Blocks another model holds: none, in one model's own pool (multi/pages.py shares one)."""
        return 0

    @property
    def num_reachable(self) -> int:
        """The most blocks one request may hold: all of them, in one model's own pool."""
        return self.num_blocks

    @property
    def num_admissible(self) -> int:
        """The most blocks a request is admitted to need: all of them, in one model's own pool."""
        return self.num_blocks

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (evicting their cached content) with ref count 1."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks, only {len(self.free_queue)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            self._uncache(block_id)
            self.ref_counts[block_id] = 1
            ids.append(block_id)
        return ids

    def next_evictions(self, n: int) -> list[tuple[int, bytes]]:
        """(block id, hash) of the cached blocks among the next n that allocate(n) would hand out.

        allocate() forgets their content; a tiered cache copies it down first.
        """
        return [(b, self.block_hash[b]) for b in itertools.islice(self.free_queue, n)
                if self.block_hash[b] is not None]

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks found by prefix match."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; unreferenced blocks become reusable.

        Pass blocks tail first: a sequence's last blocks are the least likely to
        be shared, so they should be evicted before its first ones.
        """
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"KV block {block_id} freed more often than it was taken")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self.free_queue[block_id] = None

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Register a full block's content. A hash already cached elsewhere keeps its block."""
        if self.block_hash[block_id] is not None or block_hash in self.cached:
            return
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id

    def _uncache(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block_id] = None

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.free_queue):
            self._uncache(block_id)

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (used by tests)."""
        assert all(c >= 0 for c in self.ref_counts), "negative ref count"
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue)
        for block_id, count in enumerate(self.ref_counts):
            assert (count == 0) == (block_id in free), f"block {block_id}: ref {count}, free {block_id in free}"
        for block_hash, block_id in self.cached.items():
            assert self.block_hash[block_id] == block_hash
        assert sum(h is not None for h in self.block_hash) == len(self.cached)
