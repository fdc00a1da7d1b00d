"""Speculative decoding on the Llama-3.1-8B shape (random bf16 weights), in one run.

    python benchmarks/bench_spec.py            # CUDA: the H200 figures of BENCHMARKS.md
    python benchmarks/bench_spec.py --tiny     # CPU: tiny shapes, checks the script runs

(a) the mechanism's ceiling: a one-layer draft whose proposals are all kept (forced
    acceptance: an oracle that always agrees, at almost no cost), batch 1, K = 4, against
    plain decoding (target: >= 3x tokens/s), the speculative step eager and on its CUDA graphs;
(b) a Llama-3.2-1B-shape draft: the measured draft-step and verify-step times, the cost
    model's predicted speed-up at acceptance 0.6 / 0.7 / 0.8, and a forced-acceptance run
    whose measured decode speed-up (prefill excluded, as the cost model predicts decode steps)
    is compared with the prediction at acceptance 1 (within 10%);
(c) adaptive speculation (the 1B draft; random weights agree on almost nothing, so the
    cost model should settle on K = 0) against plain decoding at batch 1, 4, 16, 64, 256
    (target: >= 0.98x in every cell).

Prints a table per part and one JSON line (prefix ``RESULT``).
"""
import argparse
import atexit
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mempath import LLM, SamplingParams  # noqa: E402

TARGET = json.loads((ROOT / "tests" / "data" / "configs" / "llama-3.1-8b.json").read_text())
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
            "rope_scaling": {**TARGET.get("rope_scaling", {}), "factor": 32.0}}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def model_dir(name: str, **overrides) -> str:
    directory = Path(tempfile.mkdtemp(prefix=f"mempath-spec-{name}-"))
    atexit.register(shutil.rmtree, directory, True)  # the bench made it: gone when it exits
    config = {**TARGET, **overrides}
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def engine(path: str, args, draft: str | None = None, k: int = 4, adaptive: bool = False, **extra) -> LLM:
    """An engine; the previous one (out of scope by now, engines hold reference cycles) is collected first."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    spec = None if draft is None else {"model": draft, "num_speculative_tokens": k, "adaptive": adaptive}
    return LLM(path, load_format="dummy", max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               speculative_config=spec, show_progress=False, device=args.device, **extra)


def tokens_per_second(llm: LLM, batch: int, args, warmup: bool = True) -> float:
    return timed_generate(llm, batch, args, warmup)[0]


def timed_generate(llm: LLM, batch: int, args, warmup: bool = True) -> tuple[float, float]:
    """(output tokens/s of the whole run, decode tokens/s: the tokens after each request's first,
    over the time after the last first token; the cost model predicts the latter)."""
    rng = np.random.default_rng(batch)
    vocab = llm.engine.spec.vocab_size
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    if warmup:
        llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    decode_time = max(o.total_time for o in outputs) - max(o.time_to_first_token for o in outputs)
    return batch * args.output_len / elapsed, batch * (args.output_len - 1) / decode_time


def print_table(title: str, rows: list[tuple]) -> None:
    print(f"\n{title}")
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def part_a(args, target: str, plain: dict) -> dict:
    oracle = model_dir("oracle", **{**args.draft_shape, "num_hidden_layers": 1})
    llm = engine(target, args, draft=oracle, k=4)
    decoder = llm.engine.spec_decoder
    decoder.force_accept = True
    decoder.use_graphs = False
    eager = tokens_per_second(llm, 1, args)
    decoder.use_graphs = True
    graphs = tokens_per_second(llm, 1, args)
    print_table(f"(a) oracle draft (forced acceptance), batch 1, K = 4 ({decoder.num_graphs()} speculative graphs)",
                [("plain tok/s", "spec eager tok/s", "speed-up", "spec graphs tok/s", "speed-up", "target"),
                 (f"{plain[1]:.1f}", f"{eager:.1f}", f"{eager / plain[1]:.2f}x", f"{graphs:.1f}",
                  f"{graphs / plain[1]:.2f}x", ">= 3x")])
    return {"plain_tok_s": plain[1], "spec_eager_tok_s": eager, "spec_tok_s": graphs,
            "speedup_eager": eager / plain[1], "speedup": graphs / plain[1], "num_graphs": decoder.num_graphs()}


def part_b(args, target: str, draft: str, plain_decode: float) -> dict:
    """``plain_decode``: plain decoding's decode tokens/s at batch 1 (prefill excluded, as the
    cost model predicts decode steps; a speculative run's prefill and first token are a larger
    share of its shorter time, which whole-run tokens/s would charge to the prediction)."""
    llm = engine(target, args, draft=draft, k=4)
    tokens_per_second(llm, 1, args)  # the real (random) proposals: measures draft and verify steps
    cost = llm.engine.spec_decoder.cost
    # A fixed K never runs a plain step: give the model plain decoding's measured step time, as
    # serving would measure it (an interval between step starts, host work included).
    cost.verify.setdefault(1, {})[1] = 1.0 / plain_decode
    times = {"draft_step_s": cost.draft_time(1), "verify_step_s": cost.verify_time(1, 5),
             "plain_step_s": cost.verify_time(1, 1)}
    predicted = {a: cost.predicted_speedup(1, 4, [a]) for a in (0.6, 0.7, 0.8, 1.0)}
    llm.engine.spec_decoder.force_accept = True
    forced_run, forced = timed_generate(llm, 1, args)
    predicted_forced = cost.predicted_speedup(1, 4, [1.0])  # with the times this run measured
    measured = forced / plain_decode
    error = measured / predicted_forced - 1
    print_table("(b) Llama-3.2-1B-shape draft, batch 1, K = 4",
                [("draft step ms", "verify step ms (5 tok)", "plain step ms", "pred. a=0.6", "pred. a=0.7",
                  "pred. a=0.8", "forced: measured (decode)", "forced: predicted", "error"),
                 (f"{times['draft_step_s'] * 1e3:.2f}", f"{times['verify_step_s'] * 1e3:.2f}",
                  f"{times['plain_step_s'] * 1e3:.2f}", f"{predicted[0.6]:.2f}x", f"{predicted[0.7]:.2f}x",
                  f"{predicted[0.8]:.2f}x", f"{measured:.2f}x", f"{predicted_forced:.2f}x", f"{error:+.1%}")])
    return {**times, "predicted": {str(a): v for a, v in predicted.items()}, "forced_measured": measured,
            "forced_predicted": predicted_forced, "forced_error": error, "plain_decode_tok_s": plain_decode,
            "forced_decode_tok_s": forced, "forced_run_tok_s": forced_run}


def adaptive_pass(args, target: str, draft: str) -> tuple[dict, dict, dict]:
    """One adaptive engine over every batch: tokens/s, chosen-K counts and probes per batch."""
    llm = engine(target, args, draft=draft, k=4, adaptive=True)
    stats = llm.engine.spec_decoder.stats
    rates, counts, probes = {}, {}, {}
    for b in args.batches:
        before, probes_before = list(stats.k_counts), stats.num_probes
        rates[b] = tokens_per_second(llm, b, args)
        counts[b] = [n - m for n, m in zip(stats.k_counts, before)]
        probes[b] = stats.num_probes - probes_before
    return rates, counts, probes


def part_c(args, target: str, draft: str, plain: dict) -> dict:
    """Plain and adaptive passes alternated ``--repeats`` times (a fresh engine each): the
    ratio of the medians, and each pass's, since one pass varied by up to 3% on the H200."""
    plains, adaptives = [plain], []
    for repeat in range(args.repeats):
        if repeat:
            plains.append(measure_plain(args, target)[0])
        rates, counts, probes = adaptive_pass(args, target, draft)
        adaptives.append(rates)
    rows = [("batch", "plain tok/s (median)", "adaptive tok/s (median)", "ratio", "ratio per pass",
             "chosen K counts (last)", "probes (last)")]
    out = {}
    for b in args.batches:
        p, a = float(np.median([r[b] for r in plains])), float(np.median([r[b] for r in adaptives]))
        per_pass = [x[b] / y[b] for x, y in zip(adaptives, plains)]
        out[b] = {"plain_tok_s": p, "adaptive_tok_s": a, "ratio": a / p, "ratio_per_pass": per_pass,
                  "plain_passes": [r[b] for r in plains], "adaptive_passes": [r[b] for r in adaptives],
                  "k_counts": counts[b], "probes": probes[b]}
        rows.append((b, f"{p:.1f}", f"{a:.1f}", f"{a / p:.3f}", " ".join(f"{x:.3f}" for x in per_pass),
                     counts[b], probes[b]))
    print_table("(c) adaptive speculation (1B-shape draft, random weights) vs plain; target >= 0.98x", rows)
    return out


def measure_plain(args, target: str) -> tuple[dict, float]:
    """Plain tokens/s per batch (whole runs), and decode tokens/s at batch 1."""
    llm = engine(target, args)
    runs = {b: timed_generate(llm, b, args) for b in args.batches}
    return {b: run[0] for b, run in runs.items()}, runs[1][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a check that it runs)")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--parts", default="abc")
    parser.add_argument("--repeats", type=int, default=3, help="(c): plain and adaptive passes, alternated")
    args = parser.parse_args()
    args.device = "cpu" if args.tiny else "cuda"
    args.batches = [1, 4, 16] if args.tiny else [1, 4, 16, 64, 256]
    args.max_num_seqs = max(args.batches)
    args.max_model_len = args.prompt_len + args.output_len + 32
    if args.tiny:
        args.output_len = min(args.output_len, 32)
        args.max_model_len = args.prompt_len + args.output_len + 32
    tiny = TINY if args.tiny else {}
    args.draft_shape = {**LLAMA_1B, **tiny, **({"num_hidden_layers": 1} if args.tiny else {})}
    target = model_dir("target", **tiny)
    draft = model_dir("draft", **args.draft_shape)
    plain, plain_decode = measure_plain(args, target)
    result = {"device": torch.cuda.get_device_name() if not args.tiny else "cpu", "plain_tok_s": plain}
    if "a" in args.parts:
        result["a"] = part_a(args, target, plain)
    if "b" in args.parts:
        result["b"] = part_b(args, target, draft, plain_decode)
    if "c" in args.parts:
        result["c"] = part_c(args, target, draft, plain)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
