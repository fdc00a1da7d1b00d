"""`mempath plan A B ...`: several models' plan on one device against the engine's own ledger."""
import json

import pytest

from mempath import LLM
from mempath.cli import main
from mempath.memory.budget import ALLOCATION_ROUNDING, OUTSIDE_TORCH_GROWTH
from mempath.tools.plan import plan_memory
from mempath.tools.plan_multi import plan_models


def test_plan_agrees_with_the_engine_ledger(two_models):
    """Every figure the plan derives that the CPU engine also has: page, block sizes, weights, pool, KV."""
    llama, qwen = two_models
    options = {"dtype": "float32", "max_model_len": 256, "num_gpu_blocks_override": 20}
    plan = plan_models([f"a={llama}", f"b={qwen}"], kv_min_share=0.25, **options)
    llm = LLM([f"a={llama}", f"b={qwen}"], show_progress=False, kv_min_share=0.25, **options)
    engine = llm.engine
    ledgers = engine.first.budget.ledgers
    assert plan.page_bytes == engine.pool.page_bytes
    assert plan.num_pages == engine.pool.num_pages == 20
    assert plan.guaranteed_pages == engine.pool.guaranteed() == 5
    assert plan.num_pages * plan.page_bytes == ledgers["shared KV pages"].as_dict()["kv_cache"]["bytes"]
    for entry in plan.models:
        model = engine.engines[entry.name]
        assert entry.plan.block_size == model.config.block_size
        assert entry.plan.kv_bytes_per_block == model.runner.kv_bytes_per_block()
        assert entry.plan.weight_bytes == ledgers[entry.name].as_dict()["weights"]["bytes"]
        assert entry.kv_tokens_alone == model.kv.num_blocks * model.config.block_size
        assert entry.kv_tokens_guaranteed == engine.pool.guaranteed() * model.config.block_size
    assert [m.plan.block_size for m in plan.models] == [32, 16]  # the Qwen3 has twice the KV per token
    assert [m.page_fill for m in plan.models] == [1.0, 1.0]


def test_pool_is_what_the_budget_leaves(two_models):
    llama, qwen = two_models
    gib = 1 << 30
    plan = plan_models([llama, qwen], gpu_mem_bytes=gib, context_bytes=1 << 20, dtype="bfloat16",
                       max_model_len=256, kv_min_share=0.1)
    # Each model's figures are plan_memory's at its block size in the pool.
    alone = [plan_memory(path, dtype="bfloat16", max_model_len=256, block_size=m.plan.block_size,
                         max_num_seqs=m.plan.max_num_seqs) for path, m in zip((llama, qwen), plan.models)]
    held = [a.resident_weight_bytes + a.step_peak_bytes + a.step_largest_block_bytes + a.cuda_graph_bytes
            for a in alone]
    assert [m.device_bytes for m in plan.models] == held
    # The context and the room for growth outside PyTorch once, not per model (multi/startup.py).
    assert plan.pool_bytes == int(gib * 0.9) - sum(held) - (1 << 20) - OUTSIDE_TORCH_GROWTH
    assert plan.num_pages == (plan.pool_bytes - ALLOCATION_ROUNDING) // plan.page_bytes  # the pool's rounding
    assert plan.guaranteed_pages == int(0.1 * plan.num_pages)
    assert plan.fits and not plan.advice


def test_cli_several_models(two_models, capsys):
    llama, qwen = two_models
    assert main(["plan", f"small={llama}", f"big={qwen}", "--gpu-mem", "1GiB", "--max-model-len", "256",
                 "--kv-min-share", "0.2"]) == 0
    text = capsys.readouterr().out
    assert "2 models on one device" in text and "= shared KV pool" in text
    assert "small: LlamaForCausalLM" in text and "big: Qwen3ForCausalLM" in text
    assert main(["plan", llama, qwen, "--gpu-mem", "1GiB", "--max-model-len", "256", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["models"]) == 2 and data["num_pages"] > 0


def test_cli_one_model_unchanged(two_models, capsys):
    llama, _ = two_models
    assert main(["plan", llama, "--gpu-mem", "1GiB", "--max-model-len", "256"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("mempath plan: LlamaForCausalLM") and "KV blocks" in text


@pytest.mark.parametrize("argv, message", [
    (["--kv-min-share", "0.6"], "use --kv-min-share 0.50 or less"),
    (["--train"], "--train plans one model"),
    (["--gpu-mem", "1MiB"], "no KV page fits"),
])
def test_cli_bad_input_one_line(two_models, capsys, argv, message):
    llama, qwen = two_models
    code = main(["plan", llama, qwen, "--max-model-len", "256", *argv] + ([] if "--gpu-mem" in argv else
                                                                         ["--gpu-mem", "1GiB"]))
    captured = capsys.readouterr()
    assert message in captured.err + captured.out
    if "no KV page" not in message:
        assert code == 2 and len(captured.err.strip().splitlines()) == 1


def test_one_model_kv_min_share_refused(two_models, capsys):
    llama, _ = two_models
    assert main(["plan", llama, "--kv-min-share", "0.2", "--gpu-mem", "1GiB"]) == 2
    assert "plan several models" in capsys.readouterr().err


def test_plan_counts_the_pinned_weight_copies_of_sleep_offload_weights(two_models, capsys):
    from mempath.memory.ledger import Pathway
    from mempath.tools.plan_multi import ARENA_GRANULARITY
    llama, qwen = two_models
    plan = plan_models([f"a={llama}", f"b={qwen}"], dtype="float32", max_model_len=256, num_gpu_blocks_override=20,
                       sleep_offload_weights=True)
    llm = LLM([f"a={llama}", f"b={qwen}"], show_progress=False, dtype="float32", max_model_len=256,
              num_gpu_blocks_override=20, sleep_after=60, sleep_offload_weights=True)
    for entry in plan.models:
        copy = entry.host_weight_copy_bytes
        assert copy % ARENA_GRANULARITY == 0 and 0 <= copy - entry.plan.weight_bytes < ARENA_GRANULARITY
        # The CPU's arena aligns each tensor to 256 bytes, not CUDA's 2 MiB: no larger than the plan.
        assert entry.plan.weight_bytes <= llm.engines[entry.name].ledger.get(Pathway.WEIGHTS_HOST) <= copy
    assert main(["plan", f"a={llama}", f"b={qwen}", "--dtype", "float32", "--num-gpu-blocks-override", "20",
                 "--sleep-offload-weights"]) == 0
    out = capsys.readouterr().out
    assert "pinned at start-up (--sleep-offload-weights)" in out and "a: its weights' copy while asleep" in out
    assert main(["plan", llama, "--sleep-offload-weights"]) == 2
    assert "--sleep-offload-weights plan several models" in capsys.readouterr().err
