"""Where a step's time goes: host work between steps, GPU time per step, and the kernels.

    python benchmarks/profile_steps.py decode --shape llama-3.1-8b --batch 1 --context 128
    python benchmarks/profile_steps.py workload --shape qwen3-0.6b      # the throughput workload
    python benchmarks/profile_steps.py mix --shape llama-3.1-8b         # bench_mix's 1,000 requests

``decode`` runs steady decode steps at a fixed batch and prints wall and GPU time
per step and the torch.profiler kernel table. ``workload`` runs the throughput
benchmark's 256 requests step by step and splits the wall time into GPU time
(CUDA events around each step's device work) and host time, by step kind and
batch size. ``mix`` submits bench_mix's lognormal mix at once (max_num_seqs 1,024) and prints the
kernel tables of its first prefill-carrying steps (8,192 prompt tokens each) and of later ones that
also carry hundreds of decode rows. GPU only. Prints a table and one JSON line (prefix ``RESULT``).
"""
import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_engine import model_dir, random_requests  # noqa: E402
from mempath import LLM, SamplingParams  # noqa: E402


class StepTimer:
    """CUDA events from the end of input preparation to the end of sampling: a step's device window.

    The window starts once the host has filled and queued the inputs, so host work
    before it (scheduling, filling buffers) is not counted as device time.
    """

    def __init__(self, runner):
        self.inner_execute, self.inner_prepare = runner.execute, runner.prepare
        self.events = []
        self.start = None
        runner.execute, runner.prepare = self, self.prepare

    def prepare(self, *args, **kwargs):
        out = self.inner_prepare(*args, **kwargs)
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()
        return out

    def __call__(self, batch, sampling, **kwargs):
        end = torch.cuda.Event(enable_timing=True)
        out = self.inner_execute(batch, sampling, **kwargs)
        end.record()
        start = self.start
        kind = "decode" if max(batch.num_new_tokens) == 1 else "mixed"
        self.events.append((start, end, kind, len(batch.requests), sum(batch.num_new_tokens)))
        return out


def kernel_table(prof, top: int) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if device_us and e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append({"name": e.key[:90], "count": e.count, "total_us": device_us})
    rows.sort(key=lambda r: -r["total_us"])
    return rows[:top]


def pathway_options(args) -> dict:
    """--quantization and --kv-cache-dtype as LLM arguments (the engine's defaults where not given)."""
    return {"quantization": None if args.quantization == "none" else args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype}


def bench_decode(args) -> dict:
    # The first sequences decode while the last are still prefilled, one token a prefill step (steps
    # of max_num_batched_tokens prompt tokens, 8,192 by default: the bound below holds down to 2,048),
    # and none may finish before the profiled steps.
    prefill_steps = -(-args.batch * args.context // 2048)
    max_tokens = args.steps * 3 + prefill_steps + 64
    llm = LLM(model_dir(args.shape), load_format="dummy", dtype="bfloat16", max_num_seqs=args.batch,
              max_model_len=args.context + max_tokens, show_progress=False,
              enforce_eager=args.enforce_eager, **pathway_options(args))
    engine = llm.engine
    engine.outputs.emit_progress = False
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request(rng.integers(0, engine.spec.vocab_size, args.context).tolist(), params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(10):
        engine.step()
    timer = StepTimer(engine.runner)
    torch.cuda.synchronize()
    walls = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    gpu = [s.elapsed_time(e) / 1e3 for s, e, *_ in timer.events]
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    kernels = kernel_table(prof, args.top)
    wall_ms, gpu_ms = 1e3 * float(np.median(walls)), 1e3 * float(np.median(gpu))
    # What the profiled steps ran: the batch the scheduler kept and its mean context.
    running = engine.scheduler.running
    mean_context = float(np.mean([r.num_tokens for r in running])) if running else 0.0
    print(f"\ndecode {args.shape} batch {args.batch} context ~{args.context}: wall {wall_ms:.3f} ms/step, "
          f"device-work window {gpu_ms:.3f} ms/step, host-only {wall_ms - gpu_ms:.3f} ms/step; "
          f"{len(running)} sequences running at the end, mean context {mean_context:.0f}")
    print(f"{'kernel':90} {'calls/step':>10} {'us/step':>9}")
    for k in kernels:
        print(f"{k['name']:90} {k['count'] / 10:>10.1f} {k['total_us'] / 10:>9.1f}")
    return {"bench": "profile-decode", "shape": args.shape, "batch": args.batch, "wall_ms": wall_ms,
            "device_window_ms": gpu_ms, "running": len(running), "mean_context": mean_context, "kernels_per_step": [
                {**k, "us_per_step": k["total_us"] / 10, "calls_per_step": k["count"] / 10} for k in kernels]}


def bench_workload(args) -> dict:
    from mempath.model.loader import read_config
    path = model_dir(args.shape)
    vocab = read_config(path)["vocab_size"]
    prompts, output_lens = random_requests(args.num_requests, 0, vocab)
    llm = LLM(path, load_format="dummy", dtype="bfloat16", show_progress=False, max_model_len=2048 + 64,
              max_num_seqs=256, max_num_batched_tokens=8192, enforce_eager=args.enforce_eager)
    engine = llm.engine
    engine.outputs.emit_progress = False
    llm.generate(prompts[:8], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    engine.kv.pool.reset_prefix_cache()
    timer = StepTimer(engine.runner)
    for p, n in zip(prompts, output_lens):
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    walls = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    groups = defaultdict(lambda: [0, 0.0, 0.0, 0])  # steps, wall, device, tokens
    for wall, (s, e, kind, rows, tokens) in zip(walls, timer.events):
        key = kind if kind == "mixed" else f"decode {8 * ((rows - 1) // 8) + 1}-{8 * ((rows - 1) // 8 + 1)}" \
            if rows > 8 else f"decode {rows}"
        bucket = "decode >128" if kind == "decode" and rows > 128 else \
            "decode 33-128" if kind == "decode" and rows > 32 else \
            "decode 9-32" if kind == "decode" and rows > 8 else key if kind == "mixed" else "decode 1-8"
        g = groups[bucket]
        g[0] += 1
        g[1] += wall
        g[2] += s.elapsed_time(e) / 1e3
        g[3] += tokens
    print(f"\nworkload {args.shape}: {len(walls)} steps, {total:.2f} s")
    print(f"{'steps':16} {'count':>6} {'wall s':>8} {'device s':>9} {'host s':>8} {'wall ms/step':>12}")
    table = {}
    for name in ("mixed", "decode >128", "decode 33-128", "decode 9-32", "decode 1-8"):
        if name not in groups:
            continue
        n, wall, dev, tokens = groups[name]
        table[name] = {"steps": n, "wall_s": wall, "device_s": dev, "tokens": tokens}
        print(f"{name:16} {n:>6} {wall:>8.2f} {dev:>9.2f} {wall - dev:>8.2f} {1e3 * wall / n:>12.3f}")
    kernels = profile_workload_steps(engine, prompts, output_lens, args.top)
    return {"bench": "profile-workload", "shape": args.shape, "seconds": total, "steps": len(walls),
            "groups": table, "kernels": kernels}


def profile_workload_steps(engine, prompts, output_lens, top: int) -> dict:
    """Kernel tables of the workload's first two (prefill) steps and of three full decode steps."""
    from torch.profiler import ProfilerActivity, profile
    engine.kv.pool.reset_prefix_cache()
    for p, n in zip(prompts, output_lens):
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    tables = {}

    def profiled(name: str, steps: int):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        tables[name] = [{**k, "us_per_step": k["total_us"] / steps} for k in kernel_table(prof, top)]
        print(f"\n{name} ({steps} steps): {'kernel':80} {'calls/step':>10} {'us/step':>9}")
        for k in tables[name]:
            print(f"{k['name'][:80]:80} {k['count'] / steps:>10.1f} {k['us_per_step']:>9.1f}")

    profiled("prefill steps", 2)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()
    engine.step()
    profiled(f"decode steps at batch {len(engine.scheduler.running)}", 3)
    for request_id in list(engine.outputs.requests):
        engine.abort_request(request_id)
    return tables


def bench_mix_steps(args) -> dict:
    from bench_mix import MixSpec, synthetic_mix
    from torch.profiler import ProfilerActivity, profile

    from mempath.model.loader import read_config
    path = model_dir(args.shape)
    prompts, output_lens = synthetic_mix(args.num_requests, 0, read_config(path)["vocab_size"], MixSpec())
    llm = LLM(path, load_format="dummy", dtype="bfloat16", show_progress=False, max_model_len=4096,
              max_num_seqs=1024, max_num_batched_tokens=8192, enforce_eager=args.enforce_eager,
              **pathway_options(args))
    engine = llm.engine
    engine.outputs.emit_progress = False
    # Warm-up over the same kinds of steps (full prefill chunks, mixed, decode), then a cold prefix cache.
    llm.generate(prompts[-64:], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    engine.kv.pool.reset_prefix_cache()
    for p, n in zip(prompts, output_lens):
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    tables, step = {}, 0
    for first, count in ((0, 2), (args.later_step, 2)):
        while step < first:
            engine.step()
            step += 1
        sched = engine.scheduler
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(count):
                engine.step()
            torch.cuda.synchronize()
        step += count
        rows = len(sched.running)
        name = f"steps {first}-{first + count - 1} ({rows} running after)"
        kernels = kernel_table(prof, args.top)
        total = sum(k["total_us"] for k in kernel_table(prof, 10 ** 6)) / count
        tables[name] = {"device_us_per_step": total,
                        "kernels": [{**k, "us_per_step": k["total_us"] / count} for k in kernels]}
        print(f"\n{name}: {total / 1e3:.2f} ms of kernels a step")
        print(f"{'kernel':90} {'calls/step':>10} {'us/step':>9} {'share':>6}")
        for k in kernels:
            print(f"{k['name']:90} {k['count'] / count:>10.1f} {k['total_us'] / count:>9.1f} "
                  f"{100 * k['total_us'] / count / total:>5.1f}%")
    for request_id in list(engine.outputs.requests):
        engine.abort_request(request_id)
    return {"bench": "profile-mix", "shape": args.shape, "requests": args.num_requests, "tables": tables}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    dec = sub.add_parser("decode")
    dec.add_argument("--shape", default="llama-3.1-8b")
    dec.add_argument("--batch", type=int, default=1)
    dec.add_argument("--context", type=int, default=128)
    dec.add_argument("--steps", type=int, default=100)
    dec.add_argument("--top", type=int, default=25)
    work = sub.add_parser("workload")
    work.add_argument("--shape", default="qwen3-0.6b")
    work.add_argument("--num-requests", type=int, default=256)
    work.add_argument("--top", type=int, default=25)
    mix = sub.add_parser("mix")
    mix.add_argument("--shape", default="llama-3.1-8b")
    mix.add_argument("--num-requests", type=int, default=1000)
    mix.add_argument("--later-step", type=int, default=24, help="the second profiled pair of steps")
    mix.add_argument("--top", type=int, default=25)
    for p in sub.choices.values():
        p.add_argument("--enforce-eager", action="store_true")
        p.add_argument("--quantization", choices=("none", "fp8"), default="none")
        p.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e4m3 or fp8_e5m2")
        p.add_argument("--no-pdl", action="store_true",
                       help="launch without programmatic dependent launch: each kernel's time is then its own, "
                            "not also the wait for the kernel before it")
    args = parser.parse_args()
    if args.no_pdl:
        from mempath.kernels import common
        common.USE_PDL = False
    result = {"decode": bench_decode, "workload": bench_workload, "mix": bench_mix_steps}[args.bench](args)
    result.update(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, pdl=not args.no_pdl)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
