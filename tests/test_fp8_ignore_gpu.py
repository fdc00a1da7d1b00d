"""A compressed-tensors fp8 checkpoint whose `ignore` list keeps projections in 16 bits, on CUDA: the
kept projections run as plain 16-bit linears beside Hopper's fp8 matmul and the weight-only fp8 GEMV, the
norms and SiLU that quantize for an fp8 projection hand a kept one its 16-bit input, eager and under CUDA
graphs, at one row (the GEMV) and 24 (`_scaled_mm`)."""
import pytest
import torch

from mempath import LLM
from mempath.model.quant import Fp8Linear, Linear
from tests.conftest import release_cuda
from tests.test_fp8_ignore import KEPT, projections, write_checkpoint
from tests.test_fp8_weights import dequantized_reference, greedy, needs_fp8_gpu, reference_logprobs

PROMPTS = [[1 + (7 * p + 3 * i) % 300 for i in range(5 + p)] for p in range(24)]


@needs_fp8_gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("batch", [1, 24])
def test_gpu_ignored_projections_run_in_16_bits_and_follow_the_reference(tmp_path, enforce_eager, batch):
    hf, quantized = write_checkpoint(tmp_path)
    llm = LLM(str(tmp_path / "fp8"), show_progress=False, gpu_memory_utilization=0.3, enforce_eager=enforce_eager)
    try:
        layers = projections(llm.engine.model)
        assert {n for n, m in layers.items() if type(m) is Linear} == KEPT
        assert all(isinstance(m, Fp8Linear) for n, m in layers.items() if n not in KEPT)
        assert all(layers[n].weight.dtype == torch.bfloat16 for n in KEPT)
        prompts = PROMPTS[:batch]
        outputs = llm.generate(prompts, greedy(12), use_tqdm=False)
    finally:
        del llm
        release_cuda()
    dequantized_reference(hf.float(), quantized)
    agree = total = 0
    for prompt, out in zip(prompts, outputs):
        assert len(out.token_ids) == 12
        ref = reference_logprobs(hf, prompt, out.token_ids).argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(out.token_ids, ref))
        total += len(ref)
    assert agree >= 0.8 * total  # bf16 activations on the GPU: near ties may flip
