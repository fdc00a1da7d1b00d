"""The fp8 KV cache (kv_cache_dtype): the twins' arithmetic, the Triton kernels against
the twins, and the engine (block count, accuracy, the disk tier keyed by KV dtype, the
bytes the tiers move).

Under ``TRITON_INTERPRET=1`` (Triton 3.x) the float32 -> fp8 downcast loses the carry
when rounding up crosses a power of two (7.93 -> 4.0 where the GPU and torch give 8.0),
so the interpreted checks write values already on the fp8 grid, and values past its
range (saturation); rounding of arbitrary values is checked on the GPU.
"""
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from mempath import LLM, SamplingParams
from mempath.config import EngineConfig
from mempath.kernels import elementwise_torch as ops
from mempath.kernels.attention_torch import paged_attention, quantize_kv, write_kv

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_triton_kernels import Case, assert_close  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ------------------------------------------------------------------ the twins (CPU)

@pytest.mark.parametrize("dtype, values, stored", [
    # round to nearest even; past the largest finite value: the largest (not NaN or inf)
    (torch.float8_e4m3fn, [7.93, 0.3, 1000.0, -1e6, 2.0 ** -10, 0.0], [8.0, 0.3125, 448.0, -448.0, 0.0, 0.0]),
    (torch.float8_e5m2, [7.93, 0.3, 1000.0, -1e6, 2.0 ** -17, 0.0], [8.0, 0.3125, 1024.0, -57344.0, 0.0, 0.0]),
])
def test_quantize_kv_rounds_and_saturates(dtype, values, stored):
    x = torch.tensor(values)
    assert quantize_kv(x, dtype).float().tolist() == stored
    assert quantize_kv(x.to(torch.bfloat16), dtype).float().tolist() == stored
    if dtype == torch.float8_e5m2:  # what the clamp is for: torch's plain cast gives inf there
        assert torch.tensor([1e6]).to(dtype).float().isinf().all()


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_kv_is_the_reference_cast_inside_the_range(dtype):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 50
    limit = torch.finfo(dtype).max
    assert same_bytes(quantize_kv(x, dtype), x.clamp(-limit, limit).to(dtype))
    grid = quantize_kv(x, dtype)
    assert same_bytes(quantize_kv(grid.float(), dtype), grid)  # dequantize, requantize: the same bytes


@pytest.mark.parametrize("dtype", FP8)
def test_write_kv_stores_quantized_rows_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(1)
    key, value = (torch.randn(10, 2, 8, generator=gen) * 100 for _ in range(2))
    slots = torch.tensor([5, 0, -1, 31, 7, -1, 12, 3, 30, 1])
    k_cache = torch.randn(4, 8, 2, 8, generator=gen).to(dtype)
    v_cache = torch.randn(4, 8, 2, 8, generator=gen).to(dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    write_kv(key, value, k_cache, v_cache, slots)
    keep = slots >= 0
    for cache, before, rows in ((k_cache, before_k, key), (v_cache, before_v, value)):
        flat, old = cache.view(-1, 2, 8), before.view(-1, 2, 8)
        assert same_bytes(flat[slots[keep]], quantize_kv(rows[keep], dtype))
        untouched = torch.ones(32, dtype=torch.bool)
        untouched[slots[keep]] = False
        assert same_bytes(flat[untouched], old[untouched])


@pytest.mark.parametrize("dtype", FP8)
def test_attention_over_fp8_is_attention_over_the_dequantized_cache(dtype):
    case = Case([(1, 40), (7, 23), (16, 16)], 4, 2, 32, 8, torch.float32, "cpu", seed=2)
    k8, v8 = quantize_kv(case.k_cache, dtype), quantize_kv(case.v_cache, dtype)
    args = (case.block_tables, case.query_start_loc, case.seq_lens, case.scale)
    got = paged_attention(case.query, k8, v8, *args)
    assert torch.equal(got, paged_attention(case.query, k8.float(), v8.float(), *args))
    # Against the unquantized cache: within what 3 (e4m3) or 2 (e5m2) mantissa bits allow.
    err = (got - case.reference()).norm() / case.reference().norm()
    assert err < {torch.float8_e4m3fn: 0.05, torch.float8_e5m2: 0.1}[dtype]


def rope_tables(dim, positions=512):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat([torch.arange(positions).float()[:, None] * inv[None, :]] * 2, -1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", FP8)
def test_rope_and_store_twin_quantizes_the_rotated_key(dtype):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(6, n, 16, generator=gen) for n in (4, 2, 2))
    positions = torch.tensor([0, 3, 9, 100, 7, 2])
    slots = torch.tensor([0, 1, 2, -1, 9, 15])
    cos, sin = rope_tables(16)
    k_cache = torch.zeros(2, 8, 2, 16, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q_out = ops.rope_and_store_torch(positions, q, k, v, cos, sin, k_cache, v_cache, slots)
    ref_q, ref_k = ops.apply_rope_torch(positions, q, k, cos, sin)
    assert torch.equal(q_out, ref_q)
    keep = slots >= 0
    assert same_bytes(k_cache.view(-1, 2, 16)[slots[keep]], quantize_kv(ref_k[keep], dtype))
    assert same_bytes(v_cache.view(-1, 2, 16)[slots[keep]], quantize_kv(v[keep], dtype))


# ------------------------------------------------------- Triton kernels against the twins
# Shared by the interpreter child (CPU) and the GPU tests.

def grid_values(shape, dtype, gen, device, src_dtype=torch.float32):
    """Values on the fp8 grid (exact in src_dtype), a few past the range (saturated)."""
    x = quantize_kv(torch.randn(shape, generator=gen) * 8, dtype).float()
    past = min(3 * torch.finfo(dtype).max, torch.finfo(src_dtype).max)  # finite in src_dtype
    x.view(-1)[::97] = past
    x.view(-1)[1::89] = -past
    return x.to(src_dtype).to(device)


def check_fp8_write_kv(ta, dtype, device, src_dtype, on_grid=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, heads, dim, block = 37, 2, 32, 8
    if on_grid:
        fused = grid_values((num_tokens, 3 * heads, dim), dtype, gen, device, src_dtype)
    else:
        fused = (torch.randn(num_tokens, 3 * heads, dim, generator=gen) * 30).to(src_dtype).to(device)
    key, value = fused[:, :heads], fused[:, heads:2 * heads]  # strided, as the model's qkv split
    slots = torch.randperm(7 * block, generator=gen)[:num_tokens]
    slots[::5] = -1
    slots = slots.to(device)
    init = [torch.randn(7, block, heads, dim, generator=gen).to(dtype).to(device) for _ in range(2)]
    ref_k, ref_v = init[0].clone(), init[1].clone()
    write_kv(key, value, ref_k, ref_v, slots)
    got_k, got_v = init[0].clone(), init[1].clone()
    ta.triton_write_kv(key, value, got_k, got_v, slots)
    assert same_bytes(got_k, ref_k) and same_bytes(got_v, ref_v)


def fp8_case(seqs, dtype, query_dtype, device, group=2, seed=0):
    """A Case whose caches are fp8 (NaN in the unused slots still) and query query_dtype."""
    case = Case(seqs, 2 * group, 2, 32, 8, torch.float32, "cpu", seed=seed)
    case.k_cache = case.k_cache.to(dtype).to(device)  # NaN stays NaN in both formats
    case.v_cache = case.v_cache.to(dtype).to(device)
    for name in ("block_tables", "query_start_loc", "seq_lens"):
        setattr(case, name, getattr(case, name).to(device))
    case.query = case.query.to(query_dtype).to(device)
    return case


def check_fp8_attention(ta, dtype, query_dtype, device, group):
    decode = fp8_case([(1, n) for n in (1, 7, 9, 64, 65, 200)], dtype, query_dtype, device, group, seed=group)
    mixed = fp8_case([(1, 1), (9, 9), (1, 77), (33, 100), (70, 70), (5, 67)], dtype, query_dtype, device,
                     group, seed=group + 1)
    for case, kernels in ((decode, ("decode", "auto")), (mixed, ("prefill", "auto"))):
        ref = case.reference()  # the twin: float32 over the dequantized cache
        for kernel in kernels:
            out = case.poisoned_out()
            if kernel == "decode":
                ta.triton_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                           case.seq_lens, case.scale, out=out, num_splits=4)
                assert_close(out, ref, query_dtype)
                out = case.poisoned_out()  # and unsplit, as from batch 128 up
                ta.triton_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                           case.seq_lens, case.scale, out=out, num_splits=1)
            elif kernel == "prefill":
                ta.triton_prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                            case.query_start_loc, case.seq_lens, case.scale,
                                            max_query_len=case.max_query_len, out=out)
            else:
                ta.paged_attention_triton(case.query, case.k_cache, case.v_cache, case.block_tables,
                                          case.query_start_loc, case.seq_lens, case.scale, out=out)
            assert_close(out, ref, query_dtype)


def check_fp8_rope_and_store(tops, dtype, device, act_dtype, on_grid=True, seed=0):
    """On the grid: cos 1, sin 0 (the rotation keeps k on the grid); else real tables."""
    gen = torch.Generator().manual_seed(seed)
    tokens, heads, kv_heads, dim, block = 9, 6, 2, 64, 8
    if on_grid:
        qkv = grid_values((tokens, (heads + 2 * kv_heads) * dim), dtype, gen, device, act_dtype)
        cos = torch.ones(512, dim, device=device)
        sin = torch.zeros(512, dim, device=device)
    else:
        qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 30).to(act_dtype).to(device)
        cos, sin = (t.to(device) for t in rope_tables(dim))
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    positions = torch.randint(0, 500, (tokens,), generator=gen).to(device)
    slots = torch.randperm(4 * block, generator=gen)[:tokens]
    slots[::4] = -1
    slots = slots.to(device)
    caches = [torch.full((4, block, kv_heads, dim), float("nan"), device=device).to(dtype) for _ in range(4)]
    ref_q = ops.rope_and_store_torch(positions, q.clone(), k.clone(), v, cos, sin, caches[0], caches[1],
                                     slots)
    tops.triton_rope_and_store(positions, q, k, v, cos, sin, caches[2], caches[3], slots)
    assert torch.equal(q, ref_q)
    assert same_bytes(caches[2], caches[0]) and same_bytes(caches[3], caches[1])


INTERPRETED = {}
for _dt in FP8:
    _n = str(_dt).removeprefix("torch.")
    for _src in (torch.float32, torch.float16):
        _s = str(_src).removeprefix("torch.")
        INTERPRETED[f"write_kv_{_n}_{_s}"] = lambda ta, tops, d=_dt, s=_src: check_fp8_write_kv(ta, d, "cpu", s)
        INTERPRETED[f"rope_and_store_{_n}_{_s}"] = (
            lambda ta, tops, d=_dt, s=_src: check_fp8_rope_and_store(tops, d, "cpu", s))
        _g = 1 if _src == torch.float32 else 4  # the GPU tests take every pair
        INTERPRETED[f"attention_{_n}_{_s}_g{_g}"] = (
            lambda ta, tops, d=_dt, s=_src, g=_g: check_fp8_attention(ta, d, s, "cpu", g))


def check_fp8_attention_tile(ta, dtype, device, tile, stages=None, warps=None, registers=None):
    """The decode kernel at another tile, pipeline depth, warp count and register cap over an fp8 cache
    (bf16 queries on CUDA: float16 dots), against the twin."""
    saved = ta.DECODE_TILE_FP8, ta.FP8_DECODE_STAGES, ta.FP8_DECODE_WARPS, ta.FP8_DECODE_MAXNREG
    ta.DECODE_TILE_FP8, ta.FP8_DECODE_STAGES, ta.FP8_DECODE_WARPS, ta.FP8_DECODE_MAXNREG = tile, stages, warps, registers
    try:
        check_fp8_attention(ta, dtype, torch.bfloat16 if device == "cuda" else torch.float16, device, 4)
    finally:
        ta.DECODE_TILE_FP8, ta.FP8_DECODE_STAGES, ta.FP8_DECODE_WARPS, ta.FP8_DECODE_MAXNREG = saved


# (The interpreter multiplies bfloat16 as raw bits: bfloat16 queries over fp8, and their float16 dots, run on CUDA only.)
INTERPRETED["attention_e4m3_tile32"] = lambda ta, tops: check_fp8_attention_tile(ta, torch.float8_e4m3fn, "cpu", 32)
INTERPRETED["attention_e4m3_tile16_stages6_warps2"] = (
    lambda ta, tops: check_fp8_attention_tile(ta, torch.float8_e4m3fn, "cpu", 16, 6, 2))


def _run_interpreted() -> dict:
    from test_triton_interpret import _patch_interpreter_for_numpy
    _patch_interpreter_for_numpy()
    from mempath.kernels import attention_triton as ta, elementwise_triton as tops
    results = {}
    for name, check in INTERPRETED.items():
        try:
            check(ta, tops)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported to the parent
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU tests below run the compiled kernels")
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child"], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"interpreter child failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("name", list(INTERPRETED))
def test_interpreted_kernel_matches_twin(interpreted, name):
    if interpreted[name] is not None:
        pytest.fail(interpreted[name], pytrace=False)


@cuda
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_fp8_write_kernels_match_twin(dtype, src):
    from mempath.kernels import attention_triton as ta, elementwise_triton as tops
    for on_grid in (True, False):  # off the grid: the rounding too, bit for bit
        check_fp8_write_kv(ta, dtype, "cuda", src, on_grid)
        check_fp8_rope_and_store(tops, dtype, "cuda", src, on_grid)


@cuda
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gpu_fp8_attention_matches_twin(dtype, query_dtype, group):
    from mempath.kernels import attention_triton as ta
    check_fp8_attention(ta, dtype, query_dtype, "cuda", group)


@pytest.mark.parametrize("tile, stages, warps", [(48, None, None), (8, None, None), (128, 0, None),
                                                 (128, 9, None), (128, None, 3), (128, None, 16)])
def test_fp8_decode_settings_out_of_range_are_refused(monkeypatch, tile, stages, warps):
    """A tile that is not a power of two cannot be a Triton block; a pipeline depth or warp count
    Triton cannot launch would fail at compile time, mid-step. All are refused before a launch, in one line."""
    pytest.importorskip("triton")
    from mempath.kernels import attention_triton as ta
    monkeypatch.setattr(ta, "DECODE_TILE_FP8", tile)
    monkeypatch.setattr(ta, "FP8_DECODE_STAGES", stages)
    monkeypatch.setattr(ta, "FP8_DECODE_WARPS", warps)
    case = fp8_case([(1, 9)], torch.float8_e4m3fn, torch.float16, "cpu")
    with pytest.raises(ValueError, match="DECODE_TILE_FP8 must be a power of two >= 16, FP8_DECODE_STAGES"):
        ta.triton_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                   case.scale, num_splits=1)


@pytest.mark.parametrize("registers", [60, 100, 256, 128.0])
def test_fp8_decode_register_cap_out_of_range_is_refused(monkeypatch, registers):
    """Below 64 a decode program spills most of its tiles, and the SM allocates registers in steps of 8 a
    thread, so a cap between two steps buys no occupancy for its spills: each refused before a launch, in
    one line (as is a float, which Triton would pass on as it is)."""
    pytest.importorskip("triton")
    from mempath.kernels import attention_triton as ta
    monkeypatch.setattr(ta, "FP8_DECODE_MAXNREG", registers)
    case = fp8_case([(1, 9)], torch.float8_e4m3fn, torch.float16, "cpu")
    with pytest.raises(ValueError, match=f"FP8_DECODE_MAXNREG None or a multiple of 8 in 64-248; got .*{registers}"):
        ta.triton_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                   case.scale, num_splits=1)


@pytest.mark.parametrize("cache_dtype, cap, launched", [(torch.float8_e4m3fn, 128, 128), (torch.float8_e4m3fn, None, None),
                                                         (torch.float16, 128, None)])
def test_fp8_decode_register_cap_reaches_the_launch(monkeypatch, cache_dtype, cap, launched):
    """The interpreter drops launch options a kernel does not declare, so the cap is checked at the launch:
    an fp8 cache's decode kernel gets ``maxnreg``, a 16-bit cache's and an uncapped one's none."""
    pytest.importorskip("triton")
    from mempath.kernels import attention_triton as ta
    options = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: options.update(kwargs)

    monkeypatch.setattr(ta, "FP8_DECODE_MAXNREG", cap)
    monkeypatch.setattr(ta, "_decode_split_kernel", Recorder())
    case = fp8_case([(1, 9)], cache_dtype, torch.float16, "cpu")
    ta.triton_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                               case.scale, num_splits=1)
    assert options.get("maxnreg") == launched and options["KV_FP8"] == (cache_dtype != torch.float16)


@cuda
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("tile, stages, warps", [(t, None, None) for t in (32, 64, 128, 256)]
                         + [(16, 6, 4), (16, 4, 2), (32, 6, 4), (64, 6, 4), (128, 3, 4), (128, 8, 4)])
def test_gpu_fp8_decode_tiles_match_twin(dtype, tile, stages, warps):
    from mempath.kernels import attention_triton as ta
    check_fp8_attention_tile(ta, dtype, "cuda", tile, stages, warps)


@cuda
@pytest.mark.parametrize("registers", [128, 168])
def test_gpu_fp8_decode_under_a_register_cap_matches_twin(registers):
    from mempath.kernels import attention_triton as ta
    check_fp8_attention_tile(ta, torch.float8_e4m3fn, "cuda", 128, 3, 4, registers)


# ------------------------------------------------------------------------ the engine

def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


PROMPTS = [[1 + (11 * p + 5 * i) % 300 for i in range(8 + 5 * p)] for p in range(6)]


def test_cli_passes_kv_cache_dtype_and_refuses_others(capsys):
    from mempath.cli import build_parser
    from mempath.engine_flags import engine_options
    args = build_parser().parse_args(["generate", "hello", "--kv-cache-dtype", "fp8_e5m2"])
    assert engine_options(args)["kv_cache_dtype"] == "fp8_e5m2"
    assert engine_options(build_parser().parse_args(["generate", "hello"]))["kv_cache_dtype"] == "auto"
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "hello", "--kv-cache-dtype", "int8"])
    assert exit_info.value.code == 2
    assert "--kv-cache-dtype: invalid choice: 'int8'" in capsys.readouterr().err


def test_bad_kv_cache_dtype_is_one_line():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be auto, fp8, fp8_e4m3, fp8_e5m2, got 'int8'"):
        EngineConfig(model="x", kv_cache_dtype="int8")


@pytest.mark.parametrize("kv", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_plan_counts_fp8_blocks(kv):
    from mempath.tools.plan import plan_memory
    model = "mempath/assets/mempath-tiny"
    root = Path(__file__).resolve().parents[1]
    full = plan_memory(str(root / model), dtype="bfloat16", gpu_mem_bytes=1 << 30)
    fp8 = plan_memory(str(root / model), dtype="bfloat16", gpu_mem_bytes=1 << 30, kv_cache_dtype=kv)
    assert 2 * fp8.kv_bytes_per_block == full.kv_bytes_per_block
    assert fp8.num_kv_blocks in (2 * full.num_kv_blocks, 2 * full.num_kv_blocks + 1)  # the same budget
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, fp8, fp8_e4m3 or fp8_e5m2, got 'fp4'"):
        plan_memory(str(root / model), kv_cache_dtype="fp4")


def test_fp8_cache_holds_four_times_the_float32_blocks(model_factory):
    path, _ = model_factory()
    engines = {kv: LLM(path, show_progress=False, device="cpu", kv_cache_dtype=kv, cpu_kv_cache_bytes=1 << 22)
               for kv in ("auto", "fp8")}
    full, fp8 = (engines[kv].engine for kv in ("auto", "fp8"))
    assert full.runner.kv_bytes_per_block() == 4 * fp8.runner.kv_bytes_per_block()  # float32 on the CPU
    assert fp8.kv.num_blocks == 4 * full.kv.num_blocks
    layer = next(iter(fp8.model.attention_layers()))
    assert layer.k_cache.dtype == torch.float8_e4m3fn
    # The ledger counts the bytes allocated: the same budget, a quarter of the bytes per block.
    assert fp8.ledger.get("kv_cache") == fp8.kv.num_blocks * fp8.runner.kv_bytes_per_block()
    assert fp8.ledger.get("kv_cache") == full.ledger.get("kv_cache")


# Measured (seed 0, 6 prompts x 48 greedy tokens, the tiny random llama, CPU): 214/288 (0.74)
# positions equal to the float32 cache's with fp8 (e4m3), 100/288 (0.35) with fp8_e5m2.
AGREEMENT_BOUND = {"fp8": 0.6, "fp8_e5m2": 0.25}


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_greedy_through_fp8_agrees_with_float32(model_factory, kv):
    path, _ = model_factory()
    runs = {}
    for name in ("auto", kv):
        llm = LLM(path, show_progress=False, device="cpu", kv_cache_dtype=name, seed=0, cpu_kv_cache_bytes=1 << 22)
        runs[name] = [o.token_ids for o in llm.generate(PROMPTS, greedy(48), use_tqdm=False)]
    same = sum(a == b for ref, got in zip(runs["auto"], runs[kv]) for a, b in zip(ref, got))
    total = sum(len(r) for r in runs["auto"])
    print(f"{kv}: {same}/{total} greedy tokens equal to the float32 cache's")
    assert same >= AGREEMENT_BOUND[kv] * total


def test_disk_tier_never_serves_blocks_of_another_kv_dtype(model_factory, tmp_path):
    """Each engine leaves its prompt's blocks on disk; a restart finds only its own dtype's."""
    path, _ = model_factory()
    prompt = [10 + (7 * i) % 200 for i in range(40)]  # two full blocks of 16
    fillers = [[20 + (13 * c + 3 * i) % 250 for i in range(40)] for c in range(3)]
    mib = 1 / 1024

    def run(kv):
        llm = LLM(path, dtype="float32", show_progress=False, device="cpu", kv_cache_dtype=kv,
                  num_gpu_blocks_override=8, cpu_kv_gb=mib, disk_kv_path=str(tmp_path), disk_kv_gb=4 * mib,
                  disk_write_policy="write-through")
        # Loading beats recomputing, whatever start-up's calibration measured on a busy machine.
        llm.engine.kv.tiers.rates["prefill_tokens_per_s"] = 1.0
        out = llm.generate(prompt, greedy(4), use_tqdm=False)[0]
        hits = llm.stats()["tiers"]["hits_blocks"]["disk"]
        for filler in fillers:  # push the prompt's blocks out of the 8 device blocks, to the tiers
            llm.generate(filler, greedy(4), use_tqdm=False)
        llm.engine.kv.tiers.close()  # its writes land before the next engine opens the directory
        tokens[kv].append(out.token_ids)
        return out.num_cached_tokens, hits

    tokens = {kv: [] for kv in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")}
    assert run("auto") == (0, 0)
    assert run("fp8") == (0, 0)  # the float32 blocks on disk are not this cache's
    assert run("fp8_e5m2") == (0, 0)  # nor the e4m3 ones
    assert run("fp8_e4m3") == (32, 2)  # fp8 is e4m3: its blocks are found
    assert run("auto") == (32, 2)
    # The fp8 bytes came back through the host tier unchanged: the same continuation.
    assert tokens["fp8_e4m3"] == tokens["fp8"] and tokens["auto"][0] == tokens["auto"][1]


# The model in bfloat16 on the CPU: "auto" stores two bytes per element, fp8 one, so an fp8
# block is exactly half a bf16 block in every tier.
TIER_DEVICE_BLOCKS, TIER_HOST_BLOCKS = 8, 2


def bf16_block_nbytes(hf_model, block_size: int) -> int:
    c = hf_model.config
    head_dim = c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * head_dim * torch.bfloat16.itemsize


def conversation_turns(llm, turns=2):
    """Five conversations, each alone, turn after turn: each later turn finds the KV of the
    turns before it (tokens and cached token counts per turn returned)."""
    history = [[10 + (7 * c + i) % 200 for i in range(40)] for c in range(5)]
    tokens, cached = [], []
    for turn in range(turns):
        for c in range(len(history)):
            out = llm.generate(history[c], greedy(6), use_tqdm=False)[0]
            tokens.append(out.token_ids)
            cached.append(out.num_cached_tokens)
            history[c] = history[c] + out.token_ids + [250 + turn, 251, 252]
    return tokens, cached


def run_through_tiers(path, kv, block_nbytes, disk_dir):
    """The conversations with a device pool too small to keep them: their blocks go down to a
    two-block host tier and, written through, to disk, and come back up for the next turn."""
    llm = LLM(path, dtype="bfloat16", show_progress=False, device="cpu", kv_cache_dtype=kv,
              num_gpu_blocks_override=TIER_DEVICE_BLOCKS, cpu_kv_gb=(TIER_HOST_BLOCKS + 0.5) * block_nbytes / (1 << 30),
              disk_kv_path=str(disk_dir), disk_kv_gb=64 * (block_nbytes + 4096) / (1 << 30),
              disk_write_policy="write-through")
    tiers = llm.engine.kv.tiers
    assert tiers.block_nbytes == block_nbytes and tiers.host.num_blocks == TIER_HOST_BLOCKS
    tiers.rates["prefill_tokens_per_s"] = 1.0  # loading beats recomputing, whatever start-up measured
    # Writes that end at once: which blocks the full host tier can evict (and the disk then
    # serves) would otherwise depend on the disk's timing.
    write_async = tiers.disk.write_async

    def write_now(*args, **kwargs):
        future = write_async(*args, **kwargs)
        future.result()
        return future

    tiers.disk.write_async = write_now
    tokens, cached = conversation_turns(llm)
    stats = llm.stats()["tiers"]
    tiers.close()
    return tokens, cached, stats


def disk_payload_sizes(disk_dir) -> set[int]:
    """The payload length each block file's header declares, checked against the file's size."""
    from mempath.kv.tiers.disk import _HEADER, _TRAILER
    sizes = set()
    for file in Path(disk_dir).rglob("*.kv"):
        with open(file, "rb") as f:
            _, _, _, payload, hash_len, layout_len = _HEADER.unpack(f.read(_HEADER.size))
        assert file.stat().st_size == _HEADER.size + hash_len + layout_len + payload + _TRAILER.size
        sizes.add(payload)
    return sizes


def test_tier_transfers_of_fp8_blocks_move_half_the_bytes_and_lose_nothing(model_factory, tmp_path):
    path, hf_model = model_factory()
    bf16_nbytes = bf16_block_nbytes(hf_model, 16)
    runs = {}
    for kv, block_nbytes in (("auto", bf16_nbytes), ("fp8", bf16_nbytes // 2)):
        runs[kv] = run_through_tiers(path, kv, block_nbytes, tmp_path / kv)
        assert disk_payload_sizes(tmp_path / kv) == {block_nbytes}
    full, fp8 = runs["auto"][2], runs["fp8"][2]
    assert full["block_nbytes"] == 2 * fp8["block_nbytes"] == bf16_nbytes
    for direction in ("gpu_to_cpu", "cpu_to_gpu", "cpu_to_disk", "disk_to_cpu"):
        moved_full, moved_fp8 = full["moved"][direction], fp8["moved"][direction]
        assert moved_fp8["blocks"] > 0, direction
        # The same workload moves the same blocks; each fp8 one is half the bytes.
        assert moved_fp8["blocks"] == moved_full["blocks"], direction
        assert moved_fp8["bytes"] == moved_fp8["blocks"] * bf16_nbytes // 2, direction
        assert moved_full["bytes"] == moved_full["blocks"] * bf16_nbytes, direction
    assert fp8["hits_blocks"]["disk"] > 0 and fp8["swaps"] == 0  # moved as cached prefixes
    assert all(n > 0 for n in runs["fp8"][1][5:])  # every second turn found its first turn's KV
    # Against a pool that keeps every block on the device: the same prefixes found, and the
    # same greedy tokens, so the trip through the tiers changed no byte of them.
    for kv, (tokens, cached, _) in runs.items():
        llm = LLM(path, dtype="bfloat16", show_progress=False, device="cpu", kv_cache_dtype=kv,
                  num_gpu_blocks_override=64)
        assert conversation_turns(llm) == (tokens, cached), kv
        assert llm.engine.kv.tiers is None


@cuda
def test_gpu_llm_fp8_with_cuda_graphs():
    """The shipped model on CUDA: graph replay gives the eager fp8 run's tokens, and those mostly
    agree with the bf16 cache's (0.807 of 5 x 256 greedy tokens on the CPU against float32)."""
    model = str(Path(__file__).resolve().parents[1] / "mempath/assets/mempath-tiny")
    prompts = ["Once upon a time", "def parse_header(data):\n", "The main thread"]
    runs = {}
    for name, kw in (("bf16", dict(kv_cache_dtype="auto")), ("fp8", dict(kv_cache_dtype="fp8")),
                     ("fp8_eager", dict(kv_cache_dtype="fp8", enforce_eager=True))):
        llm = LLM(model, show_progress=False, device="cuda", dtype="bfloat16", max_num_seqs=8,
                  num_gpu_blocks_override=512, **kw)
        assert bool(llm.engine.runner.graphs) == (name != "fp8_eager")
        runs[name] = [o.token_ids for o in llm.generate(prompts, greedy(128), use_tqdm=False)]
        del llm
    assert runs["fp8"] == runs["fp8_eager"]
    same = sum(a == b for ref, got in zip(runs["bf16"], runs["fp8"]) for a, b in zip(ref, got))
    assert same >= 0.5 * 3 * 128, f"{same} of {3 * 128} greedy tokens equal to the bf16 cache's"


if __name__ == "__main__" and sys.argv[1:] == ["--child"]:
    print(json.dumps(_run_interpreted()))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_kv_cache_on_a_gpu_before_ada_is_refused_in_one_line(monkeypatch, kv_cache_dtype):
    from mempath.model.quant import check_fp8_kv_device
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=rf"^--kv-cache-dtype {kv_cache_dtype} needs an NVIDIA GPU of compute "
                                         r"capability 8.9 or later .*A100-SXM4-80GB is 8.0: drop --kv-cache-dtype"):
        check_fp8_kv_device(torch.device("cuda", 0), kv_cache_dtype)
    check_fp8_kv_device(torch.device("cuda", 0), "auto")  # a 16-bit cache needs no fp8 conversion
    check_fp8_kv_device(torch.device("cpu"), kv_cache_dtype)  # the PyTorch twin converts on the CPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_kv_device(torch.device("cuda", 0), kv_cache_dtype)
