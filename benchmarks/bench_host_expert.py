"""Where a host-run expert's time goes (#21, --moe-cpu-experts auto): one layer's host pairs as a
decode step runs them, under the conditions a step puts them in.

A cut decode graph's host step (mempath.model.moe_slots.SlotStep) waits for the device to reach
the router, issues the misses' copies, then runs its share of the misses on the host
(``fill_host_pairs``). Start-up times the same function back to back (``measure_host_cost``);
inside a step an expert has cost 1.4-1.5 times that (BENCHMARKS.md, thirty-seventh session).
This times one layer's host pairs (``--experts`` experts, one token) after each of:

- ``hot``: nothing, back to back (start-up's condition);
- ``sleep``: an idle host for ``--idle-us`` (the thread pool's workers go to sleep);
- ``device_wait``: a wait for the device, as the step's read-back (a CUDA event's synchronize
  after ``--idle-us`` of device work);
- ``copies``: the device wait, then a burst of expert copies in flight (the split's other side).

and reports microseconds per expert, at each thread count of ``--threads``, beside the bare
matrix-vector products (no bookkeeping) hot. It also times issuing an expert's copies with the
views made per copy and made once, and a layer's host side with the host pairs after the copies'
issue on one thread (as shipped) or on a worker thread meanwhile (tried in the thirty-eighth
session and slower: BENCHMARKS.md). Run it under ``OMP_WAIT_POLICY=active`` too to see
whether the workers' sleep is what costs. The store is the engine's: huge-page pinned memory.

    python3 benchmarks/bench_host_expert.py            # Qwen3-30B-A3B's expert shape
    python3 benchmarks/bench_host_expert.py --tiny     # checks the script on the CPU
"""
from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import sys
import time
import types
from pathlib import Path

import torch

from mempath.kernels.elementwise_torch import silu_and_mul_torch
from mempath.memory.pinned import pinned_empty
from mempath.model.moe_slots import fill_host_pairs


def store(num_experts: int, hidden: int, intermediate: int) -> dict:
    make = pinned_empty if torch.cuda.is_available() else (lambda shape, dtype: torch.empty(shape, dtype=dtype))
    host = {"gate_up_proj": make((num_experts, 2 * intermediate, hidden), torch.bfloat16),
            "down_proj": make((num_experts, hidden, intermediate), torch.bfloat16)}
    for tensor in host.values():
        tensor.copy_(torch.randn(tensor.shape, dtype=torch.bfloat16))
    return host


def wait_for_device(idle_us: float, cuda: bool) -> None:
    if not cuda:
        time.sleep(idle_us / 1e6)
        return
    torch.cuda._sleep(int(idle_us * CYCLES_PER_US))
    event = torch.cuda.Event()
    event.record()
    event.synchronize()


CYCLES_PER_US = 1800.0  # the spin kernel's clock; measured in main() on CUDA


def calibrate_spin() -> float:
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return 1_000_000 / (start.elapsed_time(end) * 1e3)


def time_layers(args, host, condition: str, slot, cuda: bool) -> float:
    """Microseconds per expert of one layer's host pairs after ``condition``, over ``--layers`` layers."""
    experts = types.SimpleNamespace(cache=types.SimpleNamespace(host=host))
    num_experts, hidden = host["gate_up_proj"].shape[0], host["gate_up_proj"].shape[2]
    top_k = 8
    x = torch.randn(1, hidden, dtype=torch.bfloat16)
    weights = torch.rand(1, top_k)
    pairs, mask = torch.empty(top_k, hidden), torch.empty(top_k, dtype=torch.bool)
    order = itertools.cycle(range(num_experts))
    total = issue = 0.0
    for layer in range(args.layers + 1):
        ids = [next(order) for _ in range(top_k)]
        on_host = set(ids[:args.experts])
        if condition == "sleep":
            time.sleep(args.idle_us / 1e6)
        elif condition in ("device_wait", "copies"):
            wait_for_device(args.idle_us, cuda)
        if condition == "copies" and slot is not None:
            issued = time.perf_counter()
            for expert in ids[args.experts:args.experts + 4]:
                slot["gate_up_proj"][0].copy_(host["gate_up_proj"][expert], non_blocking=True)
                slot["down_proj"][0].copy_(host["down_proj"][expert], non_blocking=True)
            if layer:
                issue += time.perf_counter() - issued
        start = time.perf_counter()
        fill_host_pairs(experts, x, weights, ids, top_k, on_host, pairs, mask)
        if layer:  # the first is a warm-up
            total += time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()
    ISSUED[condition] = issue / (args.layers * 4) * 1e6
    return total / (args.layers * args.experts) * 1e6


ISSUED: dict[str, float] = {}  # microseconds to issue one expert's copies (two copy calls), by condition


def issue_us(args, host, slot, cuda: bool, cached: bool) -> float:
    """One expert's copy calls after a device wait, with each call's views made then (as
    Experts.load_into_slot does) or made once beforehand."""
    if slot is None:
        return None
    names = ("gate_up_proj", "down_proj")
    num_experts = host["gate_up_proj"].shape[0]
    views = {name: list(host[name].unbind(0)) for name in names}
    slots = {name: list(slot[name].unbind(0)) for name in names}
    order = itertools.cycle(range(num_experts))
    total = 0.0
    for layer in range(args.layers + 1):
        wait_for_device(args.idle_us, cuda)
        start = time.perf_counter()
        for s in range(4):
            expert = next(order)
            for name in names:
                if cached:
                    slots[name][s].copy_(views[name][expert], non_blocking=True)
                else:
                    slot[name][s].copy_(host[name][expert], non_blocking=True)
        if layer:
            total += time.perf_counter() - start
    torch.cuda.synchronize()
    return total / (args.layers * 4) * 1e6


def bare_us(args, host) -> float:
    """One expert's two matrix-vector products and the activation, back to back, no bookkeeping."""
    gate_up, down = host["gate_up_proj"], host["down_proj"]
    x = torch.randn(gate_up.shape[2], dtype=torch.bfloat16)
    order = itertools.cycle(range(gate_up.shape[0]))
    torch.mv(down[0], silu_and_mul_torch(torch.mv(gate_up[0], x)))
    start = time.perf_counter()
    for _ in range(args.layers):
        e = next(order)
        torch.mv(down[e], silu_and_mul_torch(torch.mv(gate_up[e], x)))
    return (time.perf_counter() - start) / args.layers * 1e6


def layer_wall_us(args, host, slot, cuda: bool, overlapped: bool) -> float:
    """A layer's host side after the device wait: the copies of four misses issued and ``--experts``
    run on the host, one after the other (as the step runs them) or the host pairs on a worker
    thread while this one issues the copies; microseconds a layer."""
    experts = types.SimpleNamespace(cache=types.SimpleNamespace(host=host))
    num_experts, hidden = host["gate_up_proj"].shape[0], host["gate_up_proj"].shape[2]
    top_k = 8
    x, weights = torch.randn(1, hidden, dtype=torch.bfloat16), torch.rand(1, top_k)
    pairs, mask = torch.empty(top_k, hidden), torch.empty(top_k, dtype=torch.bool)
    order = itertools.cycle(range(num_experts))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    total = 0.0
    for layer in range(args.layers + 1):
        ids = [next(order) for _ in range(top_k)]
        on_host = set(ids[:args.experts])
        wait_for_device(args.idle_us, cuda)
        start = time.perf_counter()
        work = pool.submit(fill_host_pairs, experts, x, weights, ids, top_k, on_host, pairs, mask) if overlapped \
            else None
        if slot is not None:
            for s, expert in enumerate(ids[args.experts:args.experts + 4]):
                slot["gate_up_proj"][s].copy_(host["gate_up_proj"][expert], non_blocking=True)
                slot["down_proj"][s].copy_(host["down_proj"][expert], non_blocking=True)
        if work is None:
            fill_host_pairs(experts, x, weights, ids, top_k, on_host, pairs, mask)
        else:
            work.result()
        if layer:
            total += time.perf_counter() - start
    pool.shutdown()
    if cuda:
        torch.cuda.synchronize()
    return total / args.layers * 1e6


def load_into_slot_us(args, cuda: bool) -> dict:
    """``Experts.load_into_slot`` itself, shipped and as of the thirty-seventh session (bench_moe's copy), after
    a device wait each time: microseconds to issue one expert's copies (on the CPU: to make them)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_moe import _s37_load_into_slot
    from mempath.kernels.dispatch import torch_kernels
    from mempath.model.moe import Experts
    num_experts, hidden, intermediate = (16, 64, 32) if args.tiny else (128, 2048, 768)
    experts = Experts(num_experts, hidden, intermediate, torch_kernels()).to(torch.bfloat16)
    experts.set_resident(8, pin_memory=cuda)
    if cuda:
        experts.to("cuda")
    out = {}
    for name, load in (("load_into_slot_us", Experts.load_into_slot), ("load_into_slot_s37_us", _s37_load_into_slot)):
        total = 0.0
        for layer in range(args.layers + 1):
            wait_for_device(args.idle_us, cuda)
            start = time.perf_counter()
            for s in range(4):
                load(experts, (layer * 4 + s) % num_experts, s)
            if layer:
                total += time.perf_counter() - start
        out[name] = total / (args.layers * 4) * 1e6
    if cuda:
        torch.cuda.synchronize()
    return out


def main() -> int:
    global CYCLES_PER_US
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes (checks the script runs)")
    parser.add_argument("--experts", type=int, default=2, help="host-run experts a layer (a uniform split: ~1.8)")
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--idle-us", type=float, default=700.0, help="the wait before each layer (a step's: ~700)")
    parser.add_argument("--threads", default="", help="torch thread counts to try, e.g. 16,8,4 (default: torch's)")
    parser.add_argument("--out", default=None, help="append the result lines to this file")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    num_experts, hidden, intermediate = (8, 64, 32) if args.tiny else (128, 2048, 768)
    if args.tiny:
        args.layers = min(args.layers, 4)
    host = store(num_experts, hidden, intermediate)
    slot = None
    if cuda:
        CYCLES_PER_US = calibrate_spin()
        slot = {name: torch.empty((4, *tensor.shape[1:]), dtype=tensor.dtype, device="cuda")
                for name, tensor in host.items()}
    counts = [int(n) for n in args.threads.split(",") if n] or [torch.get_num_threads()]
    lines = []
    for threads in counts:
        torch.set_num_threads(threads)
        line = {"bench": "host_expert", "threads": threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                "experts_a_layer": args.experts, "idle_us": args.idle_us, "bare_us": bare_us(args, host)}
        for condition in ("hot", "sleep", "device_wait", "copies"):
            line[f"{condition}_us"] = time_layers(args, host, condition, slot, cuda)
        line["issue_us_in_copies"] = ISSUED["copies"] if slot is not None else None
        line["issue_us_fresh_views"] = issue_us(args, host, slot, cuda, cached=False)
        line["issue_us_cached_views"] = issue_us(args, host, slot, cuda, cached=True)
        line.update(load_into_slot_us(args, cuda))
        line["layer_serial_us"] = layer_wall_us(args, host, slot, cuda, overlapped=False)
        line["layer_overlapped_us"] = layer_wall_us(args, host, slot, cuda, overlapped=True)
        lines.append(line)
        print("RESULT " + json.dumps(line), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
