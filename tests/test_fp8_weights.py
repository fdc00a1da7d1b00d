"""fp8 weights (--quantization fp8, and fp8 checkpoints): the quantize arithmetic, the fp8 linear,
loading float and pre-quantized checkpoints against transformers on the dequantized weights, the
plan and the ledger's bytes, and the refusals."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mempath import LLM, SamplingParams
from mempath.config import EngineConfig
from mempath.model.loader import load_model
from mempath.model.quant import (FP8_DTYPE, FP8_MAX, MIN_SCALE, check_fp8_device, dequantize_rows, fp8_linear_cuda,
                                 fp8_linear_scaled_mm, fp8_linear_torch, quantize_rows)
from mempath.model.spec import CheckpointError, ModelSpec
from tests.conftest import make_model, release_cuda

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_PROJECTIONS = PROJECTIONS + ("qkv_proj", "gate_up_proj")  # Phi-3's checkpoint names
PROMPTS = [[1 + (11 * p + 5 * i) % 300 for i in range(8 + 5 * p)] for p in range(3)]
ROOT = Path(__file__).resolve().parents[1]


def greedy(n, logprobs=None):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs)


# ---------------------------------------------------------------- the arithmetic


def test_quantize_rows_scales_each_row_by_its_amax():
    x = torch.tensor([[1.0, -2.0, 0.5, 448.0 / 7], [0.0, 0.0, 0.0, 0.0], [3.0, 3.0, -6.0, 1e-3]])
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (3, 1)
    inv = torch.tensor(1.0 / FP8_MAX)  # the scale is amax times float32(1 / 448), on every device
    assert scale[0, 0] == torch.tensor(448.0 / 7) * inv and scale[2, 0] == torch.tensor(6.0) * inv
    assert q.float().abs().amax(dim=1).tolist() == [FP8_MAX, 0.0, FP8_MAX]  # the largest lands on 448
    assert torch.equal(q[1].float(), torch.zeros(4))  # a zero row (graph padding) stays zero, no NaN
    # Each element: round-to-nearest of x / scale in e4m3 (3 mantissa bits: relative error <= 2^-4).
    reference = (x.double() / scale.double()).to(torch.float32).to(FP8_DTYPE)
    assert torch.equal(q.view(torch.uint8), reference.view(torch.uint8))
    back = dequantize_rows(q, scale)
    assert torch.all((back - x).abs() <= x.abs() * 2 ** -4 + scale * 2 ** -9)


def test_quantize_rows_rounds_to_nearest_even_and_never_overflows():
    # A row of amax 448 has scale 1: e4m3 steps by 2 in [16, 32), so 17 and 19 are ties, to the even
    # mantissa: 16 and 20.
    q, _ = quantize_rows(torch.tensor([[17.0, 448.0, -448.0, 19.0]], dtype=torch.bfloat16))
    assert q.float().tolist() == [[16.0, 448.0, -448.0, 20.0]]
    q, _ = quantize_rows(torch.randn(64, 256) * 1e4)
    assert torch.isfinite(q.float()).all()


def test_fp8_linear_torch_is_the_dequantized_matmul():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen)
    w, bias = torch.randn(48, 64, generator=gen) * 0.05, torch.randn(48, generator=gen)
    wq, w_scale = quantize_rows(w)
    xq, x_scale = quantize_rows(x)
    expected = (xq.float() * x_scale) @ (wq.float() * w_scale).t() + bias
    out = fp8_linear_torch(x, wq, w_scale, bias)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, x @ w.t() + bias, rtol=0.05, atol=0.05)  # and near the float product


def check_triton_quantize_rows(device: str, on_grid: bool, seed: int = 0) -> None:
    """The fused kernel stores the twin's bytes and scales. On the grid: each row's amax is 448 · 2^k and
    every value an fp8 value times 2^k, so no rounding happens (Triton's interpreter rounds some values
    that need it wrongly, as test_fp8_kv notes); the compiled kernel is checked off the grid too."""
    from mempath.kernels.quant_triton import triton_quantize_rows
    gen = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows, cols in ((1, 64), (5, 300), (3, 5000)):
            x = torch.randn(rows, cols, generator=gen) * 3
            if on_grid:
                x = quantize_rows(x)[0].float()
                x[:, 0] = FP8_MAX
                x *= 2.0 ** (torch.arange(rows) - rows // 2).float()[:, None]
            x[-1] = 0 if rows > 1 else x[-1]  # a zero row: graph padding
            x = x.to(dtype).to(device)
            q, scale = triton_quantize_rows(x, FP8_MAX, MIN_SCALE)
            ref_q, ref_scale = quantize_rows(x)
            assert torch.equal(scale, ref_scale), (dtype, rows, cols)
            assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), (dtype, rows, cols)


def run_interpreted(check: str) -> None:
    """``check`` (a call of a check function of this module) in a child process under Triton's interpreter;
    skipped where CUDA is present (the GPU tests run the compiled kernels)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU test runs the compiled kernel")
    code = ("import sys; sys.path.insert(0, 'tests'); from test_triton_interpret import _patch_interpreter_for_numpy; "
            f"_patch_interpreter_for_numpy(); import tests.test_fp8_weights as t; t.{check}")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_interpreted_quantize_kernel_matches_twin():
    run_interpreted("check_triton_quantize_rows('cpu', on_grid=True)")


def check_fused_quant_kernels(device: str, against_twins: bool, seed: int = 0) -> None:
    """The RMSNorm and SiLU-and-mul kernels with the per-row quantization inside give the bytes, scales
    and residual of the two launches they replace: the 16-bit kernel, then ``triton_quantize_rows``
    (both checked against their twins elsewhere; ``against_twins``: against the PyTorch twins too, in
    bfloat16, where the compiled RMSNorm and SiLU kernels give their twins' bits (tests/test_fused_ops.py;
    in float16 and float32 they may differ by a unit in the last place, and so may a quantized byte);
    the interpreter's fp8 rounding cannot be, see check_triton_quantize_rows)."""
    from mempath.kernels.elementwise_torch import rms_norm_torch, silu_and_mul_torch
    from mempath.kernels.elementwise_triton import triton_rms_norm, triton_silu_and_mul
    from mempath.kernels.quant_triton import triton_quantize_rows, triton_rms_norm_quant, triton_silu_and_mul_quant
    gen = torch.Generator().manual_seed(seed)

    def same(a, b, what):
        (qa, sa), (qb, sb) = a, b
        assert torch.equal(sa, sb) and torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)), what

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, cols in ((1, 64), (5, 300), (3, 5000)):
            x = (torch.randn(rows, cols, generator=gen) * 3).to(dtype)
            x[-1] = 0 if rows > 1 else x[-1]  # a zero row: graph padding
            residual = (torch.randn(rows, cols, generator=gen)).to(dtype)
            weight = (1 + 0.1 * torch.randn(cols, generator=gen)).to(dtype)
            x, residual, weight = x.to(device), residual.to(device), weight.to(device)
            for with_residual in (False, True):
                what = (dtype, rows, cols, "norm", with_residual)
                res_fused, res_split = (residual.clone(), residual.clone()) if with_residual else (None, None)
                q, scale, res_out = triton_rms_norm_quant(x.clone(), weight, 1e-5, res_fused, FP8_MAX, MIN_SCALE)
                normed, res_split_out = triton_rms_norm(x.clone(), weight, 1e-5, res_split)
                same((q, scale), triton_quantize_rows(normed, FP8_MAX, MIN_SCALE), what)
                if with_residual:
                    assert res_out is res_fused and torch.equal(res_fused, res_split), what
                if against_twins and dtype == torch.bfloat16:
                    twin, twin_res = rms_norm_torch(x, weight, 1e-5, residual if with_residual else None)
                    same((q, scale), quantize_rows(twin), what)
                    assert not with_residual or torch.equal(res_fused, twin_res), what
            gate_up = (torch.randn(rows, 2 * cols, generator=gen) * 2).to(dtype).to(device)
            expected = triton_quantize_rows(triton_silu_and_mul(gate_up), FP8_MAX, MIN_SCALE)
            for block in (None, 64):  # the row in registers, and 64 columns at a time (computed twice)
                q, scale = triton_silu_and_mul_quant(gate_up, FP8_MAX, MIN_SCALE, block=block)
                assert q.shape == (rows, cols) and scale.shape == (rows, 1)
                same((q, scale), expected, (dtype, rows, cols, "silu", block))
            if against_twins and dtype == torch.bfloat16:
                same((q, scale), quantize_rows(silu_and_mul_torch(gate_up)), (dtype, rows, cols, "silu twin"))


def test_interpreted_fused_quant_kernels_match_the_two_launches():
    run_interpreted("check_fused_quant_kernels('cpu', against_twins=False)")


# ---------------------------------------------------------------- the reference model


def dequantized_reference(hf, quantized: dict | None = None):
    """transformers with each projection's weight replaced by q · scale (``quantized``: the
    checkpoint's, by tensor name; None: its own weights quantized per row) and its input quantized
    per token, as mempath's fp8 path computes. A projection absent from ``quantized`` (one the
    checkpoint's ignore list keeps in 16 bits) is left as it is."""
    handles = []
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.rpartition(".")[2] in FUSED_PROJECTIONS and (quantized is None or f"{name}.weight" in quantized):
                q, scale = quantized[f"{name}.weight"] if quantized else quantize_rows(module.weight)
                module.weight.copy_(dequantize_rows(q, scale))
                handles.append(module.register_forward_pre_hook(
                    lambda mod, args: (dequantize_rows(*quantize_rows(args[0])).to(args[0].dtype),)))
    return handles


def reference_logprobs(hf, prompt, tokens):
    """Teacher-forced log-probabilities of the reference at each generated position."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(tokens)].float()
    return torch.log_softmax(logits, -1)


def check_against_reference(llm, hf, tokens=24):
    """Greedy tokens identical; reported logprobs at the reference's, but for the roundings that
    float32 noise moves across an fp8 step (each moves a logprob by ~1e-3): median <= 1e-4, max < 1e-2."""
    outputs = llm.generate(PROMPTS, greedy(tokens, logprobs=5), use_tqdm=False)
    diffs = []
    for prompt, out in zip(PROMPTS, outputs):
        ref = reference_logprobs(hf, prompt, out.token_ids)
        assert out.token_ids == ref.argmax(-1).tolist()
        diffs += [abs(logprob - ref[step, token_id].item())
                  for step, top in enumerate(out.logprobs) for token_id, logprob in top.items()]
    diffs = torch.tensor(diffs)
    assert diffs.median() <= 1e-4 and diffs.max() < 1e-2


def quantize_projections(hf, strategy: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each projection's weight quantized as a checkpoint would store it: per channel (a scale per
    row) or per tensor (one scale)."""
    out = {}
    for name, tensor in hf.state_dict().items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS:
            if strategy == "channel":
                out[name] = quantize_rows(tensor)
            else:
                scale = tensor.abs().amax().float().clamp(min=1e-12) / FP8_MAX
                out[name] = ((tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.reshape(1, 1))
    return out


QUANT_CONFIGS = {
    "compressed-tensors": lambda strategy: {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True,
                        "dynamic": False, "group_size": None, "observer": "minmax"},
            "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True,
                                  "dynamic": True, "group_size": None, "observer": None}}}},
    "fp8": lambda strategy: {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]},
}


def write_fp8_checkpoint(src: Path, dst: Path, hf, method: str, strategy: str):
    """The hub's fp8 layout: float8_e4m3fn `*.weight` and float32 `*.weight_scale` for the
    projections, the rest as it was, quantization_config in config.json."""
    quantized = quantize_projections(hf, strategy)
    tensors = {}
    for name, tensor in hf.state_dict().items():
        if name in quantized:
            q, scale = quantized[name]
            tensors[name] = q.contiguous()
            tensors[name + "_scale"] = scale.reshape(()) if method == "fp8" else scale.contiguous()
        elif not (hf.config.tie_word_embeddings and name == "lm_head.weight"):
            tensors[name] = tensor.contiguous()
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIGS[method](strategy)
    (dst / "config.json").write_text(json.dumps(config))
    for tokenizer_file in src.glob("tokenizer*"):
        shutil.copy(tokenizer_file, dst)
    return quantized


@pytest.mark.parametrize("method,strategy", [("compressed-tensors", "channel"), ("compressed-tensors", "tensor"),
                                             ("fp8", "tensor")])
def test_fp8_checkpoint_matches_transformers_on_the_dequantized_weights(tmp_path, method, strategy):
    hf = make_model(tmp_path / "float", "llama")
    quantized = write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", hf, method, strategy)
    llm = LLM(str(tmp_path / "fp8"), dtype="float32", show_progress=False)
    assert llm.engine.spec.quantization == "fp8"
    handles = dequantized_reference(hf, quantized)
    check_against_reference(llm, hf)
    for handle in handles:  # without the activations' quantization: still close, as fp8 goes
        handle.remove()
    out = llm.generate(PROMPTS[2], greedy(1, logprobs=5), use_tqdm=False)[0]
    ref = reference_logprobs(hf, PROMPTS[2], out.token_ids)
    assert max(abs(lp - ref[0, t].item()) for t, lp in out.logprobs[0].items()) < 0.05


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_quantization_fp8_on_a_float_checkpoint_is_the_reference_arithmetic(tmp_path, arch):
    """bf16 checkpoint (Qwen2: q/k/v biases; Phi-3: fused qkv and gate_up tensors), quantized at load."""
    hf = make_model(tmp_path, arch, dtype=torch.bfloat16)
    llm = LLM(str(tmp_path), dtype="float32", quantization="fp8", show_progress=False)
    dequantized_reference(hf.float())  # bf16 values in float32: the same rows, the same scales
    check_against_reference(llm, hf)


def test_moe_model_keeps_its_experts_and_routers_in_the_model_dtype(tmp_path):
    from mempath.model.quant import Fp8Linear
    from mempath.tools.plan import plan_memory
    make_model(tmp_path, "qwen3_moe", dtype=torch.bfloat16)  # layer 1 is dense (mlp_only_layers)
    llm = LLM(str(tmp_path), dtype="float32", quantization="fp8", show_progress=False)
    layers = llm.engine.model.model.layers
    assert all(isinstance(layer.self_attn.qkv_proj, Fp8Linear) for layer in layers)
    assert isinstance(layers[1].mlp.down_proj, Fp8Linear)
    moe = layers[0].mlp
    assert moe.gate.weight.dtype == torch.float32 and moe.experts.gate_up_proj.dtype == torch.float32
    assert len(llm.generate(PROMPTS[:1], greedy(4), use_tqdm=False)[0].token_ids) == 4
    plan = plan_memory(str(tmp_path), dtype="float32", quantization="fp8")
    assert plan.weight_bytes == llm.stats()["ledger"]["weights"]["bytes"]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_norm_and_silu_quantizing_for_the_projection_change_no_bit(tmp_path, arch):
    """The model's side of the fused quantization, on the CPU: Kernels whose RMSNorm and SiLU-and-mul
    also quantize (here their twins, then quantize_rows) and fp8 layers that ask for it at every batch
    give the same tokens and logprobs, bit for bit, as each layer quantizing its own input. The MoE
    model's sparse layers keep their post-attention norm unquantized: their experts are bf16."""
    from mempath.kernels.elementwise_torch import rms_norm_torch, silu_and_mul_torch
    from mempath.model.quant import fp8_layers
    make_model(tmp_path, arch, dtype=torch.bfloat16)
    llm = LLM(str(tmp_path), dtype="bfloat16", quantization="fp8", enable_prefix_caching=False, show_progress=False)
    expected = llm.generate(PROMPTS, greedy(8, logprobs=2), use_tqdm=False)
    model = llm.engine.model
    calls = {"norm": 0, "silu": 0}

    def rms_norm_quant(x, weight, eps, residual=None):
        calls["norm"] += 1
        out, residual = rms_norm_torch(x, weight, eps, residual)
        return (*quantize_rows(out), residual)

    def silu_and_mul_quant(x):
        calls["silu"] += 1
        return quantize_rows(silu_and_mul_torch(x))

    model.kernels.rms_norm_quant, model.kernels.silu_and_mul_quant = rms_norm_quant, silu_and_mul_quant
    for layer in fp8_layers(model):
        layer.wants_quantized = lambda rows: True
    got = llm.generate(PROMPTS, greedy(8, logprobs=2), use_tqdm=False)
    for a, b in zip(expected, got):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    layers, sparse = len(model.model.layers), len(model.moe_blocks())
    assert sparse == (0 if arch == "llama" else layers - 1)
    steps = calls["silu"] // (layers - sparse)  # one SiLU a dense layer a step
    assert steps >= 8 and calls["silu"] == steps * (layers - sparse)
    assert calls["norm"] == steps * (2 * layers - sparse)  # both norms of a layer, but a sparse one's second


def test_dummy_fp8_weights_are_the_dummy_weights_quantized(tmp_path):
    make_model(tmp_path, "llama", tokenizer=False)
    cpu = torch.device("cpu")
    plain, _, _ = load_model(tmp_path, torch.float32, cpu, 64, False, dummy=True)
    fp8, spec, report = load_model(tmp_path, torch.float32, cpu, 64, False, dummy=True, quantization="fp8")
    assert spec.quantization == "fp8"
    layer, quant = plain.model.layers[1].mlp.down_proj, fp8.model.layers[1].mlp.down_proj
    q, scale = quantize_rows(layer.weight)
    assert torch.equal(quant.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(quant.weight_scale, scale)
    assert torch.equal(plain.lm_head.weight, fp8.lm_head.weight)  # not quantized


# ---------------------------------------------------------------- bytes: the plan and the ledger


def test_ledger_and_plan_count_the_quantized_bytes(tmp_path):
    from mempath.tools.plan import plan_memory
    make_model(tmp_path, "qwen2", dtype=torch.bfloat16)  # biases stay in the model dtype
    llm = LLM(str(tmp_path), dtype="float32", quantization="fp8", show_progress=False)
    weights = llm.stats()["ledger"]["weights"]
    params = {id(p): p for p in llm.engine.model.parameters()}.values()
    assert weights["bytes"] == sum(p.numel() * p.element_size() for p in params)
    plan = plan_memory(str(tmp_path), dtype="float32", quantization="fp8", gpu_mem_bytes=1 << 30)
    full = plan_memory(str(tmp_path), dtype="float32", gpu_mem_bytes=1 << 30)
    assert plan.weight_bytes == weights["bytes"] < full.weight_bytes
    assert plan.embedding_bytes == full.embedding_bytes and plan.norm_bytes == full.norm_bytes
    assert plan.num_kv_blocks > full.num_kv_blocks


def test_out_of_memory_advice_counts_fp8_weights(tmp_path):
    from mempath.memory.oom import _plan_for
    make_model(tmp_path, "llama", tokenizer=False)
    fp8 = _plan_for(EngineConfig(model=str(tmp_path), device="cpu", quantization="fp8"), "bfloat16")
    full = _plan_for(EngineConfig(model=str(tmp_path), device="cpu"), "bfloat16")
    linear = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128)  # 2 layers: qkv, o, gate/up, down weights
    scales = 2 * 4 * (128 + 64 + 256 + 64)
    assert full.weight_bytes - fp8.weight_bytes == linear - scales


def test_plan_reads_an_fp8_checkpoint_as_fp8(tmp_path):
    from mempath.tools.plan import plan_memory
    hf = make_model(tmp_path / "float", "llama")
    write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", hf, "compressed-tensors", "channel")
    llm = LLM(str(tmp_path / "fp8"), dtype="float32", show_progress=False)
    plan = plan_memory(str(tmp_path / "fp8"), dtype="float32")
    assert plan.quantization == "fp8" and plan.weight_bytes == llm.stats()["ledger"]["weights"]["bytes"]


def test_plan_of_the_8b_shape_and_its_advice():
    from mempath.tools.plan import plan_memory
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
    full = plan_memory(config, gpu_mem_bytes=24 << 30)
    fp8 = plan_memory(config, gpu_mem_bytes=24 << 30, quantization="fp8")
    linear = 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)
    scales = 32 * 4 * (4096 + 2 * 1024 + 4096 + 2 * 14336 + 4096)
    assert full.weight_bytes - fp8.weight_bytes == linear - scales
    assert any("--quantization fp8" in line for line in full.advice)
    assert not any("--quantization fp8" in line for line in fp8.advice)
    small = plan_memory(config, gpu_mem_bytes=16 << 30)  # bf16 weights (15 GiB) exceed the budget
    assert any(line.startswith("does not fit: weights alone") and "--quantization fp8 (8.46 GiB" in line
               for line in small.advice)


# ---------------------------------------------------------------- refusals, flags


def spec_error(quantization_config, arch="LlamaForCausalLM") -> str:
    config = {"architectures": [arch], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 320, "quantization_config": quantization_config}
    if arch == "MixtralForCausalLM":
        config.update(num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(CheckpointError) as error:
        ModelSpec.from_hf_config(config)
    return str(error.value)


def test_other_quantization_schemes_are_refused_in_one_line():
    ct = QUANT_CONFIGS["compressed-tensors"]("channel")
    group = ct["config_groups"]["group_0"]
    cases = {
        "'quantization_config.quant_method' holds \"gptq\"": {"quant_method": "gptq", "bits": 4},
        "'quantization_config.activation_scheme' holds \"static\"": {"quant_method": "fp8",
                                                                      "activation_scheme": "static"},
        "'quantization_config.weight_block_size'": {"quant_method": "fp8", "weight_block_size": [128, 128]},
        "config_groups.group_0.weights.type' holds \"int\"": {**ct, "config_groups": {"group_0": {
            **group, "weights": {**group["weights"], "type": "int"}}}},
        "config_groups.group_0.weights.strategy' holds \"group\"": {**ct, "config_groups": {"group_0": {
            **group, "weights": {**group["weights"], "strategy": "group"}}}},
        "config_groups.group_0.input_activations' holds null": {**ct, "config_groups": {"group_0": {
            **group, "input_activations": None}}},
        "config_groups.group_0.input_activations.dynamic' holds false": {**ct, "config_groups": {"group_0": {
            **group, "input_activations": {**group["input_activations"], "dynamic": False}}}},
        "'quantization_config.kv_cache_scheme'": {**ct, "kv_cache_scheme": {"type": "float", "num_bits": 8}},
        "'quantization_config.sparsity_config.format' holds \"sparse-24-bitmask\"": {**ct, "sparsity_config": {
            "format": "sparse-24-bitmask", "sparsity_structure": "2:4", "global_sparsity": 0.5}},
    }
    for expected, quantization_config in cases.items():
        message = spec_error(quantization_config)
        assert expected in message and "\n" not in message
        assert "fp8" in message.rpartition(";")[2]  # the fix: what mempath does load
    assert "keeps experts in the model dtype" in spec_error(ct, "MixtralForCausalLM")


def test_fp8_weights_where_mempath_keeps_the_model_dtype_are_refused(tmp_path):
    hf = make_model(tmp_path / "float", "llama")
    write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", hf, "compressed-tensors", "channel")
    from safetensors.torch import load_file
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(FP8_DTYPE)
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'lm_head.weight' is float8_e4m3fn, expected a floating-point "
                                              r"weight \(float32, float16, bfloat16\); mempath's fp8 layers are"):
        LLM(str(tmp_path / "fp8"), dtype="float32", show_progress=False)


def test_missing_weight_scale_is_named(tmp_path):
    hf = make_model(tmp_path / "float", "llama")
    write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", hf, "compressed-tensors", "channel")
    from safetensors.torch import load_file
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"weights missing from the checkpoint: "
                                              r"\['model.layers.1.mlp.down_proj.weight_scale'\]"):
        LLM(str(tmp_path / "fp8"), dtype="float32", show_progress=False)


def test_old_gpus_are_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"^model/config.json: --quantization fp8 needs an NVIDIA GPU of compute "
                                         r"capability 8.9 or later .*A100-SXM4-80GB is 8.0: serve the model "
                                         r"unquantized"):
        check_fp8_device(torch.device("cuda", 0), "model/config.json")
    check_fp8_device(torch.device("cpu"), "model/config.json")  # the CPU path dequantizes


def test_cli_passes_quantization_and_refuses_others(capsys):
    from mempath.cli import build_parser
    from mempath.engine_flags import engine_options
    assert engine_options(build_parser().parse_args(["generate", "hi", "--quantization", "fp8"]))["quantization"] == "fp8"
    assert engine_options(build_parser().parse_args(["generate", "hi"]))["quantization"] is None
    assert build_parser().parse_args(["plan", "m", "--quantization", "fp8"]).quantization == "fp8"
    from mempath.cli import main
    assert main(["generate", "hi", "--quantization", "awq"]) == 2
    err = capsys.readouterr().err
    assert "--quantization awq: only fp8 is supported" in err and err.count("\n") == 1, err
    with pytest.raises(ValueError, match=r"^quantization must be fp8 \(or None: as the checkpoint is\), got 'int8'$"):
        EngineConfig(model="x", quantization="int8")


# ---------------------------------------------------------------- CUDA (Hopper's fp8 matmul)


needs_fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                   reason="needs a CUDA GPU of compute capability 8.9+")


@needs_fp8_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_gpu_scaled_mm_matches_the_dequantized_twin(dtype, rows):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 4096, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(1024, 4096, device="cuda", dtype=dtype, generator=gen) * 0.02
    bias = torch.randn(1024, device="cuda", dtype=dtype, generator=gen)
    wq, w_scale = quantize_rows(w)
    out = fp8_linear_scaled_mm(x, wq, w_scale, bias)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), fp8_linear_torch(x, wq, w_scale, bias).float(), rtol=2e-2, atol=2e-2)


@needs_fp8_gpu
@pytest.mark.parametrize("on_grid", [True, False])
def test_gpu_quantize_kernel_matches_twin(on_grid):
    pytest.importorskip("triton")
    check_triton_quantize_rows("cuda", on_grid)


@needs_fp8_gpu
def test_gpu_fused_quant_kernels_match_the_two_launches_and_the_twins():
    pytest.importorskip("triton")
    check_fused_quant_kernels("cuda", against_twins=True)


@needs_fp8_gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_fused_quantization_changes_no_token(tmp_path, monkeypatch, enforce_eager):
    """24 sequences: past the GEMV's 16 rows, so decode steps run _scaled_mm too. The norms and SiLU that
    quantize for it give the tokens and logprobs of the separate quantization launch, bit for bit."""
    from mempath.model import quant
    make_model(tmp_path, "llama", dtype=torch.bfloat16)
    prompts = [[1 + (7 * p + 3 * i) % 300 for i in range(5 + p)] for p in range(24)]
    outputs = []
    for fused in (False, True):
        monkeypatch.setattr(quant, "USE_FUSED_QUANT", fused)
        llm = LLM(str(tmp_path), quantization="fp8", show_progress=False, gpu_memory_utilization=0.3,
                  enforce_eager=enforce_eager)
        layer = llm.engine.model.model.layers[0].mlp.down_proj
        assert (layer.wants_quantized is not None) == fused and layer.takes_quantized(24) == fused
        assert not layer.takes_quantized(1)  # one row: the weight-only GEMV, which takes x unquantized
        outputs.append(llm.generate(prompts, greedy(12, logprobs=1), use_tqdm=False))
        del llm, layer
        release_cuda()  # the next engine's budget is the device less what this one held
    for a, b in zip(*outputs):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@needs_fp8_gpu
def test_gpu_engine_fp8_follows_the_reference_with_cuda_graphs(tmp_path):
    hf = make_model(tmp_path, "llama", dtype=torch.bfloat16)
    llm = LLM(str(tmp_path), quantization="fp8", show_progress=False, gpu_memory_utilization=0.3)
    matmul = llm.engine.model.model.layers[0].self_attn.qkv_proj.matmul
    assert getattr(matmul, "func", matmul) is fp8_linear_cuda  # the GEMV at decode batches, _scaled_mm above
    dequantized_reference(hf.float())
    outputs = llm.generate(PROMPTS, greedy(16), use_tqdm=False)
    agree = 0
    for prompt, out in zip(PROMPTS, outputs):
        ref = reference_logprobs(hf, prompt, out.token_ids).argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(out.token_ids, ref))
    assert agree >= 0.8 * 16 * len(PROMPTS)  # bf16 activations on the GPU: near ties may flip
