"""``--sleep-after S``: a model idle for S seconds gives up its KV guarantee; its next request wakes it.

Several models share one page pool (pages.py), and ``kv_min_share`` holds free pages back
for each model that does not use its share. A model nobody has asked anything for S
seconds does not need that: asleep, its guarantee is 0, so every free page is the others'
(its prefix-cached pages were free to all already, and stay cached until reused). A
request to it wakes it, and its guarantee holds again at once for the free pages; pages
the others hold come back as their requests finish, or, when the woken model asks for
pages none of which are free to it, through the victim policy (engine.py), which
preempts the model furthest above its guarantee.

Only the pages sleep. The weights stay on the device: each model's decode CUDA graphs
were captured against its weights' addresses, so moving them to host memory and back
would need them back at the same addresses (vLLM's sleep mode keeps them so with a
virtual-memory allocator, CuMemAllocator) or the graphs captured again on every wake.
"""
from __future__ import annotations

import time
from typing import Callable

from mempath.multi.pages import PagePool


def check_sleep_after(sleep_after: float | None) -> None:
    """Refuse a --sleep-after that is not a positive number of seconds (before any model loads)."""
    if sleep_after is not None and (isinstance(sleep_after, bool) or not isinstance(sleep_after, (int, float))
                                    or not sleep_after > 0):
        raise ValueError(f"sleep_after must be a number of seconds > 0, got {sleep_after!r} "
                         f"(leave --sleep-after out to keep every model awake)")


class IdleSleep:
    """When each model last had work; puts the idle ones to sleep and wakes them, counting both."""

    def __init__(self, pool: PagePool, names: list[str], sleep_after: float | None,
                 clock: Callable[[], float] = time.monotonic):
        check_sleep_after(sleep_after)
        self.pool, self.sleep_after, self.clock = pool, sleep_after, clock
        now = clock()
        self.last_active = {name: now for name in names}
        self.num_sleeps = {name: 0 for name in names}
        self.num_wakes = {name: 0 for name in names}

    def active(self, name: str) -> None:
        """A request for ``name`` arrived: it is awake from now on."""
        self.last_active[name] = self.clock()
        if name in self.pool.asleep:
            self.pool.asleep.discard(name)
            self.num_wakes[name] += 1

    def tick(self, busy: list[str]) -> None:
        """Between steps: the models with requests are active; those idle for sleep_after sleep."""
        if self.sleep_after is None:
            return
        now = self.clock()
        for name in self.last_active:
            if name in busy:
                self.last_active[name] = now
            elif name not in self.pool.asleep and now - self.last_active[name] >= self.sleep_after:
                self.pool.asleep.add(name)
                self.num_sleeps[name] += 1

    def stats(self) -> dict:
        return {"sleep_after": self.sleep_after, "asleep": sorted(self.pool.asleep),
                "sleeps_by_model": dict(self.num_sleeps), "wakes_by_model": dict(self.num_wakes)}
