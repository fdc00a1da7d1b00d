"""A missed expert run on the host instead of copied to the device: the policy and its cost model.

With fewer experts resident than all (docs/moe.md), a routed expert that is in no slot
is normally copied in from the host store. For a few tokens it can be cheaper to send
the tokens to the weights than the weights to the tokens: the host multiplies the
tokens' rows by the expert's host copy and sends the results back. ``HostExpertCost``
compares the two per expert and step:

- copy: the expert's bytes, ``3·h·I_e·b``, over the pinned host-to-device bandwidth;
- host: ``2·3·h·I_e·t`` FLOPs at the host's matmul rate, plus the t hidden states'
  round trip (``2·t·h·b`` bytes over the same link) and one synchronisation.

The rates are measured once, when the policy is set (``measure_host_cost``). A row timed
there runs alone; inside a step it shares the host with the step's copies and bookkeeping
and takes longer, so the split's per-row time then follows the rows the steps run
(``observe_host_rows``). The model is per step: it does not credit a copy with the hits it
may bring later steps.

On the grouped kernel (moe_slots.py, eager steps and decode graphs cut at the MoE layers)
``auto`` splits a step's misses instead: the host multiplies some while the copy engine
brings in the others, so the layer waits for the longer of the two, not for every copy
(``HostExpertCost.split_misses``). The host's results enter the layer as the pairs'
rows of the grouped kernel's output (``moe_slots.fill_host_pairs``), by the kernel's twin.
"""
import itertools
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mempath.kernels.elementwise_torch import silu_and_mul_torch
from mempath.model.moe_slots import fill_host_pairs

CPU_EXPERT_POLICIES = ("never", "auto", "always")
# The weight of one layer's observed rows: a decode step of a 48-layer model moves the estimate
# most of the way, so a step or two after the host's load changes, the split has followed it.
ROW_WEIGHT = 1 / 16
MAX_ROW_JUMP = 4.0
# The drift back toward start-up's row time is this many times slower than an observation's pull: layers
# whose few misses all go to the copies are common, and a fast drift would undo what the rows taught.
ROW_DRIFT_SLOWER = 8


@dataclass
class HostExpertCost:
    """Rates that decide where a missed expert runs; times in seconds for one expert of one layer.

    Shared by every layer of a model: ``host_row_seconds`` moves with the host-run rows of all of them."""

    h2d_bytes_per_s: float  # pinned host-to-device copies (one expert at a time)
    host_flops_per_s: float  # the host's matmul rate in the model dtype, decode-sized rows
    sync_seconds: float  # one device -> host -> device round trip of a row: the host path's fixed cost
    # One row of one expert on the grouped kernel's host path (moe_slots.fill_host_pairs), which runs
    # pair by pair and so reads the weights once a row: a split's host cost is rows times this (0: not
    # measured; then the FLOPs at host_flops_per_s, the eager path's rate).
    host_row_seconds: float = 0.0
    # The host's time to issue one expert's copy (the copy calls; the cache's bookkeeping is not timed):
    # the host issues a step's copies before it computes its share, so these delay its side of a split.
    issue_seconds: float = 0.0
    # How far one observed layer's rows move host_row_seconds toward their own time (0: never; the
    # start-up measurement stands). An observation counts at most MAX_ROW_JUMP times the current value.
    row_weight: float = 0.0
    # Start-up's row time, which host_row_seconds drifts back toward while layers miss with no host rows
    # (0: no drift): a few stalled observations could otherwise price the host out for good, since a
    # split that gives it nothing observes nothing.
    start_row_seconds: float = 0.0

    def copy_seconds(self, hidden: int, intermediate: int, dtype_bytes: int) -> float:
        return 3 * hidden * intermediate * dtype_bytes / self.h2d_bytes_per_s

    def host_seconds(self, tokens: int, hidden: int, intermediate: int, dtype_bytes: int) -> float:
        return tokens * self._host_seconds_per_token(hidden, intermediate, dtype_bytes) + self.sync_seconds

    def runs_on_host(self, tokens: int, hidden: int, intermediate: int, dtype_bytes: int) -> bool:
        return self.host_seconds(tokens, hidden, intermediate, dtype_bytes) < self.copy_seconds(
            hidden, intermediate, dtype_bytes)

    def host_token_limit(self, hidden: int, intermediate: int, dtype_bytes: int) -> int:
        """The most tokens for which the host is cheaper than the copy (0: never)."""
        spare = self.copy_seconds(hidden, intermediate, dtype_bytes) - self.sync_seconds
        if spare <= 0:
            return 0
        limit = max(0, math.ceil(spare / self._host_seconds_per_token(hidden, intermediate, dtype_bytes)) - 1)
        while limit and not self.runs_on_host(limit, hidden, intermediate, dtype_bytes):  # rounding at the edge
            limit -= 1
        return limit

    def split_misses(self, tokens_per_miss: dict[int, int], hidden: int, intermediate: int,
                     dtype_bytes: int) -> list[int]:
        """The misses the host runs while the others are copied: the split whose longer side (the host
        issuing the copies, then its experts one after another; or the copies one after another) is
        shortest. Fewest tokens first."""
        by_tokens = sorted(tokens_per_miss, key=lambda e: (tokens_per_miss[e], e))
        copy = self.copy_seconds(hidden, intermediate, dtype_bytes)
        best, best_seconds, host = 0, len(by_tokens) * copy, self.sync_seconds
        per_row = self.host_row_seconds or self._host_seconds_per_token(hidden, intermediate, dtype_bytes)
        for count, expert in enumerate(by_tokens, start=1):
            host += tokens_per_miss[expert] * per_row
            copied = len(by_tokens) - count
            seconds = max(host + copied * self.issue_seconds, copied * copy)
            if seconds < best_seconds:
                best, best_seconds = count, seconds
        return by_tokens[:best]

    def observe_host_rows(self, rows: int, seconds: float) -> None:
        """A layer's ``rows`` host-run rows took ``seconds`` inside a step (moe_slots.run_host_pairs)."""
        if not self.row_weight or rows <= 0:
            return
        current, seen = self.host_row_seconds, seconds / rows
        if current:  # one stall (the OS, a page fault) moves it a bounded step
            seen = min(seen, MAX_ROW_JUMP * current)
        self.host_row_seconds = current + self.row_weight * (seen - current) if current else seen

    def observe_no_host_rows(self) -> None:
        """A layer missed and its split gave the host nothing: drift back toward start-up's row time."""
        if self.row_weight and self.host_row_seconds > self.start_row_seconds > 0:
            drift = self.row_weight / ROW_DRIFT_SLOWER
            self.host_row_seconds += drift * (self.start_row_seconds - self.host_row_seconds)

    def _host_seconds_per_token(self, hidden: int, intermediate: int, dtype_bytes: int) -> float:
        return 6 * hidden * intermediate / self.host_flops_per_s + 2 * hidden * dtype_bytes / self.h2d_bytes_per_s


def _seconds_per_call(fn, min_seconds: float = 0.02, cuda: bool = False, min_calls: int = 1) -> float:
    fn()  # warm-up (allocator, kernel choice)
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and calls >= min_calls:
            return elapsed / calls


def measure_host_cost(experts) -> HostExpertCost:
    """The rates on this machine, measured with one layer's experts (its host store).

    Each host path is timed by its own function over every expert of the layer in turn:
    a step's misses are experts no recent step read, so their weights come from memory,
    not from the host's caches, which one expert timed again and again would sit in. The
    eager path (``host_mlp``: a matmul over an expert's rows) gives the FLOP rate, the
    grouped kernel's (moe_slots.fill_host_pairs, pair by pair) the one-row time. The
    copies (bursts of four, as a step issues them) go into slot 0, which gets its expert
    back afterwards, so nothing is allocated on the device beyond one row."""
    host, cache = experts.cache.host, experts.cache
    gate_ups = host["gate_up_proj"]
    num_experts, cuda = gate_ups.shape[0], experts.gate_up_proj.is_cuda
    order = itertools.cycle(range(num_experts))
    rows = torch.randn(4, gate_ups.shape[2], dtype=gate_ups.dtype)
    pairs, mask, weights = torch.empty(1, host["down_proj"].shape[1]), torch.empty(1, dtype=torch.bool), torch.ones(1)

    def one_pair() -> None:
        expert = next(order)
        fill_host_pairs(experts, rows[:1], weights, [expert], 1, {expert}, pairs, mask)

    flops = 2 * rows.shape[0] * 3 * gate_ups.shape[2] * experts.intermediate_size
    host_seconds = _seconds_per_call(lambda: host_mlp(experts, rows, next(order)), min_calls=num_experts)
    row_seconds = _seconds_per_call(one_pair, min_calls=num_experts)
    evicted = cache.expert_in[0]
    burst, issued = 4, []  # a step's copies are issued back to back: time a burst, not one copy and its sync

    def copy_burst() -> None:
        start = time.perf_counter()
        for _ in range(burst):
            experts.load_into_slot(next(order), 0)
        issued.append(time.perf_counter() - start)
    copy_seconds = _seconds_per_call(copy_burst, cuda=cuda) / burst
    issue_seconds = statistics.median(issued) / burst
    if evicted >= 0:
        experts.load_into_slot(evicted, 0)  # what the slot held before (a free slot's bytes are junk anyway)
    row = torch.zeros(1, gate_ups.shape[2], dtype=gate_ups.dtype, device=experts.gate_up_proj.device)
    sync_seconds = _seconds_per_call(lambda: row.to("cpu").to(row.device), cuda=cuda)
    return HostExpertCost(h2d_bytes_per_s=experts.expert_bytes() / copy_seconds,
                          host_flops_per_s=flops / host_seconds, sync_seconds=sync_seconds,
                          host_row_seconds=row_seconds, issue_seconds=issue_seconds,
                          row_weight=ROW_WEIGHT, start_row_seconds=row_seconds)


def check_cpu_experts(policy: str, expert_cache_size: int | None, dense: str | None = None) -> None:
    """Before loading: a policy other than never needs a mixture-of-experts model (``dense``: what says it is
    not one) with fewer experts resident than all (else no miss)."""
    if policy not in CPU_EXPERT_POLICIES:
        raise ValueError(f"moe_cpu_experts must be never, auto or always, got {policy!r}")
    if policy != "never" and dense is not None:
        raise ValueError(f"--moe-cpu-experts {policy} is for mixture-of-experts models; {dense}: drop the flag")
    if policy != "never" and expert_cache_size is None:
        raise ValueError(f"--moe-cpu-experts {policy}: every expert is resident, so none misses: drop the flag "
                         f"or keep fewer experts on the device (--moe-expert-cache-size)")


def set_cpu_experts(model, policy: str) -> None:
    """Where each MoE layer runs a missed expert: ``never`` (copy it in), ``always`` (on the host) or
    ``auto`` (the cheaper by HostExpertCost, measured here once; on a CPU device ``auto`` is
    ``never``: the slots are host memory, there is no link to save).

    Refused in one line for a policy other than never when every expert is resident (no misses)."""
    blocks = [block for block in model.moe_blocks() if block.experts.cache.host]
    check_cpu_experts(policy, blocks[0].experts.cache.num_slots if blocks else None)
    limit = {"never": 0, "always": math.inf}.get(policy)
    cost = None
    if limit is None:
        experts = blocks[0].experts
        if experts.gate_up_proj.is_cuda:
            cost = measure_host_cost(experts)
            limit = cost.host_token_limit(experts.gate_up_proj.shape[2], experts.intermediate_size,
                                          experts.gate_up_proj.element_size())
        else:
            limit = 0
    for block in model.moe_blocks():
        block.experts.cpu_experts = policy
        block.experts.host_token_limit = limit
        block.experts.host_cost = cost  # auto on the grouped kernel: the split of each step's misses


def run_on_host(experts, rows: torch.Tensor, expert: int) -> torch.Tensor:
    """One expert's MLP of ``rows`` from its host weights, returned on rows' device.

    On CUDA the two copies are the path's only synchronisation: the copy to the host
    waits for the compute stream to produce the rows, the copy back is an ordinary
    host-to-device copy the stream orders before the rows' next reader."""
    return host_mlp(experts, rows.to("cpu"), expert).to(rows.device)


def host_mlp(experts, rows: torch.Tensor, expert: int) -> torch.Tensor:
    """One expert's MLP of host ``rows`` from its host weights, in one matmul a projection."""
    host = experts.cache.host
    return F.linear(silu_and_mul_torch(F.linear(rows, host["gate_up_proj"][expert])), host["down_proj"][expert])

