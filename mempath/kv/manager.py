"""KVCacheManager: block tables of requests over one BlockPool, with prefix matching."""
from mempath.kv.blocks import BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens token slots."""
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.tiers = None  # a TieredKV once the engine attaches the host/disk tiers

    def _take(self, n: int) -> list[int]:
        """n free device blocks; with tiers, the cached content they held is demoted first."""
        return self.tiers.allocate_device(n) if self.tiers is not None else self.pool.allocate(n)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def find_cached_prefix(self, request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens.

        The last token is never matched: its logits must be computed, so at
        least one token always goes through the model.
        """
        if not self.enable_prefix_caching:
            return []
        request.update_block_hashes(self.block_size)
        limit = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:limit]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        self.pool.num_queries += limit
        self.pool.num_hits += len(blocks)
        return blocks

    def find_in_tiers(self, request, start: int) -> list:
        """(tier, id or hash) of the request's blocks after the first ``start``, up to the first miss."""
        if not self.enable_prefix_caching or self.tiers is None:
            return []
        limit = (request.num_tokens - 1) // self.block_size
        found = []
        for block_hash in request.block_hashes[start:limit]:
            where = self.tiers.locate(block_hash)
            if where is None:
                break
            found.append(where)
        return found

    def allocate(self, request, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """Give a request without blocks its cached prefix plus room for num_new_tokens."""
        assert not request.block_table, "allocate() is for requests that hold no blocks"
        num_cached_tokens = len(cached_blocks) * self.block_size
        num_new_blocks = self.blocks_for(num_cached_tokens + num_new_tokens) - len(cached_blocks)
        # Cached blocks sitting in the free queue stop being free once taken.
        free_after_touch = self.pool.num_free - sum(
            1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if num_new_blocks > free_after_touch:
            return False
        self.pool.touch(cached_blocks)
        request.block_table = cached_blocks + self._take(num_new_blocks)
        request.num_computed_tokens = num_cached_tokens
        request.num_registered_blocks = len(cached_blocks)
        return True

    def append_slots(self, request, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of a running request."""
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        if needed > self.pool.num_free:
            return False
        if needed > 0:
            request.block_table.extend(self._take(needed))
        return True

    def cache_full_blocks(self, request) -> None:
        """Make the request's fully computed blocks findable by later requests."""
        if not self.enable_prefix_caching:
            return
        if request.num_computed_tokens // self.block_size <= request.num_registered_blocks:
            return  # no block filled up since the last call: the common decode step
        request.update_block_hashes(self.block_size)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(request.num_registered_blocks, num_full):
            self.pool.cache(request.block_table[i], request.block_hashes[i])
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def free(self, request) -> None:
        self.pool.free(list(reversed(request.block_table)))
        request.block_table = []
        request.num_registered_blocks = 0

    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks
