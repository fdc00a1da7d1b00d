"""The weight-only fp8 GEMV of decode batches (mempath.kernels.fp8_gemv_triton): its twin, the kernel
against the twin (Triton's interpreter on the CPU, compiled on CUDA, CUDA-graph capture), the
configuration table, the dispatch by batch size, and the workspace's bytes against the plan's."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mempath.memory.formulas import fp8_gemv_workspace_bytes, gemv_workspace_bytes, read_shape
from mempath.model import quant
from mempath.model.quant import fp8_gemv_torch, quantize_rows

ROOT = Path(__file__).resolve().parents[1]
# (N, K): uneven against every block size below, and even.
SHAPES = ((80, 200), (64, 256))


def gemv_configs():
    from mempath.kernels.fp8_gemv_triton import GemvConfig
    return [GemvConfig(block_n=32, block_k=32),  # multiply-adds, no split
            GemvConfig(block_n=32, block_k=32, split_k=3, prefetch=True),  # atomic split, a short last split
            GemvConfig(block_n=16, block_k=64, split_k=2, reduce="two_pass"),
            GemvConfig(block_n=32, block_k=32, split_k=2, use_dot=True),
            GemvConfig(block_n=16, block_k=32, split_k=4, use_dot=True, reduce="two_pass", prefetch=True)]


def sum_k_each_step_configs():
    """The multiply-add product summed over K at every step: no split, both reduces of a split
    (a short last split at 3), each with and without prefetching."""
    from mempath.kernels.fp8_gemv_triton import GemvConfig
    return [GemvConfig(block_n=32, block_k=32, sum_k_each_step=True),
            GemvConfig(block_n=16, block_k=64, prefetch=True, sum_k_each_step=True),
            GemvConfig(block_n=32, block_k=32, split_k=3, prefetch=True, sum_k_each_step=True),
            GemvConfig(block_n=16, block_k=32, split_k=2, sum_k_each_step=True),
            GemvConfig(block_n=16, block_k=64, split_k=2, reduce="two_pass", sum_k_each_step=True),
            GemvConfig(block_n=32, block_k=32, split_k=4, reduce="two_pass", prefetch=True, sum_k_each_step=True)]


def tma_configs():
    """Tiles brought by the TMA: no split, an atomic split with a short last split (3 over K)."""
    from mempath.kernels.fp8_gemv_triton import GemvConfig
    return [GemvConfig(block_n=32, block_k=64, tma=True), GemvConfig(block_n=16, block_k=32, split_k=3, num_stages=3,
                                                                     tma=True)]


def quantize_x_configs():
    """The fp8 tensor-core product (x quantized in groups of 128 along K): no split, both reduces of
    a split (a short last split at 3), tiles of 16 and 64 outputs."""
    from mempath.kernels.fp8_gemv_triton import GemvConfig
    return [GemvConfig(block_n=32, block_k=128, use_dot=True, quantize_x=True),
            GemvConfig(block_n=16, block_k=128, split_k=3, use_dot=True, quantize_x=True),
            GemvConfig(block_n=64, block_k=128, split_k=2, use_dot=True, quantize_x=True, reduce="two_pass")]


def on_fp8_grid(x: torch.Tensor, group: int) -> torch.Tensor:
    """x moved onto the grid its groups quantize to without rounding: each group of ``group`` along a
    row holds e4m3 values times 2^j, one of them 448 · 2^j (Triton's interpreter rounds some values
    wrongly, as test_fp8_kv notes)."""
    rows, k = x.shape
    out = torch.empty(rows, k)
    for start in range(0, k, group):
        block = quantize_rows(x[:, start:start + group])[0].float()
        block[:, 0] = quant.FP8_MAX
        out[:, start:start + group] = block * 2.0 ** ((torch.arange(rows) + start // group) % 5 - 2).float()[:, None]
    return out


def check_fp8_gemv(device: str, dtypes, rows_list=(1, 3, 16), seed: int = 0, shapes=SHAPES, configs=None,
                   x_on_grid: bool = False) -> None:
    """Every configuration gives the twin's result within float32 accumulation (then one rounding
    to x's dtype), with a bias every other call, and leaves the shared workspace zero, in any
    order of calls. A quantize_x configuration is checked against the twin that quantizes x alike;
    ``x_on_grid`` puts x where that quantization needs no rounding (for the interpreter)."""
    from mempath.kernels.fp8_gemv_triton import QUANT_X_GROUP, GemvWorkspace, triton_fp8_gemv
    gen = torch.Generator().manual_seed(seed)
    workspace = GemvWorkspace(max(n for n, _ in shapes), torch.device(device))
    for dtype in dtypes:
        for n, k in shapes:
            w = torch.randn(n, k, generator=gen) * 0.05
            w[0, :k // 4] *= 1e-5  # e4m3's subnormals (and zeros) in the first row
            wq, scale = (t.to(device) for t in quantize_rows(w))
            bias = torch.randn(n, generator=gen).to(dtype).to(device)
            for rows in rows_list:
                x = torch.randn(rows, k, generator=gen)
                x = (on_fp8_grid(x, QUANT_X_GROUP) if x_on_grid else x).to(dtype).to(device)
                for i, config in enumerate(configs or gemv_configs()):
                    b = bias if (i + rows) % 2 else None
                    out = triton_fp8_gemv(x, wq, scale, b, workspace, config)
                    quantized = config.quantize_x and dtype != torch.float32  # float32 x: the multiply-adds
                    ref = fp8_gemv_torch(x, wq, scale, b, x_group=QUANT_X_GROUP if quantized else None)
                    assert out.dtype == dtype and out.shape == (rows, n)
                    ulp = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
                    torch.testing.assert_close(out.float(), ref.float(), rtol=2 * ulp, atol=2 * ulp,
                                               msg=lambda m: f"{dtype} {rows}x{n}x{k} {config}: {m}")
                    assert not workspace.partials.any() and not workspace.counters.any(), config


def check_16bit_weight_gemv(device: str, dtype, rows_list=(1, 3), seed: int = 0, shapes=SHAPES, configs=None):
    """With no weight scale the kernel multiplies by a 16-bit weight as it is: F.linear's product (in
    float32, one rounding to x's dtype), bias or not, the workspace zero afterwards."""
    from mempath.kernels.fp8_gemv_triton import GemvWorkspace, triton_fp8_gemv
    gen = torch.Generator().manual_seed(seed)
    workspace = GemvWorkspace(max(n for n, _ in shapes), torch.device(device))
    for n, k in shapes:
        w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype).to(device)
        bias = torch.randn(n, generator=gen).to(dtype).to(device)
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
            for i, config in enumerate(configs or gemv_configs()):
                b = bias if (i + rows) % 2 else None
                out = triton_fp8_gemv(x, w, None, b, workspace, config)
                ref = x.float() @ w.float().t() + (b.float() if b is not None else 0)
                ulp = torch.finfo(dtype).eps
                torch.testing.assert_close(out.float(), ref.to(dtype).float(), rtol=2 * ulp, atol=2 * ulp,
                                           msg=lambda m: f"{dtype} {rows}x{n}x{k} {config}: {m}")
                assert not workspace.partials.any() and not workspace.counters.any(), config


def check_split_sums_in_order(device: str, calls: int = 3, shapes=((256, 2048), (1000, 2048))) -> None:
    """A split K's partial sums are added in split order: the atomic way (the last split in adds the
    slices) gives the two-pass kernel's bits, and the same bits on every call (on the GPU the splits
    arrive in another order each time). Both reduce with 8 splits, one row and several, on a width that
    is a multiple of the tile and one that is not; and with the tensor-core tile of 8 warps, where the
    compiled reduce once read slices another thread had already zeroed (2026-12-06)."""
    from mempath.kernels.fp8_gemv_triton import GemvConfig, GemvWorkspace, triton_fp8_gemv
    gen = torch.Generator().manual_seed(5)
    for n, k in shapes:
        workspace = GemvWorkspace(n, torch.device(device))
        w = (torch.randn(n, k, generator=gen) * 0.05).to(device)
        wq, scale = quantize_rows(w.cpu())
        weights = [(w.to(torch.bfloat16), None), (wq.to(device), scale.to(device))]
        for rows in (1, 3):
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(device)
            for weight, weight_scale in weights:
                pairs = [(GemvConfig(block_n=32, block_k=128, split_k=8, tma=tma, sum_k_each_step=not tma),
                          GemvConfig(block_n=32, block_k=128, split_k=8, sum_k_each_step=True, reduce="two_pass"))
                         for tma in ((False, True) if rows == 1 else (False,))]
                dot = GemvConfig(block_n=128, block_k=128, split_k=8, num_warps=8, num_stages=4, use_dot=True,
                                 quantize_x=weight_scale is not None)
                pairs.append((dot, dataclasses.replace(dot, reduce="two_pass")))
                for atomic, two_pass in pairs:
                    want = triton_fp8_gemv(x, weight, weight_scale, None, workspace, two_pass)
                    for _ in range(calls):
                        got = triton_fp8_gemv(x, weight, weight_scale, None, workspace, atomic)
                        assert torch.equal(got, want), (n, rows, atomic.describe(), weight.dtype,
                                                        (got.float() - want.float()).abs().max())
                        assert not workspace.partials.any() and not workspace.counters.any()


def run_interpreted(code: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_fp8_gemv_torch_is_the_weight_only_product():
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(3, 64, generator=gen), torch.randn(48, 64, generator=gen) * 0.05, torch.randn(48)
    wq, scale = quantize_rows(w)
    expected = x.double() @ (wq.double() * scale.double()).t() + bias.double()  # x itself: no input quantization
    torch.testing.assert_close(fp8_gemv_torch(x, wq, scale, bias).double(), expected, rtol=1e-6, atol=1e-6)
    assert fp8_gemv_torch(x.bfloat16(), wq, scale, None).dtype == torch.bfloat16


def test_interpreted_split_k_sums_in_split_order():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU test runs the compiled kernel")
    run_interpreted("import sys, torch; sys.path.insert(0, 'tests'); from test_triton_interpret import "
                    "_patch_interpreter_for_numpy; _patch_interpreter_for_numpy(); "
                    "from tests.test_fp8_gemv import check_split_sums_in_order; "
                    "check_split_sums_in_order('cpu', shapes=((200, 1024),))")


def test_interpreted_gemv_matches_twin():
    """The CPU's check of the kernel: float16 (the tensor-core product: the interpreter multiplies
    bfloat16 tiles as raw bits) and bfloat16 (multiply-adds only), every way of splitting K."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU test runs the compiled kernel")
    run_interpreted(
        "import sys, torch; sys.path.insert(0, 'tests'); from test_triton_interpret import _patch_interpreter_for_numpy; "
        "_patch_interpreter_for_numpy(); from tests.test_fp8_gemv import check_fp8_gemv, gemv_configs; "
        "check_fp8_gemv('cpu', (torch.float16,), rows_list=(1, 3), shapes=((80, 200),)); "
        "check_fp8_gemv('cpu', (torch.float16,), rows_list=(16,), shapes=((64, 256),), configs=gemv_configs()[::4]); "
        "check_fp8_gemv('cpu', (torch.bfloat16,), rows_list=(2,), shapes=((80, 200),), "
        "configs=[c for c in gemv_configs() if not c.use_dot])")


def test_interpreted_gemv_of_a_16bit_weight_is_f_linear():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU test runs the compiled kernel")
    run_interpreted(
        "import sys, torch; sys.path.insert(0, 'tests'); from test_triton_interpret import _patch_interpreter_for_numpy; "
        "_patch_interpreter_for_numpy(); from tests.test_fp8_gemv import check_16bit_weight_gemv; "
        "check_16bit_weight_gemv('cpu', torch.float16, shapes=((80, 200),))")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_gemv_of_a_16bit_weight_is_f_linear():
    pytest.importorskip("triton")
    for dtype in (torch.bfloat16, torch.float16):
        check_16bit_weight_gemv("cuda", dtype, rows_list=(1, 3, 16))


def test_interpreted_gemv_summing_k_each_step_matches_twin():
    """The small accumulator at one row and at three (a padded fourth), uneven and even shapes."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU test runs the compiled kernel")
    run_interpreted(
        "import sys, torch; sys.path.insert(0, 'tests'); from test_triton_interpret import _patch_interpreter_for_numpy; "
        "_patch_interpreter_for_numpy(); from tests.test_fp8_gemv import check_fp8_gemv, sum_k_each_step_configs; "
        "check_fp8_gemv('cpu', (torch.float16,), rows_list=(1, 3), configs=sum_k_each_step_configs()); "
        "check_fp8_gemv('cpu', (torch.float32,), rows_list=(1,), shapes=((80, 200),), "
        "configs=sum_k_each_step_configs()[2:4])")


def test_interpreted_tma_gemv_matches_twin():
    """One row through the TMA (K of 208: the last tile and N's last tile read past the weight, as zeros), and the
    rows and weights it cannot take (3 rows; K of 200, rows not 16-byte aligned) through the multiply-adds."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU test runs the compiled kernel")
    run_interpreted(
        "import sys, torch; sys.path.insert(0, 'tests'); from test_triton_interpret import _patch_interpreter_for_numpy; "
        "_patch_interpreter_for_numpy(); from tests.test_fp8_gemv import check_fp8_gemv, check_16bit_weight_gemv, "
        "tma_configs; shapes = ((80, 208), (64, 256), (80, 200)); "
        "check_fp8_gemv('cpu', (torch.float16, torch.bfloat16), rows_list=(1, 3), shapes=shapes, configs=tma_configs()); "
        "check_16bit_weight_gemv('cpu', torch.float16, rows_list=(1,), shapes=shapes[:2], configs=tma_configs())")


def test_tma_runs_one_aligned_row_and_its_configs_are_checked(monkeypatch):
    pytest.importorskip("triton.tools.tensor_descriptor")
    from mempath.kernels import fp8_gemv_triton as gemv
    aligned, unaligned = torch.zeros(80, 208, dtype=torch.float8_e4m3fn), torch.zeros(80, 200, dtype=torch.float8_e4m3fn)
    assert gemv.tma_fits(aligned, 1) and not gemv.tma_fits(aligned, 3) and not gemv.tma_fits(unaligned, 1)
    assert not gemv.tma_fits(aligned[:, 1:], 1)  # the rows start one byte in
    monkeypatch.setattr(gemv, "TensorDescriptor", None)  # a triton without host-side descriptors
    assert not gemv.tma_fits(aligned, 1)
    config = gemv.GemvConfig(block_n=16, block_k=256, split_k=2, num_stages=4, tma=True)
    assert gemv.without_tma(config) == gemv.GemvConfig(block_n=16, block_k=256, split_k=2, num_stages=4,
                                                       sum_k_each_step=True)
    assert config.describe() == "gemv tma n16 k256 split2 atomic w4 s4"
    for bad in (dict(use_dot=True), dict(sum_k_each_step=True), dict(prefetch=True), dict(reduce="two_pass"),
                dict(block_k=512)):
        with pytest.raises(ValueError, match="tma is its own one-row product"):
            gemv.GemvConfig(**{**dict(block_n=16, block_k=256, tma=True), **bad})


def test_fp8_gemv_torch_quantizes_x_in_groups_along_k():
    """x_group: each group of a row its own quantize_rows scale (the last group short), so a row whose
    groups differ by 2^16 in size keeps the small groups' precision, which one scale a row loses to
    e4m3's subnormals."""
    from mempath.model.quant import quantize_groups
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 300, generator=gen)
    x[:, 128:256] *= 2.0 ** 16
    grouped = quantize_groups(x, 128)
    for start in (0, 128, 256):
        q, s = quantize_rows(x[:, start:start + 128])
        assert torch.equal(grouped[:, start:start + 128], q.float() * s)
    per_row = quant.dequantize_rows(*quantize_rows(x))
    assert (grouped[:, :128] - x[:, :128]).abs().max() < 0.5 * (per_row[:, :128] - x[:, :128]).abs().max()
    w = torch.randn(48, 300, generator=gen) * 0.05
    wq, scale = quantize_rows(w)
    expected = grouped.double() @ (wq.double() * scale.double()).t()
    torch.testing.assert_close(fp8_gemv_torch(x, wq, scale, None, x_group=128).double(), expected,
                               rtol=1e-4, atol=1e-2)  # float32 sums of terms up to 2^16


def test_interpreted_gemv_quantizing_x_matches_twin():
    """The fp8 tensor-core product under the interpreter: every reduce, x in 16-bit dtypes (float32 x
    takes the multiply-adds), one row and three, uneven and even shapes."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU test runs the compiled kernel")
    run_interpreted(
        "import sys, torch; sys.path.insert(0, 'tests'); from test_triton_interpret import _patch_interpreter_for_numpy; "
        "_patch_interpreter_for_numpy(); from tests.test_fp8_gemv import check_fp8_gemv, quantize_x_configs; "
        "check_fp8_gemv('cpu', (torch.float16, torch.float32), rows_list=(1, 3), configs=quantize_x_configs(), "
        "x_on_grid=True); "
        "check_fp8_gemv('cpu', (torch.bfloat16,), rows_list=(16,), shapes=((64, 256),), "
        "configs=quantize_x_configs()[1:], x_on_grid=True)")


def test_quantize_x_configs_are_tensor_core_tiles_one_scale_wide():
    from mempath.kernels.fp8_gemv_triton import GemvConfig
    assert GemvConfig(block_n=64, block_k=128, split_k=4, use_dot=True, quantize_x=True).describe() == \
        "gemv dot-fp8 n64 k128 split4 atomic w4 s3"
    for bad in (dict(use_dot=False), dict(block_k=256), dict(prefetch=True)):
        with pytest.raises(ValueError, match="quantize_x is a tensor-core product with one activation scale a "
                                             "block of K: set use_dot true, block_k 128"):
            GemvConfig(**{"block_k": 128, "use_dot": True, "quantize_x": True, **bad})


# ---------------------------------------------------------------- the configuration table


def test_shipped_table_covers_the_8b_projections_in_every_bucket():
    from mempath.kernels.fp8_gemv_triton import DEFAULT_TABLE, load_table
    table = load_table(DEFAULT_TABLE)
    for shape in ("6144x4096", "4096x4096", "28672x4096", "4096x14336"):  # qkv, o, gate_up, down
        assert sorted(table[shape], key=int) == ["1", "2", "4", "8", "16"]


def test_table_lookup_by_bucket_then_the_heuristic(tmp_path):
    from mempath.kernels.fp8_gemv_triton import Fp8Gemv, GemvConfig, heuristic_config, load_table, table_json
    mine = {"64x256": {"4": GemvConfig(block_n=16, split_k=2), "8": GemvConfig(kernel="scaled_mm")}}
    path = tmp_path / "t.json"
    path.write_text(table_json(mine, device="test"))
    assert load_table(path) == mine
    gemv = Fp8Gemv(64, torch.device("cpu"), load_table(path))
    assert gemv.config(64, 256, 3) == mine["64x256"]["4"]  # 3 rows: bucket 4
    assert gemv.config(64, 256, 5).kernel == "scaled_mm"
    assert gemv.config(64, 512, 1) == heuristic_config(64, 512, 1, gemv.num_sms)  # not listed
    assert gemv.chosen == {"64x256 rows<=4": "gemv fma n16 k256 split2 atomic w4 s3", "64x256 rows<=8": "_scaled_mm",
                           "64x512 rows<=1": gemv.config(64, 512, 1).describe()}


def test_summing_k_each_step_round_trips_and_older_tables_read_it_as_off(tmp_path):
    from mempath.kernels.fp8_gemv_triton import GemvConfig, load_table, table_json
    mine = {"64x256": {"1": GemvConfig(block_n=128, block_k=256, prefetch=True, sum_k_each_step=True),
                       "2": GemvConfig(block_n=64, split_k=4)}}
    path = tmp_path / "t.json"
    path.write_text(table_json(mine, device="test"))
    assert load_table(path) == mine
    assert json.loads(path.read_text())["configs"]["64x256"]["1"]["sum_k_each_step"] is True
    assert mine["64x256"]["1"].describe() == "gemv fma n128 k256 split1 w4 s3 prefetch sum-k-each-step"
    assert mine["64x256"]["2"].describe() == "gemv fma n64 k256 split4 atomic w4 s3"
    path.write_text(json.dumps({"configs": {"64x256": {"1": {"block_n": 64, "block_k": 128, "prefetch": True}}}}))
    assert load_table(path)["64x256"]["1"].sum_k_each_step is False


def test_bad_tables_are_refused_in_one_line(tmp_path):
    from mempath.kernels.fp8_gemv_triton import load_table
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"configs": {"64x256": {"1": {"block_n": 64, "blockk": 128}}}}))
    with pytest.raises(ValueError, match=r"64x256 bucket 1 has unknown fields \['blockk'\]: the fields are"):
        load_table(path)
    path.write_text(json.dumps({"configs": {"64x256": {"1": {"block_n": 48}}}}))
    with pytest.raises(ValueError, match=r"block_n \(>= 16\) and block_k \(>= 16\) must be powers of two"):
        load_table(path)
    path.write_text(json.dumps({"configs": {"64x256": {"1": {"use_dot": True, "sum_k_each_step": True}}}}))
    with pytest.raises(ValueError, match=r"64x256 bucket 1: fp8 GEMV config: sum_k_each_step is for the multiply-add "
                                         r"product: set use_dot or sum_k_each_step false$"):
        load_table(path)
    path.write_text("{")
    with pytest.raises(ValueError, match=r"not JSON .*: rewrite it with benchmarks/bench_fp8_gemv.py or delete it$"):
        load_table(path)


def test_heuristic_splits_k_until_the_sms_are_covered():
    from mempath.kernels.fp8_gemv_triton import heuristic_config
    assert heuristic_config(4096, 4096, 1, 132).split_k == 8  # 64 tiles x 8 = 512 programs
    assert heuristic_config(28672, 4096, 1, 132).split_k == 1  # 448 tiles already
    assert heuristic_config(4096, 14336, 8, 132).split_k == 8
    at_16 = heuristic_config(4096, 14336, 16, 132)  # the fp8 tensor cores: 32 tiles of 128 outputs x 16
    assert at_16.quantize_x and at_16.block_n == 128 and at_16.split_k == 16
    assert not heuristic_config(4096, 14336, 8, 132).quantize_x
    assert heuristic_config(64, 256, 1, 132).split_k == 1  # too short to split


def test_splits_fit_the_workspace():
    """Each split keeps its own rows x N partials, both ways (the atomic way added them into one M x N sum until
    2026-12-06, in the order the splits arrived)."""
    from mempath.kernels.fp8_gemv_triton import GemvConfig, GemvWorkspace, fitted_split
    workspace = GemvWorkspace(4096, torch.device("cpu"))  # 32 rows of 4096 partial sums
    for reduce in ("two_pass", "atomic"):
        config = GemvConfig(split_k=16, reduce=reduce, block_k=128)
        assert fitted_split(config, 16, 4096, 4096, workspace) == 2
        assert fitted_split(config, 1, 4096, 4096, workspace) == 16
        assert fitted_split(config, 1, 4096, 256, workspace) == 2  # one step of K each


def test_the_sweep_tries_summing_k_each_step_on_the_multiply_add_tiles():
    """Up to 4 rows: each such tile with prefetching on and off, some wider than the tiles without it at
    4 warps; none where only the tensor cores are swept; at most twice the grid of the 8B's sweep."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_fp8_gemv import candidates
    llama_8b = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
    sweep = [c for n, k in llama_8b for rows in (1, 2, 4, 8, 16) for c in candidates(n, k, rows, 132, quick=False)]
    assert len(sweep) <= 2 * sum(not c.sum_k_each_step for c in sweep)
    for rows in (1, 4):
        for n, k in llama_8b:
            grid = candidates(n, k, rows, 132, quick=False)
            summed = [c for c in grid if c.sum_k_each_step]
            assert summed and not any(c.use_dot for c in summed)
            tiles = {(c.block_n, c.block_k, c.num_warps, c.num_stages, c.split_k, c.reduce): set() for c in summed}
            for c in summed:
                tiles[c.block_n, c.block_k, c.num_warps, c.num_stages, c.split_k, c.reduce].add(c.prefetch)
            assert all(prefetch == {False, True} for prefetch in tiles.values())
            widest_without = max(c.block_n * c.block_k for c in grid if not c.use_dot and c.kernel == "gemv"
                                 and not c.sum_k_each_step and c.num_warps == 4)
            assert any(c.block_n * c.block_k > widest_without and c.num_warps == 4 for c in summed)
    assert not any(c.sum_k_each_step for c in candidates(4096, 4096, 8, 132, quick=False))
    assert any(c.sum_k_each_step for c in candidates(64, 96, 1, 4, quick=True))  # what --smoke runs



def test_the_rotating_timer_reads_a_copy_of_the_weight_in_turn(monkeypatch):
    """--timer rotate (and chain): the layer's copies hold at least ROTATE_BYTES, and run(copy=i) multiplies by
    copy i."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_fp8_gemv as bench
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "DTYPE", torch.float32)
    monkeypatch.setattr(bench, "TIMER", "rotate")
    monkeypatch.setattr(bench, "ROTATE_BYTES", 3 * (64 * 128 + 4 * 64) + 1)
    layer = bench.Layer(64, 128, bench.GemvWorkspace(64, torch.device("cpu")))
    assert len(layer.copies) == 4 and len({w.data_ptr() for w, _ in layer.copies}) == 4
    layer.copies[2][1].mul_(2.0)  # copy 2's scales doubled: its product doubles
    x = torch.randn(1, 128)
    config = bench.GemvConfig(kernel="scaled_mm")
    runs = {}
    monkeypatch.setattr(bench, "fp8_linear_scaled_mm", lambda x, w, scale, bias, quantize: fp8_gemv_torch(
        x, w, scale, bias))
    for copy in (0, 2, 6):
        runs[copy] = layer.run(x, config, copy)
    torch.testing.assert_close(runs[2], 2 * runs[0])
    torch.testing.assert_close(runs[6], runs[2])  # 6 % 4 copies
    monkeypatch.setattr(bench, "TIMER", "chain")
    assert len(bench.Layer(64, 128, bench.GemvWorkspace(64, torch.device("cpu"))).copies) == 4
    monkeypatch.setattr(bench, "TIMER", "graph")
    assert len(bench.Layer(64, 128, bench.GemvWorkspace(64, torch.device("cpu"))).copies) == 1


def test_the_tma_gemv_bench_matches_the_twin_in_the_interpreter():
    """benchmarks/bench_gemv_tma.py --smoke: its kernel (fp8 and bf16 weights, split and not) against the twins."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the bench's kernel runs compiled there (test_gpu_tma_gemv_matches_twin)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "benchmarks/bench_gemv_tma.py", "--smoke"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fp8 toy: 2 candidates match the twin" in proc.stdout and "bf16 toy: 2 candidates match" in proc.stdout

# ---------------------------------------------------------------- dispatch and memory


def test_decode_batches_take_the_gemv_and_larger_ones_scaled_mm(monkeypatch):
    """The GEMV up to 16 rows (unless the table sends a bucket to _scaled_mm), above it _scaled_mm, or the
    fp8 GEMM where its table lists the bucket; float32 activations _scaled_mm."""
    from mempath.kernels import fp8_gemm_triton
    from mempath.kernels.fp8_gemm_triton import Fp8Gemm, GemmConfig
    from mempath.kernels.fp8_gemv_triton import Fp8Gemv, GemvConfig
    ran = []
    monkeypatch.setattr(quant, "scaled_mm_quantized", lambda *a, **k: ran.append("scaled_mm"))
    monkeypatch.setattr(fp8_gemm_triton, "triton_fp8_gemm", lambda *a, **k: ran.append("gemm"))
    gemv = Fp8Gemv(64, torch.device("cpu"), {"64x32": {"2": GemvConfig(kernel="scaled_mm")}})
    monkeypatch.setattr(Fp8Gemv, "__call__", lambda self, *a: ran.append("gemv"))
    w, scale = quantize_rows(torch.randn(64, 32))
    for rows in (1, 2, 3, 16, 17):
        quant.fp8_linear_cuda(torch.randn(rows, 32, dtype=torch.bfloat16), w, scale, None, gemv)
    quant.fp8_linear_cuda(torch.randn(1, 32), w, scale, None, gemv)  # float32
    assert ran == ["gemv", "scaled_mm", "gemv", "gemv", "scaled_mm", "scaled_mm"]
    ran.clear()
    gemm = Fp8Gemm(table={"64x32": {"32": GemmConfig(block_m=32, swap_ab=True)}})
    for rows in (17, 33):
        quant.fp8_linear_cuda(torch.randn(rows, 32, dtype=torch.bfloat16), w, scale, None, gemv, gemm=gemm)
    assert ran == ["gemm", "scaled_mm"]


def test_a_bucket_handed_to_the_fp8_gemm_keeps_its_gemv_tile_where_the_gemm_lists_none(monkeypatch):
    """kernel "gemm": the fp8 GEMM where its table lists the bucket; the GEMV with the entry's tile where it
    lists none or no fp8 GEMM runs (before Hopper: gemm None), never _scaled_mm; and the kernel before the
    layer quantizes its input only for the rows that reach the GEMM."""
    from mempath.kernels import fp8_gemm_triton
    from mempath.kernels.fp8_gemm_triton import Fp8Gemm, GemmConfig
    from mempath.kernels.fp8_gemv_triton import Fp8Gemv, GemvConfig
    ran = []
    monkeypatch.setattr(quant, "scaled_mm_quantized", lambda *a, **k: ran.append("scaled_mm"))
    monkeypatch.setattr(fp8_gemm_triton, "triton_fp8_gemm", lambda *a, **k: ran.append("gemm"))
    monkeypatch.setattr(Fp8Gemv, "__call__", lambda self, x, w, s, b, config: ran.append(config))
    tile = GemvConfig(block_n=32, block_k=128, split_k=2, use_dot=True, kernel="gemm")
    table = {"64x32": {"4": tile, "8": tile}}
    gemm = Fp8Gemm(table={"64x32": {"4": GemmConfig(block_m=16, swap_ab=True)}})
    gemv = Fp8Gemv(64, torch.device("cpu"), quant.gemv_table_for(table, gemm))
    w, scale = quantize_rows(torch.randn(64, 32))
    as_gemv = dataclasses.replace(tile, kernel="gemv")
    for rows, expected in ((3, "gemm"), (4, "gemm"), (7, as_gemv)):
        ran.clear()
        quant.fp8_linear_cuda(torch.randn(rows, 32, dtype=torch.bfloat16), w, scale, None, gemv, gemm=gemm)
        assert ran == [expected], rows
        assert quant._quantized_rows(gemv, w, torch.bfloat16, rows) == (expected == "gemm")
    assert gemv.chosen["64x32 rows<=8"] == as_gemv.describe() and "64x32 rows<=8" not in gemm.chosen
    ran.clear()
    before_hopper = Fp8Gemv(64, torch.device("cpu"), quant.gemv_table_for(table, None))
    quant.fp8_linear_cuda(torch.randn(3, 32, dtype=torch.bfloat16), w, scale, None, before_hopper, gemm=None)
    assert ran == [as_gemv] and not quant._quantized_rows(before_hopper, w, torch.bfloat16, 3)


def test_dense_layers_take_the_gemv_only_where_the_table_lists_their_bucket(monkeypatch):
    """A 16-bit layer: the GEMV at a row bucket the dense table lists, F.linear at the others, above
    16 rows, and where the table splits K wider than the workspace (the LM head's vocabulary)."""
    from mempath.kernels.fp8_gemv_triton import Fp8Gemv, GemvConfig
    ran = []

    def fake_gemv(self, x, weight, weight_scale, bias, config):
        assert weight_scale is None
        ran.append(f"gemv split {config.split_k}")
        return torch.nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(Fp8Gemv, "__call__", fake_gemv)
    table = {"64x32": {"1": GemvConfig(block_n=16, block_k=32), "4": GemvConfig(split_k=2)},
             "96x32": {"1": GemvConfig(split_k=4)}}
    gemv = Fp8Gemv(64, torch.device("cpu"), table)
    w, w_wide, bias = torch.randn(64, 32), torch.randn(96, 32), torch.randn(64)

    def route(x, weight, bias=None):
        before = len(ran)
        out = quant.dense_linear_cuda(x, weight, bias, gemv)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias))
        return ran[-1] if len(ran) > before else "F.linear"

    assert [route(torch.randn(rows, 32), w, bias) for rows in (1, 2, 3, 17)] == [
        "gemv split 1", "F.linear", "gemv split 2", "F.linear"]
    assert route(torch.randn(1, 1, 32), w) == "gemv split 1"  # [batch, seq, hidden] keeps its shape
    assert route(torch.randn(1, 32), w_wide) == "F.linear"
    assert gemv.chosen["96x32 rows<=1"] == gemv.chosen["64x32 rows<=2"] == "cuBLAS (F.linear)"
    assert gemv.chosen["64x32 rows<=4"] == table["64x32"]["4"].describe()


def test_a_dense_tma_entry_that_cannot_run_is_cublas_not_its_fallback_tiles(monkeypatch):
    """The dense table's TMA tiles were measured against cuBLAS; where the TMA cannot run (before Hopper, a
    triton without descriptors) the layer takes F.linear, and ``chosen`` says why."""
    pytest.importorskip("triton")
    from mempath.kernels import fp8_gemv_triton as gemv_module
    from mempath.kernels.fp8_gemv_triton import Fp8Gemv, GemvConfig
    ran = []
    monkeypatch.setattr(Fp8Gemv, "__call__", lambda self, x, w, s, b, config: ran.append(config) or x @ w.t())
    table = {"64x32": {"1": GemvConfig(block_n=16, block_k=32, tma=True)}}
    gemv = Fp8Gemv(64, torch.device("cpu"), table)
    w, x = torch.randn(64, 32), torch.randn(1, 32)
    if gemv_module.TensorDescriptor is not None:
        quant.dense_linear_cuda(x, w, None, gemv)
        assert ran == [table["64x32"]["1"]]  # the TMA can run here (Triton's interpreter on the CPU)
    monkeypatch.setattr(gemv_module, "TensorDescriptor", None)
    torch.testing.assert_close(quant.dense_linear_cuda(x, w, None, gemv), torch.nn.functional.linear(x, w))
    assert len(ran) <= 1 and gemv.chosen["64x32 rows<=1"] == "cuBLAS (F.linear; the table's tma cannot run here)"


def test_the_shipped_dense_table_loads_and_refuses_fp8_choices(tmp_path, monkeypatch):
    from mempath.kernels.fp8_gemv_triton import GemvConfig, load_dense_table, table_json
    shipped = load_dense_table()
    assert shipped and all(c.kernel == "gemv" and not c.quantize_x for b in shipped.values() for c in b.values())
    for bad in (GemvConfig(kernel="scaled_mm"), GemvConfig(block_k=128, use_dot=True, quantize_x=True)):
        path = tmp_path / "dense.json"
        path.write_text(table_json({"64x32": {"1": bad}}, device="test"))
        monkeypatch.setenv("MEMPATH_DENSE_GEMV_CONFIGS", str(path))
        with pytest.raises(ValueError, match=r"dense.json: 64x32 bucket 1: a 16-bit weight's table lists only"):
            load_dense_table()


@pytest.mark.parametrize("loader, env", [("load_table", "MEMPATH_FP8_GEMV_CONFIGS"),
                                         ("load_dense_table", "MEMPATH_DENSE_GEMV_CONFIGS")])
def test_a_table_named_but_missing_is_one_line_not_the_shipped_one(tmp_path, monkeypatch, loader, env):
    from mempath.kernels import fp8_gemv_triton
    monkeypatch.setenv(env, str(tmp_path / "typo.json"))
    with pytest.raises(ValueError, match=rf"^{env} names .*typo.json, which does not exist: point it at a table "
                                         rf"\(benchmarks/bench_\w+_gemv.py --out FILE writes one\) or unset it$"):
        getattr(fp8_gemv_triton, loader)()
    with pytest.raises(ValueError, match=r"^the table .*other.json, which does not exist"):
        getattr(fp8_gemv_triton, loader)(tmp_path / "other.json")


def test_workspace_bytes_are_the_plans():
    from mempath.kernels.fp8_gemv_triton import GemvWorkspace
    assert GemvWorkspace(28672, torch.device("cpu")).nbytes() == fp8_gemv_workspace_bytes(28672)
    shape = read_shape(json.loads((ROOT / "mempath" / "assets" / "mempath-tiny" / "config.json").read_text()))
    assert gemv_workspace_bytes(shape) == 0  # not quantized
    shape.quantization = "fp8"
    widest = max(shape.num_heads * shape.head_dim + 2 * shape.num_kv_heads * shape.head_dim,
                 2 * shape.intermediate_size)
    assert (gemv_workspace_bytes(shape, fused_kernels=True) == fp8_gemv_workspace_bytes(widest)
            == 4 * 32 * widest + 4 * -(-widest // 16))
    assert gemv_workspace_bytes(shape, fused_kernels=False) == 0  # the PyTorch path has no GEMV
    shape.quantization = None  # a 16-bit model has the dense GEMV's workspace where the Triton kernels run
    assert gemv_workspace_bytes(shape, 2, fused_kernels=True) == fp8_gemv_workspace_bytes(widest)
    assert gemv_workspace_bytes(shape, 2, fused_kernels=False) == gemv_workspace_bytes(shape, 4, fused_kernels=True) == 0


def test_cpu_models_have_no_gemv_workspace(tmp_path):
    from tests.conftest import make_model
    from mempath import LLM
    make_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), quantization="fp8", device="cpu", show_progress=False)  # not CUDA where there is one
    assert llm.engine.model.fp8_gemv is None and quant.fp8_gemv_bytes(llm.engine.model) == 0


# ---------------------------------------------------------------- CUDA


needs_fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                   reason="needs a CUDA GPU of compute capability 8.9+")


@needs_fp8_gpu
def test_gpu_gemv_matches_twin():
    pytest.importorskip("triton")
    check_fp8_gemv("cuda", (torch.bfloat16, torch.float16, torch.float32), rows_list=(1, 2, 3, 8, 16))


@needs_fp8_gpu
def test_gpu_split_k_sums_in_split_order_every_call():
    """The bug this pins (2026-12-06): the atomic way added each split into one float32 sum as it arrived, so a
    projection's bits, and at a near-tie a greedy token, changed from run to run."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    check_split_sums_in_order("cuda", calls=50)


@needs_fp8_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_tma_gemv_matches_twin(dtype):
    """The TMA tiles compiled: the test's configurations, the sweep's tiles (each depth on half of them) on a
    4096-wide weight, and 16-bit weights (the dense GEMV's use of the same kernel) with the dense table's tiles."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    from mempath.kernels.fp8_gemv_triton import GemvConfig
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA needs Hopper")
    shapes = ((80, 208), (64, 256), (1000, 4096))
    sweep_tiles = [GemvConfig(block_n=bn, block_k=bk, split_k=split, num_stages=3 + 3 * ((i + j) % 2), tma=True)
                   for i, (bn, bk) in enumerate(((16, 256), (32, 256), (64, 128))) for j, split in enumerate((1, 4))]
    dense_tiles = [GemvConfig(block_n=32, block_k=128, split_k=split, tma=True) for split in (1, 8)]
    check_fp8_gemv("cuda", (dtype,), rows_list=(1, 3), shapes=shapes, configs=tma_configs() + sweep_tiles)
    check_16bit_weight_gemv("cuda", dtype, rows_list=(1,), shapes=shapes,
                            configs=tma_configs() + sweep_tiles[::2] + dense_tiles)


@needs_fp8_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_gemv_summing_k_each_step_matches_twin(dtype):
    """The small accumulator compiled, on the test's shapes and at the sweep's tile sizes."""
    pytest.importorskip("triton")
    from mempath.kernels.fp8_gemv_triton import GemvConfig
    sweep_tiles = [GemvConfig(block_n=bn, block_k=bk, split_k=split, num_warps=4, num_stages=2, reduce=reduce,
                              prefetch=prefetch, sum_k_each_step=True)
                   for bn, bk in ((128, 128), (64, 256), (32, 1024)) for split, reduce in ((1, "atomic"),
                   (4, "atomic"), (4, "two_pass")) for prefetch in (False, True)]
    check_fp8_gemv("cuda", (dtype,), rows_list=(1, 2, 3, 4), configs=sum_k_each_step_configs())
    if dtype != torch.float32:  # float32 output: 4096 terms summed in another order differ by more than its 2 ulp
        check_fp8_gemv("cuda", (dtype,), rows_list=(1, 3), shapes=((1000, 4096), (1024, 4096)), configs=sweep_tiles)


@needs_fp8_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_gemv_quantizing_x_matches_twin(dtype):
    """The fp8 tensor-core product compiled, off the grid (the compiled conversion rounds as PyTorch
    does), on the test's shapes and at the sweep's tile sizes and depths and the heuristic's; float32 x
    takes the multiply-adds."""
    pytest.importorskip("triton")
    from mempath.kernels.fp8_gemv_triton import GemvConfig, heuristic_config
    sweep_tiles = [GemvConfig(block_n=bn, block_k=128, split_k=split, num_warps=warps, num_stages=stages,
                              reduce=reduce, use_dot=True, quantize_x=True)
                   for bn, warps, stages in ((64, 4, 4), (128, 4, 6), (256, 8, 3))
                   for split, reduce in ((1, "atomic"), (4, "atomic"), (4, "two_pass"))]
    sweep_tiles.append(heuristic_config(1024, 4096, 16, torch.cuda.get_device_properties(0).multi_processor_count))
    assert sweep_tiles[-1].quantize_x  # what a shape the table does not list gets at 9-16 rows
    check_fp8_gemv("cuda", (dtype,), rows_list=(1, 2, 3, 16), configs=quantize_x_configs())
    if dtype != torch.float32:  # float32 output: 4096 terms summed in another order differ by more than its 2 ulp
        check_fp8_gemv("cuda", (dtype,), rows_list=(1, 3, 16), shapes=((1000, 4096), (1024, 4096)),
                       configs=sweep_tiles)


@needs_fp8_gpu
@pytest.mark.parametrize("reduce, quantize_x", [("atomic", False), ("two_pass", False), ("atomic", True)])
def test_gpu_gemv_is_captured_by_a_cuda_graph(reduce, quantize_x):
    from mempath.kernels.fp8_gemv_triton import QUANT_X_GROUP, GemvConfig, GemvWorkspace, triton_fp8_gemv
    gen = torch.Generator(device="cuda").manual_seed(0)
    wq, scale = quantize_rows(torch.randn(1024, 4096, device="cuda", generator=gen) * 0.02)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    workspace = GemvWorkspace(1024, torch.device("cuda"))
    config = GemvConfig(block_n=64, block_k=128, split_k=8, use_dot=True, reduce=reduce, quantize_x=quantize_x)
    x_group = QUANT_X_GROUP if quantize_x else None
    eager = triton_fp8_gemv(x, wq, scale, None, workspace, config)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture wants
        triton_fp8_gemv(x, wq, scale, None, workspace, config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_fp8_gemv(x, wq, scale, None, workspace, config)
    for _ in range(3):
        x.copy_(torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16, generator=gen))
        graph.replay()
        torch.testing.assert_close(out.float(), fp8_gemv_torch(x, wq, scale, None, x_group).float(), rtol=1e-2,
                                   atol=1e-2)
    assert not workspace.partials.any() and not workspace.counters.any()
    assert eager.shape == out.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_runs_the_dense_gemv_and_counts_its_workspace(tmp_path, monkeypatch):
    """A bf16 model on CUDA: decode batches of a shape the dense table lists take the GEMV (one row
    and a split one), the others cuBLAS; the workspace is the plan's and in the ledger."""
    pytest.importorskip("triton")
    from tests.conftest import make_model
    from mempath import LLM, SamplingParams
    from mempath.kernels.fp8_gemv_triton import GemvConfig, table_json
    make_model(tmp_path / "model", "llama", dtype=torch.bfloat16)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    h, heads = config["hidden_size"], config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    qkv = f"{(heads + 2 * config['num_key_value_heads']) * d}x{h}"
    table = {qkv: {"1": GemvConfig(block_n=16, block_k=32)}, f"{h}x{heads * d}": {"1": GemvConfig(split_k=2)}}
    (tmp_path / "dense.json").write_text(table_json(table, device="test", made_by="test", shapes={}))
    monkeypatch.setenv("MEMPATH_DENSE_GEMV_CONFIGS", str(tmp_path / "dense.json"))
    llm = LLM(str(tmp_path / "model"), show_progress=False, gpu_memory_utilization=0.3, max_num_seqs=4)
    model = llm.engine.model
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 8
    chosen = model.fp8_gemv.chosen
    assert chosen[f"{qkv} rows<=1"].startswith("gemv") and chosen[f"{h}x{heads * d} rows<=1"].startswith("gemv")
    assert chosen[f"{2 * config['intermediate_size']}x{h} rows<=1"] == "cuBLAS (F.linear)"
    shape = read_shape(config)
    assert quant.fp8_gemv_bytes(model) == gemv_workspace_bytes(shape, 2, fused_kernels=True) > 0
    assert llm.engine.ledger.get("step_buffers") >= quant.fp8_gemv_bytes(model)
    assert not model.fp8_gemv.workspace.partials.any() and not model.fp8_gemv.workspace.counters.any()


@needs_fp8_gpu
def test_gpu_engine_runs_the_gemv_and_counts_its_workspace(tmp_path):
    from tests.conftest import make_model
    from mempath import LLM, SamplingParams
    make_model(tmp_path, "llama", dtype=torch.bfloat16)
    llm = LLM(str(tmp_path), quantization="fp8", show_progress=False, gpu_memory_utilization=0.3, max_num_seqs=4)
    model = llm.engine.model
    assert model.fp8_gemv is not None
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 8
    assert any(v.startswith("gemv") for v in model.fp8_gemv.chosen.values()), model.fp8_gemv.chosen
    shape = read_shape(json.loads((tmp_path / "config.json").read_text()))
    shape.quantization = "fp8"
    assert quant.fp8_gemv_bytes(model) == gemv_workspace_bytes(shape, fused_kernels=True)
    assert llm.engine.ledger.get("step_buffers") >= quant.fp8_gemv_bytes(model)
