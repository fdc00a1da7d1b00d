"""Mixture-of-experts decode on the H200 (random bf16 weights): the expert cache and the grouped kernel.

    python benchmarks/bench_moe.py                         # CUDA: every part, the issue #21 targets
    python benchmarks/bench_moe.py --parts pinned,offload  # some parts
    python benchmarks/bench_moe.py --tiny                  # CPU: tiny shapes, checks the script runs

Parts (``--parts``, comma-separated):

pinned    the pinned host-to-device bandwidth, copying one expert (all three projections
          of one layer) at a time as the cache does, and the device's read bandwidth
          (a large device-to-device copy, bytes read + written per second), both measured
          in this run.
offload   the Qwen3-30B-A3B shape with a 16 GB weight budget (the non-expert weights plus
          --moe-expert-cache-gb for the slots), batch-1 decode tokens/s with three routers:
          the model's (random weights: hit_rate says how concentrated its routing is), the
          synthetic uniform one (mempath.model.moe.synthetic_uniform_router: no locality, the
          cache's worst case) and the synthetic skewed one (synthetic_router_bias, skew 1.0).
          Each against the bound copied-bytes-per-token / pinned bandwidth and against the
          planner's prediction (memory.formulas.moe_offload_tokens_per_second, from the hit
          rate and the all-resident step time measured here). On CUDA decode runs on graphs
          cut at the MoE layers (mempath/engine/piecewise.py); the model router's tokens are
          compared with the all-resident run's (the same kernels: they must be identical;
          with --cpu-experts auto or always the host's matmuls of the misses it runs round
          differently from the device's, so a near-tie can decode another token).
resident  Qwen3-30B-A3B and Mixtral-8x7B shapes with every expert resident (the grouped
          kernel, decode CUDA graphs), batch-1 decode tokens/s against the active-weight
          read limit (bytes one token reads / the device read bandwidth). ``--variants
          no-router-kernel`` measures each again with the router's logits from F.linear (the
          matmul library) instead of the router kernel, in the same run.

Each result is one JSON line (prefix ``RESULT``), naming the router that produced it.
"""
import argparse
import atexit
import contextlib
import dataclasses
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mempath import LLM, SamplingParams  # noqa: E402
from mempath.memory.formulas import (expert_bytes, moe_missed_bytes_per_token,  # noqa: E402
                                     moe_offload_tokens_per_second, read_shape, weight_bytes)
from mempath.memory.pinned import pinned_empty, transparent_huge_pages  # noqa: E402
from mempath.kernels.elementwise_torch import silu_and_mul_torch  # noqa: E402
from mempath.model import moe, moe_host, moe_slots  # noqa: E402
from mempath.model.moe_host import set_cpu_experts  # noqa: E402
from mempath.model.moe import (expert_cache_stats, set_expert_prefetch, synthetic_router_bias,  # noqa: E402
                               synthetic_uniform_router)
from mempath.tools.plan import plan_memory  # noqa: E402

CONFIGS = ROOT / "tests" / "data" / "configs"
QWEN3_30B = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
MIXTRAL = json.loads((CONFIGS / "mixtral-8x7b-v0.1.json").read_text())
TINY = {"hidden_size": 64, "moe_intermediate_size": 48, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "num_experts": 16,
        "num_experts_per_tok": 4}
TINY_MIXTRAL = {**TINY, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48}
WEIGHT_BUDGET = 16e9  # the issue's weight budget for the offloaded Qwen3-30B-A3B


def result(part: str, **figures) -> dict:
    line = {"part": part, **figures}
    print("RESULT " + json.dumps(line), flush=True)
    return line


def model_dir(name: str, config: dict) -> str:
    directory = Path(tempfile.mkdtemp(prefix=f"mempath-moe-{name}-"))
    atexit.register(shutil.rmtree, directory, True)  # the bench made it: gone when it exits
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def engine(path: str, args, **extra) -> LLM:
    """An engine; the previous one (engines hold reference cycles) is collected first."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        # PyTorch keeps freed pinned memory for reuse; the loader's host-memory check sees it as taken.
        getattr(torch._C, "_host_emptyCache", lambda: None)()
    return LLM(path, load_format="dummy", dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
               max_num_seqs=4, max_num_batched_tokens=args.max_model_len, enable_prefix_caching=False,
               show_progress=False, **extra)


def sync(llm: LLM) -> None:
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()


def decode(llm: LLM, args) -> tuple[float, list[int], dict]:
    """(decode tokens/s of one request after its prefill step, its tokens, the expert counters at the
    first decode step): one warm-up request first; the prompt's step is neither timed nor counted."""
    prompt = np.random.default_rng(0).integers(0, llm.engine.spec.vocab_size, args.prompt_len).tolist()
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=args.output_len + 1, temperature=0, ignore_eos=True))
    tokens = []
    engine.step()  # the prefill (and its first token)
    sync(llm)
    counters = expert_cache_stats(engine.model)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens = output.token_ids
    sync(llm)
    return args.output_len / (time.perf_counter() - start), tokens, counters




# ---------------------------------------------------------------- pinned / device bandwidth


def part_pinned(args, shape) -> dict:
    per_expert = 3 * shape.hidden_size * shape.moe_intermediate_size
    device = torch.device(args.device)
    pin = device.type == "cuda"
    host = torch.empty(args.copies, per_expert, dtype=torch.bfloat16, pin_memory=pin).normal_()
    slot = torch.empty(per_expert, dtype=torch.bfloat16, device=device)
    for i in range(4):
        slot.copy_(host[i], non_blocking=True)
    synchronize(device)
    start = time.perf_counter()
    for i in range(args.copies):
        slot.copy_(host[i], non_blocking=True)
    synchronize(device)
    h2d = args.copies * per_expert * 2 / (time.perf_counter() - start)
    big = torch.empty(args.device_copy_bytes // 2, dtype=torch.bfloat16, device=device)
    other = torch.empty_like(big)
    other.copy_(big)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        other.copy_(big)
    synchronize(device)
    # Bytes read + written per second, as bench_engine.copy_bandwidth counts them: the rate a
    # read-only stream (a decode step's weights) gets from the same memory.
    read = 2 * 5 * big.numel() * 2 / (time.perf_counter() - start)
    del big, other
    split = split_copies(args, shape, host, slot, device)
    return result("pinned", expert_bytes=per_expert * 2, h2d_GBps=h2d / 1e9, device_read_GBps=read / 1e9,
                  pinned=pin, copies=args.copies, **split, **host_expert_seconds(shape, args.tiny),
                  host_threads=torch.get_num_threads())


def split_copies(args, shape, host, slot, device) -> dict:
    """The cache's own copy pattern: each expert as two copies (gate/up, then down), on one stream
    and spread over two (GB/s); on the CPU, the one-stream figure only."""
    gate_up = 2 * shape.hidden_size * shape.moe_intermediate_size
    figures = {}
    for streams in ((None,), (torch.cuda.Stream(), torch.cuda.Stream())) if device.type == "cuda" else ((None,),):
        synchronize(device)
        start = time.perf_counter()
        for i in range(args.copies):
            with torch.cuda.stream(streams[i % len(streams)]) if streams[0] is not None else _nothing():
                slot[:gate_up].copy_(host[i, :gate_up], non_blocking=True)
                slot[gate_up:].copy_(host[i, gate_up:], non_blocking=True)
        synchronize(device)
        figures[f"h2d_split_{len(streams)}_stream_GBps"] = args.copies * host[0].numel() * 2 / (time.perf_counter() - start) / 1e9
    return figures


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def host_expert_seconds(shape, tiny: bool) -> dict:
    """One expert's MLP for one token on the host in bf16 (what --moe-cpu-experts runs), microseconds,
    over 64 experts in turn (a miss's weights come from memory, not the host's caches): by matrix-vector
    products (moe_slots.expert_pairs_torch, the host path) and by one-row F.linear, on pageable memory;
    by products on the driver's pinned memory and on memory/pinned.py's (huge pages), where CUDA is."""
    h, i = shape.hidden_size, shape.moe_intermediate_size
    count = 4 if tiny else 64
    stores = {"pageable": lambda size, dtype: torch.empty(size, dtype=dtype)}
    if torch.cuda.is_available():
        stores["driver_pinned"] = lambda size, dtype: torch.empty(size, dtype=dtype, pin_memory=True)
        stores["huge_pinned"] = pinned_empty
    x = torch.randn(h, dtype=torch.bfloat16)
    linear, silu = torch.nn.functional.linear, torch.nn.functional.silu
    out = {"thp": transparent_huge_pages()}
    for store, make in stores.items():
        gate_up, down = make((count, 2 * i, h), torch.bfloat16), make((count, h, i), torch.bfloat16)
        gate_up.copy_(torch.randn(gate_up.shape, dtype=torch.bfloat16))
        down.copy_(torch.randn(down.shape, dtype=torch.bfloat16))

        def by_mv(e):
            a, b = torch.mv(gate_up[e], x).chunk(2)
            torch.mv(down[e], silu(a) * b)

        def by_linear(e):
            a, b = linear(x[None], gate_up[e]).chunk(2, dim=-1)
            linear(silu(a) * b, down[e])
        for name, run in (("mv", by_mv), ("linear", by_linear)) if store == "pageable" else (("mv", by_mv),):
            run(0)
            start = time.perf_counter()
            for call in range(4 * count):
                run(call % count)
            out[f"host_expert_{name}_{store}_us"] = (time.perf_counter() - start) / (4 * count) * 1e6
        del gate_up, down
        gc.collect()
    return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- offloaded experts


def part_offload(args, config: dict, bandwidth: dict) -> list[dict]:
    path = model_dir("offload", config)
    shape = read_shape(config)
    b = torch.finfo(getattr(torch, args.dtype)).bits // 8
    every, _ = expert_bytes(shape, b)
    non_expert = weight_bytes(shape, b)["total"] - every
    slots_gb = (args.weight_budget - non_expert) / (1 << 30)
    plan = plan_memory(path, dtype=args.dtype, moe_expert_cache_gb=slots_gb)
    # The reference: every expert resident, the same kernels (decode graphs on CUDA). Its step
    # time is the planner's resident step; its tokens are what the offloaded run must give.
    resident = engine(path, args)
    resident_rate, resident_tokens, _ = decode(resident, args)
    del resident
    llm = engine(path, args, moe_expert_cache_gb=slots_gb, moe_cpu_experts=args.cpu_experts)
    set_expert_prefetch(llm.engine.model, False)  # decode graphs do not prefetch; eager steps would
    cost = llm.engine.model.moe_blocks()[0].experts.host_cost  # auto's measured rates (None otherwise)
    rates = {} if cost is None else dict(
        host_row_us=cost.host_row_seconds * 1e6, sync_us=cost.sync_seconds * 1e6, issue_us=cost.issue_seconds * 1e6,
        copy_us=cost.copy_seconds(shape.hidden_size, shape.moe_intermediate_size, b) * 1e6)
    out = []
    # Seconds per MoE layer of a cut graph's host step: measured on the model router's run. Under auto
    # it also holds that run's few host-run experts (0.03-0.08 a token on the H200), which the split
    # prediction counts again: a few microseconds a token.
    cut = 0.0
    for router in args.routers.split(","):
        set_router(llm, router)
        with HostStepClock() as clock:
            rate, tokens, before = decode(llm, args)
        after = expert_cache_stats(llm.engine.model)
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        hit_rate = hits / (hits + misses)
        # The bound: the bytes this run copied at the pinned bandwidth.
        copied = (after["bytes_loaded"] - before["bytes_loaded"]) / args.output_len
        bound = bandwidth["h2d_GBps"] * 1e9 / copied if copied else float("inf")
        # The issue's bound: every missed expert's bytes at the pinned rate, whether it was copied or
        # (--cpu-experts auto) run on the host while the others were copied.
        missed = moe_missed_bytes_per_token(shape, b, hit_rate)
        missed_bound = bandwidth["h2d_GBps"] * 1e9 / missed if missed else float("inf")
        if router == "model" and llm.engine.runner.graphs:
            cut = max(0.0, 1 / rate - 1 / resident_rate - copied / (bandwidth["h2d_GBps"] * 1e9)) / shape.num_moe_layers
        predicted = moe_offload_tokens_per_second(shape, b, hit_rate, bandwidth["h2d_GBps"] * 1e9, 1.0 / resident_rate)
        split = {} if cost is None else dict(host_row_seconds=cost.host_row_seconds, sync_seconds=cost.sync_seconds,
                                             issue_seconds=cost.issue_seconds)
        predicted_with_cuts = moe_offload_tokens_per_second(shape, b, hit_rate, bandwidth["h2d_GBps"] * 1e9,
                                                            1.0 / resident_rate, cut, **split)
        out.append(result(
            "offload", model=config["architectures"][0], router=after["router"],
            cuda_graphs=sorted(llm.engine.runner.graphs), weight_budget_GB=args.weight_budget / 1e9,
            experts_per_layer=after["num_slots"], of=shape.num_experts,
            planned_resident_weight_GB=plan.resident_weight_bytes / 1e9,
            decode_tok_s=rate, hit_rate=hit_rate, bound_tok_s=bound, copied_GB_per_token=copied / 1e9,
            missed_GB_per_token_formula=moe_missed_bytes_per_token(shape, b, hit_rate) / 1e9,
            of_bound=rate / bound if copied else None, missed_bound_tok_s=missed_bound,
            of_missed_bound=rate / missed_bound if missed else None,
            predicted_tok_s=predicted, predicted_error=(predicted - rate) / rate,
            cut_us_per_layer=cut * 1e6, predicted_with_cuts_tok_s=predicted_with_cuts,
            predicted_with_cuts_error=(predicted_with_cuts - rate) / rate,
            all_resident_tok_s=resident_rate,
            tokens_identical_to_all_resident=tokens == resident_tokens if router == "model" else None,
            cpu_experts=args.cpu_experts, host_store=args.host_store, host_token_limit=after["host_token_limit"],
            host_experts_per_token=(after["host_experts"] - before["host_experts"]) / args.output_len,
            host_pairs_us_per_expert=clock.seconds["host_pairs"] / (after["host_experts"] - before["host_experts"])
            * 1e6 if after["host_experts"] > before["host_experts"] else None,
            target_tok_s={"model": None, "uniform": 17, "skewed": 40}[router], **rates,
            host_row_us_learned=after["host_row_us"], **clock.per_layer()))
    if args.host_path_ab:
        out += alternating_ab(llm, args, "host-path-ab", args.host_path_ab,
                              {"this tree": contextlib.nullcontext, "s37 host path": s37_host_path})
    if args.row_learning_ab:
        out += alternating_ab(llm, args, "row-learning-ab", args.row_learning_ab,
                              {"rows learned": contextlib.nullcontext, "start-up rows": start_up_rows})
    out.append(result("offload-store", **store_copy_rate(llm, args)))
    del llm
    return out


def _s37_load_into_slot(self, expert: int, slot: int) -> int:
    """Experts.load_into_slot as shipped until the thirty-eighth session: two views made per copy."""
    host = self.cache.host
    with torch.no_grad():
        self.gate_up_proj[slot].copy_(host["gate_up_proj"][expert], non_blocking=True)
        self.down_proj[slot].copy_(host["down_proj"][expert], non_blocking=True)
    return self.expert_bytes()


def _s37_fill_host_pairs(experts, x, router_weights, expert_ids, top_k, on_host, pairs, mask) -> int:
    """moe_slots.fill_host_pairs as shipped until the thirty-eighth session: index tensors, then the twin."""
    mask.zero_()
    chosen = [p for p, e in enumerate(expert_ids) if e in on_host]
    if not chosen:
        return 0
    index = torch.tensor(chosen)
    host = experts.cache.host
    pairs[index] = moe_slots.expert_pairs_torch(
        x[index // top_k], router_weights.reshape(-1)[index].unsqueeze(1),
        torch.tensor([expert_ids[p] for p in chosen]).unsqueeze(1), host["gate_up_proj"], host["down_proj"],
        silu_and_mul_torch)
    mask[index] = True
    return len(chosen)


@contextlib.contextmanager
def s37_host_path():
    """The host path of a split (the copy calls, the host-run pairs) as it was before this session."""
    saved = moe.Experts.load_into_slot, moe_slots.fill_host_pairs, moe_host.fill_host_pairs
    moe.Experts.load_into_slot = _s37_load_into_slot
    moe_slots.fill_host_pairs = moe_host.fill_host_pairs = _s37_fill_host_pairs
    try:
        yield
    finally:
        moe.Experts.load_into_slot, moe_slots.fill_host_pairs, moe_host.fill_host_pairs = saved


@contextlib.contextmanager
def start_up_rows():
    """The split's per-row time held at start-up's measurement (the cost model as it was before the
    thirty-ninth session): the cost measured inside takes no weight for the steps' rows."""
    saved, moe_host.ROW_WEIGHT = moe_host.ROW_WEIGHT, 0.0
    try:
        yield
    finally:
        moe_host.ROW_WEIGHT = saved


def alternating_ab(llm: LLM, args, part: str, rounds: int, variants: dict) -> list[dict]:
    """The uniform router's decode under auto with each variant (name -> a context manager factory) in turn,
    ``rounds`` times on the one engine, start-up's costs measured again inside each (so each split follows
    its own variant)."""
    out = []
    set_router(llm, "uniform")
    for round_ in range(rounds):
        for variant, within in variants.items():
            with within():
                set_cpu_experts(llm.engine.model, "auto")
                cost = llm.engine.model.moe_blocks()[0].experts.host_cost
                measured = dataclasses.replace(cost) if cost else None  # the split's per-row time moves
                with HostStepClock() as clock:
                    rate, _, before = decode(llm, args)
                after = expert_cache_stats(llm.engine.model)
            host_experts = after["host_experts"] - before["host_experts"]
            out.append(result(part, router="synthetic uniform", variant=variant, round=round_,
                              decode_tok_s=rate, host_experts_per_token=host_experts / args.output_len,
                              host_row_us=measured.host_row_seconds * 1e6 if cost else None,  # None: the CPU
                              issue_us=measured.issue_seconds * 1e6 if cost else None,
                              host_row_us_learned=after["host_row_us"],
                              host_pairs_us_per_expert=clock.seconds["host_pairs"] / host_experts * 1e6
                              if host_experts else None, **clock.per_layer()))
    return out


class HostStepClock:
    """Host time of the cut graphs' host steps while it is active, per step: in all (the read-back
    wait included), in the cache's bookkeeping and copy issue (book_one_wave), in the copy calls
    alone (Experts.load_into_slot, inside the bookkeeping) and in the host-run pairs (under auto:
    SlotTable.write_host_pairs, the host's experts and their upload)."""

    TIMED = {"step": (moe_slots.SlotStep, "__call__"), "book": (moe_slots, "book_one_wave"),
             "load": (moe.Experts, "load_into_slot"), "host_pairs": (moe_slots.SlotTable, "write_host_pairs")}

    def __enter__(self):
        self.steps, self.loads = 0, 0
        self.seconds = dict.fromkeys(self.TIMED, 0.0)
        self.inner = {name: getattr(owner, attr) for name, (owner, attr) in self.TIMED.items()}
        for name, (owner, attr) in self.TIMED.items():
            setattr(owner, attr, self._timed(name, self.inner[name]))
        return self

    def _timed(self, name, inner):
        clock = self

        def timed(*a, **k):
            start = time.perf_counter()
            out = inner(*a, **k)
            clock.seconds[name] += time.perf_counter() - start
            clock.steps += name == "step"
            clock.loads += name == "load"
            return out
        return timed

    def __exit__(self, *exc):
        for name, (owner, attr) in self.TIMED.items():
            setattr(owner, attr, self.inner[name])
        return False

    def per_layer(self) -> dict:
        if not self.steps:
            return {}
        us = {f"host_{name}_us": seconds / self.steps * 1e6 for name, seconds in self.seconds.items()}
        us["host_load_us_per_copy"] = self.seconds["load"] / self.loads * 1e6 if self.loads else None
        return {**us, "host_steps": self.steps}


def store_copy_rate(llm: LLM, args) -> dict:
    """Copies of random experts from the cache's own host stores into a slot (the bench's pinned
    rate copies a fresh 3.7 GB buffer; the stores hold every expert of every layer). The slot is
    left holding junk, so this runs last, on an engine about to be dropped."""
    blocks = llm.engine.model.moe_blocks()
    if not blocks[0].experts.cache.host:
        return {}
    rng = np.random.default_rng(0)
    picks = [(blocks[rng.integers(len(blocks))].experts, int(rng.integers(blocks[0].num_experts))) for _ in range(args.copies)]
    sync(llm)
    start = time.perf_counter()
    for experts, expert in picks:
        experts.load_into_slot(expert, 0)
    sync(llm)
    seconds = time.perf_counter() - start
    return {"store_h2d_GBps": args.copies * blocks[0].experts.expert_bytes() / seconds / 1e9, "copies": args.copies}


def set_router(llm: LLM, router: str) -> None:
    """The routing the next run measures; decode graphs are recaptured, since the pieces hold it."""
    model = llm.engine.model
    if router == "model":
        synthetic_router_bias(model, skew=None)
    elif router == "uniform":
        synthetic_uniform_router(model, seed=0)
    else:
        synthetic_router_bias(model, skew=1.0, seed=0)
    runner = llm.engine.runner
    if runner.graphs:
        runner.graphs.clear()
        torch.cuda.empty_cache()
        runner.capture_cuda_graphs()


# ---------------------------------------------------------------- every expert resident


@contextlib.contextmanager
def without_router_kernel():
    """Engines built inside take the router's logits from F.linear (their Kernels without router_logits)."""
    from mempath.kernels import dispatch
    original = dispatch.triton_kernels
    dispatch.triton_kernels = lambda: dataclasses.replace(original(), router_logits=None)
    try:
        yield
    finally:
        dispatch.triton_kernels = original


@contextlib.contextmanager
def without_chain_pdl():
    """Route, align and the grouped GEMMs launched without programmatic dependent launch (as before)."""
    from mempath.kernels import moe_triton
    moe_triton.MOE_CHAIN_PDL = False
    try:
        yield
    finally:
        moe_triton.MOE_CHAIN_PDL = True


@contextlib.contextmanager
def aligned_one_token():
    """A single token's pairs sorted by the align launch, as any batch's (before: one pair a block, unsorted)."""
    from mempath.kernels import moe_triton
    moe_triton.ONE_TOKEN_UNALIGNED = False
    try:
        yield
    finally:
        moe_triton.ONE_TOKEN_UNALIGNED = True


RESIDENT_VARIANTS = {"no-router-kernel": without_router_kernel, "no-chain-pdl": without_chain_pdl,
                     "aligned-one-token": aligned_one_token}


RESIDENT_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b")  # --resident-models, in the order of main's (qwen, mixtral)


def part_resident(args, configs: list[dict], bandwidth: dict) -> list[dict]:
    out = []
    for config in configs:
        path = model_dir("resident", config)
        shape = read_shape(config)
        b = torch.finfo(getattr(torch, args.dtype)).bits // 8
        plan = plan_memory(path, dtype=args.dtype)
        active_bytes = plan.read_bytes_per_token  # an untied embedding table: one row a token
        limit = bandwidth["device_read_GBps"] * 1e9 / active_bytes
        reference = None
        for variant in [None] + args.variants:
            with RESIDENT_VARIANTS[variant]() if variant else contextlib.nullcontext():  # a choice read at run time too
                llm = engine(path, args)
                graphs = bool(llm.engine.runner.graphs)
                rate, tokens, _ = decode(llm, args)
                del llm
            reference = tokens if variant is None else reference
            out.append(result("resident", model=config["architectures"][0], router="model", variant=variant,
                              decode_tok_s=rate, cuda_graphs=graphs, active_GB_per_token=active_bytes / 1e9,
                              read_limit_tok_s=limit, of_limit=rate / limit, target_of_limit=0.8,
                              layers=shape.num_layers,
                              tokens_identical_to_default=None if variant is None else tokens == reference))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="pinned,offload,resident")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--routers", default="model,uniform,skewed",
                        help="the offload part's routers, of model, uniform and skewed")
    parser.add_argument("--cpu-experts", default="never", choices=("never", "auto", "always"),
                        help="the offloaded runs' --moe-cpu-experts (where a missed expert runs)")
    parser.add_argument("--host-store", default="huge", choices=("huge", "driver"),
                        help="the experts' host store: the engine's (huge pages, memory/pinned.py) or the "
                             "driver's pinned allocator (torch pin_memory), for comparison")
    parser.add_argument("--variants", type=lambda text: text.split(","), default=[],
                        help=f"the resident part again with one choice flipped: {', '.join(RESIDENT_VARIANTS)}")
    parser.add_argument("--host-path-ab", type=int, default=0, metavar="ROUNDS",
                        help="with --cpu-experts auto: ROUNDS of the uniform router's decode with this tree's "
                             "host path and the s37 one, alternately, on the offloaded engine")
    parser.add_argument("--row-learning-ab", type=int, default=0, metavar="ROUNDS",
                        help="with --cpu-experts auto: ROUNDS of the uniform router's decode with the split's "
                             "per-row time learned from the steps and held at start-up's, alternately")
    parser.add_argument("--resident-models", type=lambda text: text.split(","), default=list(RESIDENT_MODELS),
                        help="the resident part's shapes (Mixtral-8x7B's 93 GB fits an H200, not an 80 GB card)")
    args = parser.parse_args()
    if set(args.resident_models) - set(RESIDENT_MODELS):
        parser.error(f"--resident-models takes {', '.join(RESIDENT_MODELS)}; got {','.join(args.resident_models)}")
    if set(args.variants) - set(RESIDENT_VARIANTS):
        parser.error(f"--variants takes {', '.join(RESIDENT_VARIANTS)}; got {','.join(args.variants)}")
    if args.host_store == "driver":
        moe.pinned_empty = lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=True)
    parts = set(args.parts.split(","))
    if not parts <= {"pinned", "offload", "resident"}:
        parser.error(f"--parts takes pinned, offload, resident; got {args.parts}")
    if not set(args.routers.split(",")) <= {"model", "uniform", "skewed"}:
        parser.error(f"--routers takes model, uniform, skewed; got {args.routers}")
    args.device = "cpu" if args.tiny else "cuda"
    args.dtype = "float32" if args.tiny else "bfloat16"
    args.max_model_len = 256 if args.tiny else 1024
    args.copies = 16 if args.tiny else 400
    args.device_copy_bytes = 64 << 20 if args.tiny else 8 << 30
    qwen = {**QWEN3_30B, **TINY} if args.tiny else QWEN3_30B
    mixtral = {**MIXTRAL, **TINY_MIXTRAL} if args.tiny else MIXTRAL
    if args.tiny:
        non_expert = weight_bytes(read_shape(qwen), 4)["total"] - expert_bytes(read_shape(qwen), 4)[0]
        args.weight_budget = non_expert + expert_bytes(read_shape(qwen), 4)[0] * 6 // 16  # 6 of 16 experts
    else:
        args.weight_budget = WEIGHT_BUDGET
    # The bandwidths the bounds use are this run's, whatever parts are asked for.
    bandwidth = part_pinned(args, read_shape(qwen))
    if "offload" in parts:
        part_offload(args, qwen, bandwidth)
    if "resident" in parts:
        shapes = dict(zip(RESIDENT_MODELS, (qwen, mixtral)))
        part_resident(args, [shapes[m] for m in args.resident_models], bandwidth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
