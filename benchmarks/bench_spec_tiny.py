"""The shipped pair on the CPU: mempath-tiny with mempath-tiny-draft, plain against speculative.

    OMP_NUM_THREADS=1 python benchmarks/bench_spec_tiny.py

Greedy, 128 tokens for each of 4 prompts (held-out text and code), batch 1 (one request
at a time) and batch 4; fixed K = 2, 4 and adaptive. Prints tokens/s, acceptance rate and
mean accepted length, and one RESULT JSON line.
"""
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mempath import LLM, SamplingParams  # noqa: E402
from mempath.assets import ASSETS  # noqa: E402

TEXT = (ROOT / "mempath" / "assets" / "heldout.txt").read_text()
PROMPTS = ["def read_config(path):", "class Engine:\n    def step(self):", TEXT[:300], TEXT[4000:4300]]
PARAMS = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)


def run(spec):
    llm = LLM(str(ASSETS / "mempath-tiny"), show_progress=False, speculative_config=spec)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)  # warm-up
    row = {}
    for batch in (1, 4):
        start = time.perf_counter()
        if batch == 1:
            outs = [llm.generate(p, PARAMS, use_tqdm=False)[0] for p in PROMPTS]
        else:
            outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        row[batch] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
    s = llm.stats()["spec_decode"] or {}
    return row, s.get("acceptance_rate"), s.get("mean_acceptance_length"), [o.token_ids for o in outs]


def main():
    draft = str(ASSETS / "mempath-tiny-draft")
    configs = {"plain": None, **{f"K={k}": {"model": draft, "num_speculative_tokens": k, "adaptive": False}
                                 for k in (2, 4)},
               "adaptive (K<=4)": {"model": draft, "num_speculative_tokens": 4}}
    result, reference = {}, None
    print(f"{'config':<16} {'tok/s b=1':>10} {'tok/s b=4':>10} {'accept':>7} {'mean len':>8}  same tokens")
    for name, spec in configs.items():
        tps, acceptance, mean_len, tokens = run(spec)
        reference = reference or tokens
        result[name] = {"tok_s": tps, "acceptance_rate": acceptance, "mean_acceptance_length": mean_len}
        print(f"{name:<16} {tps[1]:>10.1f} {tps[4]:>10.1f} {acceptance or 0:>7.2f} {mean_len or 1:>8.2f}  "
              f"{tokens == reference}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
