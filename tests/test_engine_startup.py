"""Start-up stages: what an observer (mempath diagnose, bench_budget) sees, in order."""
from contextlib import contextmanager

from mempath import EngineConfig
from mempath.engine.engine import LLMEngine


def test_stage_observer_sees_each_stage_that_fills_a_pathway(model_factory, tmp_path):
    path, _ = model_factory("llama")
    seen = []

    @contextmanager
    def observe(name, pathway):
        seen.append(("begin", name, pathway))
        yield
        seen.append(("end", name, pathway))

    config = EngineConfig.from_kwargs(path, dtype="float32", device="cpu", cpu_kv_gb=0.01)
    engine = LLMEngine(config, show_progress=False, stage=observe)
    assert seen == [("begin", "load weights", "weights"), ("end", "load weights", "weights"),
                    ("begin", "kv allocation", "kv_cache"), ("end", "kv allocation", "kv_cache"),
                    ("begin", "cuda graph capture", "cuda_graphs"), ("end", "cuda graph capture", "cuda_graphs"),
                    ("begin", "attach tiers", None), ("end", "attach tiers", None)]
    assert engine.ledger.as_dict()["weights"]["bytes"] > 0


def test_gpu_memory_utilization_on_the_cpu_says_it_changes_nothing(model_factory, caplog):
    """On the CPU the KV cache is --cpu-kv-cache-bytes: a utilization given there was dropped without a word."""
    import logging
    path, _ = model_factory("llama")
    caplog.set_level(logging.WARNING)
    LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32"), show_progress=False)
    assert not [r for r in caplog.records if "gpu-memory-utilization" in r.getMessage()]
    LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", gpu_memory_utilization=0.5),
              show_progress=False)
    said = [r.getMessage() for r in caplog.records if "gpu-memory-utilization" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("--gpu-memory-utilization 0.5 has no effect on the CPU"), said
