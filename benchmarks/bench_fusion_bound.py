"""The most that fusing a decode step's small kernels away could save: the step timed without them (#17).

    python benchmarks/bench_fusion_bound.py --shape llama-3.1-8b --prompt-len 128      # CUDA
    python benchmarks/bench_fusion_bound.py --quantization fp8 --variants base,skip-small  # fp8 weights

Each variant builds the engine with some of its kernels replaced by nothing: SiLU-and-mul by a view of the
gate half, RMSNorm by the identity (its residual left as it was), rotary + KV write by the query as it came,
the attention by its query (no split or merge kernel), or the decode attention in one split. ``skip-small``
leaves the projections (and the embedding, LM head and sampler) alone in the step: what the chain of
projections costs by itself, against the weight-read limit.
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
            "skip-rope": ("rope",), "skip-attention": ("attention",),
            "skip-small": ("silu", "norm", "rope", "attention"), "one-split": ("split",)}


def kernels_without(skip, make=dispatch.triton_kernels):
    def build():
        kernels = make()
        if "silu" in skip:
            kernels.silu_and_mul = lambda x: x[..., : x.shape[-1] // 2]
        if "norm" in skip:
            kernels.rms_norm = lambda x, weight, eps, residual=None, out=None: (x, residual)
        if "rope" in skip:
            kernels.rope_and_store = lambda positions, q, *args, **kwargs: q
            kernels.qk_norm_rope_and_store = lambda positions, q, *args, **kwargs: q
        if "attention" in skip:
            kernels.attention = lambda q, k_cache, v_cache, meta, scale: q
        return kernels
    return build


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--quantization", choices=("none", "fp8"), default="none")
    a = parser.parse_args()
    if set(a.variants.split(",")) - set(VARIANTS):
        parser.error(f"--variants: unknown {sorted(set(a.variants.split(',')) - set(VARIANTS))}; "
                     f"name some of {','.join(VARIANTS)}")
    args = argparse.Namespace(shape=a.shape, batch=a.batch, prompt_len=a.prompt_len, new_tokens=a.new_tokens,
                              enforce_eager=False, quantization=None if a.quantization == "none" else a.quantization)
    bandwidth = bench_engine.copy_bandwidth()
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
            measured = bench_engine.measure_latency(args, prompts)
            result[name] = measured["ms_per_token"]
            limit = 1e3 * measured["read_bytes"] / bandwidth
            result.setdefault("weight_read_limit_ms", limit)
            print(f"{name}: {result[name]:.3f} ms/token ({100 * limit / result[name]:.1f}% of the weight-read limit, "
                  f"{limit:.3f} ms at {bandwidth / 1e12:.2f} TB/s: the weights a step reads)", flush=True)
    finally:
        dispatch.triton_kernels, attention_triton.decode_num_splits = make, splits
    print("RESULT " + json.dumps({"bench": "fusion_bound", "shape": a.shape, "prompt": a.prompt_len,
                                  "batch": a.batch, "quantization": a.quantization, "copy_bandwidth": bandwidth,
                                  **result}))


if __name__ == "__main__":
    main()
