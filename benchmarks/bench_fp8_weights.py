"""fp8 weights (--quantization fp8): accuracy against the unquantized weights, and batch-1 decode speed.

    python benchmarks/bench_fp8_weights.py accuracy            # CPU: shipped model + a random-weight shape
    python benchmarks/bench_fp8_weights.py latency --shape llama-3.1-8b   # CUDA (fp8 matmul: 8.9+)

accuracy: for each model, greedy 256 tokens with the unquantized weights (the reference)
and with fp8 weights through LLM; greedy agreement (equal positions, first difference);
then, teacher-forced over each prompt and the reference's tokens, |Δ logprob| of the
reference's token (mean, max) and the largest over the vocabulary. The activations are in
the device's model dtype (float32 on the CPU), so the difference is the weights' and
activations' quantization alone. The random-weight model draws its weights with
load_format="dummy": its fp8 weights are the same draws quantized.

latency: batch-1 decode ms/token of bf16 and fp8 weights on a shape (load_format dummy),
each beside its weight-read limit (the bytes a decode step reads: every weight but the
input embedding, over the device-to-device copy bandwidth measured in the same run,
bench_engine.copy_bandwidth), and their greedy agreement; then which kernel each fp8 layer
shape ran at each batch bucket (the weight-only GEMV's configuration, or _scaled_mm). Prints
tables and one ``RESULT`` JSON line. ``--also-table`` adds an fp8 engine on another fp8 GEMV table,
``--also-dense-table`` a bf16 engine on another dense GEMV table: the end-to-end A/B of a table's
entries, in one process (how the dense table's one-row MLP entries were chosen).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from mempath import LLM, SamplingParams  # noqa: E402
from mempath.kernels.fp8_gemv_triton import DEFAULT_TABLE, DENSE_TABLE_ENV, GEMV_MAX_ROWS, TABLE_ENV  # noqa: E402
from mempath.model.llama import AttentionMetadata  # noqa: E402

TINY = str(ROOT / "mempath" / "assets" / "mempath-tiny")
# A random-weight shape small enough for a shared CPU: Llama-3's layout, scaled down.
RANDOM_SHAPE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 512, "intermediate_size": 1536,
                "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000,
                "max_position_embeddings": 2048, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def teacher_forced(llm, ids: list[int]) -> torch.Tensor:
    """log-softmax at every position of one prefill of ``ids`` through the engine's model, on a KV
    cache of its own (the engine's is left alone)."""
    model, spec = llm.engine.model, llm.engine.spec
    layers = model.attention_layers()
    T, bs = len(ids), 16
    nb = -(-T // bs)
    meta = AttentionMetadata(slot_mapping=torch.arange(T), block_tables=torch.arange(nb, dtype=torch.int32)[None],
                             query_start_loc=torch.tensor([0, T], dtype=torch.int32),
                             seq_lens=torch.tensor([T], dtype=torch.int32), max_query_len=T, max_seq_len=T)
    saved = [(a.k_cache, a.v_cache) for a in layers]
    dtype = model.lm_head.weight.dtype
    try:
        for a in layers:
            a.k_cache = torch.zeros(nb, bs, spec.num_kv_heads, spec.head_dim, dtype=dtype)
            a.v_cache = torch.zeros_like(a.k_cache)
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.arange(T), meta)
            return torch.log_softmax(model.compute_logits(hidden).float(), -1)
    finally:
        for a, (k, v) in zip(layers, saved):
            a.k_cache, a.v_cache = k, v


def compare(name: str, path: str, prompts, tokens: int, **options) -> dict:
    ref_llm = LLM(path, device="cpu", show_progress=False, enable_prefix_caching=False, **options)
    fp8_llm = LLM(path, device="cpu", show_progress=False, enable_prefix_caching=False, quantization="fp8",
                  **options)
    ref = [(o.prompt_token_ids, o.token_ids) for o in ref_llm.generate(prompts, greedy(tokens), use_tqdm=False)]
    got = [o.token_ids for o in fp8_llm.generate(prompts, greedy(tokens), use_tqdm=False)]
    equal = [sum(a == b for a, b in zip(r, g)) for (_, r), g in zip(ref, got)]
    first = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for (_, r), g in zip(ref, got)]
    token_diffs, worst_vocab = [], 0.0
    for prompt, completion in ref:
        ids = prompt + completion
        a, b = teacher_forced(ref_llm, ids), teacher_forced(fp8_llm, ids)
        rows, nxt = torch.arange(len(prompt) - 1, len(ids) - 1), torch.tensor(completion)
        token_diffs.append((a[rows, nxt] - b[rows, nxt]).abs())
        worst_vocab = max(worst_vocab, (a[rows] - b[rows]).abs().max().item())
    diffs = torch.cat(token_diffs)
    weights = (ref_llm.engine.ledger.get("weights"), fp8_llm.engine.ledger.get("weights"))
    result = {"model": name, "prompts": len(prompts), "tokens": tokens, "equal_positions": equal,
              "first_difference": first, "agreement": sum(equal) / (tokens * len(prompts)),
              "mean_abs_dlogprob": diffs.mean().item(), "max_abs_dlogprob": diffs.max().item(),
              "max_abs_dlogprob_vocab": worst_vocab, "weight_bytes": weights}
    print(f"\n{name}: weights {weights[0]:,} B unquantized, {weights[1]:,} B fp8")
    print(f"  greedy {tokens} tokens x {len(prompts)} prompts: equal positions {equal} "
          f"({100 * result['agreement']:.1f}%), first difference at {first}")
    print(f"  teacher-forced |dlogprob| of the reference's token: mean {result['mean_abs_dlogprob']:.4f}, "
          f"max {result['max_abs_dlogprob']:.4f}; over the vocabulary max {worst_vocab:.4f}")
    return result


def bench_accuracy(args) -> dict:
    torch.manual_seed(0)
    text = (ROOT / "mempath" / "assets" / "heldout.txt").read_text()
    prompts = ["Once upon a time", "def parse_header(data):\n", text[:400], text[5000:5600], "The main thread"]
    results = [compare("mempath-tiny (shipped)", TINY, prompts, args.tokens)]
    directory = Path(tempfile.mkdtemp(prefix="mempath-fp8-random-"))
    try:
        (directory / "config.json").write_text(json.dumps(RANDOM_SHAPE))
        rng = np.random.default_rng(0)
        random_prompts = [rng.integers(3, RANDOM_SHAPE["vocab_size"], n).tolist() for n in (8, 40, 200)]
        results.append(compare("random weights (Llama-3 layout, hidden 512, 8 layers, dummy)", str(directory),
                               random_prompts, args.tokens, load_format="dummy"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {"bench": "fp8_weights_accuracy", "results": results}


# --------------------------------------------------------------------------- latency (CUDA)
def decode_ms(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[int]]:
    """ms a decode step of the batch of ``prompts``, the median over three runs of the requests' median; and
    the first request's tokens. Several prompts are prefilled first, so that the timed run finds them in the
    prefix cache and starts every request in one step: otherwise prompts over max_num_batched_tokens prefill
    in chunks beside the first requests' decode, and those steps would count as decode (as bench_engine does)."""
    llm.generate(prompts, greedy(8), use_tqdm=False)
    runs = []
    for _ in range(3):
        llm.engine.kv.pool.reset_prefix_cache()
        if len(prompts) > 1:
            llm.generate(prompts, greedy(1), use_tqdm=False)
        outs = llm.generate(prompts, greedy(new_tokens), use_tqdm=False)
        runs.append(float(np.median([(o.total_time - o.time_to_first_token) / (new_tokens - 1) for o in outs])))
    return 1e3 * float(np.median(runs)), outs[0].token_ids


def fp8_kernels(llm) -> dict[str, str]:
    """What each fp8 layer shape ran, by batch bucket (filled as the buckets first ran: eagerly or
    at graph capture); batches over GEMV_MAX_ROWS rows run the fp8 GEMM where its table lists them, else
    _scaled_mm."""
    gemv, gemm = llm.engine.model.fp8_gemv, llm.engine.model.fp8_gemm
    kernels = dict(gemv.chosen) if gemv is not None else {"every batch": "_scaled_mm (no Triton kernels)"}
    kernels.update(gemm.chosen if gemm is not None else {})
    if gemv is not None and gemm is None:
        kernels[f"rows>{GEMV_MAX_ROWS}"] = "_scaled_mm, input quantized by the Triton kernel"
    return kernels


def bench_latency(args) -> dict:
    from bench_engine import copy_bandwidth, decode_weight_bytes, model_dir, print_table
    bandwidth = copy_bandwidth()
    path = model_dir(args.shape)
    vocab = json.loads(Path(path, "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.batch)]
    from mempath.model import quant
    # (name, quantization, the table for its env variable: fp8 GEMV's or, for bf16, the dense GEMV's; fp8 GEMM on)
    runs = [("bf16", None, None, True), ("fp8", "fp8", None, True)]
    runs += [(f"bf16, {Path(table).name}", None, str(Path(table).resolve()), True) for table in args.also_dense_table]
    runs += [(f"fp8, {Path(table).name}", "fp8", str(Path(table).resolve()), True) for table in args.also_table]
    if args.also_scaled_mm:
        runs.append((f"fp8, _scaled_mm above {GEMV_MAX_ROWS} rows", "fp8", None, False))
    measured = {}
    given = {env: os.environ.get(env) for env in (TABLE_ENV, DENSE_TABLE_ENV)}
    for name, quantization, table, fp8_gemm in runs:
        for env, value in given.items():
            if table and env == (TABLE_ENV if quantization else DENSE_TABLE_ENV):
                os.environ[env] = table
            elif value is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = value
        quant.USE_FP8_GEMM = fp8_gemm
        llm = LLM(path, load_format="dummy", dtype="bfloat16", quantization=quantization, max_num_seqs=args.batch,
                  max_model_len=args.prompt_len + args.new_tokens + 32, show_progress=False,
                  enforce_eager=args.enforce_eager)
        weights = llm.engine.ledger.get("weights")
        read = decode_weight_bytes(llm.engine, args.batch)
        ms, tokens = decode_ms(llm, prompts, args.new_tokens)
        measured[name] = {"ms_per_token": ms, "weight_bytes": weights, "bytes_read_per_token": read,
                          "limit_ms": 1e3 * read / bandwidth, "tokens": tokens}
        if quantization:
            measured[name]["kernels"] = fp8_kernels(llm)
            measured[name]["table"] = os.environ.get(TABLE_ENV) or str(DEFAULT_TABLE.relative_to(ROOT))
        elif llm.engine.model.fp8_gemv is not None:  # the dense GEMV's choices, cuBLAS where its table lists none
            measured[name]["kernels"] = dict(llm.engine.model.fp8_gemv.chosen)
            measured[name]["table"] = os.environ.get(DENSE_TABLE_ENV) or "the shipped dense table"
        del llm
        torch.cuda.empty_cache()
    quant.USE_FP8_GEMM = True
    bf16, fp8 = measured["bf16"], measured["fp8"]
    same = next((i for i, (a, b) in enumerate(zip(bf16["tokens"], fp8["tokens"])) if a != b), args.new_tokens)
    rows = [("weights", "ms/step", "tok/s", "bytes read/step", "limit ms", "% of limit")]
    for name, m in measured.items():
        rows.append((name, f"{m['ms_per_token']:.2f}", f"{1e3 * args.batch / m['ms_per_token']:.1f}",
                     f"{m['bytes_read_per_token'] / 1e9:.2f} GB", f"{m['limit_ms']:.2f}",
                     f"{100 * m['limit_ms'] / m['ms_per_token']:.1f}%"))
    print(f"\nlatency: {args.shape}, batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, copy "
          f"bandwidth {bandwidth / 1e12:.2f} TB/s, {torch.cuda.get_device_name()}")
    print_table(rows)
    speedup = bf16["ms_per_token"] / fp8["ms_per_token"]
    for name, m in measured.items():
        if "kernels" in m:
            print(f"{name}: the kernels that ran (GEMV configurations from {m['table']}):")
            for shape, kernel in m["kernels"].items():
                print(f"  {shape}: {kernel}")
    print(f"fp8 / bf16 tokens/s: {speedup:.2f}x; greedy tokens identical for the first {same} of {args.new_tokens} "
          f"(fp8 weights are the bf16 dummy weights quantized)")
    for m in measured.values():
        del m["tokens"]
    return {"bench": "fp8_weights_latency", "shape": args.shape, "batch": args.batch, "copy_bandwidth": bandwidth,
            "speedup": speedup,
            "same_tokens_prefix": same, **measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    acc = sub.add_parser("accuracy")
    acc.add_argument("--tokens", type=int, default=256)
    lat = sub.add_parser("latency")
    lat.add_argument("--shape", default="llama-3.1-8b")
    lat.add_argument("--prompt-len", type=int, default=128)
    lat.add_argument("--new-tokens", type=int, default=256)
    lat.add_argument("--enforce-eager", action="store_true")
    lat.add_argument("--table", help=f"an fp8 GEMV configuration table (default: {TABLE_ENV} or the shipped one)")
    lat.add_argument("--also-table", action="append", default=[],
                     help="another table, run as a third engine beside the first fp8 one (repeatable)")
    lat.add_argument("--also-dense-table", action="append", default=[],
                     help="a dense GEMV table (bench_dense_gemv.py's), run as another bf16 engine (repeatable)")
    lat.add_argument("--also-scaled-mm", action="store_true",
                     help="a third fp8 engine without the fp8 GEMM: _scaled_mm above the GEMV's rows, the GEMV "
                          "at the 2-8 rows its table hands the GEMM (model.quant.USE_FP8_GEMM off: the A/B of the "
                          "fp8 GEMM's table)")
    lat.add_argument("--batch", type=int, default=1, help="sequences decoded together (the KV read is not in the "
                                                          "limit: keep the prompt short)")
    args = parser.parse_args()
    if getattr(args, "batch", 1) < 1:
        parser.error(f"--batch {args.batch}: give 1 or more sequences")
    for flag in ("table", "also_table", "also_dense_table"):
        given = getattr(args, flag, None)
        for table in [given] if isinstance(given, str) else given or []:
            if not Path(table).is_file():
                parser.error(f"--{flag.replace('_', '-')} {table}: no such file (bench_fp8_gemv.py or "
                             f"bench_dense_gemv.py --out FILE writes a table)")
    if getattr(args, "table", None):
        os.environ[TABLE_ENV] = str(Path(args.table).resolve())
    if args.bench == "accuracy":
        torch.set_num_threads(1)
    result = bench_accuracy(args) if args.bench == "accuracy" else bench_latency(args)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
