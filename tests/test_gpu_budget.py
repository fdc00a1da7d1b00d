"""The budget is a promise: device use never passes gpu_memory_utilization x total.

GPU only (skipped without CUDA): device use is ``total - free`` from the driver, read
after every step of a mixed sampling workload, so it counts memory PyTorch does not
see (the context, kernel modules, captured graphs) as well as the allocator's cache.
The CPU side of the same arithmetic is in tests/test_engine_budget.py.
"""
import argparse
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parents[1]


def test_device_use_stays_within_the_budget_over_1000_sampling_steps():
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_budget import run
    torch.cuda.empty_cache()
    args = argparse.Namespace(shape="qwen3-0.6b", gpu_memory_utilization=0.3, max_model_len=4096,
                              steps=1000, concurrency=128, seed=0)
    result = run(args)
    print({k: result[k] for k in ("limit", "after_start", "peak", "over_limit_bytes", "num_device_alloc")})
    assert result["after_start"]["used"] <= result["limit"]
    assert result["peak"]["used"] <= result["limit"], result["peak"]
