"""BlockPool and KVCacheManager invariants under random workloads (property-based)."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempath.engine.request import Request
from mempath.kv.block_pool import BlockPool, hash_block
from mempath.kv.manager import KVCacheManager
from mempath.sampling import SamplingParams


def test_hash_is_chained_and_stable():
    a = hash_block(None, [1, 2, 3])
    assert a == hash_block(None, [1, 2, 3])
    assert hash_block(a, [4]) != hash_block(hash_block(None, [9]), [4])
    assert hash_block(None, [1, 2, 3]) != hash_block(None, [1, 2, 4])


def test_freed_cached_blocks_stay_findable_until_reused():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.cache(ids[0], b"h0")
    pool.free(list(reversed(ids)))
    assert pool.num_free == 4 and pool.lookup(b"h0") == ids[0]
    pool.allocate(3)  # LRU: the two never-used blocks, then ids[1] (freed before ids[0])
    assert pool.lookup(b"h0") == ids[0]
    pool.allocate(1)
    assert pool.lookup(b"h0") is None
    pool.check_invariants()


def test_double_free_is_an_error():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([b])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), num_blocks=st.integers(4, 40), block_size=st.sampled_from([1, 2, 4, 8]))
def test_manager_invariants_under_random_workload(seed, num_blocks, block_size):
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
    live: list[Request] = []
    for step in range(80):
        op = rng.random()
        if op < 0.35:  # admit a request, maybe sharing a prefix
            tokens = list(rng.choice(prefixes)) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            request = Request(str(step), None, tokens, SamplingParams())
            cached = kv.find_cached_prefix(request)
            assert len(cached) * block_size < len(tokens)  # the last token is never matched
            if kv.allocate(request, cached, len(tokens) - len(cached) * block_size):
                request.num_computed_tokens = len(tokens)
                kv.cache_full_blocks(request)
                live.append(request)
        elif op < 0.75 and live:  # decode one token
            request = rng.choice(live)
            if kv.append_slots(request, 1):
                request.token_ids.append(rng.randrange(50))
                request.num_computed_tokens += 1
                kv.cache_full_blocks(request)
        elif live:  # finish or abort
            request = live.pop(rng.randrange(len(live)))
            kv.free(request)
        pool = kv.pool
        pool.check_invariants()
        assert pool.num_free + pool.num_used == num_blocks
        held = sum(len(r.block_table) for r in live)
        assert sum(pool.ref_counts) == held
        for r in live:
            assert len(r.block_table) == kv.blocks_for(r.num_computed_tokens)
    for request in live:
        kv.free(request)
    kv.pool.check_invariants()
    assert kv.pool.num_free == num_blocks and sum(kv.pool.ref_counts) == 0


def test_shared_prefix_shares_blocks():
    kv = KVCacheManager(16, 4)
    first = Request("a", None, list(range(13)), SamplingParams())
    assert kv.allocate(first, kv.find_cached_prefix(first), 13)
    first.num_computed_tokens = 13
    kv.cache_full_blocks(first)
    second = Request("b", None, list(range(12)) + [99, 98], SamplingParams())
    cached = kv.find_cached_prefix(second)
    assert cached == first.block_table[:3]
    assert kv.allocate(second, cached, 2)
    assert all(kv.pool.ref_counts[b] == 2 for b in cached)
    # Identical prompt of exactly 3 blocks: the last block holds the last token, so only 2 match.
    third = Request("c", None, list(range(12)), SamplingParams())
    assert len(kv.find_cached_prefix(third)) == 2
