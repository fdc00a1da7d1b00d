"""The shared KV page pool: one BlockPool of fixed-size pages, and each model's view of it.

Several models on one device carve their KV blocks from one pool of pages, one block per
page (mempath/multi/layout.py sizes each model's block to fill a page), so a model's block
id is a page id and its block tables index the pool directly. Who holds how many pages is
bookkeeping only: the split between models moves with every allocate and free, and no
device memory is allocated after start-up.

A ``TenantPages`` is what a model's KVCacheManager takes as its pool. It counts the pages
the model references, hides from it the pages other models are guaranteed but do not use
yet (``--kv-min-share``), and, when it runs short, asks ``reclaim`` (the multi-model
engine's victim policy) to preempt requests of another model before the model's own
scheduler preempts one of its own.
"""
from __future__ import annotations

from typing import Callable

from mempath.kv.block_pool import BlockPool

POOL_TENANT = "shared KV pages"  # the device budget's tenant for the pool every model's KV is carved from


def check_min_share(min_share, num_models: int = 1) -> None:
    """Refuse a kv_min_share that is not a fraction in [0, 1] (nan compared false and reached int() serving), or
    that guarantees ``num_models`` more than the whole pool."""
    if isinstance(min_share, bool) or not isinstance(min_share, (int, float)) or not 0.0 <= min_share <= 1.0:
        raise ValueError(f"kv_min_share must be a fraction of the KV pool in [0, 1], got {min_share!r}")
    if min_share * num_models > 1:
        raise ValueError(f"kv_min_share {min_share} guarantees {num_models} models {min_share * num_models:.0%} "
                         f"of the KV pool; use --kv-min-share {1 / num_models:.2f} or less")


class PagePool:
    """The pages every model shares, and each model's guaranteed minimum of them."""

    def __init__(self, num_pages: int, page_bytes: int, min_share: float = 0.0):
        check_min_share(min_share)
        self.pages = BlockPool(num_pages)
        self.page_bytes = page_bytes
        self.min_share = min_share
        self.tenants: dict[str, TenantPages] = {}
        self.asleep: set[str] = set()  # models idle past --sleep-after: no guarantee (sleep.py)

    @property
    def num_pages(self) -> int:
        return self.pages.num_blocks

    def view(self, name: str) -> "TenantPages":
        view = TenantPages(self, name)
        self.tenants[name] = view
        check_min_share(self.min_share, len(self.tenants))
        return view

    @property
    def min_pages(self) -> int:
        """Pages kv_min_share guarantees an awake model."""
        return int(self.min_share * self.num_pages)

    def guaranteed(self, name: str | None = None) -> int:
        """Pages each model (this one, if named) may always have, whatever the others use; none asleep."""
        return 0 if name in self.asleep else self.min_pages

    def held_back_from(self, name: str) -> int:
        """Free pages kept for the other models' guarantees (what they are owed and do not use)."""
        return sum(max(0, self.guaranteed(other) - view.num_used) for other, view in self.tenants.items()
                   if other != name)

    def split(self) -> dict[str, int]:
        """Pages each model references now."""
        return {name: view.num_used for name, view in self.tenants.items()}


class TenantPages:
    """One model's view of the shared pool, in BlockPool's terms (its KVCacheManager's pool)."""

    def __init__(self, pool: PagePool, name: str):
        self.shared = pool
        self.pages = pool.pages
        self.name = name
        self.num_used = 0  # pages this model references
        self.num_hits = 0
        self.num_queries = 0
        # The multi-model engine's victim policy: frees pages of other models, returns whether
        # this model may now take ``n`` (mempath/multi/engine.py).
        self.reclaim: Callable[[TenantPages, int], bool] = lambda view, n: False

    @property
    def num_blocks(self) -> int:
        return self.pages.num_blocks

    @property
    def ref_counts(self) -> list[int]:
        return self.pages.ref_counts

    @property
    def num_free(self) -> int:
        """Free pages this model may take: the pool's, less what other models are guaranteed."""
        return max(0, self.pages.num_free - self.shared.held_back_from(self.name))

    @property
    def num_cached(self) -> int:
        return self.pages.num_cached

    @property
    def num_reachable(self) -> int:
        """The most pages this model may hold: the pool less what the other (awake) models are guaranteed."""
        return self.pages.num_blocks - sum(self.shared.guaranteed(other) for other in self.shared.tenants
                                           if other != self.name)

    @property
    def num_admissible(self) -> int:
        """The most pages a request of this model is admitted to need: the pool less every other model's
        guarantee, asleep or not. A request sized to what sleeping models leave would fail when one woke."""
        return self.pages.num_blocks - self.shared.min_pages * (len(self.shared.tenants) - 1)

    @property
    def num_held_by_others(self) -> int:
        """Pages the other models reference: they come back when those requests end or are preempted."""
        return self.pages.num_used - self.num_used

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free or (self.reclaim(self, n) and n <= self.num_free)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"{self.name}: asked for {n} KV pages, only {self.num_free} free to it")
        ids = self.pages.allocate(n)
        self.num_used += n
        return ids

    def lookup(self, block_hash: bytes) -> int | None:
        return self.pages.lookup(block_hash)

    def touch(self, block_ids: list[int]) -> None:
        self.num_used += sum(1 for b in block_ids if self.pages.ref_counts[b] == 0)
        self.pages.touch(block_ids)

    def free(self, block_ids: list[int]) -> None:
        self.num_used -= sum(1 for b in block_ids if self.pages.ref_counts[b] == 1)
        self.pages.free(block_ids)

    def cache(self, block_id: int, block_hash: bytes) -> None:
        self.pages.cache(block_id, block_hash)

    def reset_prefix_cache(self) -> None:
        self.pages.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.pages.check_invariants()
        assert sum(view.num_used for view in self.shared.tenants.values()) == self.pages.num_used
