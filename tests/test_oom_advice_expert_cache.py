"""The out-of-memory advice for a mixture-of-experts model with an expert cache spends the bytes the engine
allocates: on the device the dense weights and the N resident experts per layer (not every expert), and in
a step the cache's slot waves (memory.formulas.moe_grouped_phase_bytes), as `mempath plan` and the loader do."""
import json
import re
from pathlib import Path

import pytest

from mempath import LLM
from mempath.config import EngineConfig
from mempath.memory.formulas import load_bytes, read_shape
from mempath.memory.ledger import Ledger, format_bytes
from mempath.memory.oom import _plan_for, _shape_for, explain_oom
from mempath.model.loader import read_config
from mempath.tools.plan import plan_memory

QWEN = Path(__file__).parent / "data" / "configs" / "qwen3-30b-a3b.json"
GiB = 1 << 30
SETTINGS = dict(max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=8192)
# Qwen3-30B-A3B in bfloat16: 61,064,245,248 B of weights, of which 48 MoE layers x 128 experts x
# 3 x 2048 x 768 x 2 B = 57,982,058,496 are routed experts (452,984,832 B per expert of every layer).
# 32 resident: 61,064,245,248 - 96 x 452,984,832 = 17,577,701,376 B on the device.
PER_EXPERT_ALL_LAYERS = 48 * 3 * 2048 * 768 * 2
RESIDENT_32 = 61_064_245_248 - (128 - 32) * PER_EXPERT_ALL_LAYERS
# 13.5 GiB holds 14,495,514,624 // 452,984,832 = 32 experts per layer, exactly.
CACHES = [dict(moe_expert_cache_size=32), dict(moe_expert_cache_gb=13.5)]


def _config(**cache) -> EngineConfig:
    return EngineConfig(model=str(QWEN), **SETTINGS, **cache)


@pytest.mark.parametrize("cache", CACHES, ids=["size", "gb"])
def test_advice_counts_the_resident_experts_as_the_planner_and_the_loader(cache):
    figures = _plan_for(_config(**cache), "bfloat16")
    plan = plan_memory(QWEN, dtype="bfloat16", **SETTINGS, **cache)
    loading = load_bytes(read_shape(read_config(str(QWEN))), 2, 8192, expert_cache_size=32)
    assert figures.resident_weight_bytes == plan.resident_weight_bytes == loading["weights"] == RESIDENT_32
    assert figures.weight_bytes == plan.weight_bytes == 61_064_245_248  # still every parameter
    # Without a cache every expert is on the device.
    assert _plan_for(_config(), "bfloat16").resident_weight_bytes == 61_064_245_248


@pytest.mark.parametrize("cache", CACHES, ids=["size", "gb"])
def test_load_advice_spends_the_resident_weights(cache):
    text = explain_oom("load", Ledger(), GiB, 10 * GiB, _config(**cache), dtype="bfloat16")
    assert "weights pathway exceeded its budget" in text
    need = format_bytes(RESIDENT_32)  # 16.37 GiB, not the 56.87 GiB of every expert
    assert (f"the weights need {need} and 10.00 GiB is free: free {format_bytes(RESIDENT_32 - 10 * GiB)} "
            f"on the device") in text
    # 20 GiB free holds the resident weights: no claim that the weights alone overflow it.
    roomy = explain_oom("load", Ledger(), GiB, 20 * GiB, _config(**cache), dtype="bfloat16")
    assert "the weights need" not in roomy


def test_float32_advice_gives_the_bfloat16_resident_bytes():
    """--dtype bfloat16 halves each expert, so 13.5 GiB of slots holds 32 experts a layer instead of
    16: the bfloat16 figure is its own plan's, not half the float32 one."""
    config = _config(moe_expert_cache_gb=13.5)
    float32 = plan_memory(QWEN, dtype="float32", **SETTINGS, moe_expert_cache_gb=13.5)
    assert float32.expert_cache_size == 16
    text = explain_oom("load", Ledger(), GiB, 10 * GiB, config, dtype="float32")
    assert (f"--dtype bfloat16: weights need {format_bytes(RESIDENT_32)} instead of "
            f"{format_bytes(float32.resident_weight_bytes)}") in text
    assert RESIDENT_32 != float32.resident_weight_bytes // 2


def test_step_advice_counts_the_slot_waves():
    config = _config(moe_expert_cache_size=32)
    figures = _plan_for(config, "bfloat16")
    cached = plan_memory(QWEN, dtype="bfloat16", **SETTINGS, moe_expert_cache_size=32)
    resident = plan_memory(QWEN, dtype="bfloat16", **SETTINGS)
    # The later waves' outputs, slot ids and mask: 8192 x 8 pairs x (2048 x 4 + 17) B more at the MoE peak.
    assert cached.activation_peak_bytes > resident.activation_peak_bytes
    assert figures.activation_peak_bytes == cached.activation_peak_bytes
    free = GiB  # more than the step without the waves needs (969.58 MiB), less than with them
    assert resident.activation_peak_bytes + resident.logits_bytes < free
    assert cached.activation_peak_bytes + cached.logits_bytes > free
    text = explain_oom("step", Ledger(), 512 << 20, free, config, dtype="bfloat16")
    tokens = int(re.search(r"--max-num-batched-tokens (\d+)", text).group(1))
    assert 0 < tokens < 8192
    fitted = plan_memory(QWEN, dtype="bfloat16", **{**SETTINGS, "max_num_batched_tokens": tokens},
                         moe_expert_cache_size=32)
    assert fitted.activation_peak_bytes + fitted.logits_bytes <= free  # the advice really fits, waves and all


def test_advice_weights_equal_the_engines_ledger(model_factory):
    """A tiny Mixtral with 2 of 8 experts resident: the ledger's weights and expert slots, measured from
    the tensors, are the bytes the advice spends."""
    path, _ = model_factory("mixtral")
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, moe_expert_cache_size=2)
    ledger = llm.stats()["ledger"]
    on_device = ledger["weights"]["bytes"] + ledger["expert_cache"]["bytes"]
    figures = _plan_for(llm.engine.config, "float32")
    assert figures.resident_weight_bytes == on_device < figures.weight_bytes


@pytest.mark.parametrize("cache", [*CACHES, {}], ids=["size", "gb", "none"])
def test_load_advice_names_the_expert_cache_that_fits(cache):
    """Out of memory at load: the advice names the most experts a layer whose load fits the free memory, as
    the loader's own pre-check does. 10 GiB free less the 3,082,186,752 B of dense weights holds 16 experts
    of 452,984,832 B a layer (16.9), at least the 8 a token routes to and fewer than now (32, or all 128)."""
    text = explain_oom("load", Ledger(), GiB, 10 * GiB, _config(**cache), dtype="bfloat16")
    assert "--moe-expert-cache-size 16 or less" in text
    # 3 GiB free does not hold the 8 experts a token needs beside the dense weights: no such advice.
    tight = explain_oom("load", Ledger(), GiB, 3 * GiB, _config(**cache), dtype="bfloat16")
    assert "--moe-expert-cache-size" not in tight


def test_load_advice_is_the_loaders_own_figure_with_fp8_weights(tmp_path):
    """The advice spends what the loader's pre-check spends (weights, rotary tables and their build, and with
    fp8 the quantization's copy of the largest projection), so the size it names is one the loader accepts.
    Free: the dense weights and 20 experts a layer, which leaves no room for those extras at 20 experts."""
    from mempath.memory.formulas import expert_bytes, expert_cache_size_that_fits
    config = EngineConfig(model=str(QWEN), **SETTINGS, quantization="fp8")
    shape, dtype_bytes = _shape_for(config, "bfloat16")
    experts, _ = expert_bytes(shape, dtype_bytes)
    need = load_bytes(shape, dtype_bytes, 8192, 2)
    free = need["weights"] - experts + 20 * (experts // 128) + 1000
    on_device = need["weights"] + need["rotary_tables"] + need["rotary_build"] + need["quantize_build"]
    loaders = expert_cache_size_that_fits(shape, dtype_bytes, on_device, free, None)
    assert loaders == 19  # the extras cost one expert a layer
    text = explain_oom("load", Ledger(), GiB, free, config, dtype="bfloat16")
    assert f"--moe-expert-cache-size {loaders} or less" in text


def test_load_advice_under_a_cache_in_gib_replaces_that_flag():
    """Started with --moe-expert-cache-gb, the advice's --moe-expert-cache-size takes that flag's place (the
    engine refuses the two together), and says so."""
    text = explain_oom("load", Ledger(), GiB, 10 * GiB, _config(moe_expert_cache_gb=13.5), dtype="bfloat16")
    assert "--moe-expert-cache-size 16 or less in place of --moe-expert-cache-gb 13.5" in text
    sized = explain_oom("load", Ledger(), GiB, 10 * GiB, _config(moe_expert_cache_size=32), dtype="bfloat16")
    assert "--moe-expert-cache-size 16 or less" in sized and "in place of" not in sized


def test_moe_config_whose_layers_are_all_dense(tmp_path):
    """A Qwen3-MoE config.json whose mlp_only_layers name every layer has experts on paper and none in a layer:
    the out-of-memory advice still explains (no expert-cache advice, no crash), and an expert cache is
    refused as on a dense model."""
    config = json.loads(QWEN.read_text())
    config["mlp_only_layers"] = list(range(config["num_hidden_layers"]))
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = EngineConfig(model=str(tmp_path), **SETTINGS)
    text = explain_oom("load", Ledger(), GiB, GiB, engine, dtype="bfloat16")
    assert "what would have fitted" in text and "--moe-expert-cache-size" not in text
    for cache in CACHES:
        with pytest.raises(ValueError, match="no MoE layer.*drop the flag"):
            plan_memory(tmp_path, dtype="bfloat16", **SETTINGS, **cache)
