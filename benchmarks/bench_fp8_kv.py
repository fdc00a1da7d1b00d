"""The fp8 KV cache (#20) against bf16 on a GPU: decode speed at long context, blocks in the
same budget, and retrieval of a needle in 4k-32k tokens.

    python3 benchmarks/bench_fp8_kv.py --parts kernel,decode,retrieval

kernel: the decode attention kernel alone at four (batch, context) cases, a bf16 cache against
fp8 caches at each KV tile (tokens per loop iteration), software-pipeline depth and warp count
(``--fp8-variants``),
with the KV bytes each reads per second.

decode: the Llama-3.1-8B shape (random bf16 weights), ``--batch`` sequences of ``--context``
random tokens, then ``--new-tokens`` greedy tokens each, once per KV dtype. The prompts are
prefilled first and found in the prefix cache by the timed run, so its steps are decode
steps of the whole batch (the first one recomputes each prompt's last block). Reports the KV
blocks each engine gets from the same ``--gpu-memory-utilization``, ms per decode step and
output tok/s, against the read limit: the weights plus every sequence's cached K and V
(at the run's mean context) over the device-to-device copy bandwidth measured in the same
run. transformers is not run beside it: at this batch and context its prefill alone
(logits of 64 x 8k positions over 128k tokens) does not fit the GPU.

retrieval: the hand-built needle model (benchmarks/needle_model.py) at two sharpnesses:
``--sharpness`` (default 8 and 10: where retrieval gets hard with length, and where it holds
to 32k), ``--prompts`` prompts per length, bf16 weights, KV auto (bf16) and fp8, CUDA graphs
on; and transformers (sdpa, bf16) on the same prompts as the reference.
"""
import argparse
import atexit
import json
import re
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
from mempath.memory.formulas import kv_bytes_per_token, read_shape  # noqa: E402

KV_DTYPES = ("auto", "fp8")
PARTS = ("kernel", "decode", "retrieval")


def run_decode(args, kv: str, prompts: list[list[int]], config: dict) -> dict:
    from bench_engine import decode_weight_bytes, model_dir
    llm = LLM(model_dir(args.shape), load_format="dummy", dtype="bfloat16", kv_cache_dtype=kv,
              max_num_seqs=args.batch, max_model_len=args.context + args.new_tokens + 16,
              gpu_memory_utilization=args.gpu_memory_utilization, show_progress=False)
    stats = llm.stats()
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
    prefill_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    step_s = max(o.total_time - o.time_to_first_token for o in outs) / (args.new_tokens - 1)
    cached = min(o.num_cached_tokens for o in outs)
    block_size = llm.engine.config.block_size
    needed = args.batch * -(-(args.context + args.new_tokens) // block_size)
    result = {"kv_cache_dtype": kv, "kv_blocks": stats["kv_blocks_total"], "kv_blocks_needed": needed,
              "holds_batch": stats["kv_blocks_total"] >= needed, "prefill_s": prefill_s,
              "ms_per_step": 1e3 * step_s, "output_tok_s": args.batch / step_s,
              "min_cached_prompt_tokens": cached, "weight_bytes": llm.engine.ledger.get("weights"),
              "weight_read_bytes": decode_weight_bytes(llm.engine, args.batch),
              "kv_bytes_per_token": kv_bytes_per_token(read_shape(config), 1 if kv.startswith("fp8") else 2)}
    del llm, outs
    torch.cuda.empty_cache()
    return result


VARIANT = re.compile(r"tile(16|32|64|128|256)(?:-s([1-8]))?(?:-w([1248]))?(?:-r([1-9]\d{1,2}))?")


def is_fp8_variant(name: str) -> bool:
    """A variant name whose register cap, if any, is one the launcher takes (FP8_DECODE_MAXNREG)."""
    from mempath.kernels.attention_triton import FP8_DECODE_MAXNREG_CHOICES
    match = VARIANT.fullmatch(name)
    return bool(match) and (match[4] is None or int(match[4]) in FP8_DECODE_MAXNREG_CHOICES)


def fp8_variant_list(text: str) -> list[str]:
    """--fp8-variants: comma-separated tile<16..256>[-s<1..8>][-w<1|2|4|8>][-r<registers>] names."""
    names = text.split(",")
    bad = [n for n in names if not is_fp8_variant(n)]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad}: a variant is tile16, tile32, tile64, tile128 or tile256, optionally "
                                         f"with -s1..-s8 (pipeline stages), -w1, -w2, -w4 or -w8 (warps) and -r64 to "
                                         f"-r248 (registers a thread, a multiple of 8), e.g. tile128-s3-w4-r128")
    return names


def set_fp8_variant(name: str) -> None:
    """"tile128" or "tile32-s6-w2" -> the decode kernel's tile, pipeline stages and warps over an fp8
    cache (module settings, read at launch; left out: the kernel's own choice)."""
    from mempath.kernels import attention_triton as ta
    tile, stages, warps, registers = VARIANT.fullmatch(name).groups()
    ta.DECODE_TILE_FP8 = int(tile)
    ta.FP8_DECODE_STAGES = int(stages) if stages else None
    ta.FP8_DECODE_WARPS = int(warps) if warps else None
    ta.FP8_DECODE_MAXNREG = int(registers) if registers else None


def current_fp8_variant() -> str:
    from mempath.kernels import attention_triton as ta
    return (f"tile{ta.DECODE_TILE_FP8}" + (f"-s{ta.FP8_DECODE_STAGES}" if ta.FP8_DECODE_STAGES else "")
            + (f"-w{ta.FP8_DECODE_WARPS}" if ta.FP8_DECODE_WARPS else "")
            + (f"-r{ta.FP8_DECODE_MAXNREG}" if ta.FP8_DECODE_MAXNREG else ""))


def bench_decode(args, extra_fp8_variant: str | None = None) -> list[dict]:
    from bench_engine import SHAPES, copy_bandwidth, decode_read_limit_ms
    config = json.loads((SHAPES / f"{args.shape}.json").read_text())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config["vocab_size"], args.context).tolist() for _ in range(args.batch)]
    bandwidth = copy_bandwidth()
    mean_context = args.context + args.new_tokens / 2
    results = []
    default = current_fp8_variant()
    runs = [("auto", None), ("fp8", default)] + ([("fp8", extra_fp8_variant)] if extra_fp8_variant
                                                 and extra_fp8_variant != default else [])
    for kv, variant in runs:
        if variant:
            set_fp8_variant(variant)
        try:
            r = run_decode(args, kv, prompts, config)
        finally:
            set_fp8_variant(default)
        r["fp8_decode_kernel"] = variant
        limit = decode_read_limit_ms(r["weight_read_bytes"], r["kv_bytes_per_token"], args.batch, mean_context,
                                     bandwidth)
        r.update(bench="fp8-kv-decode", shape=args.shape, batch=args.batch, context=args.context,
                 new_tokens=args.new_tokens, copy_bandwidth=bandwidth, limit_ms_per_step=limit,
                 of_limit=limit / r["ms_per_step"])
        results.append(r)
    base, fp8 = results[0], max(results[1:], key=lambda r: r["output_tok_s"])
    print(f"\ndecode: {args.shape}, batch {args.batch}, context {args.context}, {args.new_tokens} new tokens; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'KV':>18} {'blocks':>8} {'ms/step':>8} {'tok/s':>8} {'limit ms':>9} {'of limit':>9} {'prefill s':>10}")
    for r in results:
        label = r["kv_cache_dtype"] + (" " + r["fp8_decode_kernel"] if r["fp8_decode_kernel"] else "")
        print(f"{label:>18} {r['kv_blocks']:>8} {r['ms_per_step']:>8.2f} {r['output_tok_s']:>8.0f} "
              f"{r['limit_ms_per_step']:>9.2f} {100 * r['of_limit']:>8.1f}% {r['prefill_s']:>10.1f}")
    for r in results:
        if not r["holds_batch"]:
            print(f"{r['kv_cache_dtype']} KV: {r['kv_blocks']} blocks, the batch needs {r['kv_blocks_needed']}: its "
                  f"requests preempt each other, so its tok/s is no decode speed (on this GPU, lower --batch or --context)")
    print(f"fp8 ({fp8['fp8_decode_kernel']}) / bf16: {fp8['output_tok_s'] / base['output_tok_s']:.2f}x tok/s, "
          f"{fp8['kv_blocks'] / base['kv_blocks']:.3f}x blocks; every prompt found "
          f"{min(r['min_cached_prompt_tokens'] for r in results)} of its {args.context} tokens cached")
    return results


KERNEL_CASES = ((64, 8192), (1, 8192), (32, 1024), (128, 1024))
# Fewer registers a program (smaller tiles, fewer warps) let more programs share an SM; deeper
# pipelines keep more loads in flight each (registers and shared memory from compiling for sm_90:
# at tile 128, 2 programs an SM at any depth, with 40, 73 and 105 KB of shared memory at 3-4, 5-6
# and 7-8 stages). Run 2 of the ninth session swept 15 (BENCHMARKS.md); these are its best and their neighbours,
# then register caps (-r): at tile 128 the compiler takes ~200 registers a thread (2 programs an SM); capped
# at 168 a program spills into a 104-120-byte stack frame a thread and 3 share an SM, at 128 into 208-232
# and 4 do (3 at 5 stages, for their 73 KB of shared memory; sm_90 compiles, triton 3.9).
FP8_VARIANTS = ["tile128-s3", "tile128-s5", "tile128-s6", "tile64-s5", "tile32-s4-w2",
                "tile128-s5-r168", "tile128-s3-r168", "tile128-s3-r128", "tile128-s4-r128", "tile64-s5-r128"]


def bench_kernel(args) -> list[dict]:
    """The decode attention kernel alone (Llama-3.1-8B heads), bf16 cache against fp8 caches at
    each variant (tile, stages, warps): microseconds, and the KV bytes read per second."""
    import bench_kernels
    from mempath.kernels import attention_triton as ta
    defaults = current_fp8_variant()
    results = []
    print("\ndecode attention kernel (us; KV TB/s; fp8 max |difference| from the default fp8 launch)")
    try:
        for batch, context in KERNEL_CASES:
            pb = bench_kernels.PagedBatch([(1, context)] * batch)

            def run(k_cache, v_cache):
                return ta.triton_decode_attention(pb.query, k_cache, v_cache, pb.block_tables, pb.seq_lens, pb.scale,
                                                  out=pb.out, max_seq_len=context)
            fp8_bytes = 2 * batch * context * bench_kernels.NUM_KV_HEADS * bench_kernels.HEAD_DIM  # K and V
            row = {"bench": "fp8-kv-kernel", "batch": batch, "context": context,
                   "bf16_us": 1e3 * bench_kernels.bench(lambda: run(pb.k_cache, pb.v_cache))}
            row["bf16_tb_s"] = 2 * fp8_bytes / row["bf16_us"] / 1e6
            k8, v8 = pb.k_cache.to(torch.float8_e4m3fn), pb.v_cache.to(torch.float8_e4m3fn)
            set_fp8_variant(defaults)
            reference = run(k8, v8).float().clone()
            row["fp8"] = {}
            names = args.fp8_variants or FP8_VARIANTS
            for name in names:
                set_fp8_variant(name)
                us = 1e3 * bench_kernels.bench(lambda: run(k8, v8))
                err = (run(k8, v8).float() - reference).abs().max().item()
                row["fp8"][name] = {"us": us, "tb_s": fp8_bytes / us / 1e6, "max_diff": err}
            best = min(row["fp8"], key=lambda k: row["fp8"][k]["us"])
            print(f"  batch {batch:3d} context {context:5d}: bf16 {row['bf16_us']:.1f} ({row['bf16_tb_s']:.2f}); "
                  + "; ".join(f"{k} {v['us']:.1f} ({v['tb_s']:.2f}, {v['max_diff']:.1e})" for k, v in row["fp8"].items())
                  + f"; best {best}: {row['bf16_us'] / row['fp8'][best]['us']:.2f}x bf16")
            results.append(row)
            del pb, k8, v8
            torch.cuda.empty_cache()
    finally:
        set_fp8_variant(defaults)
    return results


def hf_accuracies(path: str, prompt_sets: dict) -> dict[int, float]:
    """transformers (sdpa, bf16) on every length's prompts: its accuracy per length."""
    from needle_model import accuracy
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    result = {}
    with torch.no_grad():
        for n, prompts in prompt_sets.items():
            answers = [int(model(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()) for ids, _ in prompts]
            result[n] = accuracy(answers, prompts)
    del model
    torch.cuda.empty_cache()
    return result


def bench_retrieval(args) -> list[dict]:
    from needle_model import NeedleSpec, accuracy, build_needle_model, needle_prompts
    results = []
    for sharpness in args.sharpness:
        spec = NeedleSpec(sharpness=sharpness)
        needle_dir = tempfile.mkdtemp(prefix="mempath-needle-")
        atexit.register(shutil.rmtree, needle_dir, True)  # the bench made it: gone when it exits
        path = str(build_needle_model(Path(needle_dir), spec))
        prompt_sets = {n: needle_prompts(spec, n, args.prompts, seed=n) for n in args.lengths}
        row = {"bench": "fp8-kv-retrieval", "sharpness": sharpness, "prompts": args.prompts, "accuracy": {}}
        for kv in KV_DTYPES:
            llm = LLM(path, dtype="bfloat16", kv_cache_dtype=kv, max_model_len=max(args.lengths) + 8,
                      gpu_memory_utilization=0.3, enable_prefix_caching=False, show_progress=False)
            greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            for n, prompts in prompt_sets.items():
                outs = llm.generate([ids for ids, _ in prompts], greedy, use_tqdm=False)
                row["accuracy"].setdefault(str(n), {})[kv] = accuracy([o.token_ids[0] for o in outs], prompts)
            del llm
            torch.cuda.empty_cache()
        if not args.no_hf:
            for n, acc in hf_accuracies(path, prompt_sets).items():
                row["accuracy"][str(n)]["transformers"] = acc
        results.append(row)
        print(f"\nretrieval, sharpness {sharpness}, {args.prompts} prompts per length:")
        for n, acc in row["accuracy"].items():
            print(f"  {int(n):>6} tokens: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in acc.items())
                  + f"; fp8 - bf16 {100 * (acc['fp8'] - acc['auto']):+.1f} points")
    return results


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="decode,retrieval", help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--sharpness", type=lambda s: [float(x) for x in s.split(",")], default=[8.0, 10.0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 8192, 16384, 32768])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--fp8-variants", type=fp8_variant_list, default=None,
                        help="the kernel part's fp8 launches, e.g. tile32-s6,tile64-w8 (default: FP8_VARIANTS)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' answers in the retrieval part")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if set(parts) - set(PARTS):
        parser.error(f"--parts: {sorted(set(parts) - set(PARTS))} unknown; the parts are {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_kv.py times the CUDA kernels; on the CPU, tests/test_fp8_kv_retrieval.py runs the retrieval")
    results = []
    best = None
    if "kernel" in parts:
        kernel = bench_kernel(args)
        results += kernel
        at_decode = min(kernel, key=lambda r: abs(r["batch"] - args.batch) + abs(r["context"] - args.context) / 128)
        best = min(at_decode["fp8"], key=lambda k: at_decode["fp8"][k]["us"])
    if "decode" in parts:
        results += bench_decode(args, best)
    if "retrieval" in parts:
        results += bench_retrieval(args)
    for r in results:  # one JSON line each, which benchmarks/gpu_run.sh collects
        r.update(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name())
        print("RESULT " + json.dumps(r))
    return results


if __name__ == "__main__":
    main()
