"""Mixture-of-experts MLP: router -> top-k -> dispatch -> experts -> combine.

The PyTorch twin of the fused MoE path, read top to bottom in ``MoEBlock.forward``:
the router scores every expert, each token keeps its top k, the (token, expert)
pairs are sorted by expert so each expert's tokens are one contiguous group, each
group runs one matmul per projection (gate/up, then down) with that expert's
weights, and the outputs are weighted, put back in token order and summed over k.
A grouped-GEMM kernel computes the same groups in one launch per projection; this
is its oracle.

Arithmetic follows transformers' default (``grouped_mm``) experts path, so float32
outputs are token-identical: float32 softmax over all experts before top-k, the
family's renormalisation, the weights' dtype (Qwen3-MoE and OLMoE round them to
the activation dtype, Mixtral keeps float32), weighting in sorted order and the
sum over each token's k choices in their order.

Experts as a pathway: every layer's ``ExpertCache`` keeps ``num_slots`` experts in
*slots* on the compute device and the full set in host memory (pinned on CUDA).
``num_slots == num_experts`` (the default) is the degenerate cache: slot e holds
expert e, nothing is in host memory and nothing is ever copied. With fewer slots a
step's active experts run in *waves* of at most ``num_slots``: the resident ones
first (hits), then the misses, each copied into a slot whose expert the wave does
not need, the one that scores lowest on routing recency and frequency
(``last_use + frequency_weight * log2(1 + routed_tokens)``, the KV host tier's
rule). A group's matmuls read the same weights from a slot as from the full
tensor, so outputs are bit-identical for every cache size.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mempath.kernels.dispatch import Kernels
from mempath.kernels.moe_triton import ROUTER_KERNEL_MAX_ROWS
from mempath.memory.pinned import pinned_empty
from mempath.model import moe_host, moe_slots


def dispatch(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the flat (token, choice) pairs by expert: (order, tokens per expert).

    ``order[j]`` is the pair (token ``order[j] // k``, choice ``order[j] % k``) in sorted
    position j. The sort is transformers' (not stable): a row's matmul result can depend
    on its position in the group when the CPU splits the rows over threads, so the same
    order is what makes the output bit-identical to theirs.
    """
    flat = expert_ids.reshape(-1)
    order = torch.sort(flat).indices
    return order, torch.bincount(flat, minlength=num_experts)


def route_torch(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, weights_dtype: torch.dtype):
    """Softmax in float32, the top k, renormalised where the family does: (weights, expert ids), [T, k] each."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), expert_ids


def counts_dtype() -> torch.dtype:
    return torch.int64  # torch.bincount's, so the group sizes and the predictions concatenate


def combine(sorted_out: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, top_k: int,
            dtype: torch.dtype) -> torch.Tensor:
    """Weight each pair's output, put the pairs back in (token, choice) order, sum over the k choices."""
    weighted = sorted_out * weights.reshape(-1)[order].unsqueeze(-1)
    unsorted = torch.empty_like(weighted)
    unsorted[order] = weighted
    return unsorted.view(-1, top_k, sorted_out.shape[-1]).sum(dim=1).to(dtype)


class MoEBlock(nn.Module):
    """A routed MLP: ``gate`` (the router) and ``experts``; checkpoint names as transformers'."""

    def __init__(self, spec, kernels: Kernels):
        super().__init__()
        self.num_experts = spec.num_experts
        self.top_k = spec.num_experts_per_tok
        self.norm_topk_prob = spec.norm_topk_prob
        self.routing_weights_float32 = spec.routing_weights_float32
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec.num_experts, spec.hidden_size, spec.moe_intermediate_size, kernels)
        self.router_bias: SyntheticRouterBias | None = None  # benchmarks only; see synthetic_router_bias

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights [T, k], top-k expert ids [T, k]) of each token."""
        logits = self.router_logits(x)
        if self.router_bias is not None:
            logits = self.router_bias(logits)
        weights_dtype = torch.float32 if self.routing_weights_float32 else logits.dtype
        grouped = self.uses_grouped_kernel() or moe_slots.uses_slot_kernel(self)
        route = self.experts.kernels.moe_route if grouped else None
        return (route or route_torch)(logits, self.top_k, self.norm_topk_prob, weights_dtype)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's logits: its own kernel at decode batches in 16 bits (kernels.router_logits),
        the matmul library otherwise (float32 keeps F.linear's arithmetic for the parity tests)."""
        kernel = self.experts.kernels.router_logits
        if kernel is not None and x.shape[0] <= ROUTER_KERNEL_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16):
            return kernel(x, self.gate.weight)
        return self.gate(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.route(x)
        if self.uses_grouped_kernel():
            experts = self.experts
            return experts.kernels.grouped_experts(x, weights, expert_ids, experts.gate_up_proj, experts.down_proj,
                                                   experts.kernels.silu_and_mul)
        if moe_slots.uses_slot_kernel(self):
            return moe_slots.forward_slots(self, x, weights, expert_ids)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            # The groups' sizes are read on the host; a captured graph would replay stale ones.
            raise RuntimeError("a MoE layer with fewer experts resident than all copies its misses on the "
                               "host's decision and cannot run inside a CUDA graph: run it eagerly")
        order, counts = dispatch(expert_ids, self.num_experts)
        following = self.__dict__.get("next_moe")  # a plain attribute: not a submodule
        if following is not None and following.experts.cache.prefetch:
            # The next layer's router on this layer's input predicts its experts; read with
            # this layer's group sizes (one host read), copied while this layer computes.
            predicted = following.predict_experts(x)
            sizes_and_next = torch.cat([counts, predicted]).tolist()
            sizes, next_sizes = sizes_and_next[:self.num_experts], sizes_and_next[self.num_experts:]
            following.experts.prefetch(sorted((e for e, n in enumerate(next_sizes) if n),
                                              key=lambda e: -next_sizes[e]))
        else:
            sizes = counts.tolist()  # the one host sync: where each group starts
        sorted_out = self.experts(x[order // self.top_k], sizes)
        return combine(sorted_out, weights, order, self.top_k, x.dtype)

    def predict_experts(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens per expert this layer's router would pick for ``x`` (the router bias not advanced)."""
        logits = self.gate(x)
        if self.router_bias is not None:
            logits = self.router_bias.apply(logits)
        expert_ids = torch.topk(logits, self.top_k, dim=-1).indices.reshape(-1)  # softmax keeps the order
        return torch.zeros(self.num_experts, dtype=counts_dtype(), device=x.device).scatter_add_(
            0, expert_ids, torch.ones_like(expert_ids))

    def uses_grouped_kernel(self) -> bool:
        """The fused path (kernels/moe_triton.py): its kernels are here and every expert is resident.

        It reads nothing on the host, so it counts no cache lookups: with every expert
        resident each one would be a hit."""
        return self.experts.kernels.grouped_experts is not None and not self.experts.cache.host

    def stats(self) -> dict:
        return {**self.experts.cache.stats(),
                "router": "model" if self.router_bias is None else self.router_bias.describe()}


class Experts(nn.Module):
    """Every expert's SiLU-gated MLP, stacked: gate_up_proj [slots, 2I, h], down_proj [slots, h, I].

    With all experts resident the slots are the experts (transformers 5 stores them the
    same way). With fewer (``set_resident``), the full set lives in ``cache``'s host
    store and the parameters are only the slots.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.cache = ExpertCache(num_experts, num_experts)
        self.cpu_experts = "never"  # where a miss runs: moe_host.set_cpu_experts
        self.host_cost = None  # auto on the grouped kernel: moe_host.HostExpertCost, which splits the misses
        self.host_token_limit = 0  # a miss routed at most this many tokens runs on the host

    def forward(self, x: torch.Tensor, counts) -> torch.Tensor:
        """Each expert's group of rows through its MLP; ``x`` is sorted by expert, ``counts`` (a tensor or
        the list read from it) sizes the groups."""
        sizes = counts.tolist() if torch.is_tensor(counts) else counts
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        out = x.new_empty(x.shape[0], self.down_proj.shape[1])
        cache = self.cache
        cache.record_routing(sizes)
        active = [e for e, size in enumerate(sizes) if size]
        if cache.host and self.host_token_limit:
            on_host = [e for e in active if cache.slot_of[e] < 0 and sizes[e] <= self.host_token_limit]
            for expert in on_host:
                rows = slice(starts[expert], starts[expert + 1])
                out[rows] = moe_host.run_on_host(self, x[rows], expert)
                cache.note_host_run(sizes[expert])
            active = [e for e in active if e not in on_host]  # a handful: a list is fine
        for wave in cache.waves(active):
            slots = cache.acquire(wave, self.load_into_slot)
            try:
                for expert, slot in zip(wave, slots):
                    rows = slice(starts[expert], starts[expert + 1])
                    gate_up = F.linear(x[rows], self.gate_up_proj[slot])
                    out[rows] = F.linear(self.kernels.silu_and_mul(gate_up), self.down_proj[slot])
            finally:
                cache.release(slots)
        return out

    def prefetch(self, experts: list[int]) -> None:
        """Start copying the predicted experts that are not resident into slots (most tokens first).

        On CUDA on the cache's copy stream, each slot's copy marked by an event its first
        reader waits on; on the CPU at once (the path stays synchronous). At most
        num_slots experts, evicted by the cache's rule, never one of the predicted.
        """
        cache = self.cache
        wanted = experts[:cache.num_slots]
        missing = [e for e in wanted if cache.slot_of[e] < 0]
        if not missing:
            cache.note_prefetched([])
            return
        stream = None
        if self.gate_up_proj.is_cuda:
            if cache.copy_stream is None:
                cache.copy_stream = torch.cuda.Stream(self.gate_up_proj.device)
            stream = cache.copy_stream
            stream.wait_stream(torch.cuda.current_stream())  # the slots' last readers are done
        loaded = []
        for expert in missing:
            slot = cache.claim_for_prefetch(expert, set(wanted))
            if stream is None:
                cache.bytes_loaded += self.load_into_slot(expert, slot)
            else:
                with torch.cuda.stream(stream):
                    cache.bytes_loaded += self.load_into_slot(expert, slot)
                    event = torch.cuda.Event()
                    event.record(stream)
                cache.pending[slot] = event
            cache.book(expert, slot)
            loaded.append(expert)
        cache.note_prefetched(loaded)

    def load_into_slot(self, expert: int, slot: int) -> int:
        """Copy one expert from the host store into a device slot; returns the bytes copied."""
        slots, stored = self._copy_views()
        for destination, source in zip(slots[slot], stored[expert]):
            destination.copy_(source, non_blocking=True)
        return self.expert_bytes()

    def _copy_views(self) -> tuple[list, list]:
        """Each slot's and each stored expert's (gate_up, down) views, made once per cache and slot
        tensors: a step issues its misses' copies one after another, and making two views for each
        copy is a large part of its issue time (benchmarks/bench_host_expert.py times both)."""
        key = (self.gate_up_proj.data_ptr(), self.down_proj.data_ptr())
        cached = self.__dict__.get("_views")  # dropped with the cache (set_resident)
        if cached is None or cached[0] != key:
            host = self.cache.host
            cached = (key, list(zip(self.gate_up_proj.detach().unbind(0), self.down_proj.detach().unbind(0))),
                      list(zip(host["gate_up_proj"].unbind(0), host["down_proj"].unbind(0))))
            self.__dict__["_views"] = cached
        return cached[1], cached[2]

    def expert_bytes(self) -> int:
        """From the shapes: indexing a slot makes views, and this runs for every copy."""
        per_expert = math.prod(self.gate_up_proj.shape[1:]) + math.prod(self.down_proj.shape[1:])
        return per_expert * self.gate_up_proj.element_size()

    def set_resident(self, num_slots: int | None, pin_memory: bool = False) -> None:
        """Keep ``num_slots`` experts on the parameters' device (None: all), every expert in host memory.

        On a meta model (before loading) this only shapes the slots and allocates the
        host store the loader fills; on a loaded one it moves the weights. The slots
        start empty and the counters at zero.
        """
        num_slots = self.num_experts if num_slots is None else num_slots
        if not 1 <= num_slots <= self.num_experts:
            raise ValueError(f"moe_expert_cache_size must be from 1 to the number of experts per layer "
                             f"({self.num_experts}), got {num_slots}")
        full = self._full_weights()
        device = self.gate_up_proj.device
        if num_slots == self.num_experts:
            host = {}
            self.gate_up_proj = nn.Parameter(full["gate_up_proj"].to(device), requires_grad=False)
            self.down_proj = nn.Parameter(full["down_proj"].to(device), requires_grad=False)
        else:
            pin = pin_memory and torch.cuda.is_available()
            # Huge pages: under --moe-cpu-experts auto the host reads these bytes too (memory/pinned.py).
            host = {name: pinned_empty(t.shape, t.dtype) if pin else torch.empty(t.shape, dtype=t.dtype)
                    for name, t in full.items()}
            if device.type != "meta":
                for name, t in full.items():
                    host[name].copy_(t)
            for name, t in full.items():
                slots = torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, device=device)
                setattr(self, name, nn.Parameter(slots, requires_grad=False))
        self.cache = ExpertCache(self.num_experts, num_slots, host)
        self.__dict__.pop("slot_table", None)  # moe_slots: the old cache's bookings
        self.__dict__.pop("_views", None)  # they hold the old host store
        # On by default on CUDA (set_expert_prefetch; the loader sets it once the meta model is placed).
        self.cache.prefetch = bool(host) and device.type == "cuda"

    def _full_weights(self) -> dict[str, torch.Tensor]:
        """Every expert's weights: the parameters when all are resident, else the host store."""
        if self.cache.host:
            return dict(self.cache.host)
        return {"gate_up_proj": self.gate_up_proj.data, "down_proj": self.down_proj.data}


# Prefetch is judged once a layer has prefetched this many experts, and stops below this
# fraction used by the forward they were copied for.
PREFETCH_JUDGED_AFTER = 64
PREFETCH_MIN_ACCURACY = 0.5


@dataclass(eq=False)
class ExpertCache:
    """Which expert each device slot of one layer holds, and how routing has used them.

    Slots are handed out per wave (``waves``, ``acquire``) and given back after it
    (``release``); an acquired slot is never evicted, so a wave's experts stay put
    while its groups run. Counters: a *hit* is an active expert found in a slot, a
    *miss* one that was not: copied in (``bytes_loaded``) or run on the host
    (``host_experts``, ``host_tokens``; moe_host.py); an *eviction* a copy that
    displaced another expert.
    """

    num_experts: int
    num_slots: int
    host: dict = field(default_factory=dict)  # gate_up_proj / down_proj of every expert, when offloaded
    frequency_weight: float | None = None  # None: num_slots / 4, as the KV host tier

    def __post_init__(self):
        identity = self.num_slots == self.num_experts
        if identity == bool(self.host):
            raise ValueError("an expert cache holds either every expert (no host store) or fewer slots "
                             "backed by a host store")
        if self.frequency_weight is None:
            self.frequency_weight = self.num_slots / 4
        self.slot_of = list(range(self.num_experts)) if identity else [-1] * self.num_experts
        self.expert_in = list(range(self.num_slots)) if identity else [-1] * self.num_slots
        self.in_use: set[int] = set()
        self.prefetch = False  # copy the next forward's predicted experts ahead (Experts.prefetch)
        self.judged_prefetched = self.judged_used = 0  # since prefetch was last turned on
        self.prefetch_stopped = False  # turned off for missing too often (record_routing)
        self.copy_stream = None  # CUDA: where prefetch copies run
        self.pending: dict[int, object] = {}  # slot -> the CUDA event its prefetch copy records
        self.prefetched_now: list[int] = []  # experts the last prefetch loaded, checked at the next forward
        self.prefetched = self.prefetch_used = 0
        self.clock = 0  # forward passes of this layer
        self.routed_tokens = [0] * self.num_experts
        # Eviction's score: the forward of the expert's last use + frequency_weight · log2(1 + routed_tokens).
        self.scores = [0.0] * self.num_experts
        self.hits = self.misses = self.evictions = self.bytes_loaded = 0
        self.host_experts = self.host_tokens = 0

    def note_host_run(self, tokens: int) -> None:
        """A miss run on the host's copy of the expert instead of copied into a slot."""
        self.misses += 1
        self.host_experts += 1
        self.host_tokens += tokens

    def record_routing(self, tokens_per_expert: list[int] | dict[int, int]) -> None:
        """One forward's routing (tokens per expert: a list over all, or a dict of the active ones): its
        active experts become the most recent, and more frequent."""
        routed = tokens_per_expert if isinstance(tokens_per_expert, dict) else dict(
            (e, n) for e, n in enumerate(tokens_per_expert) if n)
        self.clock += 1
        used = sum(1 for e in self.prefetched_now if e in routed)
        self.prefetch_used += used
        self.judged_prefetched += len(self.prefetched_now)
        self.judged_used += used
        self.prefetched_now = []
        # A prefetched expert the forward does not route to cost a copy and evicted one that
        # might have been a hit: on the H200 (2026-12-01, random weights, 6.6% of prefetches
        # used) prefetch made decode 26% slower than none. It stops where it misses that often.
        if (self.prefetch and self.judged_prefetched >= PREFETCH_JUDGED_AFTER
                and self.judged_used < PREFETCH_MIN_ACCURACY * self.judged_prefetched):
            self.prefetch = False
            self.prefetch_stopped = True
        for expert, tokens in routed.items():
            self.routed_tokens[expert] += tokens
            # Kept up to date here, the one place its terms change: eviction reads it per candidate slot.
            self.scores[expert] = self.clock + self.frequency_weight * math.log2(1 + self.routed_tokens[expert])

    def waves(self, active: list[int]) -> list[list[int]]:
        """The active experts in waves of at most num_slots, resident ones first (so they count as hits)."""
        resident = [e for e in active if self.slot_of[e] >= 0]
        ordered = resident + [e for e in active if self.slot_of[e] < 0]
        return [ordered[i:i + self.num_slots] for i in range(0, len(ordered), self.num_slots)]

    def acquire(self, wave: list[int], load) -> list[int]:
        """Slots holding ``wave``'s experts, copying misses in with ``load(expert, slot)``."""
        if len(wave) > self.num_slots - len(self.in_use):
            raise RuntimeError(f"expert cache: a wave of {len(wave)} experts with {len(self.in_use)} of "
                               f"{self.num_slots} slots still in use")
        wanted = set(wave)
        slots = []
        try:
            for expert in wave:
                slot = self.slot_of[expert]
                if slot >= 0:
                    self.hits += 1
                    self._wait_for_copy(slot)
                else:
                    self.misses += 1
                    slot = self._victim(wanted)
                    self._wait_for_copy(slot)  # a prefetch still writing it
                    self._evict(slot)
                    # Booked only once copied: a copy that fails leaves the slot free, not
                    # holding half of one expert under another's name.
                    self.bytes_loaded += load(expert, slot)
                    self.book(expert, slot)
                self.in_use.add(slot)
                slots.append(slot)
        except BaseException:
            self.release(slots)
            raise
        return slots

    def book(self, expert: int, slot: int) -> None:
        self.expert_in[slot], self.slot_of[expert] = expert, slot

    def claim_for_prefetch(self, expert: int, wanted: set[int]) -> int:
        """A slot for a predicted expert: free, else the lowest-scoring one not predicted; emptied."""
        slot = self._victim(wanted)
        self._wait_for_copy(slot)
        self._evict(slot)
        return slot

    def note_prefetched(self, experts: list[int]) -> None:
        self.prefetched += len(experts)
        self.prefetched_now = experts

    def _wait_for_copy(self, slot: int) -> None:
        """Make the compute stream wait for the slot's prefetch copy, if one is in flight (CUDA)."""
        event = self.pending.pop(slot, None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def _evict(self, slot: int) -> None:
        old = self.expert_in[slot]
        if old >= 0:
            self.slot_of[old] = self.expert_in[slot] = -1
            self.evictions += 1

    def _victim(self, wanted: set[int]) -> int:
        """The first free slot, else the one whose expert (not in this wave) scores lowest (ties: the lower slot)."""
        scores, expert_in, in_use = self.scores, self.expert_in, self.in_use
        victim, lowest = -1, math.inf
        for slot in range(self.num_slots):  # one pass: it runs for every miss of every layer
            expert = expert_in[slot]
            if slot in in_use or expert in wanted:
                continue
            if expert < 0:
                return slot
            if scores[expert] < lowest:
                victim, lowest = slot, scores[expert]
        if victim < 0:
            raise ValueError("expert cache: every slot is in use or wanted by this wave")
        return victim

    def release(self, slots: list[int]) -> None:
        self.in_use.difference_update(slots)

    def forget_routing(self) -> None:
        """Drop the counters, the routing history that scores eviction, and the prefetch judgement (prefetch
        back on if it was stopped), keeping the slots' experts: for forwards of dummy tokens (start-up's)."""
        self.hits = self.misses = self.evictions = self.bytes_loaded = 0
        self.host_experts = self.host_tokens = self.prefetched = self.prefetch_used = 0
        self.judged_prefetched = self.judged_used = self.clock = 0
        self.prefetched_now = []
        self.routed_tokens = [0] * self.num_experts
        self.scores = [0.0] * self.num_experts
        if self.prefetch_stopped:
            self.prefetch, self.prefetch_stopped = True, False

    def resident_experts(self) -> list[int]:
        return [e for e in self.expert_in if e >= 0]

    def check(self) -> None:
        """Raise if the slot bookkeeping is inconsistent (a leak or a double booking)."""
        held = [(s, e) for s, e in enumerate(self.expert_in) if e >= 0]
        if any(self.slot_of[e] != s for s, e in held):
            raise AssertionError(f"expert cache: slot table {self.expert_in} disagrees with {self.slot_of}")
        if sum(s >= 0 for s in self.slot_of) != len(held):
            raise AssertionError(f"expert cache: experts {self.slot_of} point at slots no expert holds")
        if self.in_use:
            raise AssertionError(f"expert cache: slots {sorted(self.in_use)} still in use between waves")

    def stats(self) -> dict:
        lookups = self.hits + self.misses
        return {
            "num_experts": self.num_experts,
            "num_slots": self.num_slots,
            "resident": len(self.resident_experts()),
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / lookups if lookups else None,
            "evictions": self.evictions,
            "bytes_loaded": self.bytes_loaded,
            "host_bytes": sum(t.numel() * t.element_size() for t in self.host.values()),
            "prefetched": self.prefetched,  # experts copied ahead on the next layer's router's prediction
            "prefetch_used": self.prefetch_used,  # of those, routed to by the forward they were copied for
            "prefetch_accuracy": self.prefetch_used / self.prefetched if self.prefetched else None,
            "prefetch_stopped": self.prefetch_stopped,  # turned off: under PREFETCH_MIN_ACCURACY
            "host_experts": self.host_experts,  # misses run on the host (--moe-cpu-experts)
            "host_tokens": self.host_tokens,  # the tokens those carried
        }


# ---------------------------------------------------------------- the model's experts


def set_expert_cache_size(model, num_slots: int | None, pin_memory: bool = True) -> None:
    """Keep ``num_slots`` experts per layer resident (None: all), the rest in host memory.

    Works on a model still on the meta device (the loader's build, before the weights
    are read) and on a loaded one. Not on CUDA after decode graphs were captured: they
    would keep reading the old weights.
    """
    blocks = model.moe_blocks()
    for block, following in zip(blocks, blocks[1:] + [None]):
        block.experts.set_resident(num_slots, pin_memory)
        block.__dict__["next_moe"] = following  # not a submodule: the next layer predicts from here


def set_expert_prefetch(model, enabled: bool) -> None:
    """Copy each MoE layer's predicted experts ahead, from the layer before (default: on CUDA with
    fewer experts resident than all; on the CPU the copies run at once, so it only tests the logic)."""
    for block in model.moe_blocks():
        cache = block.experts.cache
        cache.prefetch = enabled and bool(cache.host)
        cache.judged_prefetched = cache.judged_used = 0
        cache.prefetch_stopped = False


def forget_start_up_routing(model) -> None:
    """Start-up's forwards (on CUDA the profile step, the decode graphs' warm-ups and captures, the kernel
    probes) route dummy tokens: every MoE layer's cache forgets them (ExpertCache.forget_routing), so that
    stats(), /metrics, eviction and the prefetch judgement describe serving."""
    for block in model.moe_blocks():
        block.experts.cache.forget_routing()


def offloaded_weights(model) -> dict[str, torch.Tensor]:
    """Parameter name -> host store, for the experts kept in host memory (what the loader fills)."""
    stores = {}
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            for key, tensor in module.cache.host.items():
                stores[f"{name}.{key}"] = tensor
    return stores


def expert_slot_bytes(model) -> int:
    """Device bytes of the expert slots when fewer than all experts are resident (else 0: they are weights)."""
    return sum(t.numel() * t.element_size() for block in model.moe_blocks() if block.experts.cache.host
               for t in (block.experts.gate_up_proj, block.experts.down_proj))


def expert_cache_stats(model) -> dict:
    """Every MoE layer's cache counters, summed, and per layer; {"enabled": False} for a dense model.

    ``router`` says which router produced the figures: "model", or the synthetic bias.
    """
    layers = [block.stats() for block in model.moe_blocks()]
    if not layers:
        return {"enabled": False}
    totals = {key: sum(layer[key] for layer in layers)
              for key in ("hits", "misses", "evictions", "bytes_loaded", "host_bytes", "prefetched", "prefetch_used",
                          "host_experts", "host_tokens")}
    totals["prefetch_accuracy"] = totals["prefetch_used"] / totals["prefetched"] if totals["prefetched"] else None
    totals["resident_experts"] = sum(layer["resident"] for layer in layers)
    lookups = totals["hits"] + totals["misses"]
    return {"enabled": True, "num_experts": layers[0]["num_experts"], "num_slots": layers[0]["num_slots"],
            **totals, "hit_rate": totals["hits"] / lookups if lookups else None,
            "router": layers[0]["router"], **_cpu_experts_stats(model.moe_blocks()[0].experts), "layers": layers}


def _cpu_experts_stats(experts) -> dict:
    """The miss policy (moe_host.py) and, under auto, the measured token count up to which a miss runs on the host,
    and the host's time for one row of one expert as the split now prices it (None: no split)."""
    cost = experts.host_cost
    return {"cpu_experts": experts.cpu_experts,
            "host_token_limit": experts.host_token_limit if experts.cpu_experts == "auto" else None,
            "host_row_us": cost.host_row_seconds * 1e6 if cost is not None else None}


# ---------------------------------------------------------------- synthetic routing (benchmarks only)


class SyntheticRouterBias:
    """SYNTHETIC: a bias on one layer's router logits that makes routing skewed and reused over time.

    Random weights route almost uniformly, so an expert cache hits about as often as
    its resident fraction; real models reuse a few experts far more. This bias stands
    in for that locality in benchmarks and tests of the cache, never in serving: it
    changes the model's outputs. Expert of rank r gets ``-skew * ln(1 + r)`` added to
    its logit (Zipf-like popularity); every ``drift_every`` forward passes one of the
    ``hot`` top-ranked experts swaps rank with a random colder one, so the popular set
    stays for a while and then changes. Seeded: the same calls give the same biases.
    """

    def __init__(self, num_experts: int, skew: float, hot: int, drift_every: int, seed: int):
        if skew <= 0 or drift_every < 1 or not 1 <= hot < num_experts:
            raise ValueError(f"synthetic router bias: skew must be > 0 (got {skew}), drift_every >= 1 (got "
                             f"{drift_every}), hot from 1 to {num_experts - 1} (got {hot})")
        self.skew, self.hot, self.drift_every = skew, hot, drift_every
        self.generator = torch.Generator().manual_seed(seed)
        self.rank_of = torch.randperm(num_experts, generator=self.generator)
        self.calls = 0
        self.bias: torch.Tensor | None = None  # on the logits' device; a CUDA graph reads it in place

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The current bias added, without counting a forward pass (the next layer's prediction)."""
        if self.bias is None or self.bias.device != logits.device:
            self.bias = self._host_bias().to(logits.device)
        return logits + self.bias.to(logits.dtype)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not (logits.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.advance()
        return self.apply(logits)

    def advance(self) -> None:
        """Count one forward pass; every ``drift_every`` one hot expert swaps rank with a colder one.

        In a decode graph cut at the MoE layers (mempath.engine.piecewise) the host step after the
        router calls this, so there a drift takes effect one forward pass later than eagerly."""
        self.calls += 1
        if self.calls % self.drift_every:
            return
        hot_rank = int(torch.randint(self.hot, (1,), generator=self.generator))
        cold_rank = int(torch.randint(self.hot, len(self.rank_of), (1,), generator=self.generator))
        hot_expert = int((self.rank_of == hot_rank).nonzero())
        cold_expert = int((self.rank_of == cold_rank).nonzero())
        self.rank_of[hot_expert], self.rank_of[cold_expert] = cold_rank, hot_rank
        if self.bias is not None:
            self.bias.copy_(self._host_bias())

    def _host_bias(self) -> torch.Tensor:
        return -self.skew * torch.log1p(self.rank_of.to(torch.float32))

    def describe(self) -> str:
        return f"synthetic (skew {self.skew}, {self.hot} hot, drift every {self.drift_every})"


class SyntheticUniformRouter:
    """SYNTHETIC: each token's k experts drawn uniformly at random, independently per layer and
    forward pass (the router's logits replaced by uniform noise from the device's default generator,
    which CUDA graphs replay with fresh offsets). The cache's worst case: no locality at all, a hit
    rate of about the resident fraction. Benchmarks only: the model's routing is discarded."""

    def __init__(self, seed: int):
        self.seed = seed

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.rand(logits.shape, dtype=torch.float32, device=logits.device).to(logits.dtype)

    __call__ = apply

    def advance(self) -> None:
        pass

    def describe(self) -> str:
        return "synthetic uniform"


def synthetic_router_bias(model, skew: float | None = 1.0, hot: int | None = None, drift_every: int = 32,
                          seed: int = 0) -> None:
    """SYNTHETIC, for benchmarks: give every MoE layer a SyntheticRouterBias (see there).

    ``hot`` defaults to a quarter of the experts. ``skew=None`` removes the biases
    again. Off unless this is called; stats() then names it as the router.
    """
    for index, block in enumerate(model.moe_blocks()):
        block.router_bias = None if skew is None else SyntheticRouterBias(
            block.num_experts, skew, hot or max(1, block.num_experts // 4), drift_every, seed + index)


def synthetic_uniform_router(model, seed: int = 0) -> None:
    """SYNTHETIC, for benchmarks: every MoE layer routes uniformly at random (SyntheticUniformRouter);
    seeds the device's default generator. ``synthetic_router_bias(model, None)`` removes it."""
    device = next(model.parameters()).device
    (torch.cuda.manual_seed if device.type == "cuda" else torch.manual_seed)(seed)
    for block in model.moe_blocks():
        block.router_bias = SyntheticUniformRouter(seed)
