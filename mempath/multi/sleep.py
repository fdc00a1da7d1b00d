"""``--sleep-after S``: a model idle for S seconds gives up its KV guarantee; its next request wakes it.

Several models share one page pool (pages.py), and ``kv_min_share`` holds free pages back
for each model that does not use its share. A model nobody has asked anything for S
seconds does not need that: asleep, its guarantee is 0, so every free page is the others'
(its prefix-cached pages were free to all already, and stay cached until reused). A
request to it wakes it, and its guarantee holds again at once for the free pages; pages
the others hold come back as their requests finish, or, when the woken model asks for
pages none of which are free to it, through the victim policy (engine.py), which
preempts the model furthest above its guarantee.

With ``--sleep-offload-weights`` the weights sleep too (WeightsOffload): every model's
weights were loaded into one arena (memory/arena.py); falling asleep copies it to pinned
host memory and gives its device bytes back, and the wake copies it back to the same
addresses, where the model's CUDA graphs read them (they were captured against those
addresses; vLLM's sleep mode keeps them so with its CuMemAllocator). The wake is one
host-to-device copy of the weights, on the engine thread before the waking request is
added: the other models' steps wait for it. The freed device bytes go back to the device
(another process, a training job); the shared KV pool keeps its size. Each model's pinned
copy is allocated at start-up and kept (in the ledger as weights_host), so a sleep and a
wake are copies only.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from mempath.memory.arena import ArenaError
from mempath.memory.ledger import Pathway, format_bytes
from mempath.multi.pages import PagePool


class WakeFailed(RuntimeError):
    """An asleep model's weights found no room on the device again: the request that woke it is refused (a 503),
    the model stays asleep, and the next request tries again."""

    def __init__(self, name: str, nbytes: int, error: ArenaError):
        super().__init__(f"model {name!r} is asleep and could not wake: its weights ({format_bytes(nbytes)}) found "
                         f"no room on the device ({error.failure}); the memory they left while it slept is in use "
                         f"outside this engine (another process?). Retry later")


def check_sleep_after(sleep_after: float | None) -> None:
    """Refuse a --sleep-after that is not a positive number of seconds (before any model loads)."""
    if sleep_after is not None and (isinstance(sleep_after, bool) or not isinstance(sleep_after, (int, float))
                                    or not 0 < sleep_after < float("inf")):
        raise ValueError(f"sleep_after must be a number of seconds > 0, got {sleep_after!r} "
                         f"(leave --sleep-after out to keep every model awake)")


def offload_options(engine_options: dict, offload_weights: bool, sleep_after: float | None) -> dict:
    """The engines' options for --sleep-offload-weights (their weights loaded into arenas), checked first."""
    if offload_weights and sleep_after is None:
        raise ValueError("--sleep-offload-weights moves an asleep model's weights to host memory: "
                         "give --sleep-after S too (the seconds idle before a model sleeps)")
    return {**engine_options, "weights_arena": True} if offload_weights else engine_options


class AsleepWeights:
    """One model's weights while it may sleep: the pinned copy and the ledger entry of its device bytes.
    Kept on the engine (``engine.asleep_weights``), so whatever steps the engine sees its state."""

    def __init__(self):
        self.host: torch.Tensor | None = None
        self.awake_entry = None  # the WEIGHTS ledger entry, while the device bytes are given back
        self.last_wake_seconds: float | None = None
        self.wake_bytes = 0  # copied back by every wake


class WeightsOffload:
    """Asleep models' weights in pinned host memory, their arenas' device bytes given back."""

    def __init__(self, engines: dict):
        """Allocates every model's pinned copy now, at start-up: pinning 15 GiB took 7-16 s on the
        H200's host (2026-12-02), a stall of every model if it came with the first sleep."""
        self.engines = engines  # name -> LLMEngine, each loaded with weights_arena
        for name, engine in engines.items():
            if getattr(engine, "asleep_weights", None) is None:
                engine.asleep_weights = AsleepWeights()
                engine.asleep_weights.host = self._host_copy(name, engine)

    @staticmethod
    def _host_copy(name: str, engine) -> torch.Tensor:
        nbytes = engine.model.weights_arena.nbytes
        try:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=engine.device.type == "cuda")
        except RuntimeError as error:
            raise ValueError(f"--sleep-offload-weights needs {format_bytes(nbytes)} of pinned host memory for "
                             f"{name}'s weights, which could not be allocated ({str(error).splitlines()[0]}): "
                             f"free host memory or leave --sleep-offload-weights off") from None
        engine.ledger.record(Pathway.WEIGHTS_HOST, host.nbytes, "cpu", "measured",
                             "the weights' copy while asleep (--sleep-offload-weights), pinned at start-up")
        return host

    def state(self, name: str) -> AsleepWeights:
        return self.engines[name].asleep_weights

    def offloaded(self) -> list[str]:
        return sorted(name for name, e in self.engines.items() if not e.model.weights_arena.is_mapped)

    def offload(self, name: str) -> None:
        engine, state = self.engines[name], self.state(name)
        arena = engine.model.weights_arena
        if not arena.is_mapped:
            return
        state.host.copy_(arena.tensor)
        arena.unmap()  # waits for the copy
        state.awake_entry = engine.ledger.entries[Pathway.WEIGHTS.value]
        engine.budget.grant(name, Pathway.WEIGHTS, 0, "measured", "asleep: in host memory (weights_host)")

    def restore(self, name: str) -> None:
        """The weights back at their addresses, before anything runs the model again."""
        engine, state = self.engines[name], self.state(name)
        arena = engine.model.weights_arena
        if arena.is_mapped:
            return
        start = time.perf_counter()
        try:
            arena.map()
        except ArenaError as error:
            raise WakeFailed(name, arena.nbytes, error) from None
        arena.tensor.copy_(state.host, non_blocking=True)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        state.last_wake_seconds = time.perf_counter() - start
        state.wake_bytes += arena.nbytes
        engine.ledger.entries[Pathway.WEIGHTS.value] = state.awake_entry


class IdleSleep:
    """When each model last had work; puts the idle ones to sleep and wakes them, counting both."""

    def __init__(self, pool: PagePool, names: list[str], sleep_after: float | None,
                 clock: Callable[[], float] = time.monotonic, weights: WeightsOffload | None = None):
        check_sleep_after(sleep_after)
        self.pool, self.sleep_after, self.clock = pool, sleep_after, clock
        self.weights = weights  # --sleep-offload-weights, else None
        now = clock()
        self.last_active = {name: now for name in names}
        self.num_sleeps = {name: 0 for name in names}
        self.num_wakes = {name: 0 for name in names}

    def active(self, name: str) -> None:
        """A request for ``name`` arrived: it is awake from now on (its weights back first)."""
        self.last_active[name] = self.clock()
        if self.weights is not None:
            self.weights.restore(name)
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
                if self.weights is not None:
                    self.weights.offload(name)

    def next_deadline(self) -> float | None:
        """When (on ``clock``) the next awake model falls asleep if nothing asks for it; None: never."""
        if self.sleep_after is None:
            return None
        awake = [t for name, t in self.last_active.items() if name not in self.pool.asleep]
        return min(awake) + self.sleep_after if awake else None

    def stats(self) -> dict:
        stats = {"sleep_after": self.sleep_after, "asleep": sorted(self.pool.asleep),
                 "sleeps_by_model": dict(self.num_sleeps), "wakes_by_model": dict(self.num_wakes),
                 "offload_weights": self.weights is not None}
        if self.weights is not None:
            states = {name: self.weights.state(name) for name in self.last_active}
            stats.update(weights_offloaded=self.weights.offloaded(),
                         last_wake_seconds_by_model={n: s.last_wake_seconds for n, s in states.items()},
                         wake_bytes_by_model={n: s.wake_bytes for n, s in states.items()})
        return stats
