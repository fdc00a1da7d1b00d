"""xgrammar against llguidance on our tokenizers: compile time per schema, mask time per
token, and correctness (every completed random walk validates against its schema).

    python benchmarks/bench_grammar_backends.py [--schemas 30] [--steps 60]

Tokenizers: the shipped mempath-tiny (8,192 tokens) and a byte-level BPE of 128,000
tokens trained here (benchmarks/bpe_tokenizer.py; Llama-3's size). For each schema
(tests/structured_schemas.py, seed 0) each backend compiles it, then walks the grammar:
at each step it fills the token bitmask, takes a random allowed token (seeded) and
advances, until the grammar accepts the end. Prints a table and one RESULT JSON line.
"""
import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import bpe_tokenizer  # noqa: E402
import jsonschema  # noqa: E402
from structured_schemas import schemas  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402


def allowed(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab, eos):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def start(self, compiled):
        self.matcher = self.xgr.GrammarMatcher(compiled)

    def fill(self):
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        return self.bitmask[0]

    def accept(self, token):
        assert self.matcher.accept_token(token)

    def done(self):
        return self.matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab, eos):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False})
        # llguidance compiles lazily: building the matcher is the compile step.
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def start(self, compiled):
        self.matcher = compiled

    def fill(self):
        self.llg.torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        return self.bitmask[0]

    def accept(self, token):
        assert self.matcher.consume_token(token), self.matcher.get_error()

    def done(self):
        return self.matcher.is_stopped()


def walk(backend, schema, rng, vocab, eos, max_steps):
    """Compile, then walk to the end; (compile s, mask times, output text or None, valid)."""
    start = time.perf_counter()
    compiled = backend.compile(schema)
    compile_s = time.perf_counter() - start
    backend.start(compiled)
    tokens, mask_times = [], []
    for _ in range(max_steps):
        start = time.perf_counter()
        row = backend.fill()
        mask_times.append(time.perf_counter() - start)
        choices = allowed(row, vocab)
        # Prefer ending once allowed, so most walks finish inside the step limit.
        token = eos if eos in choices and rng.random() < 0.5 else rng.choice(choices)
        backend.accept(token)
        if token != eos:
            tokens.append(token)
        # llguidance stops by itself once only the end is left; xgrammar once it has taken EOS.
        if token == eos or backend.done():
            break
    return compile_s, mask_times, tokens, backend.done()


def run(tokenizer_dir, label, args):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab, eos = len(tokenizer), tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    rows = []
    for backend_class in (XGrammar, LLGuidance):
        backend = backend_class(tokenizer, vocab, eos)
        rng = random.Random(0)
        compile_times, mask_times, finished, valid = [], [], 0, 0
        for schema in schemas(0, args.schemas):
            compile_s, times, tokens, done = walk(backend, schema, rng, vocab, eos, args.steps)
            compile_times.append(compile_s)
            mask_times += times
            if done:
                finished += 1
                try:
                    jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema)
                    valid += 1
                except (ValueError, jsonschema.ValidationError) as error:
                    print(f"{backend.name} {label}: invalid output {tokenizer.decode(tokens)!r}: {error}")
        rows.append({"tokenizer": label, "vocab": vocab, "backend": backend.name,
                     "compile_ms_median": 1e3 * statistics.median(compile_times),
                     "compile_ms_max": 1e3 * max(compile_times),
                     "mask_us_median": 1e6 * statistics.median(mask_times),
                     "mask_us_p99": 1e6 * sorted(mask_times)[int(0.99 * len(mask_times))],
                     "walks_finished": finished, "walks_valid": valid, "schemas": args.schemas})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=30)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=128000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = run(ROOT / "mempath" / "assets" / "mempath-tiny", "mempath-tiny", args)
    with tempfile.TemporaryDirectory() as directory:
        rows += run(bpe_tokenizer.train(directory, args.vocab), f"bpe-{args.vocab // 1000}k", args)
    print(f"{'tokenizer':14} {'backend':11} {'compile ms (median/max)':>24} {'mask µs (median/p99)':>22} "
          f"{'finished':>9} {'valid':>6}")
    for r in rows:
        print(f"{r['tokenizer']:14} {r['backend']:11} {r['compile_ms_median']:11.1f} /{r['compile_ms_max']:9.1f} "
              f"{r['mask_us_median']:11.1f} /{r['mask_us_p99']:8.1f} {r['walks_finished']:>9} {r['walks_valid']:>6}")
    print("RESULT " + json.dumps(rows))


if __name__ == "__main__":
    main()
