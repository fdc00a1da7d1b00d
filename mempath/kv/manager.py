"""KVCacheManager: the owner of every request's KV state, over one BlockPool and its tiers.

It is the only writer of a request's block table (``kv/block_table.py``), block
hashes, registered blocks and swapped state, and of ``num_computed_tokens`` where
KV appears or goes (admission, a load landing, preemption). The scheduler decides who
runs and talks to it through a few calls, each returning what happened:
``admit`` (an ``Admission``), ``append_slots``, ``land_ready``, ``preempt`` (a
``Preemption``) and ``free``. With tiers (``TierConfig``), the manager builds the
tier coordinator over its pool at construction; ``tiers`` is None without them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from mempath.kv.block_pool import BlockPool, hash_block
from mempath.kv.block_table import grow_table, replace_table
from mempath.kv.tiers.coordinator import Load, TierConfig, TierCoordinator


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens token slots."""
    return -(-num_tokens // block_size)


class Admit(enum.Enum):
    RUN = "run"  # it holds blocks for its next tokens: it runs this step
    LOAD = "load"  # it holds blocks, and its KV is on its way from the host or disk tier
    NO_ROOM = "no room"  # too few free device blocks for it (to compute, promote or swap in): room taken from
    # others (a paused request's first) may admit it
    WAIT = "wait"  # a prefix another request is loading


@dataclass(frozen=True)
class Admission:
    """What ``admit`` did with a waiting request."""
    outcome: Admit
    num_new_tokens: int = 0  # RUN: tokens it computes this step
    num_cached_tokens: int = 0  # RUN: tokens found in the device prefix cache
    load: Load | None = None  # LOAD: the handle to pass to land_ready, wait_for_load and free


@dataclass(frozen=True)
class Preemption:
    """What ``preempt`` did with a running request's KV."""
    swapped: bool  # its blocks went to the host tier; else its tokens are recomputed


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tiers: TierConfig | None = None, draft_kv: bool = False, pool: BlockPool | None = None,
                 hash_seed: bytes | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # A draft model keeps its own KV under the same block tables (speculative decoding),
        # built only when a request speculates: a block is published once the target's KV in
        # it is computed, and marks whether the draft's KV in it is computed too.
        self.draft_kv = draft_kv
        # Several models on one device share one pool of pages (mempath/multi): ``pool`` is
        # this model's view of it, and ``hash_seed`` starts its hash chains so that its
        # prefix-cache keys never match another model's.
        self.pool = pool if pool is not None else BlockPool(num_blocks)
        self.hash_seed = hash_seed
        self.draft_ready = bytearray(self.pool.num_blocks)
        self.tiers = TierCoordinator(self.pool, block_size, tiers) if tiers is not None else None

    def _take(self, n: int) -> list[int]:
        """n free device blocks; with tiers, the cached content they held is demoted first."""
        ids = self.tiers.allocate_device(n) if self.tiers is not None else self.pool.allocate(n)
        if self.draft_kv:  # only a draft ever sets the flags
            for block_id in ids:
                self.draft_ready[block_id] = 0
        return ids

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # ------------------------------------------------------------ admission
    def admit(self, request, budget: int, loads) -> Admission:
        """Give a waiting request blocks for up to ``budget`` new tokens, or start loading them.

        A swapped-out request is swapped in. Otherwise its longest device-cached
        prefix is taken, and with tiers the blocks after it found in the host or
        disk tier are loaded if that beats recomputing them. ``loads`` are the
        loads in flight (of other requests): a prefix one of them is bringing up
        is waited for, then taken from the device.
        """
        if request.swapped is not None:
            return self._swap_in(request)
        cached = self.find_cached_prefix(request)
        choices = []
        if self.tiers is not None:
            found = self.find_in_tiers(request, len(cached))
            if self.tiers.being_loaded(found, request.block_hashes[len(cached):len(cached) + len(found)], loads):
                return Admission(Admit.WAIT)
            if found:
                found, choices = self.tiers.worth_loading(found)
            if found:
                return self._promote(request, cached, found, choices)
        num_cached = len(cached) * self.block_size
        num_new = min(request.num_tokens - num_cached, budget)
        if not self.allocate(request, cached, num_new):
            return Admission(Admit.NO_ROOM)
        if choices:
            self.tiers.record_choices(request.request_id, choices)
        self._count_prefix_query(request, num_cached)
        return Admission(Admit.RUN, num_new_tokens=num_new, num_cached_tokens=num_cached)

    def _count_prefix_query(self, request, num_cached: int) -> None:
        """The prefix cache's counters, in tokens as vLLM's: a request's tokens once it is admitted (not at each
        attempt while it waits for room), and those its device-cached prefix saved. A preempted request's
        readmission is not counted again (vLLM counts those apart)."""
        if self.enable_prefix_caching and not request.num_preemptions:
            self.pool.num_queries += request.num_tokens
            self.pool.num_hits += num_cached

    def _promote(self, request, cached: list[int], found: list, choices: list) -> Admission:
        load = self.tiers.start_promotion(request, cached, found)
        if load is None:
            return Admission(Admit.NO_ROOM)
        self._count_prefix_query(request, len(cached) * self.block_size)
        self.tiers.record_choices(request.request_id, choices)
        replace_table(request, cached + load.gpu_ids)
        request.num_computed_tokens = len(cached) * self.block_size
        request.num_registered_blocks = len(cached)
        return Admission(Admit.LOAD, load=load)

    def _swap_in(self, request) -> Admission:
        host_ids, num_tokens = request.swapped
        load = self.tiers.start_swap_in(request, host_ids, num_tokens)
        if load is None:
            return Admission(Admit.NO_ROOM)
        request.swapped = None
        replace_table(request, load.gpu_ids)
        return Admission(Admit.LOAD, load=load)

    def find_cached_prefix(self, request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens.

        The last token is never matched: its logits must be computed, so at
        least one token always goes through the model.
        """
        if not self.enable_prefix_caching:
            return []
        self._hash_full_blocks(request)
        limit = self._reusable_blocks(request)
        blocks = []
        for block_hash in request.block_hashes[:limit]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def _reusable_blocks(self, request) -> int:
        """How many leading full blocks a request may take from a cache instead of computing.

        Never the block of its last token (its logits must be computed), and none for a
        request asking for prompt logprobs: those need the logits at every prompt
        position. Its blocks are still registered for other requests to reuse.
        """
        if request.params.prompt_logprobs is not None:
            return 0
        return (request.num_tokens - 1) // self.block_size

    def find_in_tiers(self, request, start: int) -> list:
        """(tier, id or hash) of the request's blocks after the first ``start``, up to the first miss."""
        if not self.enable_prefix_caching or self.tiers is None:
            return []
        limit = self._reusable_blocks(request)
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
        taken_from_free = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if not self.pool.can_allocate(num_new_blocks + taken_from_free):
            return False
        self.pool.touch(cached_blocks)
        replace_table(request, cached_blocks + self._take(num_new_blocks))
        request.num_computed_tokens = num_cached_tokens
        # The draft's KV covers the cached blocks up to the first one it was never computed in.
        ready = next((i for i, b in enumerate(cached_blocks) if not self.draft_ready[b]), len(cached_blocks))
        request.num_draft_computed = ready * self.block_size
        request.num_registered_blocks = len(cached_blocks)
        return True

    def append_slots(self, request, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of a running request."""
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        if needed > 0 and not self.pool.can_allocate(needed):
            return False
        if needed > 0:
            grow_table(request, self._take(needed))
        return True

    # ------------------------------------------------------------ loads
    def land_ready(self, loads: list[Load]) -> list:
        """Hand every load whose blocks have all arrived to its request, in the order given;
        return those requests (they now hold their loaded tokens as computed)."""
        if self.tiers is None:
            return []
        self.tiers.reap()
        landed = []
        for load in loads:
            if self.tiers.poll(load):
                self._land(load)
                landed.append(load.request)
        return landed

    def _land(self, load: Load) -> None:
        """The request keeps its blocks up to the load's last good one; the rest are recomputed."""
        request = load.request
        first = len(request.block_table) - len(load.gpu_ids)
        keep = first + load.num_valid
        dropped = request.block_table[keep:]
        replace_table(request, request.block_table[:keep])
        self.pool.free(list(reversed(dropped)))
        self.tiers.land(load)
        if load.swap_host_ids:
            request.num_computed_tokens = load.num_tokens
            request.num_registered_blocks = 0
        else:
            request.num_computed_tokens = keep * self.block_size
            request.num_registered_blocks = keep
        self.cache_full_blocks(request)  # a swapped-in request's blocks get their hashes back

    def wait_for_load(self, load: Load) -> None:
        """Block until the load lands (or its disk reads are abandoned at their deadline)."""
        self.tiers.wait(load)

    # ------------------------------------------------------------ progress
    def cache_full_blocks(self, request) -> None:
        """Make the request's fully computed blocks findable by later requests."""
        if not self.enable_prefix_caching:
            return
        computed = request.num_computed_tokens
        if computed // self.block_size <= request.num_registered_blocks:
            return  # no block filled up since the last call: the common decode step
        self._hash_full_blocks(request)
        num_full = min(computed // self.block_size, len(request.block_hashes))
        for i in range(request.num_registered_blocks, num_full):
            self.pool.cache(request.block_table[i], request.block_hashes[i])
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def _hash_full_blocks(self, request) -> None:
        """Hash every full block of the request's tokens not hashed yet (chained on the previous one)."""
        hashes, token_ids, block_size = request.block_hashes, request.token_ids, self.block_size
        while (len(hashes) + 1) * block_size <= len(token_ids):
            i = len(hashes)
            parent = hashes[-1] if hashes else self.hash_seed
            hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))

    # ------------------------------------------------------------ speculation
    def reserve_lookahead(self, request, num_speculative: int) -> bool:
        """Slots for a decode row's token and ``num_speculative`` proposed ones after it."""
        return self.append_slots(request, 1 + num_speculative)

    def advance_draft(self, request, num_draft_computed: int) -> None:
        """The draft model's KV now covers the request's first ``num_draft_computed`` tokens."""
        request.num_draft_computed = num_draft_computed
        self._mark_draft_ready(request)

    def _mark_draft_ready(self, request) -> None:
        # Blocks of final tokens (none past num_tokens) that the draft's KV fills; those before
        # num_draft_marked_blocks are flagged already (a held block's flag cannot change).
        full = min(request.num_draft_computed, request.num_tokens) // self.block_size
        start = request.num_draft_marked_blocks
        if full > start:
            for block_id in request.block_table[start:full]:
                self.draft_ready[block_id] = 1
            request.num_draft_marked_blocks = full

    def accept_speculation(self, request, num_accepted: int, draft_end: int) -> None:
        """A verify step kept ``num_accepted`` proposed tokens after the row's own token (which
        the step's ordinary bookkeeping already counted): they count as computed, the draft's
        KV as far as it was written and verified (``draft_end``), and the blocks that held
        only rejected positions go back to the pool. A rejected position's KV inside a kept
        block is never read (positions past num_computed_tokens are rewritten first) and
        never published (cache_full_blocks counts computed tokens only)."""
        request.num_computed_tokens += num_accepted
        if self.draft_kv:
            request.num_draft_computed = min(draft_end, request.num_computed_tokens)
            self._mark_draft_ready(request)
        self.trim_lookahead(request)
        self.cache_full_blocks(request)

    def trim_lookahead(self, request) -> None:
        """Free the blocks past what the request's next token needs (unused lookahead slots)."""
        keep = self.blocks_for(request.num_computed_tokens + 1)
        if len(request.block_table) > keep:
            dropped = request.block_table[keep:]
            replace_table(request, request.block_table[:keep])
            self.pool.free(list(reversed(dropped)))

    # ------------------------------------------------------------ giving back
    def preempt(self, request) -> Preemption:
        """Take a running request's device blocks back; with tiers its computed blocks are
        swapped to the host tier if that beats recomputing them."""
        swapped = False
        if self.tiers is not None and request.num_computed_tokens > 0:
            blocks = request.block_table[:self.blocks_for(request.num_computed_tokens)]
            host_ids = self.tiers.preempt(request, blocks)
            if host_ids is not None:
                request.swapped = (host_ids, request.num_computed_tokens)
                swapped = True
        self._free_device_blocks(request)
        request.num_computed_tokens = 0
        return Preemption(swapped)

    def free(self, request, load: Load | None = None) -> None:
        """A request is done (finished or aborted): cancel its load in flight, give back the
        host blocks of its swap, free its device blocks."""
        if load is not None:
            self.tiers.cancel(load)
        if request.swapped is not None:
            self.tiers.release_swap(request.swapped[0])
            request.swapped = None
        self._free_device_blocks(request)

    def _free_device_blocks(self, request) -> None:
        self.pool.free(list(reversed(request.block_table)))
        replace_table(request, [])
        request.num_registered_blocks = 0
        request.num_draft_computed = 0

    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks
