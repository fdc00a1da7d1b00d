"""Structured output's cost: decode tokens/s with a JSON schema against unconstrained decoding
in the same run, at batch 1 and 64, and the grammar compile time per schema.

    python benchmarks/bench_structured.py                     # CUDA: Llama-3.1-8B shape, random weights
    python benchmarks/bench_structured.py --tiny              # CPU: the shipped mempath-tiny

The 8B shape ships no tokenizer: a byte-level BPE of 128,000 tokens is trained first
(benchmarks/bpe_tokenizer.py, ~15 s), Llama-3's size, so the mask covers a real
vocabulary. Each batch size runs unconstrained (ignore_eos) and then with the schema
(records of a string, an integer and a boolean, at least 300 of them, so every
row decodes its max_tokens) after one warm-up of each.
Prints a table and one RESULT JSON line.
"""
import argparse
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
    shutil.copy(ROOT / "tests" / "data" / "configs" / f"{shape}.json", directory / "config.json")
    bpe_tokenizer.train(directory, vocab)
    return str(directory)


def decode_rate(llm, batch: int, tokens: int, structured) -> tuple[float, float]:
    """(output tokens/s, mean output tokens) for `batch` concurrent requests."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, structured_outputs=structured)
    prompts = [f"Write notes {i}: " for i in range(batch)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    assert all(o.finish_reason in ("length", "stop") for o in outputs), [o.error for o in outputs]
    return generated / elapsed, generated / batch


def compile_times(llm, count: int) -> tuple[float, list[float]]:
    """(first compile incl. the tokenizer's preprocessing, the following ones) in seconds."""
    compiler = llm.engine.inputs.grammars
    times = []
    for schema in [{"type": "object"}] + schemas(seed=1, count=count):
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema))
        times.append(time.perf_counter() - start)
    return times[0], times[1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the shipped mempath-tiny on this device (CPU check)")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--vocab", type=int, default=128000)
    parser.add_argument("--batches", default=None, help="comma-separated (default 1,64; --tiny 1,8)")
    parser.add_argument("--tokens", type=int, default=None, help="max_tokens per request (default 256; --tiny 32)")
    parser.add_argument("--schemas", type=int, default=50)
    args = parser.parse_args()
    batches = [int(b) for b in (args.batches or ("1,8" if args.tiny else "1,64")).split(",")]
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
        free, free_len = decode_rate(llm, batch, tokens, None)
        constrained, constrained_len = decode_rate(llm, batch, tokens, structured)
        rows.append({"batch": batch, "unconstrained_tok_s": free, "json_schema_tok_s": constrained,
                     "slowdown_pct": 100 * (1 - constrained / free), "mean_tokens_unconstrained": free_len,
                     "mean_tokens_json_schema": constrained_len})
    print(f"model: {'mempath-tiny' if args.tiny else args.shape}, vocab {llm.engine.spec.vocab_size}, "
          f"device {llm.engine.device}, max_tokens {tokens}")
    print(f"compile: first {1e3 * first:.0f} ms (includes the tokenizer's preprocessing), then per schema "
          f"median {1e3 * statistics.median(compiles):.1f} ms, max {1e3 * max(compiles):.1f} ms "
          f"({len(compiles)} random schemas)")
    print(f"{'batch':>5} {'unconstrained tok/s':>20} {'json schema tok/s':>18} {'slower':>7} {'tokens/row':>11}")
    for r in rows:
        print(f"{r['batch']:>5} {r['unconstrained_tok_s']:>20.1f} {r['json_schema_tok_s']:>18.1f} "
              f"{r['slowdown_pct']:>6.1f}% {r['mean_tokens_unconstrained']:>5.0f}/{r['mean_tokens_json_schema']:<5.0f}")
    print("RESULT " + json.dumps({"shape": "mempath-tiny" if args.tiny else args.shape, "rows": rows,
                                  "compile_first_ms": 1e3 * first,
                                  "compile_median_ms": 1e3 * statistics.median(compiles),
                                  "compile_max_ms": 1e3 * max(compiles)}))


if __name__ == "__main__":
    main()
