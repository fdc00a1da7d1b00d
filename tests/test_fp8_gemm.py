"""The fp8 GEMM (mempath.kernels.fp8_gemm_triton) against its twin, fp8_linear_quantized_torch: in Triton's
interpreter on the CPU, compiled on CUDA (with CUDA-graph capture), and its table's checks."""
import json

import pytest
import torch

from mempath.kernels.fp8_gemm_triton import Fp8Gemm, GemmConfig, load_table, row_bucket
from mempath.model.quant import fp8_linear_quantized_torch, quantize_rows
from tests.test_fp8_gemv import run_interpreted

needs_fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                   reason="needs a CUDA GPU with fp8 tensor cores")


def gemm_configs() -> list[GemmConfig]:
    """Both tile orders, tiles that cover N and the rows unevenly, K deeper than one step."""
    return [GemmConfig(block_m=64, block_n=32, block_k=32, num_stages=2),
            GemmConfig(block_m=16, block_n=32, block_k=64, swap_ab=True, num_stages=3),
            GemmConfig(block_m=32, block_n=64, block_k=32, group_m=2, swap_ab=True)]


# On the GPU the fp8 tensor cores sum a step of K in less than float32 (the kernel adds each step's sums
# to a float32 accumulator, as _scaled_mm does): the normwise difference from the float32 twin, at most.
GPU_NORMWISE = {torch.float32: 3e-4, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def check_fp8_gemm(device: str, dtypes, rows_list=(1, 5, 70), shapes=((48, 96), (80, 160)), configs=None) -> None:
    """Every configuration, dtype, row count and shape against the twin on the same fp8 operands and
    scales. In the interpreter (exact products, float32 sums in another order) within two units in the
    last place of the output dtype (float32: a relative 1e-5); on the GPU within GPU_NORMWISE."""
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        wq, w_scale = quantize_rows(torch.randn(n, k, generator=gen) * 0.05)
        wq, w_scale = wq.to(device), w_scale.to(device)
        for rows in rows_list:
            xq, x_scale = quantize_rows(torch.randn(rows, k, generator=gen) * 3)
            xq, x_scale = xq.to(device), x_scale.to(device)
            for dtype in dtypes:
                bias = torch.randn(n, generator=gen).to(dtype).to(device)
                for i, config in enumerate(configs or gemm_configs()):
                    from mempath.kernels.fp8_gemm_triton import triton_fp8_gemm
                    from mempath.model.quant import Fp8Activation
                    b = bias if (i + rows) % 2 else None
                    out = triton_fp8_gemm(xq, x_scale, wq, w_scale, b, dtype, config)
                    ref = fp8_linear_quantized_torch(Fp8Activation(xq, x_scale, dtype), wq, w_scale, b)
                    assert out.dtype == dtype and out.shape == (rows, n)
                    where = f"{dtype} {rows}x{n}x{k} {config.describe()}"
                    if device == "cpu":
                        tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
                        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol,
                                                   msg=lambda m: f"{where}: {m}")
                    else:
                        exact = fp8_linear_quantized_torch(Fp8Activation(xq, x_scale, torch.float32), wq, w_scale,
                                                           b.float() if b is not None else None)
                        error = ((out.float() - exact).norm() / exact.norm()).item()
                        assert error <= GPU_NORMWISE[dtype], f"{where}: normwise difference {error:.3g}"


def test_interpreted_gemm_matches_twin():
    """The CPU's check of the kernel in float32 and float16 outputs (the interpreter multiplies the
    fp8 tiles as the device does: exact products, float32 sums)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: test_gpu_gemm_matches_twin checks the compiled kernel")
    run_interpreted(
        "import sys, torch; sys.path.insert(0, 'tests'); from test_triton_interpret import _patch_interpreter_for_numpy; "
        "_patch_interpreter_for_numpy(); from tests.test_fp8_gemm import check_fp8_gemm; "
        "check_fp8_gemm('cpu', (torch.float32, torch.float16))")


@needs_fp8_gpu
def test_gpu_gemm_matches_twin():
    pytest.importorskip("triton")
    check_fp8_gemm("cuda", (torch.bfloat16, torch.float16, torch.float32),
                   configs=gemm_configs() + [GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8),
                                             GemmConfig(block_m=16, block_n=128, block_k=128, swap_ab=True)])


@needs_fp8_gpu
def test_gpu_gemm_is_captured_by_a_cuda_graph():
    """Launched in a captured graph, replayed on new inputs written in place: the twin's result of those."""
    pytest.importorskip("triton")
    from mempath.kernels.fp8_gemm_triton import triton_fp8_gemm
    from mempath.model.quant import Fp8Activation
    gen = torch.Generator().manual_seed(1)
    wq, w_scale = (t.cuda() for t in quantize_rows(torch.randn(256, 512, generator=gen) * 0.05))
    xq, x_scale = (t.cuda() for t in quantize_rows(torch.randn(40, 512, generator=gen)))
    config = GemmConfig(block_m=64, block_n=64, block_k=128, swap_ab=True)
    triton_fp8_gemm(xq, x_scale, wq, w_scale, None, torch.bfloat16, config)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_fp8_gemm(xq, x_scale, wq, w_scale, None, torch.bfloat16, config)
    new_q, new_scale = (t.cuda() for t in quantize_rows(torch.randn(40, 512, generator=gen)))
    xq.copy_(new_q)
    x_scale.copy_(new_scale)
    graph.replay()
    ref = fp8_linear_quantized_torch(Fp8Activation(new_q, new_scale, torch.bfloat16), wq, w_scale, None)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=2 ** -7)


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 48"):
        GemmConfig(block_n=48)
    with pytest.raises(ValueError, match="num_warps must be 4 or 8, got 2"):
        GemmConfig(num_warps=2)
    with pytest.raises(ValueError, match="num_stages must be 1-8, got 9"):
        GemmConfig(num_stages=9)
    assert GemmConfig(swap_ab=True, block_m=16).describe() == "gemm swap m16 n128 k128 w4 s4 g8"


def test_buckets_are_powers_of_two_up_to_the_largest():
    assert [row_bucket(r) for r in (17, 32, 33, 500, 8192, 9000)] == [32, 32, 64, 512, 8192, 8192]


def test_table_lookup_runs_scaled_mm_where_the_table_lists_nothing(tmp_path):
    path = tmp_path / "t.json"
    config = GemmConfig(block_m=16, block_n=64, swap_ab=True)
    path.write_text(json.dumps({"device": "x", "configs": {"4096x4096": {"32": config.__dict__}}}))
    gemm = Fp8Gemm(table=load_table(path))
    assert gemm.config(4096, 4096, 20) == config
    assert gemm.config(4096, 4096, 40) is None and gemm.config(6144, 4096, 20) is None
    assert gemm.chosen == {"4096x4096 rows<=32": config.describe(), "4096x4096 rows<=64": "_scaled_mm",
                           "6144x4096 rows<=32": "_scaled_mm"}


def test_a_bad_table_is_one_line_naming_the_entry(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"configs": {"4096x4096": {"32": {"block_n": 48}}}}))
    with pytest.raises(ValueError, match=r"4096x4096 bucket 32: fp8 GEMM config: block_n must be a power of two"):
        load_table(path)
    path.write_text(json.dumps({"configs": {"4096x4096": {"32": {"tile": 1}}}}))
    with pytest.raises(ValueError, match=r"unknown fields \['tile'\]"):
        load_table(path)
    for bucket in ("48", "16384", "x"):  # no batch would ever look these up
        path.write_text(json.dumps({"configs": {"4096x4096": {bucket: {}}}}))
        with pytest.raises(ValueError, match=rf"4096x4096 bucket '{bucket}' is no batch bucket .* rewrite the table"):
            load_table(path)


def test_the_shipped_table_loads():
    """Whatever the last sweep wrote (or nothing yet): every entry a valid configuration."""
    for shape, buckets in load_table().items():
        n, k = (int(v) for v in shape.split("x"))
        assert n % 16 == 0 and k % 16 == 0
        assert all(isinstance(c, GemmConfig) for c in buckets.values())


def test_buckets_the_gemv_table_hands_over_are_in_the_gemm_table():
    """A bucket the GEMV table hands to the fp8 GEMM has the GEMM's tile: without one it would stay on the GEMV
    on Hopper too, which was 17-20% slower a step at 2-8 rows on the H200 (BENCHMARKS.md)."""
    from mempath.kernels.fp8_gemv_triton import GEMV_MAX_ROWS
    from mempath.kernels.fp8_gemv_triton import load_table as load_gemv_table
    gemm = load_table()
    handed_over = [(shape, bucket) for shape, buckets in load_gemv_table().items()
                   for bucket, config in buckets.items()
                   if config.kernel == "gemm" and int(bucket) <= GEMV_MAX_ROWS]
    assert handed_over, "the shipped GEMV table hands no bucket to the fp8 GEMM"
    missing = [f"{shape} rows<={bucket}" for shape, bucket in handed_over if bucket not in gemm.get(shape, {})]
    assert not missing, f"the fp8 GEMM table lists none of {missing}: they would stay on the GEMV"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the engine takes the fp8 GEMM's table on Hopper only")
def test_gpu_engine_runs_the_tabled_gemm_with_cuda_graphs(tmp_path, monkeypatch):
    """An fp8 engine whose table lists every projection at the buckets of 24 decoding sequences and their
    prefill: the kernel runs there (eager and in graphs) and its first tokens' logprobs are _scaled_mm's
    within bf16's rounding (the sums run in another order, so not bit for bit)."""
    pytest.importorskip("triton")
    from mempath import LLM, SamplingParams
    from mempath.kernels.common import config_table_json
    from mempath.model import quant
    from tests.conftest import make_model, release_cuda
    config = GemmConfig(block_m=32, block_n=64, block_k=64, swap_ab=True, num_stages=3)
    wide = GemmConfig(block_m=64, block_n=64, block_k=64, num_stages=3)
    hf = make_model(tmp_path / "m", "llama", dtype=torch.bfloat16)
    c = hf.config
    head_dim = c.hidden_size // c.num_attention_heads
    shapes = [((c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim, c.hidden_size),
              (c.hidden_size, c.num_attention_heads * head_dim), (2 * c.intermediate_size, c.hidden_size),
              (c.hidden_size, c.intermediate_size)]
    table = {f"{n}x{k}": {"32": config, "256": wide, "512": wide} for n, k in shapes}
    (tmp_path / "t.json").write_text(config_table_json(table, device="test", made_by="test"))
    prompts = [[1 + (7 * p + 3 * i) % 300 for i in range(5 + p)] for p in range(24)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = {}
    for use_gemm in (False, True):
        monkeypatch.setattr(quant, "USE_FP8_GEMM", use_gemm)
        if use_gemm:
            monkeypatch.setenv("MEMPATH_FP8_GEMM_CONFIGS", str(tmp_path / "t.json"))
        for eager in (True, False):
            llm = LLM(str(tmp_path / "m"), quantization="fp8", show_progress=False, gpu_memory_utilization=0.3,
                      enforce_eager=eager, max_num_batched_tokens=512)
            assert {tuple(layer.weight.shape) for layer in quant.fp8_layers(llm.engine.model)} == set(shapes)
            outputs[use_gemm, eager] = llm.generate(prompts, params, use_tqdm=False)
            chosen = llm.engine.model.fp8_gemm.chosen if use_gemm else {}
            del llm
            release_cuda()
            if use_gemm:
                assert any(v.startswith("gemm swap") for v in chosen.values()), chosen
                assert any(v.startswith("gemm m64") for v in chosen.values()), chosen
    compared = 0
    for eager in (True, False):
        for a, b in zip(outputs[False, eager], outputs[True, eager]):
            for i in range(len(a.token_ids)):  # the prefill's token, then decode steps while the tokens agree
                top_a, top_b = max(a.logprobs[i].values()), max(b.logprobs[i].values())
                assert abs(top_a - top_b) < 0.05, (eager, i, top_a, top_b)
                compared += 1
                if a.token_ids[i] != b.token_ids[i]:
                    break
    assert compared >= 2 * 24 * 3  # most of them past the prefill
