"""The most that fusing a decode step's small kernels away could save: the step timed without them (#17).

    python benchmarks/bench_fusion_bound.py --shape llama-3.1-8b --prompt-len 128      # CUDA

Each variant builds the engine with some of its kernels replaced by nothing: SiLU-and-mul by a view of the
gate half, RMSNorm by the identity (its residual left as it was), or the decode attention in one split.
The results are wrong by design; only the time counts: a fused kernel still does the work, so the gain
of a fusion is at most the difference to ``base``. Random weights (``load_format="dummy"``), greedy decode
as ``bench_engine.py latency`` times it. Prints one line a variant and one ``RESULT`` JSON line.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_engine  # noqa: E402
from mempath.kernels import attention_triton, dispatch  # noqa: E402

VARIANTS = {"base": (), "skip-silu": ("silu",), "skip-norms": ("norm",), "skip-both": ("silu", "norm"),
            "one-split": ("split",)}


def kernels_without(skip, make=dispatch.triton_kernels):
    def build():
        kernels = make()
        if "silu" in skip:
            kernels.silu_and_mul = lambda x: x[..., : x.shape[-1] // 2]
        if "norm" in skip:
            kernels.rms_norm = lambda x, weight, eps, residual=None, out=None: (x, residual)
        return kernels
    return build


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    a = parser.parse_args()
    args = argparse.Namespace(shape=a.shape, batch=a.batch, prompt_len=a.prompt_len, new_tokens=a.new_tokens,
                              enforce_eager=False)
    config = json.loads((bench_engine.SHAPES / f"{a.shape}.json").read_text())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config["vocab_size"], a.prompt_len).tolist() for _ in range(a.batch)]
    make, splits = dispatch.triton_kernels, attention_triton.decode_num_splits
    result = {}
    try:
        for name in a.variants.split(","):
            skip = VARIANTS[name]
            dispatch.triton_kernels = kernels_without(skip, make)
            attention_triton.decode_num_splits = (lambda *_, **__: 1) if "split" in skip else splits
            result[name] = bench_engine.measure_latency(args, prompts)["ms_per_token"]
            print(f"{name}: {result[name]:.3f} ms/token", flush=True)
    finally:
        dispatch.triton_kernels, attention_triton.decode_num_splits = make, splits
    print("RESULT " + json.dumps({"bench": "fusion_bound", "shape": a.shape, "prompt": a.prompt_len,
                                  "batch": a.batch, **result}))


if __name__ == "__main__":
    main()
