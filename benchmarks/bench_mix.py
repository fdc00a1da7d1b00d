"""Offline throughput on a realistic request mix, against the compute limit measured in the same run.

    python benchmarks/bench_mix.py --shape llama-3.1-8b                 # 1,000 requests, engine defaults
    python benchmarks/bench_mix.py --shape qwen3-0.6b --max-num-seqs 256,512,1024 \\
        --max-num-batched-tokens 8192,16384                             # a sweep: every pair, one engine each
    python benchmarks/bench_mix.py --shape llama-3.1-8b --hf-seconds 60 # transformers CB beside it, capped
    python benchmarks/bench_mix.py --sharegpt ShareGPT_V3.json --tokenizer DIR --shape llama-3.1-8b
    python benchmarks/bench_mix.py --tiny                               # CPU, the shipped model (tests)
    python benchmarks/bench_mix.py --quantization none,fp8 --kv-cache-dtype auto,fp8  # weights x KV dtypes

The mix: ``--requests`` prompts of random token ids, all submitted at once, EOS ignored;
input and output lengths lognormal (seeded; medians 200 / 150, inputs at most 2,048,
outputs at most 1,024), or with ``--sharegpt`` the first human turn and the first reply
of each conversation of a ShareGPT-format JSON file, counted with ``--tokenizer`` (the
ids are random: only the lengths are the file's, as the weights are random too).

Each engine run prints output and total tok/s, TTFT p50/p99, MFU: the mix's matmul
FLOPs (2 x the parameters a token reads, input and output: every parameter of a dense
model; of a mixture of experts, all but the routed experts and k of those) over its wall time, against the bf16
matmul rate of one large ``torch.matmul`` timed with CUDA events in this run (fp8 weights: of one large
``torch._scaled_mm`` with row-wise scales, the fp8 tensor cores' rate); the compute
limit (those FLOPs at that rate); and the split of each step between host and device:
host milliseconds per step in the scheduler, the runner (input preparation and launches)
and the output processor, against the device time between CUDA events recorded around
each step's work (``gpu busy``: that time over the wall time). Models are random bf16
weights of the real shapes (tests/data/configs, ``load_format="dummy"``).

On CUDA each dense model's steps are also split into classes (steps carrying a prefill, decode
steps by rows: 1-32, 33-128, 129-512, 513 and more), each class's device time against its
bound: per step the larger of its matmul FLOPs at the matmul rate (the layers' parameters for
every token, the LM head's for the sampled rows) and its bytes at the copy bandwidth measured
in the run (the weights, and the K and V of every position each sequence attends to). The sum of
the bounds is what this schedule could take at best; attention's FLOPs are left out of it.
Beside it, the serial bound: per step the projections' bound (their FLOPs or the weights' bytes,
whichever is slower) plus the KV bytes at the copy bandwidth, what the schedule could take if its
attention never runs beside its matrix multiplies (the engine's kernels and cuBLAS's do not).
``--out FILE`` appends one JSON line per result.
"""
import argparse
import contextlib
import gc
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from mempath import LLM, SamplingParams  # noqa: E402
from mempath.tools.plan import plan_memory  # noqa: E402

TINY = ROOT / "mempath" / "assets" / "mempath-tiny"
SHAPES = ("llama-3.1-8b", "qwen3-0.6b", "qwen2.5-7b-instruct", "mistral-7b-v0.1", "qwen3-30b-a3b", "mixtral-8x7b-v0.1")


@dataclass
class MixSpec:
    """The lengths of a synthetic mix: lognormal around the medians, clipped to [1, cap]."""

    input_median: float = 200
    output_median: float = 150
    input_sigma: float = 1.0
    output_sigma: float = 0.75
    input_cap: int = 2048
    output_cap: int = 1024


# --tiny: the same shape of mix scaled to the shipped model's 1,024 positions and a CPU.
TINY_MIX = MixSpec(input_median=24, output_median=12, input_cap=160, output_cap=48)


def lognormal_lengths(n: int, median: float, sigma: float, cap: int, rng: np.random.Generator) -> list[int]:
    return [int(x) for x in np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), 1, cap)]


def synthetic_mix(n: int, seed: int, vocab: int, mix: MixSpec) -> tuple[list[list[int]], list[int]]:
    """Prompts of random token ids and their output lengths (both seeded)."""
    rng = np.random.default_rng(seed)
    inputs = lognormal_lengths(n, mix.input_median, mix.input_sigma, mix.input_cap, rng)
    outputs = lognormal_lengths(n, mix.output_median, mix.output_sigma, mix.output_cap, rng)
    return [rng.integers(0, vocab, p).tolist() for p in inputs], outputs


def sharegpt_lengths(path: str, tokenizer, n: int, mix: MixSpec) -> list[tuple[int, int]]:
    """(input, output) token counts of the first ``n`` usable conversations of a ShareGPT file:
    the first human turn and the reply after it, clipped to the mix's caps; conversations with
    fewer than two turns or an empty turn are skipped (as vLLM's benchmark does)."""
    pairs = []
    for conversation in json.loads(Path(path).read_text()):
        turns = conversation.get("conversations") or conversation.get("conversation") or []
        if len(turns) < 2 or not turns[0].get("value") or not turns[1].get("value"):
            continue
        prompt_len = len(tokenizer(turns[0]["value"])["input_ids"])
        output_len = len(tokenizer(turns[1]["value"])["input_ids"])
        if prompt_len < 1 or output_len < 1:
            continue
        pairs.append((min(prompt_len, mix.input_cap), min(output_len, mix.output_cap)))
        if len(pairs) == n:
            break
    if not pairs:
        raise SystemExit(f"{path}: no conversation with a human turn and a reply (ShareGPT format: "
                         f'[{{"conversations": [{{"from": "human", "value": ...}}, {{"from": "gpt", ...}}]}}])')
    return pairs


def sharegpt_mix(path: str, tokenizer_dir: str, n: int, seed: int, vocab: int, mix: MixSpec):
    from transformers import AutoTokenizer
    pairs = sharegpt_lengths(path, AutoTokenizer.from_pretrained(tokenizer_dir), n, mix)
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, p).tolist() for p, _ in pairs], [o for _, o in pairs]


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int = 8192) -> float:
    """FLOP/s of one large square matmul (median of 10 after 3 warm-ups), CUDA events on a GPU. For
    float8_e4m3fn (CUDA): ``torch._scaled_mm`` with a scale a row and a column, the fp8 engine's arithmetic."""
    if dtype == torch.float8_e4m3fn:
        from mempath.model.quant import quantize_rows, scaled_mm_quantized
        (aq, a_scale), (bq, b_scale) = (quantize_rows(torch.randn(size, size, device=device)) for _ in range(2))

        def product():
            return scaled_mm_quantized(aq, a_scale, bq, b_scale, None, torch.bfloat16)
    else:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)

        def product():
            return torch.matmul(a, b)
    times = []
    for _ in range(13):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            product()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            product()
            times.append(time.perf_counter() - t)
    return 2 * size ** 3 / float(np.median(times[3:]))


@dataclass
class StepClock:
    """Host seconds per engine step and its parts, and device seconds between CUDA events
    recorded around each step's work (an event is timestamped when the device reaches it, so
    a step's interval starts once the previous step's work is done: the gaps are host time)."""

    steps: int = 0
    mixed_steps: int = 0
    host: float = 0.0
    schedule: float = 0.0
    runner: float = 0.0
    outputs: float = 0.0
    events: list = field(default_factory=list)
    # Per step on the device: (tokens, rows, rows sampled, KV positions attended) as the runner got it.
    shapes: list = field(default_factory=list)

    def attach(self, engine) -> None:
        """Wrap the engine's step, its scheduler, runner and output processor (this instance only)."""
        cuda = engine.device.type == "cuda"

        def timed(fn, part, device_events=False):
            def wrapper(*args, **kwargs):
                if device_events:
                    batch, sampling = args[0], args[1]
                    self.mixed_steps += any(n > 1 for n in batch.num_new_tokens)
                    self.shapes.append((sum(batch.num_new_tokens), len(batch.requests), len(sampling),
                                        sum(r.num_computed_tokens + n for r, n in
                                            zip(batch.requests, batch.num_new_tokens))))
                    start = torch.cuda.Event(enable_timing=True) if cuda else None
                    if start is not None:
                        start.record()
                t = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    setattr(self, part, getattr(self, part) + time.perf_counter() - t)
                    if device_events and cuda:
                        end = torch.cuda.Event(enable_timing=True)
                        end.record()
                        self.events.append((start, end))
            return wrapper

        step = engine.step

        def counted_step():
            self.steps += 1
            return step()

        engine.step = timed(counted_step, "host")
        engine.scheduler.schedule_step = timed(engine.scheduler.schedule_step, "schedule")
        engine.runner.execute = timed(engine.runner.execute, "runner", device_events=True)
        engine.outputs.emit = timed(engine.outputs.emit, "outputs")

    def device_seconds(self) -> float | None:
        if not self.events:
            return None
        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.events) / 1e3

    def step_times(self) -> list[float]:
        """Each step's device seconds (after device_seconds has synchronized)."""
        return [start.elapsed_time(end) / 1e3 for start, end in self.events]


@dataclass
class StepCosts:
    """What bounds a step: parameters multiplied per token, bytes read, and the rates."""

    layer_params: int  # every decoder layer's parameters (each token multiplies them)
    lm_head_params: int  # multiplied by the sampled rows only
    weight_bytes: int
    kv_bytes_per_token: int
    matmul_rate: float
    bandwidth: float

    def bound(self, tokens: int, sampled: int, kv_tokens: int) -> float:
        flops = 2 * (self.layer_params * tokens + self.lm_head_params * sampled)
        return max(flops / self.matmul_rate, (self.weight_bytes + self.kv_bytes_per_token * kv_tokens) / self.bandwidth)

    def serial_bound(self, tokens: int, sampled: int, kv_tokens: int) -> float:
        """The projections (FLOPs or weight bytes, whichever is slower), then the attention's KV bytes: a step whose
        attention does not run beside its matrix multiplies, as the engine's and cuBLAS's kernels do not."""
        flops = 2 * (self.layer_params * tokens + self.lm_head_params * sampled)
        return (max(flops / self.matmul_rate, self.weight_bytes / self.bandwidth)
                + self.kv_bytes_per_token * kv_tokens / self.bandwidth)


STEP_CLASSES = ((32, "decode 1-32"), (128, "decode 33-128"), (512, "decode 129-512"), (None, "decode 513+"))


def step_classes(shapes: list[tuple[int, int, int, int]], times: list[float], costs: StepCosts) -> dict:
    """Steps by class (prefill-carrying, decode by rows): count, device seconds, bound seconds, bound / device."""
    classes = {}
    for (tokens, rows, sampled, kv_tokens), seconds in zip(shapes, times, strict=True):
        name = "prefill" if tokens > rows else next(label for top, label in STEP_CLASSES if top is None or rows <= top)
        c = classes.setdefault(name, {"steps": 0, "tokens": 0, "device_s": 0.0, "bound_s": 0.0, "serial_bound_s": 0.0,
                                      "kv_s": 0.0})
        c["steps"] += 1
        c["tokens"] += tokens
        c["device_s"] += seconds
        c["bound_s"] += costs.bound(tokens, sampled, kv_tokens)
        c["serial_bound_s"] += costs.serial_bound(tokens, sampled, kv_tokens)
        c["kv_s"] += costs.kv_bytes_per_token * kv_tokens / costs.bandwidth  # the serial bound's attention part
    order = ["prefill"] + [label for _, label in STEP_CLASSES]
    out = {name: {**classes[name], "of_bound": classes[name]["bound_s"] / classes[name]["device_s"]
                  if classes[name]["device_s"] else None} for name in order if name in classes}
    device, bound = sum(c["device_s"] for c in out.values()), sum(c["bound_s"] for c in out.values())
    serial = sum(c["serial_bound_s"] for c in out.values())
    return {"classes": out, "schedule_bound_s": bound, "device_s": device,
            "of_schedule_bound": bound / device if device else None,
            "serial_bound_s": serial, "of_serial_bound": serial / device if device else None}


def step_costs(engine, rate: float, bandwidth: float) -> StepCosts | None:
    """The engine's StepCosts; None for a mixture of experts (a step reads only its routed experts)."""
    from bench_engine import decode_weight_bytes
    spec = engine.spec
    if getattr(spec, "num_experts", 0):
        return None
    model = engine.runner.model
    layers = sum(p.numel() for p in model.model.layers.parameters())
    return StepCosts(layer_params=layers, lm_head_params=model.lm_head.weight.numel(),
                     # an untied embedding table's rows (a few MB a step at most) are left out
                     weight_bytes=decode_weight_bytes(engine, 0),
                     kv_bytes_per_token=engine.runner.kv_bytes_per_block() // engine.runner.block_size,
                     matmul_rate=rate, bandwidth=bandwidth)


def summarize(input_tokens: int, output_tokens: int, seconds: float, ttfts: list[float], params: int,
              rate: float, clock: StepClock | None = None, device_seconds: float | None = None) -> dict:
    """The figures of one run (pure arithmetic: tests/test_bench_mix.py checks it)."""
    total = input_tokens + output_tokens
    flops = 2 * params * total
    limit = flops / rate
    result = {"input_tokens": input_tokens, "output_tokens": output_tokens, "seconds": seconds,
              "output_tok_s": output_tokens / seconds, "total_tok_s": total / seconds,
              "ttft_p50": float(np.percentile(ttfts, 50)), "ttft_p99": float(np.percentile(ttfts, 99)),
              "params": params, "matmul_flop_s": rate, "mix_flops": flops,
              "compute_limit_s": limit, "limit_output_tok_s": output_tokens / limit, "mfu": limit / seconds}
    if clock is not None and clock.steps:
        per_step = {part: 1e3 * getattr(clock, part) / clock.steps
                    for part in ("host", "schedule", "runner", "outputs")}
        result.update(steps=clock.steps, mixed_steps=clock.mixed_steps,
                      host_ms_per_step=per_step["host"], schedule_ms_per_step=per_step["schedule"],
                      runner_ms_per_step=per_step["runner"], outputs_ms_per_step=per_step["outputs"])
        if device_seconds is not None:
            result.update(device_ms_per_step=1e3 * device_seconds / clock.steps, gpu_busy=device_seconds / seconds)
    return result


def engine_options(args) -> dict:
    if args.tiny:
        return dict(model=str(TINY), dtype="float32", max_model_len=256)
    from bench_engine import model_dir
    return dict(model=model_dir(args.shape), load_format="dummy", dtype="bfloat16",
                max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                enforce_eager=args.enforce_eager)


@contextlib.contextmanager
def engine_variant(decode_order: str, quant_fusion: str, fp8_gemm: str):
    """The module switches and the fp8 GEMM table an A/B engine is built with (run_mempath's arguments), put back
    afterwards, also when the build fails: the runner and the kernels read them when an engine is built."""
    from mempath.engine import runner as runner_module
    from mempath.kernels.fp8_gemm_triton import TABLE_ENV as GEMM_TABLE_ENV
    from mempath.model import quant as quant_module
    given_table = os.environ.get(GEMM_TABLE_ENV)
    runner_module.DECODE_LONGEST_FIRST = decode_order == "longest-first"
    quant_module.USE_FUSED_QUANT = quant_fusion == "fused"
    quant_module.USE_FP8_GEMM = fp8_gemm != "scaled-mm"
    if fp8_gemm not in ("table", "scaled-mm"):
        os.environ[GEMM_TABLE_ENV] = str(Path(fp8_gemm).resolve())
    try:
        yield
    finally:
        runner_module.DECODE_LONGEST_FIRST = True
        quant_module.USE_FUSED_QUANT = quant_module.USE_FP8_GEMM = True
        if given_table is None:
            os.environ.pop(GEMM_TABLE_ENV, None)
        else:
            os.environ[GEMM_TABLE_ENV] = given_table


def run_mempath(args, prompts, output_lens, rate: float, max_num_seqs: int | None,
                max_num_batched_tokens: int | None, quantization: str = "none", kv_cache_dtype: str = "auto",
                decode_order: str = "longest-first", quant_fusion: str = "fused", fp8_gemm: str = "table") -> dict:
    """One engine on the whole mix, after a short warm-up; the engine is released before returning.
    ``decode_order`` "batch": the decode attention kernel starts the sequences in batch order
    (engine.runner.DECODE_LONGEST_FIRST off), the A/B of the runner's longest-first order.
    ``quant_fusion`` "unfused": fp8 projections quantize their input in their own launch
    (model.quant.USE_FUSED_QUANT off), the A/B of the norms and SiLU that quantize for them. ``fp8_gemm``
    "scaled-mm": every quantized fp8 product on _scaled_mm (model.quant.USE_FP8_GEMM off), the A/B of the
    Triton fp8 GEMM's table; any other value is the path of another fp8 GEMM table (a sweep's), read through
    its environment variable for this engine only."""
    limits = {k: v for k, v in (("max_num_seqs", max_num_seqs),
                                ("max_num_batched_tokens", max_num_batched_tokens)) if v is not None}
    with engine_variant(decode_order, quant_fusion, fp8_gemm):
        llm = LLM(show_progress=False, **engine_options(args), **limits, kv_cache_dtype=kv_cache_dtype,
                  quantization=None if quantization == "none" else quantization)
    engine = llm.engine
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    engine.kv.pool.reset_prefix_cache()
    clock = StepClock()
    clock.attach(engine)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    result = summarize(sum(len(p) for p in prompts), sum(len(o.token_ids) for o in outs), seconds,
                       [o.time_to_first_token for o in outs], plan_memory(engine_options(args)["model"]).active_params,
                       rate, clock, clock.device_seconds())
    costs = step_costs(engine, rate, args.bandwidth) if clock.events else None
    if costs is not None:
        result["step_classes"] = step_classes(clock.shapes, clock.step_times(), costs)
        result["copy_bandwidth"] = args.bandwidth
    stats = llm.stats()
    result.update(quantization=engine.config.quantization or "none", kv_cache_dtype=engine.config.kv_cache_dtype,
                  weight_bytes=engine.ledger.get("weights"), max_num_seqs=engine.config.max_num_seqs,
                  max_num_batched_tokens=engine.config.max_num_batched_tokens,
                  kv_blocks=stats["kv_blocks_total"], preemptions=stats["num_preemptions"], decode_order=decode_order,
                  quant_fusion=quant_fusion, fp8_gemm=fp8_gemm)
    del llm, engine, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def run_transformers(args, prompts, output_lens) -> dict:
    """transformers' continuous batching (init_continuous_batching) on the first --hf-requests
    requests, stopped after --hf-seconds (tokens of unfinished requests count: they stream)."""
    from bench_engine import run_hf_continuous_batching
    n = args.hf_requests
    hf_args = argparse.Namespace(shape=args.shape, hf_timeout=args.hf_seconds)
    return {"requests": len(prompts[:n]), **run_hf_continuous_batching(hf_args, prompts[:n], output_lens[:n])}


def print_row(label: str, r: dict) -> None:
    split = ""
    if "host_ms_per_step" in r:
        split = (f"; {r['steps']} steps ({r['mixed_steps']} with prefill), host {r['host_ms_per_step']:.2f} ms/step "
                 f"(scheduler {r['schedule_ms_per_step']:.2f}, runner {r['runner_ms_per_step']:.2f}, "
                 f"outputs {r['outputs_ms_per_step']:.2f})")
        if "device_ms_per_step" in r:
            split += f", device {r['device_ms_per_step']:.2f} ms/step, gpu busy {100 * r['gpu_busy']:.0f}%"
    print(f"{label}: {r['output_tok_s']:,.0f} output tok/s, {r['total_tok_s']:,.0f} total tok/s in "
          f"{r['seconds']:.1f} s; TTFT p50 {r['ttft_p50']:.2f} s, p99 {r['ttft_p99']:.2f} s; "
          f"MFU {100 * r['mfu']:.1f}% (compute limit {r['compute_limit_s']:.1f} s = "
          f"{r['limit_output_tok_s']:,.0f} output tok/s){split}", flush=True)
    if "step_classes" in r:
        sc = r["step_classes"]
        print(f"  steps against their bounds (copy {r['copy_bandwidth'] / 1e12:.2f} TB/s): this schedule's bound "
              f"{sc['schedule_bound_s']:.2f} s of {sc['device_s']:.2f} s on the device "
              f"({100 * sc['of_schedule_bound']:.1f}%); with attention after the projections "
              f"{sc['serial_bound_s']:.2f} s ({100 * sc['of_serial_bound']:.1f}%)")
        for name, c in sc["classes"].items():
            print(f"    {name:>15}: {c['steps']:5d} steps, {c['tokens']:8,d} tokens, device {c['device_s']:6.2f} s, "
                  f"bound {c['bound_s']:6.2f} s ({100 * c['of_bound']:.1f}%), serial {c['serial_bound_s']:6.2f} s")


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=SHAPES)
    parser.add_argument("--tiny", action="store_true", help="the shipped model on the CPU, a scaled-down mix")
    parser.add_argument("--requests", type=int, default=None, help="default 1000 (--tiny: 12)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharegpt", help="a ShareGPT-format JSON file: take the lengths from it")
    parser.add_argument("--tokenizer", help="the tokenizer that counts --sharegpt's tokens (a directory or hub name)")
    parser.add_argument("--max-num-seqs", type=int_list, default=[None], help="comma-separated: a sweep")
    parser.add_argument("--max-num-batched-tokens", type=int_list, default=[None], help="comma-separated: a sweep")
    parser.add_argument("--quantization", type=lambda s: s.split(","), default=["none"],
                        help="comma-separated weights: none (the model dtype), fp8; a sweep")
    parser.add_argument("--kv-cache-dtype", type=lambda s: s.split(","), default=["auto"],
                        help="comma-separated KV cache dtypes: auto, fp8; a sweep")
    parser.add_argument("--decode-order", type=lambda s: s.split(","), default=["longest-first"],
                        help="comma-separated: longest-first (the engine's), batch; a sweep")
    parser.add_argument("--quant-fusion", type=lambda s: s.split(","), default=["fused"],
                        help="fp8 weights: fused (the norm and SiLU kernels quantize a projection's input), unfused "
                             "(a launch of its own), or both, comma-separated")
    parser.add_argument("--fp8-gemm", type=lambda s: s.split(","), default=["table"],
                        help="fp8 weights above the GEMV's rows: table (the Triton fp8 GEMM where its table lists "
                             "the bucket, _scaled_mm elsewhere), scaled-mm (always), or the path of another fp8 GEMM "
                             "table; several, comma-separated")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every configuration this many times, interleaved round by round, and print each "
                             "one's median (an A/B on one machine varies by a few percent from run to run)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--hf-seconds", type=float, default=0.0, help="run transformers CB for at most this long")
    parser.add_argument("--hf-requests", type=int, default=200, help="transformers CB on this many of the requests")
    parser.add_argument("--out", help="append one JSON line per result to this file")
    args = parser.parse_args(argv)
    bad = [q for q in args.quantization if q not in ("none", "fp8")] + \
        [k for k in args.kv_cache_dtype if k not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")] + \
        [o for o in args.decode_order if o not in ("longest-first", "batch")] + \
        [f for f in args.quant_fusion if f not in ("fused", "unfused")] + \
        [g for g in args.fp8_gemm if g not in ("table", "scaled-mm") and not Path(g).is_file()]
    if bad:
        parser.error(f"unknown --quantization / --kv-cache-dtype / --decode-order / --quant-fusion / --fp8-gemm "
                     f"value(s) {bad}: quantization is none or fp8, the KV dtype auto, fp8, fp8_e4m3 or fp8_e5m2, "
                     f"the order longest-first or batch, the fusion fused or unfused, the GEMM table, scaled-mm or a "
                     f"table file")
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give 1 or more rounds")
    if args.requests is None:
        args.requests = 12 if args.tiny else 1000
    if args.sharegpt and not args.tokenizer:
        parser.error("--sharegpt needs --tokenizer (the model's tokenizer directory counts the file's tokens)")
    if args.tiny and args.hf_seconds:
        parser.error("--hf-seconds runs transformers on a GPU shape; leave it out with --tiny")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    mix = TINY_MIX if args.tiny else MixSpec()
    from mempath.model.loader import read_config
    vocab = read_config(engine_options(args)["model"])["vocab_size"]
    if args.sharegpt:
        prompts, output_lens = sharegpt_mix(args.sharegpt, args.tokenizer, args.requests, args.seed, vocab, mix)
    else:
        prompts, output_lens = synthetic_mix(args.requests, args.seed, vocab, mix)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    rate = matmul_rate(device, torch.float32 if device.type == "cpu" else torch.bfloat16,
                       size=512 if device.type == "cpu" else 8192)
    # fp8 weights multiply on the fp8 tensor cores (CUDA; the CPU dequantizes): their runs' MFU and bounds
    # are against that rate.
    rates = {"none": rate, "fp8": rate}
    if device.type == "cuda" and "fp8" in args.quantization:
        rates["fp8"] = matmul_rate(device, torch.float8_e4m3fn)
    if device.type == "cuda":
        from bench_engine import copy_bandwidth
        args.bandwidth = copy_bandwidth()
    else:
        args.bandwidth = None
    shape = "mempath-tiny" if args.tiny else args.shape
    print(f"mix: {shape}, {len(prompts)} requests ({'ShareGPT ' + args.sharegpt if args.sharegpt else 'lognormal'}, "
          f"seed {args.seed}), {sum(map(len, prompts)):,} input and {sum(output_lens):,} output tokens; "
          f"input median {np.median([len(p) for p in prompts]):.0f}, output median {np.median(output_lens):.0f}; "
          f"matmul {rate / 1e12:.1f} TFLOP/s" + (f" (fp8 {rates['fp8'] / 1e12:.1f})" if rates["fp8"] != rate else "")
          + f" on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}", flush=True)
    common = {"bench": "mix", "shape": shape, "requests": len(prompts), "seed": args.seed,
              "source": args.sharegpt or "lognormal", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    results = []
    configs = [c for c in itertools.product(args.quantization, args.kv_cache_dtype, args.max_num_seqs,
                                            args.max_num_batched_tokens, args.decode_order, args.quant_fusion,
                                            args.fp8_gemm)
               # no fp8 projection: the fp8-only options would give the same run again
               if c[0] != "none" or (c[5], c[6]) == (args.quant_fusion[0], args.fp8_gemm[0])]
    labels = {}
    for repeat in range(args.repeat):  # interleaved: each configuration once a round, so drift hits all alike
        for quantization, kv, seqs, tokens, order, fusion, gemm in configs:
            r = {**common, "engine": "mempath", "repeat": repeat,
                 **run_mempath(args, prompts, output_lens, rates[quantization], seqs, tokens, quantization, kv, order,
                               fusion, gemm)}
            label = (f"mempath weights={quantization} kv={kv} max_num_seqs={r['max_num_seqs']} "
                     f"max_num_batched_tokens={r['max_num_batched_tokens']} decode order {order}"
                     + (f" quantization {fusion}, fp8 GEMM {gemm}" if quantization != "none" else ""))
            print_row(label + (f" (round {repeat + 1} of {args.repeat})" if args.repeat > 1 else ""), r)
            labels.setdefault(label, []).append(r["output_tok_s"])
            results.append(r)
    if args.repeat > 1:
        print(f"\noutput tok/s over {args.repeat} interleaved rounds (median, min-max):")
        for label, values in labels.items():
            print(f"  {label}: {np.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})")
    if args.hf_seconds > 0:
        try:
            hf = run_transformers(args, prompts, output_lens)
        except Exception as error:  # report, don't lose our own figures
            hf = {"error": f"{type(error).__name__}: {error}"}
        print(f"transformers CB on {args.hf_requests} requests: " + (
            hf["error"] if "error" in hf else
            f"{hf['tok_s']:,.0f} output tok/s ({hf['output_tokens']:,} tokens in {hf['seconds']:.0f} s, "
            f"{hf['finished']} finished)"))
        results.append({**common, "engine": "transformers-cb", **hf})
    for r in results:  # benchmarks/gpu_run.sh collects these lines
        print("RESULT " + json.dumps(r))
    if args.out:
        with open(args.out, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return results


if __name__ == "__main__":
    main()
