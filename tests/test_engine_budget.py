"""The CUDA KV-budget arithmetic, on the CPU: torch.cuda's memory calls replaced by a
scripted device, the engine's own methods run against it.

What the budget must leave out of the KV cache: device use already taken (weights,
context, other processes), the profile step's peak as the allocator reserved it (not
only as it allocated it), the graph pool and the driver memory of captured graphs,
the tiers' staging buffers, and room for growth outside PyTorch; after start-up the
allocator is capped so the total stays within gpu_memory_utilization x total.
"""
import logging
from types import SimpleNamespace

import pytest
import torch

from mempath.engine import startup as startup_module
from mempath.engine.runner import TrialGraphs
from mempath.engine.startup import Startup
from mempath.kv.manager import KVCacheManager
from mempath.kv.tiers.coordinator import STAGING_BLOCKS
from mempath.memory.budget import ALLOCATION_ROUNDING, OUTSIDE_TORCH_GROWTH, DeviceBudget

GiB, MiB = 1 << 30, 1 << 20
TOTAL = 100 * GiB
PER_BLOCK = 2 * MiB


class ScriptedDevice:
    """Allocator and driver figures the engine reads, changed by the fake runner's calls."""

    def __init__(self):
        self.allocated = 10 * GiB  # weights
        self.reserved = 11 * GiB + 512 * MiB  # 1.5 GiB cached, more than the probe's KV takes
        self.outside = 700 * MiB  # context, kernel modules
        self.max_allocated = self.allocated
        self.max_reserved = self.reserved
        self.fraction = None

    def install(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(cuda, "memory_allocated", lambda *a: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda *a: self.reserved)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a: self.max_allocated)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda *a: self.max_reserved)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self.reset_peak)
        monkeypatch.setattr(cuda, "mem_get_info", lambda *a: (TOTAL - self.reserved - self.outside, TOTAL))
        monkeypatch.setattr(cuda, "set_per_process_memory_fraction",
                            lambda fraction, *a: setattr(self, "fraction", fraction))

    def empty_cache(self):
        self.reserved = self.allocated

    def reset_peak(self, *a):
        self.max_allocated, self.max_reserved = self.allocated, self.reserved

    def allocate(self, nbytes):
        cached = self.reserved - self.allocated
        self.allocated += nbytes
        self.reserved += max(0, nbytes - cached)
        self.max_allocated = max(self.max_allocated, self.allocated)
        self.max_reserved = max(self.max_reserved, self.reserved)


class FakeRunner:
    def __init__(self, device: ScriptedDevice, graph_sizes):
        self.device = device
        self.kv_blocks = 0
        self._graph_sizes = graph_sizes
        self.kv_cache = torch.empty(0)

    def allocate_kv_cache(self, num_blocks):
        self.device.allocated -= self.kv_blocks * PER_BLOCK
        self.kv_blocks = num_blocks
        self.device.allocate(num_blocks * PER_BLOCK)
        self.kv_cache = torch.empty(num_blocks * PER_BLOCK, dtype=torch.uint8, device="meta")

    def graph_sizes(self):
        return self._graph_sizes

    def trial_capture_graphs(self):
        # Its trial captures replay decode steps: they read the probe's KV cache (on the
        # H200 an empty one was an illegal memory access).
        assert self.kv_blocks > 0, "trial capture without a KV cache"
        graphs = len(self._graph_sizes)
        return TrialGraphs(200 * MiB, 3 * MiB * graphs, 3 * MiB) if graphs else TrialGraphs(0, 0, 0)


def fake_engine(monkeypatch, *, tiers: bool, eager: bool = False, activation_alloc=2 * GiB,
                activation_reserved=3 * GiB, largest_block=0):
    device = ScriptedDevice()
    device.install(monkeypatch)
    config = SimpleNamespace(max_num_batched_tokens=8192, max_num_seqs=256, block_size=16, enforce_eager=eager,
                             tiers_enabled=tiers, gpu_memory_utilization=0.5)
    budget = DeviceBudget("cuda", int(TOTAL * config.gpu_memory_utilization))
    engine = SimpleNamespace(config=config, device=torch.device("cpu"), budget=budget, tenant="model",
                             ledger=budget.ledger("model"), max_model_len=4096, draft_ledger=None, draft_runner=None,
                             runner=FakeRunner(device, [] if eager else list(range(1, 11))))

    def probe_step(num_tokens, num_seqs):
        # The step allocates activation_alloc at its peak in segments of activation_reserved,
        # carved first out of whatever the allocator already caches.
        cached = device.reserved - device.allocated
        device.max_allocated = max(device.max_allocated, device.allocated + activation_alloc)
        device.reserved += max(0, activation_reserved - cached)
        device.max_reserved = max(device.max_reserved, device.reserved)

    engine.probes = SimpleNamespace(run=probe_step)
    engine.tier_staging_bytes = lambda per_block: Startup.tier_staging_bytes(engine, per_block)
    engine.measure_step_peak = lambda: Startup.measure_step_peak(engine)
    engine.profile_step_size = lambda: Startup.profile_step_size(engine)
    engine.step_largest_block = lambda: largest_block
    engine.warn_if_no_room_for_a_step = lambda room, outside: Startup.warn_if_no_room_for_a_step(engine, room, outside)
    return engine, device


@pytest.mark.parametrize("tiers", [False, True])
def test_kv_blocks_leave_room_for_everything_allocated_after_them(monkeypatch, tiers):
    engine, device = fake_engine(monkeypatch, tiers=tiers)
    blocks = Startup.profile_kv_blocks(engine, PER_BLOCK)
    in_use = 10 * GiB + 700 * MiB  # weights + outside torch, once the probe's cache is emptied
    staging = 2 * STAGING_BLOCKS * PER_BLOCK if tiers else 0
    expected = (TOTAL // 2 - in_use - 3 * GiB - 200 * MiB - 10 * 3 * MiB - staging - OUTSIDE_TORCH_GROWTH
                - ALLOCATION_ROUNDING)  # the allocator's rounding of the cache's tensor
    assert blocks == expected // PER_BLOCK
    ledger = engine.ledger
    # As reserved from an empty cache: more than the 2 GiB it allocated, and not less for
    # the 512 MiB the allocator cached before the step (serving starts with none).
    assert ledger.get("activation_peak") == 3 * GiB
    assert ledger.get("cuda_graphs_driver") == 30 * MiB
    assert ledger.get("cuda_graphs") == 200 * MiB  # the trial captures' pool, measured
    assert ledger.as_dict()["cuda_graphs"]["source"] == "measured"
    assert ledger.get("non_torch") == 700 * MiB
    # A margin kept spare, not a figure derived from a formula: the ledger says which.
    assert ledger.as_dict()["outside_torch_growth"]["source"] == "margin"


def test_the_budget_keeps_a_spare_segment_of_the_steps_largest_tensor(monkeypatch):
    """A serving step can find the last step's largest segment cached and put its first, smaller tensors in
    it; its own largest tensor then needs a fresh segment (an fp8 engine at batch 2 ran out of memory so on
    an H100: BENCHMARKS.md, thirty-fifth session). The KV cache leaves that segment spare beside the peak."""
    engine, _ = fake_engine(monkeypatch, tiers=False)
    plain = Startup.profile_kv_blocks(engine, PER_BLOCK)
    engine, _ = fake_engine(monkeypatch, tiers=False, largest_block=112 * MiB)
    blocks = Startup.profile_kv_blocks(engine, PER_BLOCK)
    assert blocks == plain - 112 * MiB // PER_BLOCK
    spare = engine.ledger.as_dict()["activation_spare"]
    assert spare["bytes"] == 112 * MiB and spare["source"] == "derived"
    assert engine.ledger.get("activation_peak") == 3 * GiB  # the measured peak, apart


def test_the_spare_segment_is_the_profile_steps_largest_tensor():
    """Startup.step_largest_block: the formula at the profile step's tokens and sequences and the model's dtype."""
    from mempath.memory.formulas import read_shape, step_largest_block_bytes
    from mempath.model.spec import ModelSpec
    from tests.test_plan import load
    config = load("llama-3.1-8b")
    spec = ModelSpec.from_hf_config(config)
    startup = SimpleNamespace(config=SimpleNamespace(max_num_batched_tokens=8192, max_num_seqs=2),
                              max_model_len=1008, spec=spec, dtype=torch.bfloat16)
    startup.profile_step_size = lambda: Startup.profile_step_size(startup)
    assert Startup.profile_step_size(startup) == (2016, 2)
    gate_up = 2016 * 2 * 14336 * 2  # the MLP's gate/up output, rounded up to the allocator's 2 MiB
    assert Startup.step_largest_block(startup) == 112 * MiB == -(-gate_up // (2 * MiB)) * 2 * MiB
    assert step_largest_block_bytes(read_shape(config), 2016, 2, 2) == 112 * MiB


def test_allocated_peak_counts_when_it_is_the_larger(monkeypatch):
    engine, _ = fake_engine(monkeypatch, tiers=False, activation_alloc=3 * GiB, activation_reserved=1 * GiB)
    Startup.profile_kv_blocks(engine, PER_BLOCK)
    assert engine.ledger.get("activation_peak") == 3 * GiB


def test_eager_engines_reserve_no_graph_memory(monkeypatch):
    engine, _ = fake_engine(monkeypatch, tiers=False, eager=True)
    blocks = Startup.profile_kv_blocks(engine, PER_BLOCK)
    expected = TOTAL // 2 - (10 * GiB + 700 * MiB) - 3 * GiB - OUTSIDE_TORCH_GROWTH - ALLOCATION_ROUNDING
    assert blocks == expected // PER_BLOCK
    assert "cuda_graphs_driver" not in engine.ledger.entries


def test_nothing_left_gives_zero_blocks(monkeypatch):
    engine, device = fake_engine(monkeypatch, tiers=False)
    device.outside = TOTAL // 2  # another process holds half the device
    assert Startup.profile_kv_blocks(engine, PER_BLOCK) == 0


def test_the_allocator_is_capped_at_what_the_budget_leaves_it(monkeypatch, caplog):
    engine, device = fake_engine(monkeypatch, tiers=False)
    device.outside = 900 * MiB  # graphs captured after the profile added driver memory
    Startup.cap_device_memory(engine)
    assert device.fraction * TOTAL == pytest.approx(TOTAL // 2 - 900 * MiB - OUTSIDE_TORCH_GROWTH)
    assert engine.ledger.get("non_torch") == 900 * MiB
    assert not caplog.records

    device.allocated = device.reserved = TOTAL // 2  # start-up already holds more than the cap: say so,
    with caplog.at_level(logging.WARNING, logger=startup_module.__name__):  # and leave room for a step
        Startup.cap_device_memory(engine)
    assert any("--gpu-memory-utilization" in r.getMessage() for r in caplog.records)
    assert device.fraction * TOTAL == pytest.approx(TOTAL // 2 + startup_module.ALLOCATOR_SEGMENTS)


def test_start_up_says_when_what_grew_outside_pytorch_leaves_no_room_for_the_largest_step(monkeypatch, caplog):
    """The cap leaves PyTorch the budget less what is outside it now: what grew there after the KV cache was
    sized (kernels and graphs loaded later) comes out of the room for a step's activations. Start-up says so
    with the block count that would leave the profile's step room, instead of steps failing later."""
    engine, device = fake_engine(monkeypatch, tiers=False)
    blocks = Startup.profile_kv_blocks(engine, PER_BLOCK)
    engine.runner.allocate_kv_cache(blocks)
    engine.kv, engine.kv_bytes_per_block = KVCacheManager(blocks, 16, False), lambda: PER_BLOCK
    with caplog.at_level(logging.WARNING, logger=startup_module.__name__):
        Startup.cap_device_memory(engine)
    assert not caplog.records  # the plan's own margins hold the step

    device.outside += 2 * GiB
    with caplog.at_level(logging.WARNING, logger=startup_module.__name__):
        Startup.cap_device_memory(engine)
    room = TOTAL // 2 - device.outside - OUTSIDE_TORCH_GROWTH - device.reserved
    short = 3 * GiB - room  # the profile step's peak, as reserved
    assert 0 < short < 2 * GiB
    [record] = caplog.records
    message = record.getMessage()
    assert "the largest steps may run out of memory" in message
    assert f"--num-gpu-blocks-override {blocks - -(-short // PER_BLOCK)}" in message


@pytest.mark.parametrize("moe,expected", [
    (None, [1, 2, 4, 8, 16]),
    ("grouped kernel", [1, 2, 4, 8, 16]),
    ("partial cache", [1, 2]),  # cut at the MoE layer: 5 slots hold the k = 2 experts of 2 rows at once
    ("partial cache, misses on the host", []),
    ("no grouped kernel", []),
])
def test_graphs_are_planned_only_where_they_can_be_captured(moe, expected):
    """With every expert resident the grouped kernel is captured in whole-step graphs; with fewer,
    the graphs are cut at the MoE layers (engine/piecewise.py) for the batches whose routing fits
    the slots at once, and none when a miss may run on the host or there is no grouped kernel."""
    import dataclasses

    from mempath.engine.runner import ModelRunner
    from mempath.kernels.dispatch import torch_kernels
    from mempath.model.moe import MoEBlock
    from tests.test_moe_grouped_memory import Spec

    grouped = {} if moe == "no grouped kernel" else {"grouped_experts": print, "grouped_expert_pairs": print}
    spec = Spec(num_experts=8, num_experts_per_tok=2, hidden_size=16, moe_intermediate_size=8)
    block = MoEBlock(spec, dataclasses.replace(torch_kernels(), **grouped))
    if moe and moe.startswith("partial cache"):
        block.experts.set_resident(5)
        block.experts.cpu_experts = "always" if "host" in moe else "never"
    elif moe == "no grouped kernel":
        block.experts.set_resident(5)
    runner = SimpleNamespace(device=torch.device("cuda"), config=SimpleNamespace(enforce_eager=False),
                             max_num_seqs=16, model=SimpleNamespace(moe_blocks=lambda: [block] if moe else []))
    assert ModelRunner.graph_sizes(runner) == expected
