"""The persistent batch-1 decode prototype (benchmarks/persistent_decode.py) against its PyTorch twin.

On the CPU the kernel runs a launch a phase under Triton's interpreter (in a child process: Triton reads
TRITON_INTERPRET when first imported); on CUDA it runs persistent, every phase of every layer in one launch.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import persistent_decode as pd  # noqa: E402

# A small Llama-like stack: the last row tile, the last K tile and the last attention chunk are partial.
SMALL = dict(layers=2, hidden=64, intermediate=100, q_heads=4, kv_heads=2, head_dim=16)
TILES = dict(row_tile=16, k_tile=32, positions=8, num_warps=4)


def run_case(dtype: torch.dtype, pos: int, splits: int, device: str, persistent: bool, programs: int = 3,
             pipeline: bool = False, preload: bool = False) -> dict:
    """One step through the kernel and through the twin, from the same caches; the largest differences."""
    torch.manual_seed(pos)
    stack = pd.random_stack(**SMALL, dtype=dtype, device=device, seed=pos)
    block_size, blocks = 16, 7
    shape = (SMALL["layers"], blocks, block_size, SMALL["kv_heads"], SMALL["head_dim"])
    k_cache = torch.randn(shape, device=device).to(dtype)
    v_cache = torch.randn(shape, device=device).to(dtype)
    block_table = torch.randperm(blocks, device=device)[:pos // block_size + 1].to(torch.int32)
    cos, sin = pd.rope_tables(64, SMALL["head_dim"], 10000.0, device)
    x0 = torch.randn(SMALL["hidden"], device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = pd.layer_stack_torch(x0, stack, k_ref, v_ref, block_table, cos, sin, pos)
    bufs = pd.StepBuffers.make(stack, splits, device)
    bufs.x.copy_(x0)
    pd.launch_layer_stack(stack, bufs, k_cache, v_cache, block_table, cos, sin, pos, programs=programs,
                          persistent=persistent, cooperative=persistent, pipeline=pipeline, preload=preload, **TILES)
    # The whole caches are compared: a write to a wrong slot shows.
    return {"x": ((bufs.x - ref).abs().max() / ref.abs().max()).item(),
            "k": (k_cache.float() - k_ref.float()).abs().max().item(),
            "v": (v_cache.float() - v_ref.float()).abs().max().item()}


CASES = [("float32", 37, 2, False), ("float32", 5, 4, True), ("float32", 47, 1, False), ("bfloat16", 37, 2, True)]


def interpreter_results() -> list[dict]:
    code = ("import json, sys, torch; sys.path.insert(0, sys.argv[1]); import test_persistent_decode as t; "
            "print(json.dumps([t.run_case(getattr(torch, d), p, s, 'cpu', False, pipeline=pl) "
            "for d, p, s, pl in t.CASES]))")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not pd.HAS_TRITON, reason="needs triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below runs the kernel itself")
def test_launch_per_phase_matches_the_twin_in_the_interpreter():
    for (dtype, pos, splits, _), result in zip(CASES, interpreter_results()):
        # float32: only the sums' order differs. bfloat16: a K or V the kernel rounds the other way is an
        # ulp (1/64 at |x| < 4), and the residual follows it.
        bound, kv_bound = (1e-5, 1e-5) if dtype == "float32" else (2e-3, 1 / 32)
        assert result["x"] < bound, (dtype, pos, splits, result)
        assert result["k"] < kv_bound and result["v"] < kv_bound, (dtype, pos, splits, result)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("programs", [3, 64])
def test_persistent_kernel_matches_the_twin_on_cuda(programs):
    for dtype, pos, splits, pipeline in CASES:
        # The pipelined cases also load each phase's first tile between a barrier's halves.
        result = run_case(getattr(torch, dtype), pos, splits, "cuda", True, programs, pipeline, preload=pipeline)
        bound, kv_bound = (1e-5, 1e-5) if dtype == "float32" else (2e-3, 1 / 32)
        assert result["x"] < bound, (dtype, pos, splits, result)
        assert result["k"] < kv_bound and result["v"] < kv_bound, (dtype, pos, splits, result)


def test_split_length_covers_the_context_in_whole_chunks():
    for pos in (0, 5, 31, 32, 100, 2048):
        for splits in (1, 2, 4, 8):
            length = pd.split_length(pos, splits, 32)
            assert length % 32 == 0 and length * splits >= pos + 1 and length - 32 < -(-(pos + 1) // splits)
