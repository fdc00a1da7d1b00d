"""Two models on one device sharing one KV page pool (docs/multi_model.md), in one run.

    python benchmarks/bench_multi_model.py           # CUDA: Llama-3.1-8B and Llama-3.2-1B shapes, bf16 dummy weights
    python benchmarks/bench_multi_model.py --tiny    # CPU: tiny shapes, checks the script runs

Every configuration has the same KV bytes (``--pages`` pages of one 8B block, 16 tokens):

(a) alternating bursts, big, small, big, small: each burst fills ``--fill`` of the pool in
    its model's tokens, all its requests arriving at once. Time to first token, p50 and p99
    per model, for the shared pool, two static halves (the same engine with
    kv_min_share 0.5: each model always has half, never more) and each model alone with
    the whole pool. Target: shared p99 <= 1.2x alone. The pool's split at each burst's peak,
    and num_device_alloc across the shared run's bursts (target: flat).
(b) hand-off: pipelines small -> big with one tokenizer (token ids as they are) and small ->
    small2 with another (the text re-tokenized): the mean time to build and add the second
    request, and the device reads on that path (target: <= 50 us and 0 for one tokenizer).

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
sys.path.insert(0, str(ROOT / "benchmarks"))

from mempath import LLM, SamplingParams  # noqa: E402

import bpe_tokenizer  # noqa: E402

BIG = json.loads((ROOT / "tests" / "data" / "configs" / "llama-3.1-8b.json").read_text())
SMALL = {**BIG, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
         "rope_scaling": {**BIG.get("rope_scaling", {}), "factor": 32.0}}
TINY_BIG = {**BIG, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32}
TINY_SMALL = {**TINY_BIG, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
TEMPLATE = "Summary: {output}\nAnswer:"


def model_dir(name: str, config: dict, tokenizer_dir: Path) -> str:
    """A dummy-weights directory: config.json with the tokenizer's vocabulary, and the tokenizer."""
    directory = Path(tempfile.mkdtemp(prefix=f"mempath-multi-{name}-"))
    atexit.register(shutil.rmtree, directory, True)  # the bench made it: gone when it exits
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    (directory / "config.json").write_text(json.dumps({**config, "vocab_size": len(vocab),
                                                       "bos_token_id": 0, "eos_token_id": 1}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((tokenizer_dir / name).read_bytes())
    return str(directory)


def fresh(models, args, **options) -> LLM:
    """An engine; the previous one (engines hold reference cycles) is collected first."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return LLM(models, load_format="dummy", max_model_len=args.prompt_len + args.output_len + 64,
               show_progress=False, device=args.device, num_gpu_blocks_override=args.pages,
               gpu_memory_utilization=0.9, **options)


def burst_prompts(vocab: int, tokens: int, args, seed: int) -> list[list[int]]:
    """Prompts whose requests need ``tokens`` KV slots in all."""
    rng = np.random.default_rng(seed)
    count = max(1, tokens // (args.prompt_len + args.output_len))
    return [rng.integers(8, vocab - 8, args.prompt_len).tolist() for _ in range(count)]


def run_burst(step_all, add, prompts, args) -> list[float]:
    """Add every prompt at once, step until all finish; their times to first token."""
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    ids = [add(p, params) for p in prompts]
    ttft = {}
    while len(ttft) < len(ids):
        for output in step_all():
            if output.finished:
                ttft[output.request_id] = output.time_to_first_token
    return [ttft[i] for i in ids]


def bursts(llm: LLM, plan: list[str], sizes: dict, vocab: int, args, multi: bool) -> tuple[dict, list]:
    """Run the bursts of ``plan`` (model names); TTFTs per model and the split at each burst's peak."""
    counter = iter(range(1 << 30))
    ttfts, peaks = {name: [] for name in set(plan)}, []
    for k, model in enumerate(plan):
        tokens = int(args.fill * args.pages * sizes[model])
        prompts = burst_prompts(vocab, tokens, args, seed=k)
        peak = {}
        if multi:
            engine = llm.engine

            def step_all():
                outputs = engine.step()
                for name, used in engine.pool.split().items():
                    peak[name] = max(peak.get(name, 0), used)
                return outputs
            add = lambda p, params: engine.add_request(p, params, f"q{next(counter)}", model=model)  # noqa: E731
        else:
            step_all, add = llm.engine.step, lambda p, params: llm.engine.add_request(p, params, f"q{next(counter)}")
        ttfts[model] += run_burst(step_all, add, prompts, args)
        peaks.append({"model": model, "requests": len(prompts), "peak_pages": peak})
    return ttfts, peaks


def percentiles(values: list[float]) -> dict:
    return {"p50_ms": round(float(np.percentile(values, 50)) * 1e3, 1),
            "p99_ms": round(float(np.percentile(values, 99)) * 1e3, 1), "n": len(values)}


def part_a(dirs: dict, args) -> dict:
    result, plan = {}, ["big", "small"] * args.bursts
    warm = ["big", "small"]
    llm = fresh([f"big={dirs['big']}", f"small={dirs['small']}", f"small2={dirs['small2']}"], args)
    sizes = {name: e.config.block_size for name, e in llm.engines.items()}
    vocab = llm.engines["small"].spec.vocab_size
    bursts(llm, warm, sizes, vocab, args, multi=True)
    cuda = torch.cuda.is_available()
    before = torch.cuda.memory_stats()["num_device_alloc"] if cuda else 0
    ttfts, peaks = bursts(llm, plan, sizes, vocab, args, multi=True)
    after = torch.cuda.memory_stats()["num_device_alloc"] if cuda else 0
    result["shared"] = {m: percentiles(v) for m, v in ttfts.items()}
    result["shared_peaks"], result["num_device_alloc"] = peaks, [before, after]
    result["handoff"] = part_b(llm, vocab, args)
    del llm
    llm = fresh([f"big={dirs['big']}", f"small={dirs['small']}"], args, kv_min_share=0.5)
    bursts(llm, warm, sizes, vocab, args, multi=True)
    ttfts, _ = bursts(llm, plan, sizes, vocab, args, multi=True)
    result["static_halves"] = {m: percentiles(v) for m, v in ttfts.items()}
    del llm
    result["alone"] = {}
    for model in ("big", "small"):
        llm = fresh(dirs[model], args, block_size=sizes[model])
        bursts(llm, [model], sizes, vocab, args, multi=False)
        ttfts, _ = bursts(llm, [model] * args.bursts, sizes, vocab, args, multi=False)
        result["alone"][model] = percentiles(ttfts[model])
        del llm
    return result


def part_b(llm: LLM, vocab: int, args) -> dict:
    """Hand-off cost per pipeline, one tokenizer and two."""
    engine, out = llm.engine, {}
    rng = np.random.default_rng(7)
    prompts = [rng.integers(8, vocab - 8, min(256, args.prompt_len)).tolist() for _ in range(args.pipelines)]
    first = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    second = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for label, target in (("same_tokenizer", "big"), ("other_tokenizer", "small2")):
        llm.pipeline(prompts[:1], "small", target, TEMPLATE, first, second)  # first-time costs: vocabularies compared, pieces tokenized
        count, seconds, reads = engine.num_handoffs, engine.handoff_seconds, engine.num_handoff_device_reads
        start = time.perf_counter()
        llm.pipeline(prompts, "small", target, TEMPLATE, first, second)
        out[label] = {"pipelines": engine.num_handoffs - count,
                      "handoff_us": round((engine.handoff_seconds - seconds) / max(1, engine.num_handoffs - count) * 1e6, 1),
                      "device_reads": engine.num_handoff_device_reads - reads,
                      "wall_s": round(time.perf_counter() - start, 3)}
    return out


def print_tables(result: dict) -> None:
    print("\n(a) time to first token under alternating bursts (ms)")
    print(f"{'config':<14}{'model':<8}{'p50':>10}{'p99':>10}{'p99 / alone':>14}")
    for config in ("alone", "shared", "static_halves"):
        for model in ("big", "small"):
            row = result[config][model]
            ratio = row["p99_ms"] / result["alone"][model]["p99_ms"]
            print(f"{config:<14}{model:<8}{row['p50_ms']:>10}{row['p99_ms']:>10}{ratio:>14.2f}")
    print(f"num_device_alloc across the shared bursts: {result['num_device_alloc']}")
    for peak in result["shared_peaks"]:
        print(f"  burst on {peak['model']:<6} {peak['requests']:>4} requests, peak pages {peak['peak_pages']}")
    print("\n(b) hand-off")
    for label, row in result["handoff"].items():
        print(f"  {label:<16} {row['handoff_us']:>8} us per hand-off, {row['device_reads']} device reads, "
              f"{row['pipelines']} pipelines in {row['wall_s']} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a check that it runs)")
    parser.add_argument("--pages", type=int, default=None, help="pages in the pool (default 4096; tiny: 64)")
    parser.add_argument("--fill", type=float, default=0.75, help="fraction of the pool one burst needs")
    parser.add_argument("--bursts", type=int, default=2, help="bursts per model")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--pipelines", type=int, default=None)
    args = parser.parse_args()
    args.device = "cpu" if args.tiny else "cuda"
    args.pages = args.pages or (64 if args.tiny else 4096)
    args.prompt_len = args.prompt_len or (40 if args.tiny else 1000)
    args.output_len = args.output_len or (8 if args.tiny else 64)
    args.pipelines = args.pipelines or (4 if args.tiny else 64)
    work = Path(tempfile.mkdtemp(prefix="mempath-multi-tok-"))
    atexit.register(shutil.rmtree, work, True)  # the bench made it: gone when it exits
    corpus = 1 << 20 if args.tiny else 4 << 20
    t1 = bpe_tokenizer.train(work / "t1", 512 if args.tiny else 8192, corpus)
    t2 = bpe_tokenizer.train(work / "t2", 400 if args.tiny else 6000, corpus // 2)
    big, small = (TINY_BIG, TINY_SMALL) if args.tiny else (BIG, SMALL)
    dirs = {"big": model_dir("big", big, t1), "small": model_dir("small", small, t1),
            "small2": model_dir("small2", small, t2)}
    start = time.perf_counter()
    result = part_a(dirs, args)
    result.update(pages=args.pages, fill=args.fill, prompt_len=args.prompt_len, output_len=args.output_len,
                  device=torch.cuda.get_device_name() if not args.tiny else "cpu",
                  wall_s=round(time.perf_counter() - start, 1))
    print_tables(result)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
