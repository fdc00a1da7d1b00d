"""Does device use stay within gpu_memory_utilization × total while serving?

    python benchmarks/bench_budget.py --shape llama-3.1-8b --gpu-memory-utilization 0.5 --steps 1000

Starts the engine (random bf16 weights of the shape), then runs a mixed workload —
lognormal prompt and output lengths, greedy / temperature / top-k / top-p / min-p
rows, logprobs and seeds, requests topped up every step — and reads
``torch.cuda.mem_get_info`` after every step. Device use is ``total - free``: every
process's memory on the device, so run it on an otherwise idle GPU. Prints the limit,
device use after start-up and its maximum while serving, split into PyTorch's
reserved memory and the rest (CUDA context, kernel modules, libraries), and one JSON
line (prefix ``RESULT``).
"""
import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_engine import SHAPES, model_dir  # noqa: E402
from mempath import EngineConfig, SamplingParams  # noqa: E402
from mempath.engine.engine import LLMEngine  # noqa: E402

MiB = 1 << 20


def device_use(device) -> tuple[int, int, int]:
    """(device bytes in use, total, PyTorch reserved)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free, total, torch.cuda.memory_reserved(device)


def sampling_mix(rng: np.random.Generator, seed: int, max_tokens: int) -> SamplingParams:
    kind = int(rng.integers(0, 6))
    common = dict(max_tokens=max_tokens, ignore_eos=True, seed=seed if rng.random() < 0.5 else None)
    if rng.random() < 0.15:
        common["logprobs"] = int(rng.integers(0, 6))
    if kind == 0:
        return SamplingParams(temperature=0.0, **common)
    if kind == 1:
        return SamplingParams(temperature=0.8, top_p=0.9, **common)
    if kind == 2:
        return SamplingParams(temperature=0.7, top_k=int(rng.integers(1, 100)), **common)
    if kind == 3:
        return SamplingParams(temperature=1.0, min_p=0.05, **common)
    if kind == 4:
        return SamplingParams(temperature=0.9, top_k=40, top_p=0.95, **common)
    return SamplingParams(temperature=1.2, **common)


def stage_recorder(stages: list):
    """An engine start-up observer that records device use before and after each stage."""
    @contextmanager
    def observe(name: str, pathway: str | None):
        device = torch.device("cuda")
        torch.cuda.synchronize(device)
        before = device_use(device)
        yield
        torch.cuda.synchronize(device)
        after = device_use(device)
        stages.append({"stage": name, "outside_torch_delta": (after[0] - after[2]) - (before[0] - before[2]),
                       "reserved_delta": after[2] - before[2]})
    return observe


def run(args) -> dict:
    vocab = json.loads((SHAPES / f"{args.shape}.json").read_text())["vocab_size"]
    device = torch.device("cuda")
    stages = []
    start = time.perf_counter()
    config = EngineConfig.from_kwargs(model_dir(args.shape), load_format="dummy", dtype="bfloat16",
                                      gpu_memory_utilization=args.gpu_memory_utilization,
                                      max_model_len=args.max_model_len, enable_prefix_caching=True)
    engine = LLMEngine(config, show_progress=False, stage=stage_recorder(stages))
    startup_s = time.perf_counter() - start
    used, total, reserved = device_use(device)
    limit = int(total * args.gpu_memory_utilization)
    after_start = {"used": used, "reserved": reserved, "outside_torch": used - reserved}

    rng = np.random.default_rng(args.seed)
    counter = 0
    peak = dict(after_start, step=0)
    peak_outside = after_start["outside_torch"]
    allocs_before = torch.cuda.memory_stats(device)["num_device_alloc"]
    allocated_at_start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    for step in range(1, args.steps + 1):
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < args.concurrency:
            prompt_len = int(min(args.max_model_len // 2, max(4, rng.lognormal(np.log(200), 0.9))))
            out_len = int(min(args.max_model_len // 2, max(1, rng.lognormal(np.log(150), 0.9))))
            prompt = rng.integers(0, vocab, prompt_len).tolist()
            engine.add_request(prompt, sampling_mix(rng, counter, out_len), f"r{counter}")
            counter += 1
        engine.step()
        used, _, reserved = device_use(device)
        peak_outside = max(peak_outside, used - reserved)
        if used > peak["used"]:
            peak = {"used": used, "reserved": reserved, "outside_torch": used - reserved, "step": step}
    allocs_after = torch.cuda.memory_stats(device)["num_device_alloc"]
    step_peak_allocated = torch.cuda.max_memory_allocated(device) - allocated_at_start
    ledger = engine.ledger.as_dict()
    return {
        "bench": "budget", "shape": args.shape, "gpu_memory_utilization": args.gpu_memory_utilization,
        "total": total, "limit": limit, "startup_s": round(startup_s, 1), "steps": args.steps,
        "requests": counter, "kv_blocks": engine.kv.num_blocks,
        "after_start": after_start, "peak": peak, "peak_outside_torch": peak_outside,
        "over_limit_bytes": max(0, peak["used"] - limit),
        "non_torch_at_profile": ledger.get("non_torch", {}).get("bytes"),
        "activation_peak_at_profile": ledger.get("activation_peak", {}).get("bytes"),
        "serving_step_peak_allocated": step_peak_allocated, "startup_stages": stages,
        "num_device_alloc": [allocs_before, allocs_after],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=128, help="requests kept running or waiting")
    parser.add_argument("--seed", type=int, default=0)
    result = run(parser.parse_args())
    print(f"limit {result['limit'] / MiB:,.0f} MiB ({result['gpu_memory_utilization']} x "
          f"{result['total'] / MiB:,.0f} MiB)")
    for name in ("after_start", "peak"):
        r = result[name]
        print(f"{name:12s} used {r['used'] / MiB:,.0f} MiB = torch reserved {r['reserved'] / MiB:,.0f} "
              f"+ outside torch {r['outside_torch'] / MiB:,.0f}")
    for stage in result["startup_stages"]:
        print(f"  {stage['stage']:24s} outside torch {stage['outside_torch_delta'] / MiB:+,.1f} MiB, "
              f"torch reserved {stage['reserved_delta'] / MiB:+,.1f} MiB")
    print(f"activation peak: profile step {result['activation_peak_at_profile'] / MiB:,.1f} MiB, "
          f"serving steps {result['serving_step_peak_allocated'] / MiB:,.1f} MiB (allocated)")
    print(f"over the limit by {result['over_limit_bytes'] / MiB:,.1f} MiB at the peak; "
          f"num_device_alloc {result['num_device_alloc']}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
