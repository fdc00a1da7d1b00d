"""Mixture-of-experts models: token-identical to transformers, and the expert cache.

Tiny random Qwen3-MoE, Mixtral and OLMoE models (tests/conftest.py MOE_ARCH_CONFIGS:
8 experts, 2 active) in float32 on the CPU. The cache tests keep fewer experts
resident than a step uses, so every step misses, evicts and runs in waves.
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mempath import LLM, SamplingParams
from mempath.memory.formulas import decoder_peak_bytes, gemv_workspace_bytes, load_bytes, moe_phase_bytes, read_shape
from mempath.model.spec import CheckpointError, ModelSpec
from mempath.model.loader import load_model
from mempath.model.moe import (
    ExpertCache,
    MoEBlock,
    expert_cache_stats,
    set_expert_cache_size,
    synthetic_router_bias,
)
from mempath.tools.diagnose.meters import TensorBytesTracker
from mempath.tools.diagnose.probes import _probe_batch
from mempath.tools.plan import plan_memory
from tests.conftest import MOE_ARCH_CONFIGS, MOE_ARCHS, hf_greedy, make_model
from tests.test_plan import CONFIGS, load, meta_model

PROMPTS = [
    [1, 5, 9, 33, 7],
    list(range(10, 47)),  # crosses two block boundaries at block size 16
    [3] * 20 + [8, 9],
    [100 + i % 50 for i in range(70)],
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def references(model_factory):
    return {arch: [hf_greedy(model_factory(arch)[1], p, GREEDY.max_tokens) for p in PROMPTS]
            for arch in MOE_ARCHS}


def generate(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def check_caches(model) -> None:
    for block in model.moe_blocks():
        block.experts.cache.check()


# ---------------------------------------------------------------- transformers parity


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_matches_transformers(arch, model_factory, references):
    """Four prompts batched together (prefill and decode rows mixed), 32 tokens each."""
    path, _ = model_factory(arch)
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False)
    assert generate(llm) == references[arch]
    stats = expert_cache_stats(llm.engine.model)
    assert stats["hit_rate"] == 1.0 and stats["misses"] == 0 and stats["router"] == "model"


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_chunked_prefill_and_preemption_match(arch, model_factory, references):
    path, _ = model_factory(arch)
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, block_size=8, max_num_batched_tokens=8,
              num_gpu_blocks_override=14)
    assert generate(llm) == references[arch]
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_block_is_bitwise_transformers_block(arch, model_factory):
    """Router, top-k, normalisation, weights' dtype and the sum over k as transformers does them."""
    path, hf = model_factory(arch)
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False)
    ours = llm.engine.model.moe_blocks()[0]
    torch.manual_seed(1)
    x = torch.randn(37, hf.config.hidden_size)
    with torch.no_grad():
        expected = hf.model.layers[0].mlp(x[None])[0]
        assert torch.equal(ours(x), expected)


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    config = {**load("qwen3-30b-a3b"), "num_hidden_layers": 6, "decoder_sparse_step": 2,
              "mlp_only_layers": [3], "num_experts": 4, "num_experts_per_tok": 2}
    hf_sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
                 for layer in meta_model(config).model.layers]
    assert ModelSpec.from_hf_config(config).moe_layers == tuple(i for i, s in enumerate(hf_sparse) if s) == (1, 5)


def test_unnormalised_top_k_and_sparse_step_match_transformers(tmp_path):
    """Qwen3-MoE with norm_topk_prob off (the weights sum to less than 1) and every other layer dense."""
    hf = make_model(tmp_path, "qwen3_moe", tokenizer=False, norm_topk_prob=False, decoder_sparse_step=2,
                    mlp_only_layers=[], num_hidden_layers=2)
    llm = LLM(str(tmp_path), dtype="float32", show_progress=False)
    assert [type(layer.mlp).__name__ for layer in llm.engine.model.model.layers] == ["MLP", "MoEBlock"]
    prompts = PROMPTS[1::2]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def test_qwen3_moe_whose_layers_are_all_dense_is_a_dense_model(tmp_path):
    """mlp_only_layers naming every layer: transformers builds no expert, so the spec has none (an expert
    cache on it is refused as on any dense model), and the tokens are transformers'."""
    hf = make_model(tmp_path, "qwen3_moe", tokenizer=False, mlp_only_layers=[0, 1], num_hidden_layers=2)
    assert not any(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers)
    llm = LLM(str(tmp_path), dtype="float32", show_progress=False)
    assert llm.engine.spec.num_experts == 0 and llm.engine.spec.moe_layers == ()
    prompts = PROMPTS[:2]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    with pytest.raises(ValueError, match="dense model.*no MoE layer"):
        LLM(str(tmp_path), dtype="float32", show_progress=False, moe_expert_cache_size=2)


# ---------------------------------------------------------------- the expert cache


@pytest.mark.parametrize("arch,sizes", [(arch, (8, 2)) for arch in MOE_ARCHS] + [("mixtral", (8, 5, 3, 1))])
def test_every_cache_size_gives_the_same_tokens(arch, sizes, model_factory, references):
    """Fewer experts resident than a prefill step uses (waves, misses, evictions), down to 1."""
    path, _ = model_factory(arch)
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, enable_prefix_caching=False)
    for size in sizes:
        set_expert_cache_size(llm.engine.model, size)  # new cache, counters from zero
        assert generate(llm) == references[arch], f"{size} experts resident"
        check_caches(llm.engine.model)
        stats = expert_cache_stats(llm.engine.model)
        if size == 8:
            activations = stats["hits"]  # all resident: every activation hits
        assert stats["hits"] + stats["misses"] == activations
        layers = stats["layers"]
        assert all(layer["resident"] <= size for layer in layers)
        if size < 8:
            block = llm.engine.model.moe_blocks()[0]
            assert stats["misses"] > 0 and stats["evictions"] > 0
            assert layers[0]["bytes_loaded"] == layers[0]["misses"] * block.experts.expert_bytes()
            assert stats["host_bytes"] == sum(t.numel() * 4 for b in llm.engine.model.moe_blocks()
                                              for t in b.experts.cache.host.values())


def test_uniform_router_hits_about_its_resident_fraction(model_factory):
    """Random weights route almost uniformly: 2 of 8 resident hits far less than half the time."""
    path, _ = model_factory("mixtral")
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, enable_prefix_caching=False)
    set_expert_cache_size(llm.engine.model, 2)
    generate(llm)
    assert expert_cache_stats(llm.engine.model)["hit_rate"] < 0.4


def test_eviction_weighs_routing_frequency_and_recency():
    cache = ExpertCache(num_experts=8, num_slots=2, host={"gate_up_proj": torch.empty(0)})
    loads = []

    def step(tokens_per_expert: dict[int, int]):
        sizes = [tokens_per_expert.get(e, 0) for e in range(8)]
        cache.record_routing(sizes)
        for wave in cache.waves([e for e in range(8) if sizes[e]]):
            cache.release(cache.acquire(wave, lambda e, s: loads.append((e, s)) or 10))

    step({0: 100})  # expert 0: many tokens, long ago
    step({1: 1})
    step({2: 1})  # expert 1 (recent, 1 token) scores below expert 0 (1 + 0.5 * log2(101))
    assert sorted(cache.resident_experts()) == [0, 2]
    step({3: 1})  # expert 2 now scores 3 + 0.5, below expert 0's 4.33
    assert sorted(cache.resident_experts()) == [0, 3]
    step({4: 1, 5: 1, 6: 1})  # a step with more experts than slots runs in waves of two
    assert cache.resident_experts() and all(e in (4, 5, 6) for e in cache.resident_experts())
    assert (cache.hits, cache.misses, cache.bytes_loaded) == (0, 7, 70)
    assert cache.evictions == 5
    cache.check()


def test_a_failed_copy_leaves_no_slot_in_use_and_no_stale_expert(model_factory, monkeypatch):
    """A host-to-device copy that fails mid-wave must not leave a slot booked, nor an expert
    recorded as resident in a slot it was never (completely) copied into."""
    path, _ = model_factory("mixtral")
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False)
    block = llm.engine.model.moe_blocks()[0]
    torch.manual_seed(2)
    x = torch.randn(40, block.gate.in_features)
    with torch.no_grad():
        expected = block(x)
        set_expert_cache_size(llm.engine.model, 2)
        experts = block.experts
        real_load = type(experts).load_into_slot
        calls = []

        def failing_load(self, expert, slot):
            calls.append(expert)
            if len(calls) == 2:
                self.gate_up_proj[slot].zero_()  # half-copied, then the copy fails
                raise RuntimeError("copy failed")
            return real_load(self, expert, slot)

        monkeypatch.setattr(type(experts), "load_into_slot", failing_load)
        with pytest.raises(RuntimeError, match="copy failed"):
            block(x)
        experts.cache.check()
        monkeypatch.setattr(type(experts), "load_into_slot", real_load)
        assert torch.equal(block(x), expected)
        experts.cache.check()


def test_expert_cache_size_is_validated(model_factory, tmp_path):
    path, _ = model_factory("mixtral")
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False)
    for bad in (0, 9):
        with pytest.raises(ValueError, match="from 1 to the number of experts per layer"):
            set_expert_cache_size(llm.engine.model, bad)
    with pytest.raises(ValueError, match="from 1 to 8"):
        load_model(path, torch.float32, CPU, expert_cache_size=9, show_progress=False)
    dense, _ = model_factory("llama")
    with pytest.raises(ValueError, match="dense model"):
        load_model(dense, torch.float32, CPU, expert_cache_size=2, show_progress=False)
    with pytest.raises(ValueError, match="dense model"):
        plan_memory(load("qwen3-0.6b"), moe_expert_cache_size=2)


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_loader_fills_the_host_store_and_only_the_slots_are_parameters(arch, model_factory):
    path, hf = model_factory(arch)
    full, spec, full_report = load_model(path, torch.float32, CPU, show_progress=False)
    cached, _, report = load_model(path, torch.float32, CPU, show_progress=False, expert_cache_size=2)
    hf_experts = hf.model.layers[0].mlp.experts
    block = cached.moe_blocks()[0]
    assert torch.equal(block.experts.cache.host["gate_up_proj"], hf_experts.gate_up_proj)
    assert torch.equal(block.experts.cache.host["down_proj"], hf_experts.down_proj)
    assert block.experts.gate_up_proj.shape[0] == 2
    plan = plan_memory(path, dtype="float32", moe_expert_cache_size=2)
    assert full_report.weight_bytes == plan.weight_bytes
    assert report.weight_bytes == plan.resident_weight_bytes
    assert report.host_weight_bytes == plan.host_expert_bytes == plan.expert_bytes
    torch.manual_seed(3)
    x = torch.randn(25, spec.hidden_size)
    with torch.no_grad():
        for ours, reference in zip(cached.moe_blocks(), full.moe_blocks()):
            assert torch.equal(ours(x), reference(x))


def test_dummy_weights_are_the_same_for_every_cache_size(model_factory):
    path, _ = model_factory("qwen3_moe")
    full, _, _ = load_model(path, torch.float32, CPU, dummy=True)
    cached, _, report = load_model(path, torch.float32, CPU, dummy=True, expert_cache_size=3)
    assert report.host_weight_bytes > 0
    for a, b in zip(full.moe_blocks(), cached.moe_blocks()):
        assert torch.equal(a.experts.gate_up_proj, b.experts.cache.host["gate_up_proj"])
        assert torch.equal(a.experts.down_proj, b.experts.cache.host["down_proj"])
        assert torch.equal(a.gate.weight, b.gate.weight)
    assert torch.equal(full.lm_head.weight, cached.lm_head.weight)


def test_stacked_expert_checkpoint_loads(model_factory, tmp_path):
    """transformers 5's in-memory names (experts.gate_up_proj [E, 2I, h]) load as well as per-expert ones."""
    path, hf = model_factory("olmoe")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((Path(path) / "config.json").read_text())
    model, _, _ = load_model(tmp_path, torch.float32, CPU, show_progress=False)
    assert torch.equal(model.moe_blocks()[1].experts.down_proj, hf.model.layers[1].mlp.experts.down_proj)


def test_a_missing_expert_is_refused_in_one_line(model_factory, tmp_path):
    path, hf = model_factory("mixtral")
    from safetensors.torch import load_file
    tensors = load_file(Path(path) / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((Path(path) / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"weights missing from the checkpoint: \['model.layers.1.mlp."
                                              r"experts.gate_up_proj'\]"):
        load_model(tmp_path, torch.float32, CPU, show_progress=False)


@pytest.mark.parametrize("change,match", [
    ({"num_experts_per_tok": 9}, r"field 'num_experts_per_tok' holds 9 \(a number\), expected at most "
                                 r"num_local_experts \(8\)"),
    ({"num_local_experts": 0}, r"field 'num_local_experts' holds 0 \(a number\), expected a positive integer"),
    ({"intermediate_size": "48"}, r"field 'intermediate_size' holds \"48\" \(a string\)"),
])
def test_bad_mixtral_configs_are_refused(change, match):
    config = {**load("mixtral-8x7b-v0.1"), **change}
    with pytest.raises(CheckpointError, match=match):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize("change,match", [
    ({"mlp_only_layers": [48]}, r"field 'mlp_only_layers' holds \[48\] \(a list\), expected a list of layer "
                                r"indices from 0 to 47"),
    ({"mlp_only_layers": "0"}, r"field 'mlp_only_layers'"),
    ({"decoder_sparse_step": 0}, r"field 'decoder_sparse_step' holds 0"),
    ({"moe_intermediate_size": None}, r"field 'moe_intermediate_size' is missing"),
    ({"norm_topk_prob": "yes"}, r"field 'norm_topk_prob' holds \"yes\" \(a string\), expected true or false"),
])
def test_bad_qwen3_moe_configs_are_refused(change, match):
    config = {k: v for k, v in {**load("qwen3-30b-a3b"), **change}.items() if v is not None}
    with pytest.raises(CheckpointError, match=match):
        ModelSpec.from_hf_config(config)


def test_olmoe_head_dim_must_match_its_norms():
    config = {"architectures": ["OlmoeForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
              "head_dim": 32, "intermediate_size": 48, "num_hidden_layers": 2, "vocab_size": 320,
              "num_experts": 8, "num_experts_per_tok": 2}
    with pytest.raises(CheckpointError, match="field 'head_dim' holds 32 .*hidden_size / num_attention_heads"):
        ModelSpec.from_hf_config(config)


def test_transformers_5_expert_count_key_is_read(model_factory):
    """transformers 5 saves Qwen3-MoE's num_experts as num_local_experts."""
    path, _ = model_factory("qwen3_moe")
    saved = json.loads((Path(path) / "config.json").read_text())
    assert "num_experts" not in saved and ModelSpec.from_hf_config(saved).num_experts == 8


# ---------------------------------------------------------------- the planner


def moe_meta_counts(model) -> dict:
    counts = dict.fromkeys(["embedding", "attention", "mlp", "experts", "norms", "lm_head"], 0)
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            key = "experts"
        elif "embed_tokens" in name:
            key = "embedding"
        elif name.startswith("lm_head"):
            key = "lm_head"
        elif "norm" in name:
            key = "norms"
        else:
            key = "attention" if ".self_attn." in name else "mlp"
        counts[key] += p.numel()
    return counts


def plan_counts(plan) -> dict:
    return {"embedding": plan.embedding_params, "attention": plan.attention_params, "mlp": plan.mlp_params,
            "experts": plan.expert_params, "norms": plan.norm_params, "lm_head": plan.lm_head_params}


@pytest.mark.parametrize("name,cache_size", [("qwen3-30b-a3b", 16), ("mixtral-8x7b-v0.1", 2)])
def test_planner_counts_experts_as_transformers_does(name, cache_size):
    config = load(name)
    meta = meta_model(config)
    plan = plan_memory(CONFIGS / f"{name}.json", dtype="bfloat16", moe_expert_cache_size=cache_size,
                       gpu_mem_bytes=141 << 30)
    assert plan_counts(plan) == moe_meta_counts(meta)
    assert plan.weight_bytes == sum(p.numel() * p.element_size() for p in meta.parameters())
    experts = moe_meta_counts(meta)["experts"]
    per_expert = experts // plan.num_experts
    assert plan.expert_bytes == 2 * experts
    assert plan.resident_expert_bytes == 2 * per_expert * cache_size
    assert plan.resident_weight_bytes == plan.weight_bytes - 2 * per_expert * (plan.num_experts - cache_size)
    assert plan.host_expert_bytes == plan.expert_bytes
    assert plan.active_params == plan.total_params - experts + per_expert * plan.num_experts_per_tok
    assert plan.kv_budget_bytes == plan.budget_bytes - plan.resident_weight_bytes - plan.workspace_bytes
    loading = load_bytes(read_shape(config), 2, 4096, expert_cache_size=cache_size)  # what loading checks
    assert (loading["weights"], loading["host_experts"]) == (plan.resident_weight_bytes, plan.expert_bytes)


def test_planner_reference_figures():
    qwen = plan_memory(CONFIGS / "qwen3-30b-a3b.json")
    assert qwen.weight_bytes == qwen.resident_weight_bytes == 61_064_245_248  # ~61 GB in bfloat16
    assert qwen.host_expert_bytes == 0
    assert qwen.active_params == 3_353_032_704  # the "A3B"
    mixtral = plan_memory(CONFIGS / "mixtral-8x7b-v0.1.json")
    assert mixtral.total_params == 46_702_792_704 and mixtral.active_params == 12_879_925_248
    # What a decode token reads: an untied embedding table gives it one row, not the 151,936 or 32,000.
    assert qwen.read_params_per_token == 3_353_032_704 - 151_936 * 2048 + 2048
    assert mixtral.read_params_per_token == 12_879_925_248 - 32_000 * 4096 + 4096
    tied = plan_memory(CONFIGS / "qwen3-0.6b.json")
    assert tied.tied_embeddings and tied.read_params_per_token == tied.active_params == tied.total_params


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tiny_moe_counts_match_transformers(arch, model_factory):
    path, hf = model_factory(arch)
    plan = plan_memory(path, dtype="float32")
    assert plan_counts(plan) == moe_meta_counts(hf)


# Proportions of Qwen3-30B-A3B's layers (k·h well above I_e), small: the MoE phase sets the peak.
WIDE_MOE = dict(hidden_size=256, moe_intermediate_size=96, num_experts=16, num_experts_per_tok=4,
                num_attention_heads=4, head_dim=64, mlp_only_layers=[], num_hidden_layers=2)


@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide-moe")
    make_model(path, "qwen3_moe", tokenizer=False, **WIDE_MOE)
    return str(path)


def test_moe_block_peak_equals_the_plan(wide_moe):
    """The PyTorch path's live tensors in one MoE block, counted by the diagnose tracker."""
    llm = LLM(wide_moe, dtype="float32", device="cpu", show_progress=False)
    shape = read_shape(json.loads((Path(wide_moe) / "config.json").read_text()))
    block = llm.engine.model.moe_blocks()[0]
    for tokens in (7, 96, 512):
        x = torch.randn(tokens, shape.hidden_size)
        tracker = TensorBytesTracker()
        with torch.inference_mode(), tracker:
            block(x)
        assert tracker.peak == moe_phase_bytes(shape, tokens, 4, fused=False)


def test_fused_forward_peak_equals_the_plan(wide_moe, monkeypatch):
    """The whole forward with the fused kernels' memory behaviour (tests/test_forward_memory.py's twins)."""
    from tests import test_forward_memory as fakes
    llm = LLM(wide_moe, dtype="float32", device="cpu", show_progress=False)
    engine = llm.engine
    fakes.run_fused_fakes(engine.model, monkeypatch)
    shape = read_shape(json.loads((Path(wide_moe) / "config.json").read_text()))
    batch = _probe_batch(engine, 96, 1)
    with torch.inference_mode():
        input_ids, positions, meta, _ = engine.runner.prepare(batch, {id(r) for r in batch.requests})
        tracker = TensorBytesTracker()
        with tracker:
            engine.model(input_ids, positions, meta)
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    assert moe_phase_bytes(shape, 96, 4) > 96 * 4 * ((q + 2 * kv) + (q + kv) + q + shape.hidden_size)  # the peak
    assert tracker.peak == decoder_peak_bytes(shape, 96, 4, fused=True)


# ---------------------------------------------------------------- synthetic routing


def test_synthetic_router_bias_is_off_by_default_and_labelled(model_factory):
    path, _ = model_factory("mixtral")
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, enable_prefix_caching=False)
    assert all(block.router_bias is None for block in llm.engine.model.moe_blocks())
    synthetic_router_bias(llm.engine.model)
    assert expert_cache_stats(llm.engine.model)["router"].startswith("synthetic")
    synthetic_router_bias(llm.engine.model, skew=None)
    assert expert_cache_stats(llm.engine.model)["router"] == "model"


def test_synthetic_router_bias_gives_locality_and_the_same_tokens_for_every_cache_size(model_factory):
    path, _ = model_factory("mixtral")
    outputs, hit_rates = [], []
    for size in (8, 2):
        llm = LLM(path, dtype="float32", device="cpu", show_progress=False, enable_prefix_caching=False)
        set_expert_cache_size(llm.engine.model, size)
        synthetic_router_bias(llm.engine.model, skew=1.0, seed=5)
        outputs.append(generate(llm))
        hit_rates.append(expert_cache_stats(llm.engine.model)["hit_rate"])
        check_caches(llm.engine.model)
    assert outputs[0] == outputs[1]
    assert hit_rates[1] > 0.6  # the uniform router hits < 0.4 with 2 of 8 resident (test above)


# ---------------------------------------------------------------- CUDA (skipped without it)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_cuda_eager_matches_cpu_for_every_cache_size(arch, model_factory, references):
    """Both MoE paths on CUDA, eager: the grouped kernel with every expert resident, then the PyTorch
    path with 2 of 8 resident, experts from pinned memory."""
    path, _ = model_factory(arch)
    llm = LLM(path, dtype="float32", device="cuda", enforce_eager=True, show_progress=False,
              enable_prefix_caching=False, max_num_seqs=8, max_num_batched_tokens=64)
    assert generate(llm) == references[arch]
    set_expert_cache_size(llm.engine.model, 2)
    host = llm.engine.model.moe_blocks()[0].experts.cache.host["gate_up_proj"]
    assert host.is_pinned() and llm.engine.model.moe_blocks()[0].experts.gate_up_proj.is_cuda
    assert generate(llm) == references[arch]
    check_caches(llm.engine.model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_load_allocates_only_the_resident_experts(model_factory):
    """On the device: the planner's resident weights, the rotary tables and the dense GEMV's workspace (a
    16-bit model on CUDA with the Triton kernels, memory.formulas.gemv_workspace_bytes); every expert pinned
    on the host."""
    path, _ = model_factory("mixtral")
    device = torch.device("cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    model, _, report = load_model(path, torch.bfloat16, device, max_positions=512, show_progress=False,
                                  expert_cache_size=2)
    torch.cuda.synchronize()
    shape = read_shape(json.loads((Path(path) / "config.json").read_text()))
    planned = load_bytes(shape, 2, 512, expert_cache_size=2)
    rounding = 512 * (len(list(model.parameters())) + 8)  # the allocator rounds each block up to 512 bytes
    kept = planned["weights"] + planned["rotary_tables"] + gemv_workspace_bytes(shape, 2, model.kernels.triton)
    assert kept <= torch.cuda.memory_allocated(device) - before <= kept + rounding
    assert report.host_weight_bytes == planned["host_experts"]
    assert all(t.is_pinned() for block in model.moe_blocks() for t in block.experts.cache.host.values())


def test_a_miss_is_copied_from_the_current_host_store_after_the_cache_is_resized():
    """load_into_slot keeps its views of the slots and of the host store; a new cache (set_resident)
    has a new store, whose bytes a miss must come from."""
    from mempath.kernels.dispatch import torch_kernels
    from mempath.model.moe import Experts
    experts = Experts(4, 8, 6, torch_kernels())
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn_like(experts.gate_up_proj))
        experts.down_proj.copy_(torch.randn_like(experts.down_proj))
    experts.set_resident(2)
    experts.load_into_slot(3, 1)
    assert torch.equal(experts.gate_up_proj[1], experts.cache.host["gate_up_proj"][3])
    experts.set_resident(3)
    experts.cache.host["gate_up_proj"][3].fill_(7.0)
    experts.cache.host["down_proj"][3].fill_(5.0)
    experts.load_into_slot(3, 2)
    assert (experts.gate_up_proj[2] == 7.0).all() and (experts.down_proj[2] == 5.0).all()


def test_planner_active_and_read_bytes_count_fp8_projections():
    """With -q fp8 the attention projections are one byte a weight: what a token reads shrinks by what they
    save, and so does the predicted decode's read time (the rows used parameters x dtype bytes)."""
    bf16 = plan_memory(CONFIGS / "qwen3-30b-a3b.json", moe_expert_cache_size=16)
    fp8 = plan_memory(CONFIGS / "qwen3-30b-a3b.json", moe_expert_cache_size=16, quantization="fp8")
    assert bf16.active_bytes == 2 * bf16.active_params and bf16.read_bytes_per_token == 2 * bf16.read_params_per_token
    saved = bf16.weight_bytes - fp8.weight_bytes  # the attention projections' (routed experts stay 16-bit)
    assert saved > 0 and fp8.active_params == bf16.active_params
    assert fp8.active_bytes == bf16.active_bytes - saved
    assert fp8.read_bytes_per_token == bf16.read_bytes_per_token - saved
    assert fp8.moe_decode_tokens_per_s > bf16.moe_decode_tokens_per_s
