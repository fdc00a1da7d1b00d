"""What the realistic mix (bench_mix.py) could take at best, derived on the CPU: no model runs.

The mix's seeded lengths are scheduled as the engine schedules them when every request fits
(max_num_seqs at least the request count, a KV pool that holds them all): each step runs
every decoding request's one token first, then fills max_num_batched_tokens with prompt
chunks in arrival order; a request whose prompt completes samples its first token in that
step. Each step is then bounded at the given rates, two ways:

- ``bound``: the larger of its matmul FLOPs (2 x the layers' parameters a token, plus the LM
  head's for each sampled row) and its bytes (the weights once, the K and V of every position
  each row attends to), as bench_mix.py's step classes are;
- ``serial``: the projections' bound (FLOPs or weight bytes, whichever is slower) plus the KV
  bytes, for a step whose attention does not run beside its matrix multiplies.

The step count is this model of the scheduler's, not a measurement; bench_mix.py reports the
same two bounds over the steps it measured (on CUDA). The rates are arguments: pass the matmul
rate and copy bandwidth a run measured.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_mix import MixSpec, StepCosts, lognormal_lengths, step_classes  # noqa: E402
from mempath.memory.formulas import count_params, kv_bytes_per_token, shape_from_spec, weight_bytes  # noqa: E402
from mempath.model.spec import ModelSpec  # noqa: E402

SHAPES = ROOT / "tests" / "data" / "configs"


def schedule(inputs: list[int], outputs: list[int], max_num_batched_tokens: int):
    """Yield each step's (tokens, rows, sampled rows, KV positions attended), bench_mix.py's step shape, until
    every request is done."""
    n = len(inputs)
    prefilled, generated = [0] * n, [0] * n
    next_prompt = 0  # requests before it have their whole prompt computed
    while True:
        decoding = [i for i in range(next_prompt) if generated[i] < outputs[i]]
        budget = max_num_batched_tokens - len(decoding)
        chunks = []
        i = next_prompt
        while budget > 0 and i < n:
            take = min(budget, inputs[i] - prefilled[i])
            chunks.append((i, take))
            budget -= take
            i += 1
        if not decoding and not chunks:
            return
        kv = sum(inputs[r] + generated[r] for r in decoding) + sum(prefilled[r] + c for r, c in chunks)
        sampled = len(decoding) + sum(1 for r, c in chunks if prefilled[r] + c == inputs[r])
        yield len(decoding) + sum(c for _, c in chunks), len(decoding) + len(chunks), sampled, kv
        for r in decoding:
            generated[r] += 1
        for r, c in chunks:
            prefilled[r] += c
            if prefilled[r] == inputs[r]:
                generated[r] = 1
                next_prompt = r + 1


def bounds(shape_name: str, n: int, seed: int, mix: MixSpec, max_num_batched_tokens: int, rate: float,
           bandwidth: float, dtype_bytes: int = 2) -> dict:
    spec = ModelSpec.from_hf_config(json.loads((SHAPES / f"{shape_name}.json").read_text()))
    shape = shape_from_spec(spec)
    counts = count_params(shape)
    lm_head = counts["lm_head"] or counts["embedding"]
    layers = counts["total"] - counts["embedding"] - counts["lm_head"]
    # The weights a step reads: all but the embedding table, whose few looked-up rows are left out.
    read = weight_bytes(shape, dtype_bytes)["total"] - (counts["embedding"] * dtype_bytes if counts["lm_head"] else 0)
    kv_token = kv_bytes_per_token(shape, dtype_bytes)
    rng = np.random.default_rng(seed)
    inputs = lognormal_lengths(n, mix.input_median, mix.input_sigma, mix.input_cap, rng)
    outputs = lognormal_lengths(n, mix.output_median, mix.output_sigma, mix.output_cap, rng)
    costs = StepCosts(layer_params=layers, lm_head_params=lm_head, weight_bytes=read, kv_bytes_per_token=kv_token,
                      matmul_rate=rate, bandwidth=bandwidth)
    shapes = list(schedule(inputs, outputs, max_num_batched_tokens))
    by_class = step_classes(shapes, [0.0] * len(shapes), costs)  # no device time: a derivation
    classes = {name: {key: c[key] for key in ("steps", "bound_s", "serial_bound_s", "kv_s")}
               for name, c in by_class["classes"].items()}
    steps, plain, serial = len(shapes), by_class["schedule_bound_s"], by_class["serial_bound_s"]
    flops = 2 * (layers * (sum(inputs) + sum(outputs)) + lm_head * sum(outputs)) / rate
    out_tokens = sum(outputs)
    return {"shape": shape_name, "requests": n, "input_tokens": sum(inputs), "output_tokens": out_tokens,
            "steps": steps, "matmul_rate": rate, "bandwidth": bandwidth, "flops_s": flops,
            "bound_s": plain, "serial_bound_s": serial, "flops_output_tok_s": out_tokens / flops,
            "bound_output_tok_s": out_tokens / plain, "serial_bound_output_tok_s": out_tokens / serial,
            "classes": classes}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--matmul-rate", type=float, required=True, help="FLOP/s, as a run measured it")
    parser.add_argument("--bandwidth", type=float, required=True, help="copy bytes/s, as a run measured it")
    parser.add_argument("--target-output-tok-s", type=float, default=None)
    args = parser.parse_args(argv)
    r = bounds(args.shape, args.num_requests, args.seed, MixSpec(), args.max_num_batched_tokens, args.matmul_rate,
               args.bandwidth)
    print(f"{r['shape']}: {r['requests']} requests, {r['input_tokens']:,} input / {r['output_tokens']:,} output "
          f"tokens, {r['steps']} steps (this script's schedule); matmul {r['matmul_rate'] / 1e12:.1f} TFLOP/s, "
          f"copy {r['bandwidth'] / 1e12:.2f} TB/s")
    # bench_mix.py's MFU limit counts every parameter for every token; this counts the LM head for sampled rows.
    for label, key in (("the steps' FLOPs alone", "flops"), ("steps' bound", "bound"),
                       ("serial bound (attention after the projections)", "serial_bound")):
        print(f"  {label}: {r[key + '_s']:.2f} s, {r[key + '_output_tok_s']:,.0f} output tok/s")
    for name, c in r["classes"].items():
        print(f"    {name:>15}: {c['steps']:5d} steps, bound {c['bound_s']:6.2f} s, serial {c['serial_bound_s']:6.2f} s "
              f"(of which KV {c['kv_s']:5.2f} s)")
    if args.target_output_tok_s:
        r["target_of_serial_bound"] = args.target_output_tok_s / r["serial_bound_output_tok_s"]
        print(f"  {args.target_output_tok_s:,.0f} output tok/s is {100 * r['target_of_serial_bound']:.1f}% of the "
              f"serial bound's speed")
    return r


if __name__ == "__main__":
    main()
