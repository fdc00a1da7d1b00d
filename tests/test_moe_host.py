"""A missed expert run on the host (--moe-cpu-experts): the cost model's choice on given rates,
and outputs identical to the all-resident run with every miss on the host (CPU, tiny random models)."""
import pytest
import torch

from mempath import LLM
from mempath.engine_flags import add_engine_arguments, engine_options
from mempath.model.moe import expert_cache_stats, set_expert_cache_size
from mempath.model.moe_host import HostExpertCost, set_cpu_experts
from tests.conftest import release_cuda
from tests.test_moe import check_caches, generate, references  # noqa: F401 (fixture)

# Qwen3-30B-A3B's expert: h 2048, I_e 768, bf16 -> 9,437,184 bytes, 9,437,184 FLOPs per token.
H, I, B = 2048, 768, 2


def test_cost_model_runs_a_miss_on_the_host_while_computing_beats_copying():
    # Copy: 9.437 MB / 50 GB/s = 189 us. Host: 94.4 us per token at 100 GFLOP/s (+ 0.16 us of
    # hidden-state round trip) plus a 20 us sync -> 1 token 114 us (host), 2 tokens 209 us (copy).
    cost = HostExpertCost(h2d_bytes_per_s=50e9, host_flops_per_s=100e9, sync_seconds=20e-6)
    assert cost.copy_seconds(H, I, B) == pytest.approx(188.7e-6, rel=1e-3)
    assert cost.host_seconds(1, H, I, B) == pytest.approx(114.5e-6, rel=1e-3)
    assert cost.host_token_limit(H, I, B) == 1
    assert cost.runs_on_host(1, H, I, B) and not cost.runs_on_host(2, H, I, B)
    # Ten times the host rate: up to 17 tokens (17 * 9.6 us + 20 us < 189 us < 18 * 9.6 us + 20 us).
    fast = HostExpertCost(h2d_bytes_per_s=50e9, host_flops_per_s=1e12, sync_seconds=20e-6)
    assert fast.host_token_limit(H, I, B) == 17
    # A sync slower than the copy: never on the host.
    slow_sync = HostExpertCost(h2d_bytes_per_s=50e9, host_flops_per_s=1e12, sync_seconds=1e-3)
    assert slow_sync.host_token_limit(H, I, B) == 0 and not slow_sync.runs_on_host(1, H, I, B)


@pytest.mark.parametrize("arch,sizes", [("mixtral", (5, 2, 1)), ("qwen3_moe", (3,))])
def test_every_miss_on_the_host_gives_the_all_resident_tokens(arch, sizes, model_factory, references):
    path, _ = model_factory(arch)
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, enable_prefix_caching=False)
    for size in sizes:
        set_expert_cache_size(llm.engine.model, size)
        set_cpu_experts(llm.engine.model, "always")
        assert generate(llm) == references[arch], f"{size} experts resident"
        check_caches(llm.engine.model)
        stats = expert_cache_stats(llm.engine.model)
        # Nothing is copied: the slots stay empty and every lookup is a miss run on the host.
        assert stats["bytes_loaded"] == 0 and stats["hits"] == 0 and stats["resident_experts"] == 0
        assert stats["host_experts"] == stats["misses"] > 0
        assert stats["host_tokens"] >= stats["host_experts"]
    set_cpu_experts(llm.engine.model, "never")
    assert generate(llm) == references[arch]
    stats = expert_cache_stats(llm.engine.model)
    assert stats["host_experts"] == 0 or stats["bytes_loaded"] > 0  # counters carry on; copies resumed


def test_engine_option_runs_misses_on_the_host_and_counts_them(model_factory, references):
    from prometheus_client.parser import text_string_to_metric_families

    from mempath.server.metrics import ServerMetrics
    path, _ = model_factory("mixtral")
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, enable_prefix_caching=False,
              moe_expert_cache_size=2, moe_cpu_experts="always")
    assert generate(llm) == references["mixtral"]
    stats = llm.stats()
    cache = stats["expert_cache"]
    assert cache["cpu_experts"] == "always" and cache["host_experts"] > 0 and cache["bytes_loaded"] == 0
    text = ServerMetrics("m", 16).render(stats).decode()
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["mempath:moe_expert_cache_host_experts_total"] == cache["host_experts"]
    assert samples["mempath:moe_expert_cache_host_tokens_total"] == cache["host_tokens"]


@pytest.mark.parametrize("options,message", [
    ({"moe_cpu_experts": "sometimes"}, r"moe_cpu_experts must be never, auto or always, got 'sometimes'"),
    ({"moe_cpu_experts": "auto"}, r"--moe-cpu-experts auto: every expert is resident, so none misses: .*\(--moe-expert-cache-size\)"),
])
def test_bad_cpu_experts_settings_are_refused_in_one_line(options, message, model_factory):
    path, _ = model_factory("mixtral")
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", device="cpu", show_progress=False, **options)


def test_cpu_experts_flag():
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_options(parser.parse_args([]))["moe_cpu_experts"] == "never"
    assert engine_options(parser.parse_args(["--moe-cpu-experts", "auto"]))["moe_cpu_experts"] == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-cpu-experts", "maybe"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_host_path_and_measured_cost_model(model_factory, references):
    """On CUDA in float32: every miss on the host gives the all-resident tokens (tiny model: the host's
    and the device's float32 matmuls agree to the token); auto measures its rates and keeps the slots sane."""
    path, _ = model_factory("mixtral")
    for policy in ("always", "auto"):
        llm = LLM(path, dtype="float32", device="cuda", show_progress=False, enable_prefix_caching=False,
                  gpu_memory_utilization=0.3, moe_expert_cache_size=2, moe_cpu_experts=policy)
        assert generate(llm) == references["mixtral"], policy
        check_caches(llm.engine.model)
        cache = llm.stats()["expert_cache"]
        if policy == "always":
            assert cache["host_experts"] == cache["misses"] > 0  # prefetched experts found in a slot are hits
        else:
            assert isinstance(cache["host_token_limit"], int) and cache["host_token_limit"] >= 0
        del llm
        release_cuda()


def test_auto_splits_a_steps_misses_so_the_host_and_the_copies_end_together():
    # Copies 188.7 us each; the host 250 us an expert at one row, after a 20 us sync. Six one-token
    # misses: all copied 1,132 us; 1 on the host 943; 2: max(520, 755) = 755; 3: max(770, 566) = 770.
    cost = HostExpertCost(h2d_bytes_per_s=50e9, host_flops_per_s=100e9, sync_seconds=20e-6, host_row_seconds=250e-6)
    misses = {10: 1, 11: 1, 12: 3, 13: 1, 14: 2, 15: 1}
    assert cost.split_misses(misses, H, I, B) == [10, 11]  # the fewest tokens first, then by id
    # Many tokens an expert: the host's FLOPs (94.4 us a token) make every copy cheaper.
    assert cost.split_misses({1: 64, 2: 64, 3: 64}, H, I, B) == []
    # One miss: the host (270 us) is slower than its copy (189 us).
    assert cost.split_misses({7: 1}, H, I, B) == []
    assert cost.split_misses({}, H, I, B) == []
    # A host as fast as the link: half the misses each side.
    even = HostExpertCost(h2d_bytes_per_s=50e9, host_flops_per_s=100e9, sync_seconds=0.0, host_row_seconds=188.7e-6)
    assert len(even.split_misses({e: 1 for e in range(8)}, H, I, B)) == 4
    # The host issues the copies before it computes: 60 us an issue puts 2 on the host (host side
    # 20 + 4 x 60 + 500 = 760 us against 4 copies, 755), not 3 (20 + 3 x 60 + 750 = 950).
    issuing = HostExpertCost(h2d_bytes_per_s=50e9, host_flops_per_s=100e9, sync_seconds=20e-6,
                             host_row_seconds=250e-6, issue_seconds=60e-6)
    assert issuing.split_misses(misses, H, I, B) == [10, 11]
    # 150 us an issue: 1 on the host (20 + 5 x 150 + 250 = 1,020 us < 6 copies, 1,132), not 2 (1,120).
    slow_issue = HostExpertCost(h2d_bytes_per_s=50e9, host_flops_per_s=100e9, sync_seconds=20e-6,
                                host_row_seconds=250e-6, issue_seconds=150e-6)
    assert slow_issue.split_misses(misses, H, I, B) == [10]


@pytest.mark.parametrize("arch,size", [("mixtral", 2), ("mixtral", 5), ("qwen3_moe", 3)])
def test_split_misses_on_the_slot_path_give_the_all_resident_tokens(arch, size, model_factory, references):
    """auto on the grouped kernel (its twin here): a host as fast as the link takes about half of each
    step's misses; their rows replace those pairs' rows, in the twin's arithmetic, so float32 tokens
    are the all-resident ones, and every lookup is a hit, a copied miss or a host-run miss."""
    from mempath.model import moe_slots
    from tests.test_moe_slots import slot_kernel_llm
    path, _ = model_factory(arch)
    llm = slot_kernel_llm(path, size)
    blocks = llm.engine.model.moe_blocks()
    experts = blocks[0].experts
    copy = HostExpertCost(h2d_bytes_per_s=1.0, host_flops_per_s=1.0, sync_seconds=0.0).copy_seconds(
        experts.gate_up_proj.shape[2], experts.intermediate_size, experts.gate_up_proj.element_size())
    cost = HostExpertCost(h2d_bytes_per_s=1.0, host_flops_per_s=1e30, sync_seconds=0.0, host_row_seconds=copy)
    for block in blocks:
        block.experts.cpu_experts, block.experts.host_cost = "auto", cost
    assert all(moe_slots.uses_slot_kernel(b) for b in blocks)
    assert generate(llm) == references[arch]
    check_caches(llm.engine.model)
    stats = expert_cache_stats(llm.engine.model)
    assert stats["host_experts"] > 0 and stats["bytes_loaded"] > 0  # both sides of the split ran
    assert stats["host_tokens"] >= stats["host_experts"]
    copied = stats["bytes_loaded"] // experts.expert_bytes()
    assert copied <= stats["misses"] - stats["host_experts"]  # a host-run miss copies nothing


def test_measured_host_rates_read_every_expert_of_the_layer_cold(model_factory, monkeypatch):
    """A step's missed experts are not in the host's caches (a layer's experts are far larger
    than them), so each host path is timed over every expert of the layer in turn, not over
    one expert whose weights a repeated call would find cached; the slots and the counters
    are as they were."""
    from mempath.model import moe_host
    path, _ = model_factory("mixtral")
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, enable_prefix_caching=False)
    set_expert_cache_size(llm.engine.model, 2)
    generate(llm)  # the slots hold experts now: slot 0's must come back
    experts = llm.engine.model.moe_blocks()[0].experts
    slots = {name: getattr(experts, name).detach().clone() for name in ("gate_up_proj", "down_proj")}
    stats = expert_cache_stats(llm.engine.model)
    assert experts.cache.expert_in[0] >= 0
    by_pairs, by_rows = [], []
    fill, mlp = moe_host.fill_host_pairs, moe_host.host_mlp

    def recording_fill(experts, x, weights, expert_ids, *rest):
        by_pairs.extend(expert_ids)
        return fill(experts, x, weights, expert_ids, *rest)

    def recording_mlp(experts, rows, expert):
        by_rows.append(expert)
        return mlp(experts, rows, expert)
    monkeypatch.setattr(moe_host, "fill_host_pairs", recording_fill)
    monkeypatch.setattr(moe_host, "host_mlp", recording_mlp)
    cost = moe_host.measure_host_cost(experts)
    assert set(by_pairs) == set(by_rows) == set(range(experts.num_experts))
    assert cost.host_row_seconds > 0 and cost.host_flops_per_s > 0 and cost.h2d_bytes_per_s > 0
    assert cost.issue_seconds > 0
    for name, before in slots.items():
        assert torch.equal(getattr(experts, name), before), name
    assert expert_cache_stats(llm.engine.model) == stats
    check_caches(llm.engine.model)


def test_the_host_row_time_moves_to_what_rows_take_inside_steps():
    """A row measured at start-up, alone, runs faster than inside a step (copies in flight, the step's own
    work): with a weight, observed rows move the split's per-row time toward theirs, an outlier at most a
    bounded step, and the split follows. Without one (the default) an observation changes nothing."""
    cost = HostExpertCost(h2d_bytes_per_s=50e9, host_flops_per_s=100e9, sync_seconds=0.0, host_row_seconds=100e-6,
                          row_weight=0.25)
    six = {e: 1 for e in range(6)}  # copies 188.7 us each
    assert len(cost.split_misses(six, H, I, B)) == 4  # max(400, 377) us
    cost.observe_host_rows(1, 50e-3)  # one stall: the estimate moves a quarter of the way to 4x, no further
    assert cost.host_row_seconds == pytest.approx(100e-6 * (1 + 0.25 * 3))
    for _ in range(40):
        cost.observe_host_rows(2, 2 * 400e-6)
    assert cost.host_row_seconds == pytest.approx(400e-6, rel=1e-3)
    assert len(cost.split_misses(six, H, I, B)) == 2  # max(800, 755) us
    fixed = HostExpertCost(h2d_bytes_per_s=50e9, host_flops_per_s=100e9, sync_seconds=0.0, host_row_seconds=100e-6)
    fixed.observe_host_rows(2, 2 * 400e-6)
    assert fixed.host_row_seconds == 100e-6


def test_host_run_rows_of_a_step_teach_the_split_their_time(model_factory):
    """On the slot path (the kernel's twin on the CPU), each layer's host-run rows are timed and fed to the
    cost model: a per-row time set far below the real one rises toward it, and the stats report it."""
    from tests.test_moe_slots import slot_kernel_llm
    path, _ = model_factory("mixtral")
    llm = slot_kernel_llm(path, 2)
    cost = HostExpertCost(h2d_bytes_per_s=1e9, host_flops_per_s=1e30, sync_seconds=0.0, host_row_seconds=1e-9,
                          row_weight=0.5)
    for block in llm.engine.model.moe_blocks():
        block.experts.cpu_experts, block.experts.host_cost = "auto", cost
    generate(llm)
    stats = expert_cache_stats(llm.engine.model)
    assert stats["host_experts"] > 0
    assert cost.host_row_seconds > 1e-7  # a row of the tiny model's expert takes microseconds on any host
    assert stats["host_row_us"] == pytest.approx(cost.host_row_seconds * 1e6)
    check_caches(llm.engine.model)


def test_a_row_time_pushed_up_by_stalls_drifts_back_so_the_host_runs_rows_again():
    """Stalled observations can price the host out (no host rows, so nothing observed to bring it down): while
    layers miss with no host rows the row time drifts back toward start-up's, and the split gives the host rows."""
    cost = HostExpertCost(h2d_bytes_per_s=50e9, host_flops_per_s=100e9, sync_seconds=0.0, host_row_seconds=100e-6,
                          row_weight=0.25, start_row_seconds=100e-6)
    six = {e: 1 for e in range(6)}
    for _ in range(12):
        cost.observe_host_rows(1, 1.0)  # one stall after another
    assert cost.split_misses(six, H, I, B) == []
    for _ in range(480):  # the drift is ROW_DRIFT_SLOWER (8) times slower than an observation's pull
        cost.observe_no_host_rows()
    assert cost.host_row_seconds == pytest.approx(100e-6, rel=1e-3)
    assert len(cost.split_misses(six, H, I, B)) == 4
    below = HostExpertCost(50e9, 100e9, 0.0, host_row_seconds=50e-6, row_weight=0.25, start_row_seconds=100e-6)
    below.observe_no_host_rows()  # only a time above start-up's drifts: a faster host is kept
    assert below.host_row_seconds == 50e-6


def test_the_slot_path_lets_a_priced_out_host_back_in(model_factory):
    from tests.test_moe_slots import slot_kernel_llm
    path, _ = model_factory("mixtral")
    llm = slot_kernel_llm(path, 2)
    cost = HostExpertCost(h2d_bytes_per_s=1e9, host_flops_per_s=1e30, sync_seconds=0.0, host_row_seconds=1e-3,
                          row_weight=1.0, start_row_seconds=1e-9)
    for block in llm.engine.model.moe_blocks():
        block.experts.cpu_experts, block.experts.host_cost = "auto", cost
    generate(llm)
    assert expert_cache_stats(llm.engine.model)["host_experts"] > 0
    check_caches(llm.engine.model)
