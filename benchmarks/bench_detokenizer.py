"""The detokenizer's host cost per token: the path before #17's change, the slow path, the fast one.

    python benchmarks/bench_detokenizer.py              # mempath-tiny and a 128k-vocab byte-level BPE
    python benchmarks/bench_detokenizer.py --vocab 0    # mempath-tiny only (no training)

"before" is the detokenizer as it ran until the fast path came: two transformers
decodes a token, handed a fresh slice of the whole output each token (quadratic in
the output's length). "slow" is SlowIncrementalDetokenizer (the same two decodes on
the new token alone), "fast" FastIncrementalDetokenizer (one DecodeStream step).
Token ids are real text (this Python's standard library sources) encoded by each
tokenizer. Per tokenizer it prints µs per token, averaged over outputs of 16, 256
and 2048 tokens, and one 256-row step's total at output lengths 256 and 2048;
then one RESULT JSON line. CPU only; the 128k BPE is trained first (about 15 s).
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import bpe_tokenizer  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from mempath.engine.detokenizer import FastIncrementalDetokenizer, SlowIncrementalDetokenizer  # noqa: E402

PROMPT_TOKENS = 64
LENGTHS = (16, 256, 2048)
ROWS = 256


class BeforeDetokenizer:
    """The detokenizer and its call as they were: offsets into the whole output, sliced per token."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.prefix_offset = self.read_offset = 0
        self.token_ids: list[int] = []

    def delta(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        output = self.token_ids[PROMPT_TOKENS:]  # output.py's request.token_ids[num_prompt_tokens:]
        prefix = self.tokenizer.decode(output[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = self.tokenizer.decode(output[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(output)
            return full[len(prefix):]
        return ""

    def start(self, prompt_ids: list[int]) -> None:
        self.token_ids = list(prompt_ids)


def detokenizers(tokenizer):
    def before():
        detok = BeforeDetokenizer(tokenizer)
        detok.start([0] * PROMPT_TOKENS)
        return detok
    return {"before": before,
            "slow": lambda: SlowIncrementalDetokenizer(tokenizer),
            "fast": lambda: FastIncrementalDetokenizer(tokenizer.backend_tokenizer)}


def text_ids(tokenizer, count: int) -> list[int]:
    ids: list[int] = []
    for text in bpe_tokenizer.corpus(8 << 20):
        ids += tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) >= count:
            return ids[:count]
    raise SystemExit("not enough text for the token ids")


def per_token_us(make, ids: list[int], length: int, repeats: int) -> float:
    """Mean µs per token over whole outputs of `length` tokens."""
    best = float("inf")
    for _ in range(repeats):
        detok = make()
        start = time.perf_counter()
        for token_id in ids[:length]:
            detok.delta(token_id)
        best = min(best, time.perf_counter() - start)
    return best / length * 1e6


def step_ms(make, ids: list[int], at_length: int, steps: int = 5) -> float:
    """The fastest of `steps` steps of ROWS rows (a token each) whose outputs hold `at_length` tokens."""
    rows = []
    for row in range(ROWS):
        detok = make()
        for token_id in ids[row:row + at_length]:
            detok.delta(token_id)
        rows.append(detok)
    best = float("inf")
    for step in range(steps):
        start = time.perf_counter()
        for row, detok in enumerate(rows):
            detok.delta(ids[row + at_length + step])
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def measure(name: str, tokenizer) -> dict:
    ids = text_ids(tokenizer, max(LENGTHS) + ROWS + 5)
    result = {"tokenizer": name, "vocab": len(tokenizer)}
    for path, make in detokenizers(tokenizer).items():
        for length in LENGTHS:
            result[f"{path}_us_per_token_{length}"] = round(
                per_token_us(make, ids, length, repeats=3 if length <= 256 else 1), 2)
        for at_length in (256, 2048):
            result[f"{path}_step_ms_{ROWS}rows_at_{at_length}"] = round(step_ms(make, ids, at_length), 2)
    return result


def print_table(result: dict) -> None:
    print(f"\n{result['tokenizer']} (vocab {result['vocab']:,})")
    columns = [f"µs/token @{n}" for n in LENGTHS] + [f"{ROWS}-row step ms @{n}" for n in (256, 2048)]
    print(f"{'path':<8}" + "".join(f"{c:>22}" for c in columns))
    for path in ("before", "slow", "fast"):
        values = [result[f"{path}_us_per_token_{n}"] for n in LENGTHS]
        values += [result[f"{path}_step_ms_{ROWS}rows_at_{n}"] for n in (256, 2048)]
        print(f"{path:<8}" + "".join(f"{v:>22.2f}" for v in values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128_000, help="the trained BPE's vocabulary (0: skip it)")
    args = parser.parse_args()
    results = [measure("mempath-tiny", AutoTokenizer.from_pretrained(ROOT / "mempath" / "assets" / "mempath-tiny"))]
    print_table(results[-1])
    if args.vocab:
        with tempfile.TemporaryDirectory(prefix="mempath-detok-bpe-") as directory:
            bpe_tokenizer.train(directory, args.vocab)
            results.append(measure(f"byte-level BPE {args.vocab // 1000}k", AutoTokenizer.from_pretrained(directory)))
        print_table(results[-1])
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
