"""`mempath plan`'s predicted batch-1 decode tokens/s for a MoE model with fewer experts resident."""
import pytest

from mempath.memory.formulas import moe_offload_tokens_per_second, read_shape
from mempath.tools.plan import plan_memory
from mempath.tools.plan_cli import format_plan
from tests.test_plan import CONFIGS, load


def qwen_moe(**options):
    return plan_memory(CONFIGS / "qwen3-30b-a3b.json", dtype="bfloat16", gpu_mem_bytes=141 * 10**9, **options)


def test_plan_predicts_decode_tokens_per_second_with_the_uniform_router():
    plan = qwen_moe(moe_expert_cache_size=32, moe_h2d_bytes_per_s=50e9, moe_device_read_bytes_per_s=4e12)
    assert plan.moe_hit_rate == 32 / 128
    # 48 layers x 8 active x 0.75 missed x 9,437,184 B = 2.72 GB per token at 50 GB/s: 54.4 ms;
    # plus the weights a token reads, 3,041,869,824 params x 2 B at 4 TB/s (the A3B's 3,353,032,704 less the
    # untied embedding table but one row): 1.52 ms, and 48 x 42 us of the cut decode graph's host steps:
    # 2.02 ms -> 17.3 tok/s.
    shape = read_shape(load("qwen3-30b-a3b"))
    assert plan.moe_decode_tokens_per_s == pytest.approx(moe_offload_tokens_per_second(
        shape, 2, 0.25, 50e9, 3_041_869_824 * 2 / 4e12, 42e-6))
    assert plan.moe_decode_tokens_per_s == pytest.approx(17.27, abs=0.01)
    text = format_plan(plan)
    assert "predicted batch-1 decode 17.3 tok/s" in text
    assert "42 us a MoE layer for the decode graph's host step" in text
    assert "hit rate 25% = the resident fraction 32/128 (the uniform router's;" in text
    assert "50 GB/s pinned host->device, 4000 GB/s device read" in text


def test_no_prediction_with_every_expert_resident_or_a_dense_model():
    for plan in (qwen_moe(), plan_memory(CONFIGS / "qwen3-0.6b.json", gpu_mem_bytes=80 * 10**9)):
        assert plan.moe_decode_tokens_per_s is None and "predicted batch-1 decode" not in format_plan(plan)


def test_bad_rates_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"moe_h2d_bytes_per_s must be > 0 bytes/s, got 0"):
        qwen_moe(moe_expert_cache_size=32, moe_h2d_bytes_per_s=0)


def test_plan_flags_set_the_rates(capsys):
    from mempath.cli import main
    assert main(["plan", str(CONFIGS / "qwen3-30b-a3b.json"), "--gpu-mem", "141GB", "--dtype", "bfloat16",
                 "--moe-expert-cache-size", "32", "--h2d-gbps", "25", "--device-read-gbps", "4000"]) == 0
    assert "predicted batch-1 decode 8.9 tok/s" in capsys.readouterr().out


def test_prediction_with_misses_split_between_the_host_and_the_copies():
    """--moe-cpu-experts auto: each MoE layer waits for the longer of the host's share of the misses
    (one expert after another, after a sync) and the copies of the rest, at the best split."""
    shape = read_shape(load("qwen3-30b-a3b"))
    copy = 3 * 2048 * 768 * 2 / 50e9  # 188.7 us
    step = 1.7e-3
    copies_only = moe_offload_tokens_per_second(shape, 2, 0.25, 50e9, step)
    # 6 misses a layer; a host as fast as the link takes 3: the layer waits 3 copies, not 6.
    even = moe_offload_tokens_per_second(shape, 2, 0.25, 50e9, step, host_row_seconds=copy)
    assert 1 / even == pytest.approx(step + 48 * 3 * copy)
    # A 20 us sync and a host at 1.5x a copy: 2 on the host (max(20 + 566, 755) = 755 us) beats
    # 3 (max(869, 566)) and 1 (max(303, 944)).
    slower = moe_offload_tokens_per_second(shape, 2, 0.25, 50e9, step, host_row_seconds=1.5 * copy, sync_seconds=20e-6)
    assert 1 / slower == pytest.approx(step + 48 * 4 * copy)
    # The host issues the others' copies first, 47 us each: 2 on the host, max(20 + 4 x 47 + 566, 755)
    # = 775 us (1: max(539, 943); 3: max(1,011, 566)), the host's side now the longer.
    issuing = moe_offload_tokens_per_second(shape, 2, 0.25, 50e9, step, host_row_seconds=1.5 * copy,
                                            sync_seconds=20e-6, issue_seconds=0.25 * copy)
    assert 1 / issuing == pytest.approx(step + 48 * (20e-6 + 4 * 0.25 * copy + 2 * 1.5 * copy))
    # A host whose one expert (after the sync) outlasts all six copies takes none: copies only.
    assert moe_offload_tokens_per_second(shape, 2, 0.25, 50e9, step, host_row_seconds=6 * copy,
                                         sync_seconds=copy) == pytest.approx(copies_only)


def test_a_fraction_of_a_miss_a_layer_is_charged_as_a_fraction_on_the_host():
    # Hit rate 0.9: 0.8 misses a layer. A host at 0.9 of a copy runs that fraction in 0.72 copies.
    shape = read_shape(load("qwen3-30b-a3b"))
    copy = 3 * 2048 * 768 * 2 / 50e9
    rate = moe_offload_tokens_per_second(shape, 2, 0.9, 50e9, 1.7e-3, host_row_seconds=0.9 * copy)
    assert 1 / rate == pytest.approx(1.7e-3 + 48 * 0.8 * 0.9 * copy)


def test_plan_with_auto_splits_the_misses_at_the_host_read_rate():
    from mempath.memory.formulas import ASSUMED_COPY_ISSUE_SECONDS, ASSUMED_CUT_SECONDS, ASSUMED_HOST_SYNC_SECONDS
    shape = read_shape(load("qwen3-30b-a3b"))
    never = qwen_moe(moe_expert_cache_size=28, moe_h2d_bytes_per_s=54.6e9, moe_device_read_bytes_per_s=4.3e12)
    auto = qwen_moe(moe_expert_cache_size=28, moe_h2d_bytes_per_s=54.6e9, moe_device_read_bytes_per_s=4.3e12,
                    moe_cpu_experts="auto", moe_host_read_bytes_per_s=24.2e9)
    assert auto.moe_cpu_experts == "auto" and never.moe_cpu_experts == "never"
    assert auto.moe_decode_tokens_per_s == pytest.approx(moe_offload_tokens_per_second(
        shape, 2, 28 / 128, 54.6e9, 3_041_869_824 * 2 / 4.3e12, ASSUMED_CUT_SECONDS,
        host_row_seconds=9_437_184 / 24.2e9, sync_seconds=ASSUMED_HOST_SYNC_SECONDS,
        issue_seconds=ASSUMED_COPY_ISSUE_SECONDS))
    assert auto.moe_decode_tokens_per_s > never.moe_decode_tokens_per_s
    assert "auto: some misses run on the host meanwhile, its reads at 24.2 GB/s" in format_plan(auto)
    # A host that reads slower than the link does no better than copying.
    slow = qwen_moe(moe_expert_cache_size=28, moe_cpu_experts="auto", moe_host_read_bytes_per_s=1e9)
    assert slow.moe_decode_tokens_per_s == pytest.approx(qwen_moe(moe_expert_cache_size=28).moe_decode_tokens_per_s)


def test_plan_with_always_predicts_nothing_and_says_so():
    plan = qwen_moe(moe_expert_cache_size=28, moe_cpu_experts="always")
    assert plan.moe_decode_tokens_per_s is None and plan.moe_hit_rate == 28 / 128
    assert "batch-1 decode not predicted: --moe-cpu-experts always decodes eagerly" in format_plan(plan)


@pytest.mark.parametrize("options,message", [
    ({"moe_cpu_experts": "auto"}, r"--moe-cpu-experts auto: every expert is resident, so none misses"),
    ({"moe_cpu_experts": "sometimes", "moe_expert_cache_size": 28}, r"moe_cpu_experts must be never, auto or always"),
    ({"moe_cpu_experts": "auto", "moe_expert_cache_size": 28, "moe_host_read_bytes_per_s": 0},
     r"moe_host_read_bytes_per_s must be > 0 bytes/s, got 0"),
])
def test_plan_refuses_cpu_expert_settings_the_engine_would_refuse(options, message):
    with pytest.raises(ValueError, match=message):
        qwen_moe(**options)


def test_plan_cli_takes_the_engines_cpu_experts_flag(capsys):
    from mempath.cli import main
    code = main(["plan", str(CONFIGS / "qwen3-30b-a3b.json"), "--gpu-mem", "141GB", "--moe-expert-cache-size", "28",
                 "--moe-cpu-experts", "auto", "--host-read-gbps", "30"])
    out = capsys.readouterr().out
    assert code == 0 and "its reads at 30.0 GB/s (--host-read-gbps" in out
