"""Multi-turn chat with a limited GPU KV pool: recompute only vs GPU+CPU vs GPU+CPU+disk tiers.

    python benchmarks/bench_multiturn.py                      # H200: Llama-3.1-8B shape, dummy weights
    python benchmarks/bench_multiturn.py --tiny               # CPU smoke run with the built-in model

Every conversation shares one system prompt and adds its own user turns. In each
turn, --concurrency users at a time send their conversation's next message (a
closed loop: when one gets its answer, the next conversation's message goes in).
The GPU pool is limited (--gpu-kv-blocks) so idle conversations cannot all stay
on the GPU: with tiers they are demoted and promoted back, without they are
recomputed. Reported per mode: TTFT p50/p95 per turn, throughput, the GPU KV
bytes still held while every conversation is idle, achieved transfer bandwidth.
Prints a table and one JSON line (prefix ``RESULT``).
"""
import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_engine import model_dir  # noqa: E402
from mempath import LLM, SamplingParams  # noqa: E402


def pinned_copy_bandwidth(nbytes: int = 1 << 30) -> dict:
    """One large pinned copy each way (median of 5): the ceiling block transfers are measured against."""
    import torch
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for direction, copy in (("h2d", lambda: dev.copy_(host, non_blocking=True)),
                            ("d2h", lambda: host.copy_(dev, non_blocking=True))):
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            t = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[direction] = nbytes / float(np.median(times[1:]))
    del host, dev
    return out


def swap_versus_recompute(engine, num_tokens: int) -> dict:
    """Swap a long request's blocks out and back through the TransferEngine vs prefilling its tokens.

    Uses the mechanisms the engine's preemption uses (batched gather + one copy per
    direction; a probe prefill step of the same length); run at the end of a mode,
    over blocks whose contents no longer matter.
    """
    import torch
    tiers = engine.kv.tiers
    num_blocks = engine.kv.blocks_for(num_tokens)
    gpu_ids = list(range(num_blocks))
    host_ids = tiers.host.allocate(num_blocks) if num_blocks <= engine.kv.num_blocks else None
    if host_ids is None:
        return {"skipped": f"needs {num_blocks} free blocks in each tier"}
    timings = {}
    for name, run in (("swap_out", lambda: tiers.transfer.device_to_host(gpu_ids, host_ids).wait()),
                      ("swap_in", lambda: tiers.transfer.host_to_device(host_ids, gpu_ids).wait()),
                      ("recompute", lambda: engine.probes.run(num_tokens, 1))):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            run()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        timings[name] = best
    tiers.host.free(host_ids)
    nbytes = num_blocks * engine.runner.kv_bytes_per_block()
    return {"tokens": num_tokens, "bytes": nbytes, "swap_out_s": timings["swap_out"],
            "swap_in_s": timings["swap_in"], "swap_round_trip_s": timings["swap_out"] + timings["swap_in"],
            "recompute_s": timings["recompute"],
            "d2h_bytes_per_s": nbytes / timings["swap_out"], "h2d_bytes_per_s": nbytes / timings["swap_in"]}


def run_mode(model: str, mode: str, args, engine_options: dict) -> dict:
    options = dict(engine_options)
    disk_dir = None
    if mode in ("cpu", "disk"):
        options["cpu_kv_gb"] = args.cpu_kv_gb
    if mode == "disk":
        disk_dir = args.disk_kv_path or tempfile.mkdtemp(prefix="mempath-disk-kv-")
        options.update(cpu_kv_gb=args.cpu_kv_gb_with_disk, disk_kv_path=disk_dir, disk_kv_gb=args.disk_kv_gb)
    llm = LLM(model, show_progress=False, **options)
    engine = llm.engine
    rng = np.random.default_rng(0)
    vocab = engine.spec.vocab_size
    system = rng.integers(3, vocab, args.system_tokens).tolist()
    history = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    turns, generated, start = [], 0, time.perf_counter()
    for turn in range(args.turns):
        # A closed loop of --concurrency users: the next conversation's message goes in when
        # one finishes, so a request's TTFT is its own prefill or restore, not a queue.
        pending, ids = list(range(args.conversations)), {}

        def submit():
            c = pending.pop(0)
            length = args.first_user_tokens if turn == 0 and args.first_user_tokens else args.user_tokens
            history[c] += rng.integers(3, vocab, length).tolist()
            ids[engine.add_request(history[c], params)] = c

        for _ in range(min(args.concurrency, len(pending))):
            submit()
        ttft, cached = [], 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    ttft.append(out.time_to_first_token)
                    cached += out.num_cached_tokens
                    history[ids[out.request_id]] += out.token_ids
                    generated += len(out.token_ids)
                    if pending:
                        submit()
        stats = engine.stats()
        turns.append({"turn": turn, "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
                      "ttft_p95_ms": 1e3 * float(np.percentile(ttft, 95)), "cached_tokens": cached,
                      # Held: blocks referenced while every conversation is idle (must be 0).
                      # Resident: free blocks whose cached content is still findable; any
                      # allocation may take them (demoting the content to the host tier first).
                      "idle_gpu_kv_held_bytes": stats["kv_blocks_used"] * engine.runner.kv_bytes_per_block(),
                      "idle_gpu_kv_bytes": stats["kv_blocks_cached"] * engine.runner.kv_bytes_per_block()})
    seconds = time.perf_counter() - start
    tiers = engine.stats()["tiers"]
    bandwidth = {}
    if tiers["enabled"]:
        for direction, moved in tiers["moved"].items():
            if moved.get("seconds"):
                bandwidth[direction] = moved["bytes"] / moved["seconds"]
    swap = None
    if mode == "cpu" and args.swap_tokens and engine.device.type == "cuda":
        swap = swap_versus_recompute(engine, min(args.swap_tokens, engine.max_model_len))
    if disk_dir and not args.disk_kv_path:
        engine.kv.tiers.close()
        shutil.rmtree(disk_dir, ignore_errors=True)
    return {"mode": mode, "seconds": seconds, "output_tokens_per_s": generated / seconds, "turns": turns,
            "transfer_bytes_per_s": bandwidth, "swap_check": swap,
            "tiers": {k: tiers.get(k) for k in ("hits_blocks", "swaps", "recompute_preemptions", "decisions")}
            if tiers["enabled"] else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", help="a config in tests/data/configs")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: built-in model, tiny sizes")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=4, help="conversations in flight at once")
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--first-user-tokens", type=int, default=0,
                        help="length of each conversation's first message (a pasted document; 0: --user-tokens)")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--gpu-kv-blocks", type=int, default=2048, help="the limited GPU pool (blocks of 16)")
    parser.add_argument("--cpu-kv-gb", type=float, default=32.0, help="host tier in the cpu mode")
    parser.add_argument("--cpu-kv-gb-with-disk", type=float, default=8.0, help="host tier in the disk mode")
    parser.add_argument("--disk-kv-gb", type=float, default=128.0)
    parser.add_argument("--disk-kv-path", default=None, help="default: a temporary directory")
    parser.add_argument("--modes", default="recompute,cpu,disk")
    parser.add_argument("--swap-tokens", type=int, default=8192,
                        help="length of the request in the swap-versus-recompute check (cpu mode, CUDA; 0: skip)")
    args = parser.parse_args()

    if args.tiny:
        from mempath.assets import default_model_path
        model = default_model_path()
        engine_options = dict(device="cpu", dtype="float32", num_gpu_blocks_override=24,
                              max_num_batched_tokens=512)
        for name, value in (("conversations", 4), ("turns", 3), ("system_tokens", 96), ("user_tokens", 16),
                            ("output_tokens", 8), ("cpu_kv_gb", 0.01), ("cpu_kv_gb_with_disk", 0.0005),
                            ("disk_kv_gb", 0.05)):
            setattr(args, name, value)
    else:
        model = model_dir(args.shape)
        engine_options = dict(load_format="dummy", dtype="bfloat16", num_gpu_blocks_override=args.gpu_kv_blocks,
                              max_model_len=args.system_tokens + max(0, args.first_user_tokens - args.user_tokens)
                              + args.turns * (args.user_tokens + args.output_tokens))

    ceiling = None
    if not args.tiny:
        ceiling = pinned_copy_bandwidth()
        print(f"pinned copy ceiling: h2d {ceiling['h2d'] / 1e9:.1f} GB/s, d2h {ceiling['d2h'] / 1e9:.1f} GB/s",
              flush=True)
    results = []
    for mode in args.modes.split(","):
        results.append(run_mode(model, mode, args, engine_options))
        print("MODE " + json.dumps(results[-1]), flush=True)  # partial results survive a time limit
    print(f"{'mode':10} {'turn':>4} {'ttft p50 ms':>12} {'ttft p95 ms':>12} {'cached tok':>10} {'idle held':>10} {'idle resident':>14}")
    for r in results:
        for t in r["turns"]:
            print(f"{r['mode']:10} {t['turn']:>4} {t['ttft_p50_ms']:>12.2f} {t['ttft_p95_ms']:>12.2f} "
                  f"{t['cached_tokens']:>10} {t['idle_gpu_kv_held_bytes'] / 2**20:>6.1f} MiB "
                  f"{t['idle_gpu_kv_bytes'] / 2**20:>10.1f} MiB")
        rates = ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in r["transfer_bytes_per_s"].items())
        print(f"{r['mode']:10} {r['output_tokens_per_s']:.1f} output tokens/s  {rates}")
        if r.get("swap_check") and "recompute_s" in r["swap_check"]:
            c = r["swap_check"]
            print(f"{r['mode']:10} swap of a {c['tokens']}-token request: out {1e3 * c['swap_out_s']:.1f} ms + in "
                  f"{1e3 * c['swap_in_s']:.1f} ms = {1e3 * c['swap_round_trip_s']:.1f} ms; recompute "
                  f"{1e3 * c['recompute_s']:.1f} ms")
    print("RESULT " + json.dumps({"benchmark": "multiturn", "shape": "tiny" if args.tiny else args.shape,
                                  "pinned_copy_bytes_per_s": ceiling, "results": results}))


if __name__ == "__main__":
    main()
