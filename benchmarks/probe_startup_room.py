"""What the cap leaves a step after start-up, against what the budget keeps for one (CUDA).

    python3 benchmarks/probe_startup_room.py
    python3 benchmarks/probe_startup_room.py --cases llama-3.1-8b:64:bf16,qwen3-0.6b:256:fp8

Start-up sizes the KV cache from what it measured before the decode graphs are captured over it; whatever
the real captures take beyond what was kept for them (their pool, their driver memory outside PyTorch) comes
out of the step's room under the allocator's cap, and start-up warns when that room is less than the profile
step's peak and spare. Each case builds an engine (dummy weights, the shape's config, max_model_len 2048) in
its own process and prints one RESULT line: the ledger when the KV cache was sized and after start-up, the
room under the cap, what is kept for a step, how much short, any start-up warning about it, the start-up time.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

CASES = "qwen3-0.6b:256:bf16,llama-3.1-8b:64:bf16"


def run_case(case: str) -> dict:
    import logging

    import torch

    from mempath import LLM
    from mempath.engine import startup as startup_module
    from bench_engine import model_dir

    shape, seqs, dtype = case.split(":")
    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())
    logging.getLogger("mempath").addHandler(Collect())
    seen = {}
    original_profile, original_cap = startup_module.Startup.profile_kv_blocks, startup_module.Startup.cap_device_memory

    def profile(self, per_block):
        blocks = original_profile(self, per_block)
        seen["ledger_at_sizing"] = {name: row["bytes"] for name, row in self.ledger.as_dict().items()}
        return blocks

    def cap(self):
        original_cap(self)
        free, total = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        seen["room"] = int(torch.cuda.get_per_process_memory_fraction(0) * total) - reserved
        seen["kept"] = self.ledger.get("activation_peak") + self.ledger.get("activation_spare")
    startup_module.Startup.profile_kv_blocks, startup_module.Startup.cap_device_memory = profile, cap
    start = time.perf_counter()
    llm = LLM(model_dir(shape), load_format="dummy", dtype="bfloat16", quantization=None if dtype == "bf16" else dtype,
              max_num_seqs=int(seqs), max_model_len=2048, show_progress=False)
    engine = llm.engine
    return dict(case=case, start_s=time.perf_counter() - start, graphs=len(engine.runner.graphs),
                kv_blocks=engine.kv.num_blocks, short=max(0, seen["kept"] - seen["room"]),
                room_warnings=[w for w in warnings if "less than it keeps" in w],
                ledger_after_start={name: row["bytes"] for name, row in engine.ledger.as_dict().items()}, **seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=CASES, help="shape:max_num_seqs:bf16|fp8, comma-separated")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process: one case
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_case(args.cases)), flush=True)
        return
    for case in args.cases.split(","):
        subprocess.run([sys.executable, __file__, "--one", "--cases", case], check=False)


if __name__ == "__main__":
    main()
