"""Structured output's cost: decode tokens/s with a JSON schema against unconstrained decoding
in the same run, at batch 1 and 64, and the grammar compile time per schema.

    python benchmarks/bench_structured.py                     # CUDA: Llama-3.1-8B shape, random weights
    python benchmarks/bench_structured.py --tiny              # CPU: the shipped mempath-tiny

The 8B shape ships no tokenizer: a byte-level BPE of 128,000 tokens is trained first
(benchmarks/bpe_tokenizer.py, ~15 s), Llama-3's size, so the mask covers a real
vocabulary. Each batch size runs unconstrained (ignore_eos), then with the schema (records of a
string, an integer and a boolean, at least 300 of them, so every row decodes its
max_tokens), then with the schema and async scheduling off (every step read back before
the next is scheduled: how grammar steps ran before they were scheduled ahead), after one
warm-up of each. Per run: tokens/s, ms per decode step, and for the schema the host time
of one step's mask fill (xgrammar's batched fill, measured inside GrammarBitmask).
Prints a table and one RESULT JSON line.
"""
import argparse
import atexit
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import bpe_tokenizer  # noqa: E402
from structured_schemas import schemas  # noqa: E402

from mempath import LLM, SamplingParams  # noqa: E402
from mempath.structured import StructuredOutputsParams  # noqa: E402
from mempath.structured.bitmask import fill_threads  # noqa: E402

# Records of a string, an integer and a boolean; minItems keeps the grammar from ending
# before max_tokens, so both runs decode the same number of tokens per row.
RECORD = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99999},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "count", "ok"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "items": RECORD, "minItems": 300}},
          "required": ["records"], "additionalProperties": False}


def shape_dir(shape: str, vocab: int) -> str:
    directory = Path(tempfile.mkdtemp(prefix=f"mempath-structured-{shape}-"))
    atexit.register(shutil.rmtree, directory, True)  # the bench made it: gone when it exits
    shutil.copy(ROOT / "tests" / "data" / "configs" / f"{shape}.json", directory / "config.json")
    bpe_tokenizer.train(directory, vocab)
    return str(directory)


def decode_rate(llm, batch: int, tokens: int, structured, async_scheduling: bool = True) -> dict:
    """Output tokens/s, mean output tokens, ms per step and ms of mask fill per step for
    `batch` concurrent requests."""
    # The scheduler reads this flag at every step; switching it here spares building a second
    # engine (the 8B shape's weights twice).
    llm.engine.scheduler.async_scheduling = async_scheduling
    fills = timed_fills(llm.engine.runner.grammar_bitmask)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, structured_outputs=structured)
    prompts = [f"Write notes {i}: " for i in range(batch)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    llm.engine.scheduler.async_scheduling = True
    del llm.engine.runner.grammar_bitmask.fill  # the class's again
    generated = sum(len(o.token_ids) for o in outputs)
    assert all(o.finish_reason in ("length", "stop") for o in outputs), [o.error for o in outputs]
    return {"tok_s": generated / elapsed, "mean_tokens": generated / batch,
            "step_ms": 1e3 * elapsed / max(len(o.token_ids) for o in outputs),
            "mask_fill_ms_median": 1e3 * statistics.median(fills) if fills else 0.0,
            "mask_fill_ms_mean": 1e3 * statistics.fmean(fills) if fills else 0.0}


def timed_fills(bitmask) -> list[float]:
    """Time each call of the bitmask's fill (every grammar row's mask of one step, on the host)
    by shadowing it on the instance; the list fills as the engine runs."""
    seconds, fill = [], bitmask.fill

    def timed(grammars):
        start = time.perf_counter()
        fill(grammars)
        seconds.append(time.perf_counter() - start)
    bitmask.fill = timed
    return seconds


def compile_times(llm, count: int) -> tuple[float, list[float]]:
    """(first compile incl. the tokenizer's preprocessing, the following ones) in seconds."""
    compiler = llm.engine.inputs.grammars
    times = []
    for schema in [{"type": "object"}] + schemas(seed=1, count=count):
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema))
        times.append(time.perf_counter() - start)
    return times[0], times[1:]


def fill_costs(model_dir: str, batches: list[int], steps: int = 64) -> list[dict]:
    """Host µs per step to fill every row's mask: one row at a time (xgrammar's single-matcher
    fill, as before the batched fill) against GrammarBitmask.fill, over the same walks (each
    row takes a seeded random allowed token per step); no model runs."""
    import numpy as np
    from transformers import AutoTokenizer

    from mempath.structured.bitmask import GrammarBitmask
    from mempath.structured.grammar import GrammarCompiler
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab, {tokenizer.eos_token_id})
    rng = np.random.default_rng(0)
    results = []
    for batch in batches:
        grammars = [compiler.matcher(StructuredOutputsParams(json=SCHEMA)) for _ in range(batch)]
        bitmask = GrammarBitmask(batch, vocab, torch.device("cpu"))
        one_at_a_time, batched = [], []
        for _ in range(steps):
            start = time.perf_counter()
            for row, grammar in enumerate(grammars):
                grammar.matcher.fill_next_token_bitmask(bitmask.host, row)
                bitmask.host_np[row].any()  # the dead-end check, per row as it was
            one_at_a_time.append(time.perf_counter() - start)
            start = time.perf_counter()
            bitmask.fill(grammars)
            bitmask.host_np[:batch].any(axis=1)
            batched.append(time.perf_counter() - start)
            bits = np.unpackbits(bitmask.host_np[:batch].view(np.uint8), axis=1, bitorder="little")[:, :vocab]
            for row, grammar in enumerate(grammars):
                grammar.accept(int(rng.choice(np.flatnonzero(bits[row]))))
        results.append({"batch": batch, "one_row_at_a_time_us": 1e6 * statistics.median(one_at_a_time),
                        "batched_us": 1e6 * statistics.median(batched)})
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the shipped mempath-tiny on this device (CPU check)")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--vocab", type=int, default=128000)
    parser.add_argument("--batches", default=None, help="comma-separated (default 1,64; --tiny 1,8)")
    parser.add_argument("--tokens", type=int, default=None, help="max_tokens per request (default 256; --tiny 32)")
    parser.add_argument("--schemas", type=int, default=50)
    parser.add_argument("--fill-only", action="store_true",
                        help="only the host cost of filling the masks, one row at a time against batched (no model)")
    args = parser.parse_args()
    batches = [int(b) for b in (args.batches or ("1,8" if args.tiny else "1,64")).split(",")]
    if args.fill_only:
        model_dir = str(ROOT / "mempath" / "assets" / "mempath-tiny") if args.tiny else shape_dir(args.shape, args.vocab)
        costs = fill_costs(model_dir, batches)
        print(f"mask fill, host µs per step (median of 64 steps, {fill_threads()} fill threads)")
        for c in costs:
            print(f"  batch {c['batch']:>3}: one row at a time {c['one_row_at_a_time_us']:8.1f}   "
                  f"batched {c['batched_us']:8.1f}")
        print("RESULT " + json.dumps({"fill": costs, "fill_threads": fill_threads()}))
        return
    tokens = args.tokens or (32 if args.tiny else 256)
    if args.tiny:
        llm = LLM(str(ROOT / "mempath" / "assets" / "mempath-tiny"), show_progress=False,
                  max_num_seqs=max(batches))
    else:
        llm = LLM(shape_dir(args.shape, args.vocab), load_format="dummy", dtype="bfloat16",
                  max_num_seqs=max(batches), show_progress=False)
    first, compiles = compile_times(llm, args.schemas)
    structured = StructuredOutputsParams(json=SCHEMA)
    rows = []
    for batch in batches:
        for constraint in (None, structured):  # warm-up: graphs, allocator, the schema's compile
            decode_rate(llm, batch, 8, constraint)
        free = decode_rate(llm, batch, tokens, None)
        constrained = decode_rate(llm, batch, tokens, structured)
        constrained_sync = decode_rate(llm, batch, tokens, structured, async_scheduling=False)
        rows.append({"batch": batch, "unconstrained": free, "json_schema": constrained,
                     "json_schema_sync": constrained_sync,
                     "slowdown_pct": 100 * (1 - constrained["tok_s"] / free["tok_s"]),
                     "slowdown_sync_pct": 100 * (1 - constrained_sync["tok_s"] / free["tok_s"])})
    print(f"model: {'mempath-tiny' if args.tiny else args.shape}, vocab {llm.engine.spec.vocab_size}, "
          f"device {llm.engine.device}, max_tokens {tokens}")
    print(f"compile: first {1e3 * first:.0f} ms (includes the tokenizer's preprocessing), then per schema "
          f"median {1e3 * statistics.median(compiles):.1f} ms, max {1e3 * max(compiles):.1f} ms "
          f"({len(compiles)} random schemas)")
    print("tok/s (ms per step); 'sync': the schema with async scheduling off; "
          "mask fill: host ms per step, median / mean")
    print(f"{'batch':>5} {'unconstrained':>16} {'json schema':>16} {'slower':>7} {'json, sync':>16} "
          f"{'slower':>7} {'mask fill':>13} {'tokens/row':>11}")
    for r in rows:
        free, fast, slow = r["unconstrained"], r["json_schema"], r["json_schema_sync"]
        print(f"{r['batch']:>5} {cell(free):>16} {cell(fast):>16} {r['slowdown_pct']:>6.1f}% {cell(slow):>16} "
              f"{r['slowdown_sync_pct']:>6.1f}% "
              f"{fast['mask_fill_ms_median']:>6.3f}/{fast['mask_fill_ms_mean']:<6.3f} "
              f"{free['mean_tokens']:>5.0f}/{fast['mean_tokens']:<5.0f}")
    print("RESULT " + json.dumps({"shape": "mempath-tiny" if args.tiny else args.shape, "rows": rows,
                                  "compile_first_ms": 1e3 * first,
                                  "compile_median_ms": 1e3 * statistics.median(compiles),
                                  "compile_max_ms": 1e3 * max(compiles)}))


def cell(run: dict) -> str:
    return f"{run['tok_s']:.1f} ({run['step_ms']:.2f})"


if __name__ == "__main__":
    main()
