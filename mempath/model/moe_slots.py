"""The expert cache on the grouped kernel: a MoE layer whose experts are partly in host memory,
run over its slots with the same per-pair arithmetic as the all-resident layer.

With fewer experts resident than all (mempath.model.moe's ExpertCache), which experts a step
needs is known only once the router has run, and the misses are copied in on the host's
decision. On CUDA the layer then runs like this:

- **eagerly** (prefill, and decode batches without a graph): the router's expert ids are read
  on the host, the active experts go through the cache in waves of at most ``num_slots``
  (hits first, misses copied into the slots), and each wave is one grouped launch per
  projection over the slots (``Kernels.grouped_expert_pairs``) with every pair's expert id
  replaced by its slot; a pair keeps the output of the wave that holds its expert;
- **inside a decode CUDA graph cut at each MoE layer** (mempath.engine.piecewise): the graph
  piece before the cut ends with the router; between the pieces ``SlotStep`` reads the ids,
  books the misses into slots and copies them in, and writes the layer's slot table (expert ->
  slot) to the device; the piece after the cut maps the ids through that table and runs the
  grouped kernel over the slots. A graph's batch must fit one wave: ``rows·k <= num_slots``.

With ``--moe-cpu-experts auto`` on CUDA, a step's misses are split (moe_host.HostExpertCost.
split_misses): the host multiplies some from the host store while the others are copied in,
and their rows replace those pairs' rows of the kernel's output (in a cut graph through the
slot table's host-pair buffers, uploaded between the pieces).

A pair's row is computed the same way in any group of the grouped kernel, and the sum over k
is the all-resident layer's, so outputs are bit-identical to the all-resident model on the
grouped kernel for every cache size (host-run pairs: on the CPU too; on CUDA the host's
arithmetic is not the kernel's). ``expert_pairs_torch`` is the kernel's twin over the
same stacks: CPU tests run this module's bookkeeping with it.

This module works on a MoEBlock passed in (duck-typed) and imports nothing from moe.py.
"""
import time

import numpy as np
import torch
import torch.nn.functional as F

from mempath.kernels.moe_triton import sum_pairs
from mempath.kernels.elementwise_torch import silu_and_mul_torch


def expert_pairs_torch(x: torch.Tensor, router_weights: torch.Tensor, expert_ids: torch.Tensor,
                       gate_up_proj: torch.Tensor, down_proj: torch.Tensor, silu_and_mul) -> torch.Tensor:
    """``Kernels.grouped_expert_pairs`` in PyTorch: each pair's expert MLP times its router weight,
    float32 [T·k, h] (the product in x's dtype, weighted in float32; exact for float32 models).

    One pair at a time, as the kernel computes a row whatever group it sits in: a matmul over a
    group's rows can round a row differently with the group's size, a vector product cannot."""
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).tolist()
    weights = router_weights.reshape(-1).to(torch.float32)
    out = torch.empty(len(flat), down_proj.shape[1], dtype=torch.float32, device=x.device)
    for pair, expert in enumerate(flat):
        out[pair] = _pair_row(gate_up_proj[expert], down_proj[expert], x[pair // top_k], weights[pair], silu_and_mul)
    return out


def _pair_row(gate_up: torch.Tensor, down: torch.Tensor, row: torch.Tensor, weight: torch.Tensor,
              silu_and_mul) -> torch.Tensor:
    return torch.mv(down, silu_and_mul(torch.mv(gate_up, row))).to(torch.float32) * weight


def fill_host_pairs(experts, x: torch.Tensor, router_weights: torch.Tensor, expert_ids: list[int], top_k: int,
                    on_host: set[int], pairs: torch.Tensor, mask: torch.Tensor) -> int:
    """The rows of the grouped kernel's output (``[T·k, h]`` float32, on the host) of every pair whose
    expert is in ``on_host``, by the kernel's twin over the host store, and ``mask`` (bool ``[T·k]``)
    True at them: on the CPU a host-run pair is the kernel's pair bit for bit. Returns how many rows it filled.

    Pair by pair with no index tensors: a decode step runs one or two pairs a layer here, and
    the step waits for each operator's fixed cost."""
    mask.zero_()
    chosen = [p for p, e in enumerate(expert_ids) if e in on_host]
    if not chosen:
        return 0
    host = experts.cache.host
    gate_up, down = host["gate_up_proj"], host["down_proj"]
    weights = router_weights.reshape(-1).to(torch.float32)
    for pair in chosen:
        expert = expert_ids[pair]
        pairs[pair] = _pair_row(gate_up[expert], down[expert], x[pair // top_k], weights[pair], silu_and_mul_torch)
    mask.numpy()[chosen] = True
    return len(chosen)


def run_host_pairs(experts, x: torch.Tensor, router_weights: torch.Tensor, expert_ids: list[int], top_k: int,
                   on_host: set[int], pairs: torch.Tensor, mask: torch.Tensor) -> None:
    """``fill_host_pairs`` inside a step, timed for the cost model (moe_host.HostExpertCost.observe_host_rows)."""
    start = time.perf_counter()
    rows = fill_host_pairs(experts, x, router_weights, expert_ids, top_k, on_host, pairs, mask)
    if experts.host_cost is not None:
        experts.host_cost.observe_host_rows(rows, time.perf_counter() - start)


def uses_slot_kernel(block) -> bool:
    """The cache runs on the grouped kernel: it has fewer experts resident than all, the kernel is
    there, and a miss is copied or split by the cost model (--moe-cpu-experts never or auto; with
    always every miss runs on the host, through MoE's eager path)."""
    experts = block.experts
    return (bool(experts.cache.host) and experts.kernels.grouped_expert_pairs is not None
            and experts.cpu_experts in ("never", "auto"))


class SlotTable:
    """One layer's expert -> slot map on the device (non-resident experts point at slot 0: only a
    padding row of a captured batch can read one, and its output is discarded), and its pinned host
    copy. Rewritten between graph pieces when the cache's bookings change."""

    def __init__(self, num_experts: int, device: torch.device, host_pairs: int = 0, hidden: int = 0):
        pin = device.type == "cuda"
        self.device_table = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self.host_table = torch.zeros(num_experts, dtype=torch.int64, pin_memory=pin)
        self.written: list[int] | None = None  # the cache's slot_of as last written
        # A cut graph's pairs run on the host (``host_pairs`` of them at most: its batch · k): their
        # rows and where they go, uploaded between the pieces; the mask is all False when none ran.
        self.pair_rows = torch.zeros(host_pairs, hidden, dtype=torch.float32, device=device)
        self.pair_mask = torch.zeros(host_pairs, dtype=torch.bool, device=device)
        self.host_pair_rows = torch.zeros(host_pairs, hidden, dtype=torch.float32, pin_memory=pin)
        self.host_pair_mask = torch.zeros(host_pairs, dtype=torch.bool, pin_memory=pin)
        self.mask_dirty = False  # the device mask has a True from an earlier step

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.device_table, self.pair_rows, self.pair_mask))

    def write_host_pairs(self, experts, x: torch.Tensor, weights: torch.Tensor, expert_ids: list[int],
                         top_k: int, on_host: set[int]) -> None:
        """The host-run pairs' rows and mask for the piece after the cut (``x`` and ``weights``: the
        layer's rows, read back to the host with the ids, so the device is past the router)."""
        if not on_host and not self.mask_dirty:
            return
        n = len(expert_ids)
        run_host_pairs(experts, x, weights, expert_ids, top_k, on_host, self.host_pair_rows[:n],
                       self.host_pair_mask)
        if on_host:
            self.pair_rows[:n].copy_(self.host_pair_rows[:n], non_blocking=True)
        self.pair_mask.copy_(self.host_pair_mask, non_blocking=True)
        self.mask_dirty = bool(on_host)

    def write(self, slot_of: list[int]) -> None:
        """Upload the cache's bookings if they changed since the last write (asynchronously: the host
        copy is rewritten only after a later piece's read-back, which the stream orders after this)."""
        if slot_of == self.written:
            return
        table = self.host_table.numpy()
        table[:] = slot_of
        np.maximum(table, 0, out=table)
        self.device_table.copy_(self.host_table, non_blocking=True)
        self.written = list(slot_of)


def slot_table(block) -> SlotTable:
    experts = block.experts
    table = experts.__dict__.get("slot_table")
    if table is None:
        # A cut graph routes at most num_slots pairs (graph_rows_limit); host pairs only under auto.
        host_pairs = experts.cache.num_slots if experts.host_cost is not None else 0
        table = SlotTable(experts.num_experts, experts.gate_up_proj.device, host_pairs, experts.down_proj.shape[1])
        experts.__dict__["slot_table"] = table
    return table


def split_routing(experts, routed: dict[int, int]) -> tuple[dict[int, int], set[int]]:
    """The experts the slots run (hits and the misses to copy) and the misses the host runs, by the
    cost model under auto (none otherwise). The host-run ones are counted here, as misses that copy nothing."""
    cache, cost = experts.cache, experts.host_cost
    if cost is None:
        return routed, set()
    misses = {e: n for e, n in routed.items() if cache.slot_of[e] < 0}
    on_host = set(cost.split_misses(misses, experts.gate_up_proj.shape[2], experts.intermediate_size,
                                    experts.gate_up_proj.element_size()))
    if misses and not on_host:
        cost.observe_no_host_rows()
    for expert in on_host:
        cache.note_host_run(routed[expert])
    return {e: n for e, n in routed.items() if e not in on_host}, on_host


def count_routed(expert_ids: list[int]) -> dict[int, int]:
    """Pairs per active expert (the cache's record of a forward)."""
    routed: dict[int, int] = {}
    for expert in expert_ids:
        routed[expert] = routed.get(expert, 0) + 1
    return routed


def book_one_wave(block, expert_ids: list[int]) -> set[int]:
    """A captured batch's routing through the cache: hits counted, misses copied into slots on the
    current stream (spread over two copy streams they ran slower on the H200: BENCHMARKS.md), or
    under auto some left to the host (returned: the host computes them while the copies run).

    Every active expert must fit the slots at once (the graph sizes are chosen so)."""
    experts = block.experts
    cache = experts.cache
    routed = count_routed(expert_ids)
    if len(routed) > cache.num_slots:
        raise RuntimeError(f"a captured MoE step routed to more experts than the {cache.num_slots} slots: "
                           "its graph size should not have been captured")
    cache.record_routing(routed)
    in_slots, on_host = split_routing(experts, routed)
    if in_slots:
        [wave] = cache.waves(sorted(in_slots))
        cache.release(cache.acquire(wave, experts.load_into_slot))
    slot_table(block).write(cache.slot_of)
    return on_host


class SlotStep:
    """The host's part of one MoE layer between two pieces of a captured decode step.

    Made at the cut, outside any capture (it allocates its pinned landing buffer there)."""

    def __init__(self, block, expert_ids: torch.Tensor, x: torch.Tensor, weights: torch.Tensor):
        self.block = block
        # The piece before the cut writes these; held so nothing reuses them.
        self.expert_ids, self.x, self.weights = expert_ids, x, weights
        self.landing = torch.empty(expert_ids.shape, dtype=expert_ids.dtype, pin_memory=True)
        self.landed = self.landing.numpy()
        self.splits = block.experts.host_cost is not None  # auto: the host may run misses, from these rows
        if self.splits:
            self.x_landing = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self.weights_landing = torch.empty(weights.shape, dtype=weights.dtype, pin_memory=True)
        self.read = torch.cuda.Event()

    def __call__(self, rows: int | None) -> None:
        """Book the routing of the first ``rows`` rows (None: all; the rest pad the captured batch)."""
        self.landing.copy_(self.expert_ids, non_blocking=True)
        if self.splits:
            self.x_landing.copy_(self.x, non_blocking=True)
            self.weights_landing.copy_(self.weights, non_blocking=True)
        self.read.record()
        self.read.synchronize()
        ids = self.landed[:rows].ravel().tolist()
        on_host = book_one_wave(self.block, ids)  # the misses' copies are issued: the host works meanwhile
        if self.splits:
            slot_table(self.block).write_host_pairs(self.block.experts, self.x_landing, self.weights_landing, ids,
                                                    self.block.top_k, on_host)
        if self.block.router_bias is not None:  # benchmarks' synthetic routing: its drift counts forwards
            self.block.router_bias.advance()


def forward_slots(block, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """The layer's experts over its slots (see the module docstring); [T, h] in x's dtype."""
    experts = block.experts
    kernel = experts.kernels.grouped_expert_pairs
    cut = block.__dict__.get("graph_cut")
    if cut is not None and x.is_cuda and torch.cuda.is_current_stream_capturing():
        cut(lambda: SlotStep(block, expert_ids, x, weights))
        table = slot_table(block)
        slot_ids = table.device_table[expert_ids]
        pairs = kernel(x, weights, slot_ids, experts.gate_up_proj, experts.down_proj, experts.kernels.silu_and_mul)
        if experts.host_cost is not None:
            n = pairs.shape[0]
            pairs = torch.where(table.pair_mask[:n, None], table.pair_rows[:n], pairs)
        return _sum(experts)(pairs, block.top_k, x.dtype)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a MoE layer with fewer experts resident than all copies its misses on the host's "
                           "decision: capture it with mempath.engine.piecewise, or run it eagerly")
    return _run_waves(block, x, weights, expert_ids, kernel)


def _sum(experts):
    """The sum over k the all-resident layer uses (Kernels.sum_expert_pairs), or its twin."""
    return experts.kernels.sum_expert_pairs or sum_pairs


def _run_waves(block, x, weights, expert_ids, kernel) -> torch.Tensor:
    experts, cache = block.experts, block.experts.cache
    ids = _read_ids_and_prefetch(block, x, expert_ids)
    routed = count_routed(ids)
    cache.record_routing(routed)
    in_slots, on_host = split_routing(experts, routed)
    # The host-run rows are read back before the waves are issued (a read after them would wait for them).
    host_rows = (x.to("cpu"), weights.to("cpu")) if on_host else None
    pairs = None
    for wave in cache.waves(sorted(in_slots)):
        slots = cache.acquire(wave, experts.load_into_slot)
        try:
            slot_of = dict(zip(wave, slots))
            slot_ids = torch.tensor([slot_of.get(e, slots[0]) for e in ids], dtype=torch.int64)
            out = kernel(x, weights, slot_ids.to(x.device).view_as(expert_ids), experts.gate_up_proj,
                         experts.down_proj, experts.kernels.silu_and_mul)
        finally:
            cache.release(slots)
        if pairs is None:
            pairs = out  # every pair is rewritten by the wave holding its expert, or by the host below
        else:
            mine = torch.tensor([e in slot_of for e in ids]).to(x.device)
            torch.where(mine.unsqueeze(1), out, pairs, out=pairs)
        del out, slot_ids
    if on_host:  # after the waves are issued: on CUDA the host computes while the device copies and runs them
        rows, mask = _host_pairs(block, *host_rows, ids, on_host)
        rows, mask = rows.to(x.device), mask.to(x.device)
        pairs = rows if pairs is None else torch.where(mask.unsqueeze(1), rows, pairs)
    slot_table(block).write(cache.slot_of)
    return _sum(experts)(pairs, block.top_k, x.dtype)


def _host_pairs(block, x, weights, ids: list[int], on_host: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """An eager step's [T·k, h] float32 pairs with the host-run ones filled in, and where they are
    (from the layer's rows and router weights on the host)."""
    experts = block.experts
    rows = torch.zeros(len(ids), experts.down_proj.shape[1], dtype=torch.float32)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    run_host_pairs(experts, x, weights, ids, block.top_k, on_host, rows, mask)
    return rows, mask


def _read_ids_and_prefetch(block, x: torch.Tensor, expert_ids: torch.Tensor) -> list[int]:
    """The pairs' expert ids on the host; with prefetch on, the next layer's predicted experts are
    read in the same host read and their copies started (mempath.model.moe.Experts.prefetch)."""
    flat = expert_ids.reshape(-1)
    following = block.__dict__.get("next_moe")
    if following is None or not following.experts.cache.prefetch:
        return flat.tolist()
    predicted = following.predict_experts(x)
    both = torch.cat([flat, predicted.to(flat.dtype)]).tolist()
    ids, next_sizes = both[:flat.numel()], both[flat.numel():]
    following.experts.prefetch(sorted((e for e, n in enumerate(next_sizes) if n), key=lambda e: -next_sizes[e]))
    return ids


def allocate_slot_tables(model) -> int:
    """Every slot-kernel MoE layer's slot table, allocated now (before the step loop); their device bytes."""
    return sum(slot_table(block).nbytes() for block in model.moe_blocks() if uses_slot_kernel(block))


def graph_rows_limit(model) -> int | None:
    """The largest decode batch whose routing always fits one wave of every offloaded layer's slots
    (None: no layer is offloaded), or 0 when some offloaded layer cannot run in a graph at all."""
    offloaded = [block for block in model.moe_blocks() if block.experts.cache.host]
    if not offloaded:
        return None
    if not all(uses_slot_kernel(block) for block in offloaded):
        return 0
    return min(block.experts.cache.num_slots // block.top_k for block in offloaded)


def offloaded_blocks(model) -> list:
    return [block for block in model.moe_blocks() if uses_slot_kernel(block)]
