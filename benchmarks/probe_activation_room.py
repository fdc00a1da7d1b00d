"""Where a step's activations go against the room the budget leaves them: the allocator's figures
after start-up, around each serving step and at each out of memory (CUDA).

    CASES=bf16+fp8 python3 benchmarks/probe_activation_room.py      # bench_fp8_weights latency's flow
    CASES=fp8,bf16 OUT=/tmp/probe python3 benchmarks/probe_activation_room.py

Each case builds the Llama-3.1-8B shape (dummy weights, bf16 or fp8) at batch 2, max_model_len 1008, and runs
bench_fp8_weights.decode_ms (prompts of 960 tokens, 16 new) as `bench_fp8_weights.py latency --batch 2
--prompt-len 960 --new-tokens 16` does; ``bf16+fp8`` is that bench's order, both engines in one process. It
writes $OUT/overrun.json: the ledger and the room under the allocator's cap after start-up, each step of more
than 16 tokens (reserved and allocated before, reserved after, the peak), and at each out of memory the
allocator's segments (the partly used ones show which tensors kept a segment). The thirty-fifth session's
runs are in benchmarks/results/2026-12-07-s35-h100-activation-overrun.jsonl.
"""
import gc
import json
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
import numpy as np  # noqa: E402
import torch  # noqa: E402

import mempath.memory.oom as oom  # noqa: E402
from mempath import LLM  # noqa: E402
from bench_engine import model_dir  # noqa: E402
from bench_fp8_weights import decode_ms  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/probe-activation-room")
records = []


def segments():
    out = []
    for s in torch.cuda.memory_snapshot():
        live = [b["size"] for b in s["blocks"] if b["state"] == "active_allocated"]
        out.append({"size": s["total_size"], "allocated": s["allocated_size"], "pool": str(s.get("segment_pool_id")),
                    "stream": s["stream"], "live": sorted(live, reverse=True)[:6], "n_live": len(live)})
    return sorted(out, key=lambda d: -d["size"])


def mem(tag):
    free, total = torch.cuda.mem_get_info()
    return {"tag": tag, "reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated(),
            "fraction": torch.cuda.get_per_process_memory_fraction(0), "free": free, "total": total,
            "cap_bytes": int(torch.cuda.get_per_process_memory_fraction(0) * total)}


orig = oom.explain_oom


def explain(stage, ledger, requested, free, config, **kw):
    rec = mem("oom")
    rec.update(stage=stage, requested=requested, segs=segments()[:60], ledger=ledger.table())
    records.append(rec)
    return orig(stage, ledger, requested, free, config, **kw)


from mempath.engine import startup as startup_module  # noqa: E402

orig_cap = startup_module.Startup.cap_device_memory


def cap(self):
    before = self.ledger.get("non_torch")
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    orig_cap(self)
    records.append({"tag": "cap", "non_torch_at_profile": before, "non_torch_after": self.ledger.get("non_torch"),
                    "outside_before_cap": outside, "activation_peak": self.ledger.get("activation_peak"),
                    "reserved": torch.cuda.memory_reserved(),
                    "cap": torch.cuda.get_per_process_memory_fraction(0) * total})


def probe(case, quantization, batch=2, prompt_len=960, new_tokens=16, eager=False):
    path = model_dir("llama-3.1-8b")
    vocab = json.loads(open(f"{path}/config.json").read())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(batch)]
    t = time.time()
    llm = LLM(path, load_format="dummy", dtype="bfloat16", quantization=quantization, max_num_seqs=batch,
              max_model_len=prompt_len + new_tokens + 32, show_progress=False, enforce_eager=eager)
    eng = llm.engine
    start = mem("after start-up")
    start.update(case=case, ledger=eng.ledger.table(), segs=segments()[:40], load_s=time.time() - t)
    records.append(start)
    steps = []
    execute = eng.runner.execute

    def traced(batch_, *a, **k):
        before = mem("before")
        out = execute(batch_, *a, **k)
        torch.cuda.synchronize()
        steps.append({"tokens": int(sum(batch_.num_new_tokens)), "seqs": len(batch_.requests),
                      "reserved_before": before["reserved"], "allocated_before": before["allocated"],
                      "reserved_after": torch.cuda.memory_reserved(), "peak": torch.cuda.max_memory_allocated()})
        torch.cuda.reset_peak_memory_stats()
        return out

    eng.runner.execute = traced
    ooms_before = sum(r["tag"] == "oom" for r in records)
    ms, _ = decode_ms(llm, prompts, new_tokens)
    ooms = sum(r["tag"] == "oom" for r in records) - ooms_before
    records.append({"tag": "done", "case": case, "ms": ms, "ooms": ooms,
                    "steps": [s for s in steps if s["tokens"] > 16][:20], "n_steps": len(steps)})
    print(case, "ms", ms, "ooms", records[-1]["ooms"], flush=True)
    del eng.runner.execute, execute, traced
    del llm, eng
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("probe_activation_room needs CUDA: the allocator's cap and segments are what it reads")
    os.makedirs(OUT, exist_ok=True)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    oom.explain_oom = explain
    startup_module.Startup.cap_device_memory = cap
    for case in os.environ.get("CASES", "fp8,bf16+fp8").split(","):
        if case == "bf16+fp8":
            probe("bf16 first", None)
            probe("fp8 after bf16", "fp8")
        elif case in ("fp8", "bf16", "fp8-eager"):
            probe(case, None if case == "bf16" else "fp8", eager=case == "fp8-eager")
        else:
            sys.exit(f"CASES: unknown case {case!r}: give fp8, bf16, fp8-eager or bf16+fp8")
        with open(f"{OUT}/overrun.json", "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
