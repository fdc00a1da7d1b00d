"""`mempath plan` given bad input: one line naming the problem and the fix, exit 2, never a traceback
and never a field silently ignored (an adversarial probe's findings)."""
import json
import re

import pytest

from mempath.cli import main
from mempath.tools.plan import parse_bytes
from tests.test_plan import CONFIGS

DENSE = str(CONFIGS / "llama-3.1-8b.json")
MOE = str(CONFIGS / "qwen3-30b-a3b.json")
TWO = [f"a={DENSE}", f"b={DENSE}", "--gpu-mem", "160GiB"]
MIXED = [f"a={DENSE}", f"b={MOE}", "--gpu-mem", "160GiB"]
GiB = 1 << 30


def plan(capsys, *argv):
    code = main(["plan", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def refused(capsys, *argv) -> str:
    """The one line a refusal prints (asserted: exit 2, nothing on stdout, one line on stderr)."""
    code, out, err = plan(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and not out and len(lines) == 1, (code, out, err)
    assert "Traceback" not in err and "usage:" not in err
    return lines[0]


# ---------------------------------------------------------------- 1: a name the filesystem cannot look up


def test_a_name_too_long_for_a_path_is_one_line(capsys):
    line = refused(capsys, "a" * 300, "--gpu-mem", "80GiB")
    assert "File name too long" in line and "pass a model directory" in line, line
    assert len(line) < 300  # the name is shortened, not echoed whole
    line = refused(capsys, "x=" + "a" * 300, f"b={DENSE}", "--gpu-mem", "80GiB")
    assert "File name too long" in line, line


# ---------------------------------------------------------------- 2: block sizes the engine refuses


@pytest.mark.parametrize("size", ["3", "7", "99999999999999999999"])
@pytest.mark.parametrize("models", [[DENSE, "--gpu-mem", "80GiB"], TWO], ids=["one", "several"])
def test_a_block_size_not_a_power_of_two_is_refused(capsys, size, models):
    line = refused(capsys, *models, "--block-size", size)
    assert f"block_size must be a power of two, got {size}" in line, line


def test_powers_of_two_still_plan(capsys):
    assert plan(capsys, DENSE, "--gpu-mem", "80GiB", "--block-size", "32")[0] == 0
    assert plan(capsys, *TWO, "--block-size", "8")[0] == 0


# ---------------------------------------------------------------- 3: the pool's page override


@pytest.mark.parametrize("pages", ["0", "-5"])
def test_page_override_below_one_is_refused_as_the_engine_does(capsys, pages):
    line = refused(capsys, *TWO, "--num-gpu-blocks-override", pages)
    assert f"num_gpu_blocks_override must be >= 1, got {pages}" in line, line


def test_page_override_beyond_the_budget_is_planned_with_a_warning(capsys):
    """As the one-model plan treats settings the device cannot hold: the plan, and advice saying so."""
    code, out, _ = plan(capsys, *TWO, "--num-gpu-blocks-override", "99999999999", "--json")
    data = json.loads(out)
    assert code == 0 and data["num_pages"] == 99999999999
    code, out, _ = plan(capsys, *TWO, "--json")
    fits = json.loads(out)["num_pages"]
    warning = [line for line in data["advice"] if "--num-gpu-blocks-override 99999999999" in line]
    assert warning and f"{fits:,} pages" in warning[0] and data["fits"] is False, data["advice"]
    # Within the budget: no warning.
    code, out, _ = plan(capsys, *TWO, "--num-gpu-blocks-override", "10000", "--json")
    assert code == 0 and not json.loads(out)["advice"]


# ---------------------------------------------------------------- 4: context larger than the device


@pytest.mark.parametrize("models", [[DENSE], TWO[:2]], ids=["one", "several"])
def test_context_memory_larger_than_the_device_is_refused(capsys, models):
    line = refused(capsys, *models, "--gpu-mem", "80GiB", "--context-mem", "100GiB")
    assert "--context-mem" in line and "--gpu-mem" in line and "100.00 GiB" in line, line
    assert "smaller model" not in line


# ---------------------------------------------------------------- 5, 7: the MoE prediction's rates


@pytest.mark.parametrize("flag", ["--h2d-gbps", "--device-read-gbps", "--host-read-gbps"])
@pytest.mark.parametrize("rate", ["inf", "1e308", "nan", "-5", "0"])
def test_a_rate_must_be_finite_and_positive(capsys, flag, rate):
    line = refused(capsys, MOE, "--gpu-mem", "141GB", "--moe-expert-cache-size", "32", "--moe-cpu-experts", "auto",
                   flag, rate)
    assert line.startswith(f"mempath plan: error: {flag} {rate}") and "finite" in line, line


def test_several_models_pass_the_rates_to_the_prediction(capsys):
    argv = [*MIXED, "--moe-expert-cache-size", "64", "--json"]
    code, out, _ = plan(capsys, *argv)
    default = json.loads(out)["models"][1]["plan"]
    code, out, _ = plan(capsys, *argv, "--h2d-gbps", "25", "--device-read-gbps", "4000")
    slower = json.loads(out)["models"][1]["plan"]
    assert code == 0 and slower["moe_h2d_bytes_per_s"] == 25e9 and slower["moe_device_read_bytes_per_s"] == 4e12
    assert slower["moe_decode_tokens_per_s"] < default["moe_decode_tokens_per_s"]
    code, out, _ = plan(capsys, *argv, "--moe-cpu-experts", "auto", "--host-read-gbps", "7")
    assert code == 0 and json.loads(out)["models"][1]["plan"]["moe_host_read_bytes_per_s"] == 7e9
    assert "--h2d-gbps -5" in refused(capsys, *argv, "--h2d-gbps", "-5")


# ---------------------------------------------------------------- 6: what the engine refuses together


def test_sleep_offload_weights_with_an_expert_cache_is_refused_with_the_engines_reason(capsys):
    from mempath.config import EngineConfig
    with pytest.raises(ValueError) as engine:
        EngineConfig(model="", device="cpu", weights_arena=True, moe_expert_cache_size=64)
    line = refused(capsys, *MIXED, "--sleep-offload-weights", "--moe-expert-cache-size", "64")
    assert str(engine.value) in line, line
    line = refused(capsys, *MIXED, "--sleep-offload-weights", "--moe-expert-cache-gb", "4")
    assert str(engine.value) in line, line


# ---------------------------------------------------------------- 8: training flags without --train


@pytest.mark.parametrize("flag, value", [("--optimizer", "adamw-8bit"), ("--micro-batch", "8"), ("--seq-len", "99"),
                                         ("--lora-rank", "8"), ("--checkpointing", "full"),
                                         ("--lora-targets", "q_proj"), ("--checkpoint-layers", "0-3"),
                                         ("--optimizer", "adamw-fp32")])
def test_a_training_flag_without_train_is_refused(capsys, flag, value):
    line = refused(capsys, DENSE, "--gpu-mem", "80GiB", flag, value)
    assert f"{flag} {value}" in line and "--train" in line, line
    assert refused(capsys, *TWO, flag, value) == line  # several models: the same line


def test_lora_targets_without_a_rank_are_refused(capsys):
    line = refused(capsys, DENSE, "--gpu-mem", "80GiB", "--train", "--lora-targets", "q_proj")
    assert "--lora-targets q_proj" in line and "--lora-rank" in line, line


def test_training_flags_with_train_still_plan(capsys):
    code, out, _ = plan(capsys, DENSE, "--gpu-mem", "80GiB", "--train", "--optimizer", "adamw-8bit", "--micro-batch",
                        "8", "--seq-len", "99", "--lora-rank", "8", "--lora-targets", "q_proj", "--checkpointing",
                        "full", "--json")
    data = json.loads(out)
    assert code == 0 and (data["optimizer"], data["micro_batch"], data["seq_len"]) == ("adamw-8bit", 8, 99)
    assert data["lora_targets"] == ["q_proj"] and data["checkpointing"] == "full"
    code, out, _ = plan(capsys, DENSE, "--gpu-mem", "80GiB", "--train", "--json")
    data = json.loads(out)
    assert (data["optimizer"], data["micro_batch"], data["seq_len"], data["checkpointing"]) == (
        "adamw-fp32", 1, 4096, "none")


# ---------------------------------------------------------------- 9: rates where they do not apply


@pytest.mark.parametrize("flag", ["--h2d-gbps", "--device-read-gbps", "--host-read-gbps"])
@pytest.mark.parametrize("models", [[DENSE], [MOE], TWO[:2]], ids=["dense", "all-resident", "several-dense"])
def test_a_rate_is_refused_where_nothing_is_predicted(capsys, flag, models):
    line = refused(capsys, *models, "--gpu-mem", "160GiB", flag, "10")
    assert f"{flag} 10" in line and "--moe-expert-cache-size" in line, line


def test_host_read_rate_needs_auto_and_copy_rates_need_a_prediction(capsys):
    cache = [MOE, "--gpu-mem", "141GB", "--moe-expert-cache-size", "32"]
    line = refused(capsys, *cache, "--host-read-gbps", "10")
    assert "--host-read-gbps 10" in line and "--moe-cpu-experts auto" in line, line
    line = refused(capsys, *cache, "--moe-cpu-experts", "always", "--h2d-gbps", "10")
    assert "--h2d-gbps 10" in line and "always" in line, line
    assert plan(capsys, *cache, "--moe-cpu-experts", "auto", "--host-read-gbps", "10")[0] == 0


# ---------------------------------------------------------------- 10, 11, 12: sizes


@pytest.mark.parametrize("flag", ["--gpu-mem", "--context-mem"])
def test_an_empty_size_is_refused(capsys, flag):
    argv = [DENSE, "--gpu-mem", "80GiB"] if flag == "--context-mem" else [DENSE]
    line = refused(capsys, *argv, flag, "")
    assert f"{flag} is empty" in line, line


@pytest.mark.parametrize("text", ["80i", "80iB", "80XB", "80GiBs", "80 G B"])
def test_a_size_with_an_unknown_unit_is_refused_with_the_units(capsys, text):
    line = refused(capsys, DENSE, "--gpu-mem", text)
    assert "--gpu-mem" in line and "KiB" in line and "GB" in line, line


@pytest.mark.parametrize("text", ["80Gb", "80Gib", "512Mb"])
def test_a_size_in_bits_is_refused(capsys, text):
    line = refused(capsys, DENSE, "--gpu-mem", text)
    assert "bits" in line and "GB" in line, line


@pytest.mark.parametrize("text", ["100000000000000000000000GiB", "1025TiB", "9" * 400 + "GiB"])
def test_a_size_beyond_any_device_is_refused(capsys, text):
    line = refused(capsys, DENSE, "--gpu-mem", text)
    assert "1 PiB" in line and len(line) < 300, line


def test_legitimate_units_still_read():
    assert parse_bytes("80GiB") == parse_bytes("80gi") == parse_bytes("80GIB") == parse_bytes("80 Gi") == 80 * GiB
    assert parse_bytes("24GB") == parse_bytes("24G") == parse_bytes("24g") == 24 * 10**9
    assert parse_bytes("1kB") == parse_bytes("1K") == 1000 and parse_bytes("1KiB") == 1024
    assert parse_bytes("80gb") == 80 * 10**9 and parse_bytes("512mib") == 512 << 20  # typed casually: bytes
    assert parse_bytes("1.5T") == 1.5e12 and parse_bytes("1TiB") == 1 << 40 and parse_bytes("7B") == 7
    assert parse_bytes("1024TiB") == 1 << 50  # 1 PiB: the largest


@pytest.mark.parametrize("flag", ["--gpu-mem", "--context-mem"])
def test_a_negative_size_gets_the_must_be_positive_line(capsys, flag):
    argv = [DENSE, "--gpu-mem", "80GiB"] if flag == "--context-mem" else [DENSE]
    line = refused(capsys, *argv, flag, "-1GiB")
    assert f"{flag} -1GiB must be positive" in line, line


# ---------------------------------------------------------------- 13, 14: several models' syntax and share


def test_name_equals_dir_with_one_model_says_it_names_one_of_several(capsys):
    line = refused(capsys, f"a={DENSE}", "--gpu-mem", "80GiB")
    assert "NAME=DIR" in line and "several models" in line and f"mempath plan {DENSE}" in line, line


@pytest.mark.parametrize("share", ["-0.5", "nan", "inf"])
def test_kv_min_share_outside_zero_one_is_refused_with_the_range(capsys, share):
    line = refused(capsys, *TWO, "--kv-min-share", share)
    assert f"kv_min_share must be a fraction of the KV pool in [0, 1], got {float(share)!r}" in line, line


def test_a_reversed_layer_range_is_named():
    """'5-2' was read as no layers, and the plan said selective checkpointing needs layers."""
    from mempath.tools.plan_cli import parse_layers
    with pytest.raises(ValueError, match=re.escape("layer range '5-2' runs backwards: write 2-5")):
        parse_layers("5-2")
    assert parse_layers("2-5,7") == [2, 3, 4, 5, 7]


# ---------------------------------------------------------------- sizes in GiB beyond any memory


def test_an_expert_cache_beyond_any_device_is_one_line(capsys):
    """1e308 GiB passed the finite check and overflowed int() in bytes: a traceback."""
    line = refused(capsys, MOE, "--gpu-mem", "80GiB", "--moe-expert-cache-gb", "1e308")
    assert "moe_expert_cache_gb" in line and "1 PiB" in line, line


@pytest.mark.parametrize("field", ["cpu_kv_gb", "disk_kv_gb"])
def test_a_tier_beyond_any_memory_is_one_line(field, tmp_path):
    from mempath.config import EngineConfig
    sizes = {"cpu_kv_gb": 1.0, "disk_kv_gb": 1.0, field: 1e300}
    with pytest.raises(ValueError, match=rf"--{field.replace('_', '-')} 1e\+300 is more than 1 PiB"):
        EngineConfig(model="m", disk_kv_path=str(tmp_path / "kv"), **sizes)


def test_swap_space_inf_is_named_as_itself():
    import argparse
    from mempath.engine_flags import engine_options, add_engine_arguments
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    with pytest.raises(ValueError, match=r"--swap-space inf"):
        engine_options(parser.parse_args(["--model", "m", "--swap-space", "inf"]))


def test_a_layer_range_past_any_model_is_refused_before_it_is_listed():
    """0-9999999999 was listed layer by layer, then a MemoryError."""
    from mempath.tools.plan_cli import parse_layers
    with pytest.raises(ValueError, match=re.escape("checkpoint layers '0-9999999999' out of range: no model has")):
        parse_layers("0-9999999999")


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 10**400), ("vocab_size", 10**30)])
def test_config_integers_no_model_comes_near_are_refused(capsys, tmp_path, field, value):
    """num_hidden_layers 1e400 overflowed a float in the report; vocab_size 1e30 planned a 7e21 TiB embedding."""
    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    line = refused(capsys, tmp_path, "--gpu-mem", "80GiB")
    assert f"field '{field}'" in line and "below 2^32" in line, line


@pytest.mark.parametrize("flag,value,says", [("--lora-rank", "99999999", "above the hidden size 4096")])
def test_training_sizes_past_the_model_are_refused(capsys, flag, value, says):
    line = refused(capsys, DENSE, "--gpu-mem", "80GiB", "--train", flag, value)
    assert says in line, line


@pytest.mark.parametrize("flags,says", [(["--cpu-offload-gb", "4"], "weights stay on the device"),
                                        (["-tp", "2"], "tensor parallelism is not implemented")])
def test_vllm_flags_refused_by_serve_are_refused_by_plan_with_the_reason(capsys, flags, says):
    """Plan answered "unrecognized arguments" under its usage, where serve and diagnose give the reason."""
    code, out, err = plan(capsys, DENSE, "--gpu-mem", "80GiB", *flags)
    assert code == 2 and not out and says in err and "unrecognized" not in err, err


@pytest.mark.parametrize("zero", ["0", "00", "0B", "0GiB", "0.0MiB"])
def test_zero_context_memory_in_any_unit_is_the_default(capsys, zero):
    """0 is --context-mem's default, yet 0B was "must be positive" and 00 was told to be written 00GiB."""
    code, out, err = plan(capsys, DENSE, "--gpu-mem", "80GiB", "--context-mem", zero)
    assert code == 0 and not err, err
    assert out == plan(capsys, DENSE, "--gpu-mem", "80GiB")[1]
    assert "must be positive" in refused(capsys, DENSE, "--gpu-mem", "0GiB")
