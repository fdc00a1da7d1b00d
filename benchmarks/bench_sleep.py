"""--sleep-offload-weights: how long an asleep model's wake takes, against its weights' bytes
over the pinned host-to-device bandwidth measured in the same run (docs/multi_model.md).

    python benchmarks/bench_sleep.py          # CUDA: Llama-3.1-8B and Llama-3.2-1B shapes, bf16 dummy weights
    python benchmarks/bench_sleep.py --tiny   # CPU: tiny shapes, checks the script runs

Both models are served together with their weights in arenas (memory/arena.py). Each in
turn is put to sleep (the other model runs a burst past --sleep-after, on a fake clock) and
woken by a request, ``--repeats`` times: per model, the first sleep (which allocates the
pinned copy), later sleeps, each wake, the device memory given back while asleep (from
cudaMemGetInfo), whether the restored weights' bytes equal those before the first sleep
(a checksum), and whether the woken model's greedy tokens (its CUDA graphs replaying over
the restored weights) equal those of the same request before it (both from the prefix cache).

Prints a table and one JSON line (prefix ``RESULT``).
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mempath import LLM, SamplingParams  # noqa: E402
from mempath.multi.engine import MultiEngine  # noqa: E402

BIG = json.loads((ROOT / "tests" / "data" / "configs" / "llama-3.1-8b.json").read_text())
SMALL = {**BIG, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
         "rope_scaling": {**BIG.get("rope_scaling", {}), "factor": 32.0}}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPT = list(range(100, 164))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def model_dir(root: Path, name: str, config: dict) -> str:
    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def answer(engine: MultiEngine, model: str, request_id: str) -> list[int]:
    engine.add_request(PROMPT, GREEDY, request_id, model=model)
    tokens = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                tokens = output.outputs[0].token_ids
    return tokens


def pinned_bandwidth(nbytes: int, device: torch.device) -> float | None:
    """Bytes/s of a pinned host-to-device copy of ``nbytes``, at most 1 GiB (best of three; the
    KV pool leaves PyTorch no room for a copy of a whole model), None off CUDA."""
    if device.type != "cuda":
        return None
    nbytes = min(nbytes, 1 << 30)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    del host, target
    torch.cuda.empty_cache()
    return nbytes / best


def device_free(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


def checksum(arena) -> int:
    """The arena's bytes as int64 words, summed (wrapping: exact, whatever the order)."""
    return int(arena.tensor.view(torch.int64).sum())


def cycle(engine: MultiEngine, clock: Clock, sleeper: str, other: str, tag: str) -> dict:
    """``sleeper`` falls asleep during a step of ``other``, then a request wakes it."""
    device = engine.device
    clock.now += 10
    free_awake = device_free(device)
    start = time.perf_counter()
    engine.add_request(PROMPT, SamplingParams(max_tokens=1), f"{tag}-tick", model=other)
    while engine.has_unfinished_requests():
        engine.step()  # the first step's tick puts the sleeper to sleep
    sleep_and_step = time.perf_counter() - start
    free_asleep = device_free(device)
    assert engine.stats()["sleep"]["weights_offloaded"] == [sleeper], engine.stats()["sleep"]
    tokens = answer(engine, sleeper, f"{tag}-wake")
    seconds = engine.stats()["sleep"]["last_wake_seconds_by_model"][sleeper]
    restored = checksum(engine.engines[sleeper].model.weights_arena)
    for name in engine.names:
        engine.sleep.last_active[name] = clock.now  # nobody else sleeps meanwhile
    return {"sleep_and_one_step_s": sleep_and_step, "wake_s": seconds, "tokens": tokens, "checksum": restored,
            "freed_bytes": None if free_awake is None else free_asleep - free_awake}


def run(args, device: str, root: Path) -> tuple[list[tuple], dict]:
    """Both models put to sleep and woken ``args.repeats`` times: the table's rows and the RESULT line."""
    big = model_dir(root, "big", {**BIG, **TINY} if args.tiny else BIG)
    small = model_dir(root, "small", {**SMALL, **TINY} if args.tiny else SMALL)
    llm = LLM([f"big={big}", f"small={small}"], load_format="dummy", max_model_len=1024, max_num_seqs=8,
              sleep_after=5, sleep_offload_weights=True, show_progress=False, device=device,
              **({"dtype": "float32"} if args.tiny else {}))
    clock = Clock()
    engine = MultiEngine(llm.engines, llm.engine.pool, sleep_after=5, clock=clock)
    rows = [("model", "weights", "first sleep + step s", "sleep + step s (median)", "wake ms (median)",
             "bound ms", "wake / bound", "freed GiB", "same tokens", "same weights")]
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "models": {}}
    for sleeper, other in (("big", "small"), ("small", "big")):
        answer(engine, sleeper, f"{sleeper}-cold")  # from here on the prompt's full blocks come from the prefix cache
        before = answer(engine, sleeper, f"{sleeper}-before")
        arena = engine.engines[sleeper].model.weights_arena
        weights = checksum(arena)
        bandwidth = pinned_bandwidth(arena.nbytes, engine.device)
        runs = [cycle(engine, clock, sleeper, other, f"{sleeper}{i}") for i in range(args.repeats)]
        wake = float(np.median([r["wake_s"] for r in runs]))
        later = float(np.median([r["sleep_and_one_step_s"] for r in runs[1:]])) if len(runs) > 1 else None
        bound = arena.nbytes / bandwidth if bandwidth else None
        same = all(r["tokens"] == before for r in runs)
        same_weights = all(r["checksum"] == weights for r in runs)
        freed = [r["freed_bytes"] for r in runs]
        result["models"][sleeper] = {"arena_bytes": arena.nbytes, "pinned_bandwidth": bandwidth,
                                     "bound_s": bound, "wake_s": [r["wake_s"] for r in runs], "wake_median_s": wake,
                                     "first_sleep_and_step_s": runs[0]["sleep_and_one_step_s"],
                                     "later_sleep_and_step_s": later, "freed_bytes": freed, "same_tokens": same,
                                     "same_weights": same_weights}
        rows.append((sleeper, f"{arena.nbytes / 2**30:.2f} GiB", f"{runs[0]['sleep_and_one_step_s']:.2f}",
                     "-" if later is None else f"{later:.3f}", f"{wake * 1e3:.1f}",
                     "-" if bound is None else f"{bound * 1e3:.1f}", "-" if bound is None else f"{wake / bound:.2f}",
                     "-" if freed[0] is None else f"{np.median(freed) / 2**30:.2f}", same, same_weights))
    return rows, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    with tempfile.TemporaryDirectory(prefix="mempath-sleep-") as root:  # the two configs, gone after
        rows, result = run(args, device, Path(root))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    print("sleep and wake with --sleep-offload-weights (bound: weights bytes / pinned H2D bandwidth, this run)")
    for n, row in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    print("RESULT " + json.dumps({"bench": "sleep", **result}))


if __name__ == "__main__":
    main()
