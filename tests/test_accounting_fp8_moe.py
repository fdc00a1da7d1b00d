"""The fp8 and mixture-of-experts pathways counted alike by the engine (ledger, stats()), `mempath plan`,
`mempath diagnose`, the out-of-memory advice and /metrics (CPU, tiny random models)."""
import json
from pathlib import Path

import pytest
import torch

from mempath import LLM, SamplingParams
from mempath.config import EngineConfig
from mempath.memory.formulas import gemv_workspace_bytes, read_shape
from mempath.memory.ledger import Ledger
from mempath.memory.oom import explain_oom
from mempath.model.quant import fp8_gemv_bytes
from mempath.tools.diagnose.run import diagnose
from mempath.tools.plan import plan_memory
from tests.conftest import make_model

CONFIGS = Path(__file__).parent / "data" / "configs"
GiB = 1 << 30
CPU_KV_BYTES = 4 << 20


# ---------------------------------------------------------------- fp8 KV cache


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_and_engine_agree_on_fp8_kv_blocks(dtype, kv, model_factory):
    path, _ = model_factory("llama")
    llm = LLM(path, dtype=dtype, kv_cache_dtype=kv, device="cpu", cpu_kv_cache_bytes=CPU_KV_BYTES,
              show_progress=False)
    stats = llm.stats()
    plan = plan_memory(path, dtype=dtype, kv_cache_dtype=kv, block_size=llm.engine.config.block_size)
    assert plan.kv_bytes_per_block == llm.engine.runner.kv_bytes_per_block() == 2 * 2 * 16 * 2 * 16  # 1 B each
    assert stats["kv_blocks_total"] == CPU_KV_BYTES // plan.kv_bytes_per_block
    assert stats["ledger"]["kv_cache"]["bytes"] == stats["kv_blocks_total"] * plan.kv_bytes_per_block


def test_kv_out_of_memory_advice_counts_fp8_blocks():
    """An fp8 cache's block is half a bf16 one's: the blocks the free memory holds are twice as many."""
    config = EngineConfig(model=str(CONFIGS / "llama-3.1-8b.json"), kv_cache_dtype="fp8", max_num_seqs=64,
                          max_model_len=8192)
    text = explain_oom("kv_allocation", Ledger(), 3 * GiB, int(1.2 * GiB), config, dtype="bfloat16")
    # 2 (K, V) x 32 layers x 16 tokens x 8 KV heads x 128 x 1 B = 1 MiB a block: 1.2 GiB holds 1,228.
    assert "--num-gpu-blocks-override 1228" in text and "blocks of 1.00 MiB" in text
    assert "max-num-seqs 64 at max-model-len 8192 needs 32.00 GiB of KV" in text


# ---------------------------------------------------------------- fp8 weights


def test_the_pytorch_paths_plan_claims_no_gemv_workspace(tmp_path):
    """The fp8 GEMV's workspace exists only where the Triton kernels run (CUDA): the CPU engine has none,
    and the plan of the PyTorch path (fused_kernels=False) must not count one in its step peak."""
    make_model(tmp_path, "llama", dtype=torch.bfloat16, tokenizer=False)
    llm = LLM(str(tmp_path), dtype="bfloat16", quantization="fp8", device="cpu", show_progress=False)
    assert fp8_gemv_bytes(llm.engine.model) == 0
    shape = read_shape(json.loads((tmp_path / "config.json").read_text()))
    shape.quantization = "fp8"
    assert gemv_workspace_bytes(shape, 2, fused_kernels=False) == 0 < gemv_workspace_bytes(shape, 2, fused_kernels=True)
    settings = dict(dtype="bfloat16", fused_kernels=False, cublas_workspace=0)
    fp8 = plan_memory(str(tmp_path), quantization="fp8", **settings)
    dense = plan_memory(str(tmp_path), **settings)
    assert fp8.step_peak_bytes == dense.step_peak_bytes
    assert fp8.weight_bytes == llm.stats()["ledger"]["weights"]["bytes"]


# ---------------------------------------------------------------- diagnose: fp8 KV and an expert cache


EXPERT_SLOTS = 4


@pytest.fixture(scope="module")
def moe_report(tmp_path_factory):
    """`mempath diagnose` of a Mixtral whose experts are 8x the hidden size wide (the MoE phase sets the
    activation peak), half of its experts resident, over an fp8 KV cache."""
    path = tmp_path_factory.mktemp("moe-fp8-kv")
    make_model(path, "mixtral", intermediate_size=512)
    report = diagnose(str(path), device="cpu", probe_tokens=64, probe_seqs=4, leak_requests=2, out_dir=None,
                      cpu_kv_cache_bytes=CPU_KV_BYTES, max_model_len=256, moe_expert_cache_size=EXPERT_SLOTS,
                      kv_cache_dtype="fp8")
    return str(path), report, {row["pathway"]: row for row in report["pathways"]}


def test_diagnose_plans_the_fp8_kv_cache_the_engine_allocates(moe_report):
    _, report, rows = moe_report
    assert report["plan"]["kv_cache_dtype"] == "fp8"
    for name in ("kv_cache", "kv growth (peak during generation)"):
        assert rows[name]["error_pct"] == 0.0, rows[name]
    assert rows["kv_cache"]["measured"] == report["ledger"]["kv_cache"]["bytes"]


def test_diagnose_weights_row_leaves_the_host_expert_store_out(moe_report):
    """On the CPU the load stage's live tensors include the host store of every expert: it is the
    expert_host pathway's row, not the device's weights."""
    _, report, rows = moe_report
    for name in ("weights", "weights.experts", "expert_cache", "expert_host"):
        assert rows[name]["error_pct"] == 0.0, rows[name]
    ledger = report["ledger"]
    assert rows["weights"]["measured"] == ledger["weights"]["bytes"] + ledger["expert_cache"]["bytes"]
    assert rows["expert_host"]["measured"] == report["engine_stats"]["expert_cache"]["host_bytes"]


def test_diagnose_probe_plan_has_the_expert_cache(moe_report):
    """The forward's rows are planned with the engine's expert slots, whose waves hold their own
    temporaries (memory.formulas.moe_grouped_phase_bytes), as its serving plan is."""
    path, report, rows = moe_report
    probe = report["probe"]
    settings = dict(dtype="float32", max_model_len=256, max_num_seqs=probe["sequences"],
                    max_num_batched_tokens=probe["tokens"], cuda_graphs=False, fused_kernels=False,
                    cublas_workspace=0, kv_cache_dtype="fp8")
    cached = plan_memory(path, moe_expert_cache_size=EXPERT_SLOTS, **settings)
    assert report["plan"]["expert_cache_size"] == EXPERT_SLOTS
    assert rows["decoder layer peak"]["predicted"] == cached.activation_peak_bytes
    assert cached.activation_peak_bytes > plan_memory(path, **settings).activation_peak_bytes


# ---------------------------------------------------------------- /metrics


def test_metrics_do_not_call_misses_run_on_the_host_copies(model_factory):
    """--moe-cpu-experts always: every miss runs on the host and none is copied; /metrics' misses
    counter says so (a miss: not found in a slot), and its bytes copied are 0."""
    from prometheus_client.parser import text_string_to_metric_families

    from mempath.server.metrics import ServerMetrics
    path, _ = model_factory("mixtral")
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, moe_expert_cache_size=2,
              moe_cpu_experts="always")
    llm.generate([[1, 5, 9, 13, 17]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    stats = llm.stats()
    cache = stats["expert_cache"]
    assert cache["misses"] == cache["host_experts"] > 0 and cache["bytes_loaded"] == 0
    families = {f.name: f for f in text_string_to_metric_families(ServerMetrics("m", 16).render(stats).decode())}
    misses = families["mempath:moe_expert_cache_misses"]
    assert misses.samples[0].value == cache["misses"]
    assert families["mempath:moe_expert_cache_bytes_copied"].samples[0].value == 0
    assert "run on the host" in misses.documentation, misses.documentation  # not only "copied"
