"""`mempath diagnose` end to end on the CPU, and the out-of-memory explanations."""
import json
import re
from pathlib import Path

import pytest
import torch

from mempath.config import EngineConfig
from mempath.memory.diagnose import TensorBytesTracker, diagnose
from mempath.memory.ledger import Ledger
from mempath.memory.oom import (MempathOutOfMemoryError, explain_oom, oom_guard,
                                parse_oom_message)
from mempath.memory.plan import plan_memory
from mempath.memory.report import format_table

CONFIGS = Path(__file__).parent / "data" / "configs"
GiB = 1 << 30


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from tests.conftest import make_model
    model_dir = tmp_path_factory.mktemp("diag-model")
    make_model(model_dir, "qwen3")  # tied embeddings and q/k norms: the awkward weight groups
    out = tmp_path_factory.mktemp("diag-out")
    torch.set_num_threads(2)
    return diagnose(str(model_dir), device="cpu", train=True, probe_tokens=64, probe_seqs=4,
                    leak_requests=4, out_dir=out, cpu_kv_cache_bytes=4 << 20, max_model_len=256)


def test_json_has_every_pathway_with_predicted_measured_error(report):
    data = json.loads(Path(report["files"]["json"]).read_text())
    rows = {r["pathway"]: r for r in data["pathways"]}
    for name in ("weights", "weights.embedding", "weights.attention", "weights.mlp", "weights.norms",
                 "kv_cache", "embedding (forward output)", "decoder layer peak", "decoder forward peak",
                 "logits", "kv growth (peak during generation)", "train.gradients",
                 "train.optimizer_state", "train.activations"):
        row = rows[name]
        assert row["predicted"] is not None and row["measured"] is not None, name
        assert row["predicted_source"] and row["measured_source"], name
        assert row["error_pct"] is not None, name
    # What is sized by a formula over tensor shapes must match exactly.
    for exact in ("weights", "weights.attention", "weights.mlp", "weights.norms", "kv_cache",
                  "embedding (forward output)", "kv growth (peak during generation)",
                  "train.gradients", "train.optimizer_state"):
        assert rows[exact]["error_pct"] == 0.0, (exact, rows[exact])
    assert rows["weights.lm_head"]["predicted"] == 0  # tied: shares the embedding
    # Activations are an estimate, and never above what was measured: the planner counts tensors
    # the forward must hold, and the CPU reference attention (not flash-style) adds per-sequence
    # K/V copies and scores. On this attention-heavy shape (q heads twice the hidden size) that
    # reads +14% in a layer and +29% over the forward; the fused-kernel formula, which is not the
    # CPU's path, would read +33% and +50%.
    assert 0 <= rows["decoder layer peak"]["error_pct"] < 20, rows["decoder layer peak"]
    assert 0 <= rows["decoder forward peak"]["error_pct"] < 40, rows["decoder forward peak"]
    assert abs(rows["logits"]["error_pct"]) < 5, rows["logits"]


def test_json_side_figures(report):
    assert report["leak"]["kv_blocks_used_after"] == 0
    assert report["leak"]["ok"], report["leak"]
    assert report["bandwidth"]["reason"].startswith("n/a: no CUDA")
    assert report["pcie"]["reason"].startswith("n/a: no CUDA")
    assert report["host"]["load_rss_anon_peak"] >= report["host"]["load_rss_anon_start"] > 0
    growth = report["kv_growth"]
    assert len(growth) > 2 and all(s["predicted_bytes"] == s["measured_bytes"] for s in growth)
    stages = {s["stage"] for s in (dict(zip(report["timeline"]["columns"], x))
                                   for x in report["timeline"]["samples"])}
    assert {"load weights", "decoder forward", "kv growth (generation)"} <= stages


def test_html_has_the_plots(report):
    text = Path(report["files"]["html"]).read_text()
    assert text.startswith("<!doctype html>")
    assert '<svg class="timeline"' in text and '<svg class="bars"' in text
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")  # nothing fetched
    assert "decoder forward peak" in text


def test_terminal_table(report):
    table = format_table(report)
    assert re.search(r"^weights\s+\S+ KiB\s+\S+ KiB\s+\+0\.0%", table, re.MULTILINE)
    assert "leak check" in table and "n/a: no CUDA" in table


def test_tracker_counts_allocations_not_views():
    tracker = TensorBytesTracker()
    weight = torch.randn(64, 64)
    with tracker:
        a = torch.empty(1000)
        assert tracker.live == 4000
        view = a.view(10, 100).t()
        assert tracker.live == 4000
        product = weight @ weight
        assert tracker.live == 4000 + 64 * 64 * 4
        del a, view, product
        assert tracker.live == 0
    assert tracker.peak == 4000 + 64 * 64 * 4


# ---------------------------------------------------------------- OOM explanations

def _config(**kw):
    return EngineConfig(model=str(CONFIGS / "llama-3.1-8b.json"), **kw)


def test_parse_oom_messages():
    cuda = ("CUDA out of memory. Tried to allocate 3.10 GiB. GPU 0 has a total capacity of "
            "139.80 GiB of which 1.20 GiB is free.")
    assert parse_oom_message(cuda) == (int(3.10 * GiB), int(1.20 * GiB))
    cpu = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes."
    assert parse_oom_message(cpu) == (4096, None)


def test_kv_oom_names_pathway_and_fix():
    config = _config(max_num_seqs=64, max_model_len=8192)
    ledger = Ledger()
    ledger.record("weights", 16_060_522_496, "cuda", "measured")
    message = ("CUDA out of memory. Tried to allocate 3.10 GiB. GPU 0 has a total capacity of "
               "139.80 GiB of which 1.20 GiB is free.")
    with pytest.raises(MempathOutOfMemoryError) as caught:
        with oom_guard("kv_allocation", ledger, config, dtype="bfloat16"):
            raise torch.OutOfMemoryError(message)
    error = caught.value
    text = str(error)
    assert error.pathway == "kv_cache" and error.stage == "kv_allocation"
    assert "kv_cache pathway exceeded its budget" in text
    assert "weights" in text and "16,060,522,496" in text  # the ledger table
    # 1.2 GiB free / 2 MiB blocks = 614 blocks; 8192 tokens = 512 blocks per sequence.
    assert "--num-gpu-blocks-override 614" in text
    assert "max-num-seqs 64 at max-model-len 8192 needs 64.00 GiB of KV" in text
    assert "--max-num-seqs 1" in text
    assert isinstance(error.__cause__, torch.OutOfMemoryError)


def test_weights_too_big_for_the_budget():
    config = _config()
    # The planner says the fp32 weights alone exceed a 24 GB device ...
    plan = plan_memory(config.model, dtype="float32", gpu_mem_bytes=24 * 10**9)
    assert plan.weight_bytes > plan.budget_bytes
    assert any("does not fit: weights alone" in line for line in plan.advice)
    # ... and an OOM while loading says which pathway and what would fit.
    text = explain_oom("load", Ledger(), 1 << 30, 20 * GiB, config, dtype="float32")
    assert "weights pathway exceeded its budget" in text
    assert "--dtype bfloat16: weights need 14.96 GiB instead of 29.92 GiB" in text


def test_step_oom_gives_a_smaller_batch():
    config = _config(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=8192)
    text = explain_oom("step", Ledger(), 2 * GiB, 1 * GiB, config, dtype="bfloat16")
    assert "activations pathway exceeded its budget" in text
    tokens = int(re.search(r"--max-num-batched-tokens (\d+)", text).group(1))
    plan = plan_memory(config.model, dtype="bfloat16", max_model_len=8192, max_num_batched_tokens=tokens,
                       max_num_seqs=256)
    assert 0 < tokens < 8192
    assert plan.activation_peak_bytes + plan.logits_bytes <= GiB  # the advice really fits


def test_real_cpu_allocation_failure_is_explained():
    config = EngineConfig(model=str(CONFIGS / "qwen3-0.6b.json"), device="cpu")
    with pytest.raises(MempathOutOfMemoryError) as caught:
        with oom_guard("profile", Ledger(), config):
            torch.empty(1 << 50, dtype=torch.uint8)  # far beyond any host: a budget too small
    assert caught.value.requested_bytes == 1 << 50
    assert "activation_peak pathway exceeded its budget" in str(caught.value)


def test_other_errors_pass_through():
    with pytest.raises(ValueError):
        with oom_guard("load", Ledger(), _config()):
            raise ValueError("not memory")


def test_activation_peak_prediction_on_the_cpu_path(tmp_path):
    """The planner's PyTorch-path formula against the measured forward (the issue's target
    is 10%), on a model with real proportions (MLP 3.5x the hidden size, as Llama-3.1-8B)
    where the MLP phase sets the peak, as it does in real models."""
    from tests.conftest import make_model
    make_model(tmp_path / "m", "llama", tokenizer=False, hidden_size=128, intermediate_size=448,
               num_attention_heads=4, num_key_value_heads=2)
    result = diagnose(str(tmp_path / "m"), device="cpu", probe_tokens=512, probe_seqs=4, leak_requests=2,
                      out_dir=tmp_path / "out", cpu_kv_cache_bytes=8 << 20, max_model_len=256)
    rows = {r["pathway"]: r for r in json.loads(Path(result["files"]["json"]).read_text())["pathways"]}
    errors = {k: rows[k]["error_pct"] for k in ("decoder layer peak", "decoder forward peak")}
    print(errors)
    assert abs(errors["decoder forward peak"]) <= 10
    assert abs(errors["decoder layer peak"]) <= 10
