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
