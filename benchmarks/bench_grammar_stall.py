"""How long a running stream stalls while new grammars compile: on the engine thread (as
before issue #19) against in AsyncEngine's pool (now), plus the costs behind it.

    python benchmarks/bench_grammar_stall.py           # CUDA: Llama-3.1-8B shape, random weights
    python benchmarks/bench_grammar_stall.py --tiny    # CPU: the shipped mempath-tiny

The 8B shape gets a trained 128,000-token byte-level BPE (benchmarks/bpe_tokenizer.py,
~15 s), so xgrammar's tokenizer preprocessing is a real vocabulary's. Each mode starts from
a compiler that has not been set up, so its first schema also pays that preprocessing; a
free stream (greedy, ignore_eos) decodes while `--schemas` random JSON schemas are added
one after another, and the gaps between the free stream's tokens meanwhile are reported
against its gaps before. Also: the preprocessing alone, and compiling the schemas one by one
against GrammarCompiler.compile_all (LLM.generate's batch). Prints a table and a RESULT line.
"""
import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_structured import shape_dir  # noqa: E402
from structured_schemas import schemas  # noqa: E402

from mempath.config import EngineConfig  # noqa: E402
from mempath.engine.engine import LLMEngine  # noqa: E402
from mempath.sampling import SamplingParams  # noqa: E402
from mempath.server.async_engine import AsyncEngine, UpdateQueue  # noqa: E402
from mempath.structured import StructuredOutputsParams  # noqa: E402
from mempath.structured.grammar import GrammarCompiler  # noqa: E402


def fresh_compiler(engine) -> GrammarCompiler:
    old = engine.inputs.grammars
    return GrammarCompiler(old.tokenizer, old.vocab_size, set(old.stop_token_ids))


async def on_the_engine_thread(params, request_id, model) -> bool:
    return True  # AsyncEngine._compile_grammar skipped: the engine thread's add compiles


async def stall(client: AsyncEngine, cases: list[dict], seed: int) -> dict:
    """The free stream's token gaps (ms) before and while `cases` are added, one after another."""
    stream = UpdateQueue()
    await client.add_request([11 + seed, 12, 13], SamplingParams(max_tokens=100000, temperature=0, ignore_eos=True),
                             f"free-{seed}", stream)
    arrivals = []

    async def read():
        while not (await stream.get()).finished:
            arrivals.append(time.perf_counter())
    reader = asyncio.create_task(read())
    while len(arrivals) < 40:
        await asyncio.sleep(0.005)
    began = time.perf_counter()
    for i, schema in enumerate(cases):
        params = SamplingParams(max_tokens=4, temperature=0, structured_outputs=StructuredOutputsParams(json=schema))
        await client.add_request("x", params, f"s{seed}-{i}", UpdateQueue())
    added = time.perf_counter()
    await asyncio.sleep(0.2)
    client.abort(f"free-{seed}")
    await reader
    before = [1e3 * (b - a) for a, b in zip(arrivals, arrivals[1:]) if b <= began]
    during = [1e3 * (b - a) for a, b in zip(arrivals, arrivals[1:]) if b > began and a < added]
    return {"adding_s": added - began, "gap_before_median_ms": statistics.median(before),
            "gap_during_max_ms": max(during), "gap_during_median_ms": statistics.median(during)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the shipped mempath-tiny on this device (CPU check)")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--vocab", type=int, default=128000)
    parser.add_argument("--schemas", type=int, default=32)
    args = parser.parse_args()
    if args.tiny:
        config = EngineConfig.from_kwargs(str(ROOT / "mempath" / "assets" / "mempath-tiny"))
    else:
        config = EngineConfig.from_kwargs(shape_dir(args.shape, args.vocab), load_format="dummy", dtype="bfloat16")
    engine = LLMEngine(config, show_progress=False)
    compiler = fresh_compiler(engine)
    setup_s = compiler.prepare()
    cases = schemas(seed=3, count=args.schemas)
    start = time.perf_counter()
    for schema in cases:
        compiler.compile(StructuredOutputsParams(json=schema))
    one_by_one_s = time.perf_counter() - start
    compiler = fresh_compiler(engine)
    compiler.prepare()
    start = time.perf_counter()
    compiler.compile_all([StructuredOutputsParams(json=schema) for schema in cases])
    compile_all_s = time.perf_counter() - start

    client = AsyncEngine(engine)
    client.start()
    modes = {}
    for seed, mode in enumerate(("engine thread", "pool")):
        engine.inputs.grammars = fresh_compiler(engine)  # not set up: the first schema pays that too
        if mode == "engine thread":
            client._compile_grammar = on_the_engine_thread
        else:
            del client._compile_grammar
        modes[mode] = asyncio.run(stall(client, schemas(seed=10 + seed, count=args.schemas), seed))
    client.shutdown()

    print(f"model: {'mempath-tiny' if args.tiny else args.shape}, vocab {engine.spec.vocab_size}, "
          f"device {engine.device}, {args.schemas} random JSON schemas")
    print(f"xgrammar tokenizer preprocessing: {setup_s:.2f} s; compiling the schemas one by one "
          f"{one_by_one_s:.3f} s, compile_all {compile_all_s:.3f} s")
    print(f"{'compiled on':>14} {'adding (s)':>11} {'gap before, median ms':>22} {'gap while adding: max':>22} "
          f"{'median ms':>10}")
    for mode, r in modes.items():
        print(f"{mode:>14} {r['adding_s']:>11.2f} {r['gap_before_median_ms']:>22.1f} "
              f"{r['gap_during_max_ms']:>22.1f} {r['gap_during_median_ms']:>10.1f}")
    print("RESULT " + json.dumps({"setup_s": setup_s, "one_by_one_s": one_by_one_s, "compile_all_s": compile_all_s,
                                  "modes": modes}))


if __name__ == "__main__":
    main()
