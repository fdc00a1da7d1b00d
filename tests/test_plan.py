"""`mempath plan`: figures checked against transformers models built on the meta device."""

import argparse
import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mempath.memory.budget import ALLOCATION_ROUNDING, OUTSIDE_TORCH_GROWTH
from mempath.tools.plan import MemoryPlan, parse_bytes, plan_memory
from mempath.tools.plan_cli import add_plan_arguments, format_plan, parse_layers, run_plan

CONFIGS = Path(__file__).parent / "data" / "configs"
REAL = ["llama-3.1-8b", "qwen2.5-7b-instruct", "qwen3-0.6b", "mistral-7b-v0.1", "phi-3-mini-4k-instruct"]
GiB = 1 << 30

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
    "max_position_embeddings": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
TINY_PARAMS = 276_032  # 64000 embed + 49152 attn + 98304 mlp + 576 norms + 64000 head

# Variants that exercise the bias and q/k-norm paths on small shapes.
TINY_VARIANTS = {
    "llama-biases": {**TINY, "attention_bias": True, "mlp_bias": True},
    "llama-tied": {**TINY, "tie_word_embeddings": True},
    "qwen2": {**TINY, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "qwen3-bias": {**TINY, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                   "head_dim": 32, "attention_bias": True},
    "mistral-head-dim-null": {**TINY, "architectures": ["MistralForCausalLM"],
                              "model_type": "mistral", "head_dim": None},
    "phi3": {**TINY, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
             "pad_token_id": 0},
}

_META_CACHE = {}


def load(name):
    return json.loads((CONFIGS / f"{name}.json").read_text())


def meta_model(config: dict, dtype=torch.bfloat16):
    key = (json.dumps(config, sort_keys=True), dtype)
    if key not in _META_CACHE:
        cfg = AutoConfig.for_model(**config)
        with torch.device("meta"):
            _META_CACHE[key] = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return _META_CACHE[key]


def pathway(name: str) -> str:
    if "embed_tokens" in name:
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if "norm" in name:  # layer norms, the final norm, and Qwen3's q/k norms
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    raise AssertionError(f"unclassified parameter {name}")


def meta_counts(model) -> dict:
    counts = dict.fromkeys(["embedding", "attention", "mlp", "norms", "lm_head"], 0)
    for name, p in model.named_parameters():  # tied weights appear once
        counts[pathway(name)] += p.numel()
    counts["bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return counts


def plan_counts(plan: MemoryPlan) -> dict:
    return {"embedding": plan.embedding_params, "attention": plan.attention_params,
            "mlp": plan.mlp_params, "norms": plan.norm_params,
            "lm_head": plan.lm_head_params, "bytes": plan.weight_bytes}


# ---------------------------------------------------------------- weights and KV


@pytest.mark.parametrize("name", REAL)
def test_weights_match_meta_model(name):
    config = load(name)
    plan = plan_memory(config, dtype="bfloat16")
    assert plan_counts(plan) == meta_counts(meta_model(config))
    assert plan.total_params == sum(p.numel() for p in meta_model(config).parameters())


@pytest.mark.parametrize("name", sorted(TINY_VARIANTS))
def test_tiny_variants_match_meta_model(name):
    config = TINY_VARIANTS[name]
    plan = plan_memory(config, dtype="float32")
    assert plan_counts(plan) == meta_counts(meta_model(config, torch.float32))


def test_llama_31_8b_reference_figures():
    plan = plan_memory(CONFIGS / "llama-3.1-8b.json")
    assert plan.dtype == "bfloat16"
    assert plan.weight_bytes == 16_060_522_496
    assert plan.kv_bytes_per_token == 131_072
    assert plan.kv_bytes_per_block == 2 * 1024 * 1024
    assert plan.lm_head_bytes == plan.embedding_bytes


@pytest.mark.parametrize("name", REAL)
def test_kv_per_token_matches_formula(name):
    config = load(name)
    cfg = AutoConfig.for_model(**config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    expected = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2
    plan = plan_memory(config, block_size=32)
    assert plan.kv_bytes_per_token == expected
    assert plan.kv_bytes_per_block == expected * 32


def test_tied_lm_head_costs_nothing():
    plan = plan_memory(load("qwen3-0.6b"))
    assert plan.tied_embeddings and plan.lm_head_params == 0 and plan.lm_head_bytes == 0
    assert plan.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2


def test_model_directory_and_dtype_override(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(load("mistral-7b-v0.1")))
    plan = plan_memory(str(tmp_path), dtype="fp32")
    assert (plan.dtype, plan.dtype_bytes) == ("float32", 4)
    assert plan.weight_bytes == 4 * plan.total_params


# ---------------------------------------------------------------- workspace and capacity


def test_workspace_figures():
    plan = plan_memory(TINY, max_num_seqs=8, max_num_batched_tokens=100, block_size=16)
    h, i, q, kv = 64, 128, 64, 32
    attention = (q + 2 * kv) + (q + kv) + q + h
    assert plan.activation_peak_bytes == 100 * 2 * (2 * h + max(attention, 3 * i))  # fused CUDA path
    reference = plan_memory(TINY, max_num_seqs=8, max_num_batched_tokens=100, fused_kernels=False)
    assert reference.activation_peak_bytes == 100 * 2 * (4 * h + max(attention, 4 * i))
    # bf16 lm_head output, plus the sampler's float32 scores and its sort slice (8 rows < 16)
    assert plan.logits_rows == 8 and plan.logits_bytes == 8 * 1000 * 2 + 1000 * (4 * 8 + 21 * 8)
    # 256 rows: scores + noise outweigh the 16-row sort slice
    wide = plan_memory(TINY, dtype="float32", max_num_seqs=256, max_num_batched_tokens=256)
    assert wide.logits_bytes == 256 * 1000 * 4 + 1000 * 8 * 256
    # The step peaks in the forward or in the sampling phase after it, whichever is larger,
    # on top of the serving stream's cuBLAS workspace (Hopper's 32 MiB by default; none on the CPU)
    # and, on the fused path (CUDA with Triton), the dense GEMV's split-K workspace: float32 partial
    # sums of 32 rows of the widest projection (gate/up, 2i) and an int32 counter per 16 outputs.
    sampling = (100 + 8) * h * 2 + plan.logits_bytes
    gemv = 4 * 32 * 2 * i + 4 * (2 * i // 16)
    assert plan.step_peak_bytes == max(plan.activation_peak_bytes, sampling) + (32 << 20) + gemv
    cpu = plan_memory(TINY, max_num_seqs=8, max_num_batched_tokens=100, cublas_workspace=0)
    assert cpu.step_peak_bytes == max(cpu.activation_peak_bytes, sampling) + gemv
    assert reference.step_peak_bytes == max(reference.activation_peak_bytes, sampling) + (32 << 20)
    f32 = plan_memory(TINY, dtype="float32", max_num_seqs=8, max_num_batched_tokens=100)  # no dense GEMV
    assert f32.step_peak_bytes == max(f32.activation_peak_bytes, (100 + 8) * h * 4 + f32.logits_bytes) + (32 << 20)
    # The engine keeps room for what grows outside PyTorch while serving before it sizes the KV cache
    # (engine/startup.py): the plan leaves the same, or it plans blocks the engine never grants.
    assert plan.outside_torch_growth_bytes == OUTSIDE_TORCH_GROWTH
    assert plan.workspace_bytes == (plan.step_peak_bytes + plan.step_largest_block_bytes + plan.cuda_graph_bytes
                                    + OUTSIDE_TORCH_GROWTH)
    assert plan_memory(TINY, cuda_graphs=False).cuda_graph_bytes == 0


def test_the_largest_block_kept_spare_is_the_steps_largest_tensor_as_reserved():
    """A chunk of prompt tokens: the MLP's gate/up output; a step of many sampled rows over a wide vocabulary:
    the sampler's float32 logits; both rounded up to the allocator's 2 MiB, as their segments are."""
    llama = load("llama-3.1-8b")
    chunk = plan_memory(llama, max_num_batched_tokens=8192)
    assert chunk.step_largest_block_bytes == 8192 * 2 * 14336 * 2
    sampled = plan_memory(llama, max_num_seqs=256, max_num_batched_tokens=256)
    assert sampled.step_largest_block_bytes == -(-256 * 128256 * 4 // (2 << 20)) * (2 << 20)
    assert plan_memory(TINY, max_num_seqs=8, max_num_batched_tokens=100).step_largest_block_bytes == 2 << 20


def test_capacity_arithmetic():
    plan = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=80 * GiB, max_model_len=8192,
                       max_num_seqs=64, host_mem_bytes=512 * GiB)
    assert plan.budget_bytes == int(80 * GiB * 0.9)
    assert plan.kv_budget_bytes == plan.budget_bytes - plan.weight_bytes - plan.workspace_bytes
    # Less the caching allocator's rounding of the cache's tensor, as the engine grants its blocks.
    assert plan.num_kv_blocks == (plan.kv_budget_bytes - ALLOCATION_ROUNDING) // plan.kv_bytes_per_block
    assert plan.kv_capacity_tokens == plan.num_kv_blocks * 16
    assert plan.max_concurrency == plan.kv_capacity_tokens // plan.max_model_len
    assert 0 < plan.max_concurrency < 64 and plan.fits
    advice = " ".join(plan.advice)
    assert f"use --max-num-seqs {plan.max_concurrency}, or --kv-cache-dtype fp8" in advice
    assert "or --cpu-kv-gb 9 to keep the KV" in advice
    assert "block size 16 (the default)" in advice and "8 was the slowest" in advice


def test_concurrency_counts_whole_blocks():
    # 500 tokens occupy 32 blocks of 16 (512 slots), so tokens // max_model_len would overcount.
    plan = plan_memory(TINY, gpu_mem_bytes=GiB, max_model_len=500, block_size=16)
    assert plan.blocks_per_seq == 32
    assert plan.max_concurrency == plan.num_kv_blocks // 32


def test_everything_fits_advice():
    plan = plan_memory(load("qwen3-0.6b"), gpu_mem_bytes=80 * GiB, max_model_len=4096,
                       max_num_seqs=16)
    assert plan.kv_bytes_wanted == 16 * 4096 * plan.kv_bytes_per_token
    assert any(line.startswith("fits: max-num-seqs 16") for line in plan.advice)


def test_weights_exceed_budget():
    plan = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=16 * GiB)
    assert plan.kv_budget_bytes < 0 and plan.num_kv_blocks == 0 and plan.max_concurrency == 0
    assert not plan.fits
    assert any(line.startswith("does not fit: weights alone") for line in plan.advice)


def test_kv_for_one_sequence_does_not_fit():
    plan = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=parse_bytes("18.5GiB"), host_mem_bytes=1 << 40)
    assert plan.kv_budget_bytes > 0 and plan.max_concurrency == 0 and not plan.fits
    line = next(line for line in plan.advice if "one max-model-len 131072 sequence" in line)
    assert f"--max-model-len {plan.kv_capacity_tokens}" in line
    # A running sequence's KV must be on the device: the host tier cannot make one fit.
    assert "--cpu-kv-gb" not in line


def test_advice_proposes_fp8_weights_for_a_16bit_model():
    """--quantization fp8 exists: the projections in one byte per weight (docs/quantization.md)."""
    plan = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=12 * GiB)
    line = next(line for line in plan.advice if "does not fit: weights alone" in line)
    assert "use --quantization fp8 (8.46 GiB of weights)" in line, line
    assert not any("8-bit" in line for line in plan.advice), plan.advice
    fp8 = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=12 * GiB, quantization="fp8")
    assert not any("--quantization" in line for line in fp8.advice), fp8.advice


def test_advice_proposes_the_fp8_kv_cache_only_where_it_helps():
    """--kv-cache-dtype fp8 exists: one byte per element, half of bf16's KV."""
    short = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=80 * GiB, max_model_len=8192, max_num_seqs=64)
    line = next(line for line in short.advice if line.startswith("max-num-seqs 64"))
    assert "--kv-cache-dtype fp8" in line and "32.00 GiB" in line, line
    already = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=80 * GiB, max_model_len=8192, max_num_seqs=128,
                          kv_cache_dtype="fp8")
    assert already.kv_cache_dtype == "fp8"
    assert not any("--kv-cache-dtype" in line for line in already.advice), already.advice
    one_fits_in_fp8 = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=30 * GiB)
    line = next(line for line in one_fits_in_fp8.advice if "one max-model-len 131072 sequence" in line)
    assert "--kv-cache-dtype fp8" in line, line
    none_fits = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=18 * GiB)
    line = next(line for line in none_fits.advice if "one max-model-len 131072 sequence" in line)
    assert "--kv-cache-dtype" not in line, line  # 8 GiB in fp8 still does not fit in 258 MiB


def test_host_tier_advice_is_capped_by_the_host_memory():
    """256 sequences of 131,072 tokens need ~4 TiB of KV: no --cpu-kv-gb 4040 on a 64 GiB host."""
    small_host = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=80 * GiB, host_mem_bytes=64 * GiB,
                             max_num_seqs=256)
    line = next(line for line in small_host.advice if line.startswith("max-num-seqs 256"))
    proposed = [int(n) for n in re.findall(r"--cpu-kv-gb (\d+)", line)]
    assert proposed and max(proposed) <= 0.7 * 64, line
    assert "64.00 GiB" in line, line
    big_host = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=80 * GiB, host_mem_bytes=1 << 44, max_num_seqs=256)
    line = next(line for line in big_host.advice if line.startswith("max-num-seqs 256"))
    needed = math.ceil((big_host.kv_bytes_wanted - big_host.kv_budget_bytes) / GiB)
    assert f"--cpu-kv-gb {needed}" in line, line
    unknown_host = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=80 * GiB, max_num_seqs=256)
    assert not any("--cpu-kv-gb" in line for line in unknown_host.advice)


def test_no_gpu_mem_leaves_capacity_empty():
    plan = plan_memory(load("phi-3-mini-4k-instruct"))
    assert plan.budget_bytes is None and plan.max_concurrency is None and plan.fits is None
    assert any("capacity needs --gpu-mem" in line for line in plan.advice)


# ---------------------------------------------------------------- training


def tiny_train(**kw):
    args = dict(train=True, micro_batch=2, seq_len=128)
    return plan_memory(TINY, dtype="bfloat16", **{**args, **kw})


# Korthikanti, s=128, b=2, h=64, a=4, 16-bit: 1,212,416. Its 34·sbh is 16 two-byte tensors of s·b·h and two
# one-byte dropout masks, its 5·as²b two two-byte s×s tensors and a one-byte mask.
A = 128 * 2 * (34 * 64 + 5 * 4 * 128)
A32 = 128 * 2 * (66 * 64 + 9 * 4 * 128)  # the same tensors in float32, the masks still one byte: 2,260,992
LOGITS = 128 * 2 * 1000 * (2 + 4)  # 16-bit LM-head output + the loss's fp32 log-softmax
LOGITS32 = 128 * 2 * 1000 * (4 + 4)


def test_training_adamw_fp32_no_checkpointing():
    """adamw-fp32 trains fp32 weights, so the forward runs in fp32: 4-byte activations and logits."""
    plan = tiny_train()
    assert plan.total_params == TINY_PARAMS
    assert A == 1_212_416 and A32 == 2_260_992
    assert plan.trainable_params == TINY_PARAMS
    assert (plan.train_weight_bytes, plan.grad_bytes, plan.master_weight_bytes, plan.optimizer_bytes) == (
        4 * TINY_PARAMS, 4 * TINY_PARAMS, 0, 8 * TINY_PARAMS)
    assert plan.activation_dtype_bytes == 4
    assert plan.activation_bytes_per_layer == A32
    assert plan.train_activation_bytes == 4 * A32 == 9_043_968
    assert plan.train_logits_bytes == LOGITS32 == 2_048_000
    assert plan.train_total_bytes == 16 * TINY_PARAMS + 4 * A32 + LOGITS32


@pytest.mark.parametrize("optimizer,dtype,lora_rank,activation_bytes", [
    ("adamw-fp32", "bfloat16", 0, 4),  # fp32 weights, whatever the checkpoint's dtype
    ("adamw-fp32", "float32", 0, 4),
    ("mixed", "bfloat16", 0, 2),       # 16-bit weights beside the fp32 master copy
    ("mixed", "float32", 0, 2),
    ("adamw-8bit", "bfloat16", 0, 2),  # the model's dtype
    ("adamw-8bit", "float32", 0, 4),
    ("adamw-fp32", "bfloat16", 8, 2),  # LoRA: the frozen base runs in the model's dtype
    ("adamw-fp32", "float32", 8, 4),
    ("mixed", "float32", 8, 2),
])
def test_training_activations_follow_the_precision_the_optimizer_implies(optimizer, dtype, lora_rank,
                                                                          activation_bytes):
    """Every optimizer got 16-bit activations and logits: float32 training was planned at about half."""
    plan = plan_memory(TINY, dtype=dtype, train=True, micro_batch=2, seq_len=128, optimizer=optimizer,
                       lora_rank=lora_rank)
    e = activation_bytes
    per_layer = 128 * 2 * ((16 * e + 2) * 64 + (2 * e + 1) * 4 * 128) + e * 128 * 2 * 8 * 2 * bool(lora_rank)
    assert plan.activation_dtype_bytes == e
    assert plan.activation_bytes_per_layer == per_layer
    assert plan.train_activation_bytes == 4 * per_layer
    assert plan.train_logits_bytes == 128 * 2 * 1000 * (e + 4)
    full = plan_memory(TINY, dtype=dtype, train=True, micro_batch=2, seq_len=128, optimizer=optimizer,
                       lora_rank=lora_rank, checkpointing="full")
    assert full.train_activation_bytes == 4 * e * 128 * 2 * 64 + per_layer  # each layer's input, in that dtype


def test_training_optimizers():
    mixed = tiny_train(optimizer="mixed")
    assert (mixed.train_weight_bytes, mixed.grad_bytes, mixed.master_weight_bytes,
            mixed.optimizer_bytes) == (2 * TINY_PARAMS, 2 * TINY_PARAMS, 4 * TINY_PARAMS, 8 * TINY_PARAMS)
    eight = tiny_train(optimizer="adamw-8bit")
    assert (eight.train_weight_bytes, eight.grad_bytes, eight.master_weight_bytes,
            eight.optimizer_bytes) == (2 * TINY_PARAMS, 2 * TINY_PARAMS, 0, 2 * TINY_PARAMS)


def test_training_checkpointing():
    layer_input = 2 * 128 * 2 * 64  # s·b·h·2 bytes (mixed: 16-bit)
    mixed = dict(optimizer="mixed")
    assert tiny_train(checkpointing="full", **mixed).train_activation_bytes == 4 * layer_input + A == 1_343_488
    selective = tiny_train(checkpointing="selective", checkpoint_layers=[0, 2], **mixed)
    assert selective.train_activation_bytes == 2 * layer_input + 2 * A + A == 3_702_784
    fp32 = tiny_train(checkpointing="selective", checkpoint_layers=[0, 2])  # adamw-fp32: 4-byte inputs
    assert fp32.train_activation_bytes == 2 * 2 * layer_input + 2 * A32 + A32
    assert selective.checkpoint_layers == [0, 2]


def test_training_lora_matches_meta_linears():
    plan = tiny_train(lora_rank=8)
    model = meta_model(TINY)
    manual = sum(8 * (m.in_features + m.out_features) for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and name.split(".")[-1] in ("q_proj", "v_proj"))
    assert plan.trainable_params == manual == 7168
    assert plan.train_weight_bytes == 2 * TINY_PARAMS + 4 * 7168
    assert (plan.grad_bytes, plan.optimizer_bytes) == (4 * 7168, 8 * 7168)
    assert plan.activation_bytes_per_layer == A + 2 * 128 * 2 * 8 * 2


@pytest.mark.parametrize("name,targets", [("llama-3.1-8b", "all-linear"),
                                          ("phi-3-mini-4k-instruct", ("qkv_proj", "gate_up_proj")),
                                          ("qwen2.5-7b-instruct", ("q_proj", "k_proj", "v_proj", "o_proj"))])
def test_lora_real_configs_match_meta_linears(name, targets):
    config = load(name)
    plan = plan_memory(config, train=True, lora_rank=16, lora_targets=targets, seq_len=256)
    wanted = set(plan.lora_targets)
    manual = sum(16 * (m.in_features + m.out_features) for n, m in meta_model(config).named_modules()
                 if isinstance(m, torch.nn.Linear) and ".layers." in n and n.split(".")[-1] in wanted)
    assert plan.trainable_params == manual


def test_training_does_not_fit_suggests_alternatives():
    plan = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=80 * GiB, train=True, seq_len=4096)
    assert plan.fits and not plan.train_fits
    line = next(line for line in plan.advice if line.startswith("training does not fit"))
    assert "--checkpointing full ->" in line and "--optimizer adamw-8bit ->" in line
    assert "--lora-rank 16 ->" in line


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs,match", [
    (dict(model={**TINY, "architectures": ["GPT2LMHeadModel"]}), "unsupported architecture"),
    (dict(model="/nonexistent/model"), "no config.json"),
    (dict(model={**TINY, "hidden_size": 0}), "hidden_size"),
    (dict(model=TINY, dtype="int3"), "unknown dtype"),
    (dict(model=TINY, gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(model=TINY, gpu_mem_bytes=-1), "gpu_mem_bytes"),
    (dict(model=TINY, max_model_len=4096), "max_position_embeddings"),
    (dict(model=TINY, block_size=0), "block_size"),
    (dict(model=TINY, train=True, optimizer="sgd"), "unknown optimizer"),
    (dict(model=TINY, train=True, checkpointing="selective"), "needs checkpoint_layers"),
    (dict(model=TINY, train=True, checkpointing="selective", checkpoint_layers=[9]), "out of range"),
    (dict(model={**TINY, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3"},
          train=True, lora_rank=8, lora_targets=("q_proj",)), "qkv_proj"),
])
def test_bad_input_raises(kwargs, match):
    model = kwargs.pop("model")
    with pytest.raises(ValueError, match=match):
        plan_memory(model, **kwargs)


def test_parse_sizes_and_layers():
    assert parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes("24GB") == 24_000_000_000
    assert parse_bytes("141 G") == 141_000_000_000
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("123") == 123
    for bad in ("lots", "-5GB", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    assert parse_layers("0-3,8") == [0, 1, 2, 3, 8]


# ---------------------------------------------------------------- CLI


def cli(*argv):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return run_plan(parser.parse_args([str(a) for a in argv]))


def test_cli_table(capsys):
    rc = cli(CONFIGS / "llama-3.1-8b.json", "--gpu-mem", "80GiB", "--max-model-len", "8192",
             "--train", "--optimizer", "mixed", "--checkpointing", "selective",
             "--checkpoint-layers", "0-7", "--lora-rank", "8")
    out = capsys.readouterr().out
    assert rc == 0
    assert "16,060,522,496 B" in out and "131,072 B" in out
    assert "max concurrency at 8192" in out and "layers 0-7" in out and "advice" in out


@pytest.mark.parametrize("optimizer,bits", [("adamw-fp32", "fp32"), ("mixed", "16-bit")])
def test_cli_training_rows_name_the_activation_dtype(capsys, optimizer, bits):
    """The logits row said "16-bit" for adamw-fp32 too."""
    assert cli(CONFIGS / "qwen3-0.6b.json", "--train", "--optimizer", optimizer, "--seq-len", "1024") == 0
    out = capsys.readouterr().out
    assert f"activations per layer ({bits})" in out and f"logits ({bits} + fp32 log-softmax)" in out


def test_cli_json(capsys):
    assert cli(CONFIGS / "qwen3-0.6b.json", "--gpu-mem", "24GB", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["weight_bytes"] == 1_192_099_840 and data["gpu_mem_bytes"] == 24_000_000_000
    assert data["max_concurrency"] >= 1 and isinstance(data["advice"], list)


def test_cli_error(capsys):
    assert cli(CONFIGS / "qwen3-0.6b.json", "--gpu-mem", "lots") == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--gpu-mem", "--context-mem"])
def test_cli_refuses_a_size_without_a_unit(capsys, flag):
    """`--gpu-mem 80` planned for 80 bytes; a size on the command line must say its unit."""
    assert cli(CONFIGS / "qwen3-0.6b.json", flag, "80") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no unit" in err and "80GiB" in err, err
    assert cli(CONFIGS / "qwen3-0.6b.json", flag, "80GiB") == 0
    assert cli(CONFIGS / "qwen3-0.6b.json", flag, "85899345920B") == 0  # bytes, said so


def test_cli_kv_cache_dtype(capsys):
    assert cli(CONFIGS / "qwen3-0.6b.json", "--gpu-mem", "24GB", "--json") == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert cli(CONFIGS / "qwen3-0.6b.json", "--gpu-mem", "24GB", "--kv-cache-dtype", "fp8", "--json") == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert fp8["kv_cache_dtype"] == "fp8" and 2 * fp8["kv_bytes_per_token"] == bf16["kv_bytes_per_token"]


def test_cli_passes_the_host_memory_to_the_advice(capsys, monkeypatch):
    import psutil
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"total": 64 * GiB})())
    assert cli(CONFIGS / "llama-3.1-8b.json", "--gpu-mem", "80GiB", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["host_mem_bytes"] == 64 * GiB
    proposed = [int(n) for line in data["advice"] for n in re.findall(r"--cpu-kv-gb (\d+)", line)]
    assert proposed and max(proposed) <= 0.7 * 64, data["advice"]


def test_format_without_gpu_mem():
    text = format_plan(plan_memory(load("mistral-7b-v0.1"), cuda_graphs=False))
    assert "capacity: needs --gpu-mem" in text and "CUDA graphs (off)" in text


def test_auto_dtype_reads_either_config_key():
    no_dtype = {k: v for k, v in TINY.items() if k != "torch_dtype"}
    assert plan_memory(no_dtype).dtype == "bfloat16"
    assert plan_memory({**no_dtype, "dtype": "float16"}).dtype == "float16"
    assert plan_memory({**TINY, "torch_dtype": "float32"}).weight_bytes == 4 * TINY_PARAMS


def test_max_num_seqs_defaults_to_1024_on_a_large_gpu_as_the_engine_does():
    """vLLM V1's default: 1024 on a GPU of 70 GiB or more, 256 on smaller ones and the CPU; the plan
    counts the step buffers and sampler rows of the number the engine will run."""
    from mempath.config import EngineConfig
    large = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=80 * GiB, max_model_len=8192)
    small = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=24 * GiB, max_model_len=8192)
    assert (large.max_num_seqs, small.max_num_seqs, plan_memory(load("llama-3.1-8b")).max_num_seqs) == (1024, 256, 256)
    explicit = plan_memory(load("llama-3.1-8b"), gpu_mem_bytes=80 * GiB, max_model_len=8192, max_num_seqs=256)
    assert large.workspace_bytes > explicit.workspace_bytes
    assert EngineConfig(model="", device="cpu").max_num_seqs == 256
    assert EngineConfig(model="", device="cpu", max_num_seqs=7).max_num_seqs == 7


@pytest.mark.parametrize("named", [None, "bfloat16", "float16", "float32"])
def test_plan_and_engine_resolve_auto_to_the_same_dtype_on_cuda(tmp_path, named, monkeypatch):
    """A config.json that names no dtype was planned in bfloat16 (vLLM's auto) and served in float32 on CUDA:
    twice the bytes the plan counted."""
    from mempath.config import EngineConfig
    from mempath.model.loader import checkpoint_dtype
    cfg = json.loads((Path(__file__).parent / "data" / "configs" / "qwen3-0.6b.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    if named is not None:
        cfg["torch_dtype"] = named
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = EngineConfig(model=str(tmp_path), device="cpu")
    config.device = "cuda:0"  # how auto resolves there; nothing touches a GPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)  # a Hopper or Ampere GPU
    engine_dtype = config.torch_dtype(checkpoint_dtype(cfg))
    assert str(engine_dtype).removeprefix("torch.") == plan_memory(str(tmp_path)).dtype
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)  # a T4 or V100
    assert config.torch_dtype(checkpoint_dtype(cfg)) == (torch.float16 if named is None else engine_dtype)


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).parent / "data" / "configs").glob("*.json")))
def test_plan_takes_the_engines_longest_sequence(tmp_path, name):
    """The engine serves no longer than a sliding window; plan counted max_position_embeddings (Mistral-7B:
    32,768 planned, 4,096 served) and accepted a --max-model-len the engine refuses."""
    from mempath.engine.startup import resolve_max_model_len
    from mempath.model.spec import ModelSpec
    source = Path(__file__).parent / "data" / "configs" / f"{name}.json"
    (tmp_path / "config.json").write_text(source.read_text())
    served = resolve_max_model_len(None, ModelSpec.from_hf_config(json.loads(source.read_text())))
    assert plan_memory(str(tmp_path)).max_model_len == served
    with pytest.raises(ValueError, match=rf"max_model_len {served + 1} exceeds what this model supports \({served}"):
        plan_memory(str(tmp_path), max_model_len=served + 1)
