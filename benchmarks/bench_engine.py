"""Engine benchmarks, each side by side with transformers and the hardware limit in one run.

    python benchmarks/bench_engine.py latency --shape llama-3.1-8b
    python benchmarks/bench_engine.py throughput --shape qwen3-0.6b --num-requests 256
    python benchmarks/bench_engine.py block-size --shape qwen3-0.6b

Models are random bf16 weights with the real architectures' shapes (config.json
files in tests/data/configs; mempath loads them with load_format="dummy").
Each command prints a table and one JSON line (prefix ``RESULT``).
"""
import argparse
import atexit
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
from mempath.memory.formulas import kv_bytes_per_token, read_shape  # noqa: E402

SHAPES = ROOT / "tests" / "data" / "configs"


def model_dir(shape: str) -> str:
    """A directory holding only the shape's config.json (weights come from load_format=dummy)."""
    directory = Path(tempfile.mkdtemp(prefix=f"mempath-{shape}-"))
    atexit.register(shutil.rmtree, directory, True)  # the bench made it: gone when it exits
    shutil.copy(SHAPES / f"{shape}.json", directory / "config.json")
    return str(directory)


def copy_bandwidth(device="cuda", nbytes=4 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (median of 10)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / float(np.median(times[3:]))


def hf_model(shape: str, dtype=torch.bfloat16, attn="sdpa"):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_dir(shape))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()


def random_requests(n: int, seed: int, vocab: int, low=100, high=1024):
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(low, high + 1, n)
    output_lens = rng.integers(low, high + 1, n)
    prompts = [rng.integers(0, vocab, int(p)).tolist() for p in prompt_lens]
    return prompts, [int(o) for o in output_lens]


def print_table(rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


# --------------------------------------------------------------------------- latency
def _set_rope_store(on: bool):
    from mempath.kernels import elementwise_triton
    elementwise_triton.FUSE_ROPE_AND_STORE = on


def _set_qk_norm(on: bool):
    from mempath.kernels import elementwise_triton
    elementwise_triton.FUSE_QK_NORM = on


def _set_pdl(on: bool):
    from mempath.kernels import common
    common.USE_PDL = on


def _set_cublas(default: bool):
    torch.backends.cuda.preferred_blas_library("cublas" if default else "cublaslt")


def _set_dense_gemv(on: bool):
    from mempath.model import quant
    quant.USE_DENSE_GEMV = on


def _set_decode_order(longest_first: bool):
    from mempath.engine import runner
    runner.DECODE_LONGEST_FIRST = longest_first


def _decode_programs_per_sm(programs: int):
    """A setter of the decode attention's target programs an SM (how many splits a batch gets): ``programs``,
    then back to the value it replaced."""
    replaced = []

    def set_programs(default: bool):
        from mempath.kernels import attention_triton
        if default:
            attention_triton.DECODE_PROGRAMS_PER_SM = replaced.pop()
        else:
            replaced.append(attention_triton.DECODE_PROGRAMS_PER_SM)
            attention_triton.DECODE_PROGRAMS_PER_SM = programs
    return set_programs


# --variants NAME: the same measurement with one choice flipped, in the same run:
# a fast-path piece turned off, or an alternative we did not adopt.
VARIANTS = {"no-fused-rope-store": _set_rope_store, "no-fused-qk-norm": _set_qk_norm, "no-pdl": _set_pdl,
            "cublaslt": _set_cublas, "no-dense-gemv": _set_dense_gemv, "batch-decode-order": _set_decode_order,
            **{f"decode-programs-{n}": _decode_programs_per_sm(n) for n in (1, 2, 8)}}


def copy_weights(llm, hf) -> None:
    """Give mempath the transformers model's (random) weights, so their greedy tokens can be compared."""
    from mempath.model.loader import copy_checkpoint_tensors
    source = "transformers model"
    tensors = ((source, name, lambda t=tensor: t) for name, tensor in hf.state_dict().items())
    copy_checkpoint_tensors(llm.engine.runner.model, tensors, source)


def measure_latency(args, prompts, hf=None) -> dict:
    path = model_dir(args.shape)
    llm = LLM(path, load_format="dummy", dtype="bfloat16", max_num_seqs=args.batch,
              max_model_len=args.prompt_len + args.new_tokens + 32, show_progress=False,
              enforce_eager=args.enforce_eager, quantization=getattr(args, "quantization", None))
    if hf is not None:
        copy_weights(llm, hf)
    weight_bytes = llm.engine.ledger.get("weights")
    read_bytes = decode_weight_bytes(llm.engine, args.batch)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    runs = []
    for _ in range(3):
        llm.engine.kv.pool.reset_prefix_cache()
        if args.batch > 1:
            # The prompts' prefills take several steps, during which the first requests already
            # decode beside them: prefilled first, the timed run starts every request from the
            # prefix cache in one step, so its decode steps are all full-batch decode.
            llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        decode = max(o.total_time - o.time_to_first_token for o in outs) / (args.new_tokens - 1)
        runs.append((decode, max(o.time_to_first_token for o in outs)))
    tokens = [o.token_ids for o in outs]
    del llm
    torch.cuda.empty_cache()
    return {"ms_per_token": 1e3 * float(np.median([r[0] for r in runs])),
            # At batch > 1 the timed run's prompts come from the prefix cache: no TTFT to report.
            "ttft_ms": 1e3 * float(np.median([r[1] for r in runs])) if args.batch == 1 else None,
            "weight_bytes": weight_bytes, "read_bytes": read_bytes, "tokens": tokens}


def decode_weight_bytes(engine, batch: int) -> int:
    """The weight bytes a decode step of ``batch`` sequences reads: every weight, except that an untied
    embedding table gives one row a sequence (a tied one is the LM head too, read whole)."""
    weights = engine.ledger.get("weights")
    if engine.spec.tie_word_embeddings:
        return weights
    table = engine.model.model.embed_tokens.weight
    return weights - table.numel() * table.element_size() + batch * table.shape[1] * table.element_size()


def decode_read_limit_ms(weight_bytes: int, kv_token_bytes: int, batch: int, mean_context: float,
                         bandwidth: float) -> float:
    """The step's bytes (the weights it reads, decode_weight_bytes; every sequence's cached KV) over the copy
    bandwidth."""
    return 1e3 * (weight_bytes + batch * mean_context * kv_token_bytes) / bandwidth


def bench_latency(args) -> dict:
    bandwidth = copy_bandwidth()
    rng = np.random.default_rng(0)
    config = json.loads((SHAPES / f"{args.shape}.json").read_text())
    prompts = [rng.integers(0, config["vocab_size"], args.prompt_len).tolist() for _ in range(args.batch)]
    # transformers' model is built first and mempath runs on its weights: random weights
    # drawn separately would make the token comparison meaningless. Seeded, so runs compare.
    # (It stays on the GPU while mempath runs: a smaller KV pool, which batch 1 does not feel.)
    torch.manual_seed(0)
    model = hf_model(args.shape) if args.hf_tokens > 0 else None
    main = measure_latency(args, prompts, model)
    ms_token, ttft_ms, weight_bytes = main["ms_per_token"], main["ttft_ms"], main["weight_bytes"]
    read_bytes = main["read_bytes"]  # the limit's weights: an untied embedding table gives a row a sequence
    # Every sequence's bf16 KV, at the mean context over the decode (prompt to prompt + new tokens).
    kv_token_bytes = kv_bytes_per_token(read_shape(config), 2)
    mean_context = args.prompt_len + args.new_tokens / 2
    kv_read_bytes = args.batch * mean_context * kv_token_bytes
    limit_ms = decode_read_limit_ms(read_bytes, kv_token_bytes, args.batch, mean_context, bandwidth)
    variants = {}
    for name in args.variants:
        VARIANTS[name](False)
        try:
            result = measure_latency(args, prompts, model)
        finally:
            VARIANTS[name](True)
        variants[name] = {"ms_per_token": result["ms_per_token"],
                           "same_tokens": result["tokens"] == main["tokens"]}

    hf_ms = same_as_hf = divergence = None
    if model is not None:
        ids = torch.tensor(prompts, device="cuda")
        mask = torch.ones_like(ids)

        hf_tokens = []

        def timed(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
            torch.cuda.synchronize()
            hf_tokens[:] = out[:, ids.shape[1]:].tolist()
            return time.perf_counter() - t

        timed(4)
        hf_ms = 1e3 * (timed(args.hf_tokens) - timed(1)) / (args.hf_tokens - 1)
        timed(args.hf_tokens)
        # Random weights give nearly flat logits, where bf16 rounding differences flip
        # near-ties: how far the greedy tokens agree, and at the first difference how far
        # apart transformers' own logits put the two tokens.
        same_as_hf = min(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                         for a, b in zip(main["tokens"], hf_tokens))
        print(f"greedy tokens identical to transformers: the first {same_as_hf} of {args.hf_tokens}")
        if same_as_hf < args.hf_tokens:
            row = next(r for r, (a, b) in enumerate(zip(main["tokens"], hf_tokens))
                       if a[same_as_hf] != b[same_as_hf])
            ours, theirs = main["tokens"][row][same_as_hf], hf_tokens[row][same_as_hf]
            with torch.no_grad():
                seq = torch.tensor([prompts[row] + hf_tokens[row][:same_as_hf]], device="cuda")
                logits = model(seq).logits[0, -1].float()
                # The same model in float32: the reference both bf16 engines round away from.
                exact = model.float()(seq).logits[0, -1]
            top2 = logits.topk(2).values
            divergence = {"token": same_as_hf, "hf_logit_gap": (logits[theirs] - logits[ours]).item(),
                          "hf_top1_top2_gap": (top2[0] - top2[1]).item(), "hf_logit_std": logits.std().item(),
                          "fp32_logit_gap": (exact[theirs] - exact[ours]).item(),
                          "hf_bf16_vs_fp32_max_abs": (logits - exact).abs().max().item()}
            print(f"first difference at token {same_as_hf}: transformers' full forward scores its generate() "
                  f"token {divergence['hf_logit_gap']:+.4f} against mempath's (top-2 gap "
                  f"{divergence['hf_top1_top2_gap']:.4f}, logits' standard deviation {divergence['hf_logit_std']:.3f}); "
                  f"in float32 {divergence['fp32_logit_gap']:+.4f}; transformers' bf16 logits are up to "
                  f"{divergence['hf_bf16_vs_fp32_max_abs']:.4f} from float32")
        del model
        torch.cuda.empty_cache()

    rows = [("engine", "ms/token", "tok/s (per sequence)", "% of read limit"),
            ("weights + KV read limit", f"{limit_ms:.2f}", f"{1e3 / limit_ms:.1f}", "100%"),
            ("mempath", f"{ms_token:.2f}", f"{1e3 / ms_token:.1f}", f"{100 * limit_ms / ms_token:.1f}%")]
    if hf_ms:
        rows.append(("transformers generate", f"{hf_ms:.2f}", f"{1e3 / hf_ms:.1f}", f"{100 * limit_ms / hf_ms:.1f}%"))
    for name, result in variants.items():
        ms = result["ms_per_token"]
        rows.append((f"mempath, {name}" + ("" if result["same_tokens"] else " (tokens differ)"),
                     f"{ms:.2f}", f"{1e3 / ms:.1f}", f"{100 * limit_ms / ms:.1f}%"))
    print(f"\nlatency: {args.shape}, batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"weights {weight_bytes / 1e9:.2f} GB ({read_bytes / 1e9:.2f} GB read a step), KV read "
          f"{kv_read_bytes / 1e9:.3f} GB a step, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print_table(rows)
    return {"bench": "latency", "shape": args.shape, "batch": args.batch, "quantization": args.quantization,
            "ms_per_token": ms_token,
            "ttft_ms": ttft_ms, "limit_ms_per_token": limit_ms, "fraction_of_limit": limit_ms / ms_token,
            "hf_ms_per_token": hf_ms, "copy_bandwidth": bandwidth, "weight_bytes": weight_bytes,
            "weight_read_bytes": read_bytes,
            "kv_read_bytes": kv_read_bytes, "prompt_len": args.prompt_len,
            "variants": variants, "same_tokens_as_hf": same_as_hf, "first_divergence": divergence}


# --------------------------------------------------------------------------- throughput
def run_mempath_throughput(args, prompts, output_lens, block_size=16) -> dict:
    llm = LLM(model_dir(args.shape), load_format="dummy", dtype="bfloat16", show_progress=False,
              max_model_len=2048 + 64, max_num_seqs=args.max_num_seqs, block_size=block_size,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
              gpu_memory_utilization=args.gpu_memory_utilization)
    warm = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:8], warm, use_tqdm=False)
    llm.engine.kv.pool.reset_prefix_cache()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    ttfts = [o.time_to_first_token for o in outs]
    stats = llm.stats()
    result = {"output_tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
              "ttft_p50": float(np.median(ttfts)), "kv_blocks": stats["kv_blocks_total"],
              "preemptions": stats["num_preemptions"], "block_size": block_size}
    del llm
    torch.cuda.empty_cache()
    return result


def run_hf_continuous_batching(args, prompts, output_lens) -> dict:
    """transformers' continuous batching on the same requests, capped at --hf-timeout.

    Requests stream, so tokens of unfinished requests count too: with 256 requests
    sharing its batch, transformers finishes few within a short cap even at a steady
    rate, and counting finished requests alone would understate it.
    """
    from transformers import GenerationConfig
    model = hf_model(args.shape, attn="paged|sdpa")
    config = GenerationConfig(max_new_tokens=1024, do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, output_lens)):
        manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, streaming=True)
    generated: dict[str, int] = {}
    finished = set()
    while len(finished) < len(prompts) and time.perf_counter() - start < args.hf_timeout:
        result = manager.get_result(timeout=1.0)
        if result is None:
            continue
        generated[result.request_id] = len(result.generated_tokens)  # cumulative when streaming
        if result.is_finished():
            finished.add(result.request_id)
    elapsed = time.perf_counter() - start
    manager.stop(block=False)
    del model
    torch.cuda.empty_cache()
    tokens = sum(generated.values())
    if tokens == 0:
        # A generation loop that fails (out of memory building its batch) finishes every request empty.
        raise RuntimeError(f"transformers CB generated no tokens for {len(finished)} finished requests: its "
                           f"generation loop failed (its log above names the error)")
    return {"output_tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
            "finished": len(finished), "complete": len(finished) == len(prompts)}


def bench_throughput(args) -> dict:
    from mempath.model.loader import read_config
    vocab = read_config(model_dir(args.shape))["vocab_size"]
    prompts, output_lens = random_requests(args.num_requests, args.seed, vocab)
    ours = run_mempath_throughput(args, prompts, output_lens)
    hf = None
    if args.hf_timeout > 0:
        try:
            hf = run_hf_continuous_batching(args, prompts, output_lens)
        except Exception as error:  # report, don't lose our own figures
            hf = {"error": f"{type(error).__name__}: {error}"}
    rows = [("engine", "output tokens", "seconds", "output tok/s", "note")]
    rows.append(("mempath", ours["output_tokens"], f"{ours['seconds']:.1f}", f"{ours['tok_s']:.0f}",
                 f"{ours['preemptions']} preemptions, {ours['kv_blocks']} KV blocks"))
    if hf and "error" not in hf:
        note = "complete" if hf["complete"] else \
            f"stopped at {args.hf_timeout:.0f}s, {hf['finished']} finished (tokens include unfinished)"
        rows.append(("transformers CB", hf["output_tokens"], f"{hf['seconds']:.1f}", f"{hf['tok_s']:.0f}", note))
    elif hf:
        rows.append(("transformers CB", "-", "-", "-", hf["error"][:80]))
    print(f"\nthroughput: {args.shape}, {args.num_requests} requests, lengths uniform in [100, 1024], "
          f"seed {args.seed}, EOS ignored")
    print_table(rows)
    speedup = ours["tok_s"] / hf["tok_s"] if hf and hf.get("tok_s") else None
    if speedup:
        print(f"speed-up over transformers: {speedup:.1f}x")
    return {"bench": "throughput", "shape": args.shape, "mempath": ours, "transformers": hf, "speedup": speedup}


def bench_block_size(args) -> dict:
    from mempath.model.loader import read_config
    vocab = read_config(model_dir(args.shape))["vocab_size"]
    results = {}
    rows = [("block size", "output tok/s", "TTFT p50 ms", "KV blocks")]
    for short, label in ((True, "short [16,128]"), (False, "long [100,1024]")):
        low, high = (16, 128) if short else (100, 1024)
        rng_prompts, outs = random_requests(args.num_requests, args.seed, vocab, low, high)
        for block_size in args.block_sizes:
            r = run_mempath_throughput(args, rng_prompts, outs, block_size)
            results[f"{label}/{block_size}"] = r
            rows.append((f"{label} / {block_size}", f"{r['tok_s']:.0f}", f"{1e3 * r['ttft_p50']:.0f}", r["kv_blocks"]))
            print("BLOCK " + json.dumps({"lengths": label, "block_size": block_size, **r}), flush=True)
    print(f"\nblock size sweep: {args.shape}, {args.num_requests} requests")
    print_table(rows)
    return {"bench": "block-size", "shape": args.shape, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    lat = sub.add_parser("latency")
    lat.add_argument("--shape", default="llama-3.1-8b")
    lat.add_argument("--batch", type=int, default=1)
    lat.add_argument("--prompt-len", type=int, default=128)
    lat.add_argument("--new-tokens", type=int, default=256)
    lat.add_argument("--hf-tokens", type=int, default=32, help="tokens for the transformers run (0: skip)")
    lat.add_argument("--variants", type=lambda s: s.split(","), default=[],
                     help=f"also measure these variants, comma-separated: {', '.join(VARIANTS)}")
    lat.add_argument("--quantization", choices=("none", "fp8"), default="none",
                     help="fp8: weights quantized at load (give --hf-tokens 0: transformers runs bf16)")
    for p in (sub.add_parser("throughput"), sub.add_parser("block-size")):
        p.add_argument("--shape", default="qwen3-0.6b")
        p.add_argument("--num-requests", type=int, default=256)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--max-num-seqs", type=int, default=256)
        p.add_argument("--max-num-batched-tokens", type=int, default=8192)
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        p.add_argument("--hf-timeout", type=float, default=60.0, help="cap on the transformers run (0: skip)")
        p.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64, 128, 256])
    for p in sub.choices.values():
        p.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    if getattr(args, "quantization", "none") == "fp8" and args.hf_tokens:
        parser.error("--quantization fp8 runs mempath's fp8 engine only: give --hf-tokens 0")
    if getattr(args, "quantization", None) == "none":
        args.quantization = None
    fn = {"latency": bench_latency, "throughput": bench_throughput, "block-size": bench_block_size}[args.bench]
    result = fn(args)
    result.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  date=time.strftime("%Y-%m-%d"))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
