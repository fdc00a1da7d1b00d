"""The planner's MoE phase on the grouped-kernel path (memory/formulas.py moe_grouped_phase_bytes) against
the tensors kernels/moe_triton.py allocates, counted on the CPU by the diagnose tracker.

The two launches are faked (they write into buffers the code has already allocated, so
they add nothing). Under TRITON_INTERPRET=1 the interpreter itself keeps the launches'
buffers alive longer than CUDA would (the gate/up buffer past its ``del``): 2,643,800 bytes
at 300 tokens on this shape against the code's 2,029,400, so the interpreter's peak is not
the one compared.
"""
import dataclasses
import json

import pytest
import torch

from mempath.kernels import moe_triton
from mempath.kernels.dispatch import torch_kernels
from mempath.memory.formulas import moe_grouped_phase_bytes, moe_phase_bytes, read_shape
from mempath.model.moe import MoEBlock
from mempath.tools.diagnose.meters import TensorBytesTracker
from tests.test_plan import CONFIGS


@dataclasses.dataclass
class Spec:
    num_experts: int = 16
    num_experts_per_tok: int = 4
    hidden_size: int = 256
    moe_intermediate_size: int = 96
    norm_topk_prob: bool = True
    routing_weights_float32: bool = False


def fused_silu_and_mul(gate_up):  # the Triton kernel's memory: its output only
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


@pytest.mark.parametrize("fused, dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)])
def test_grouped_path_peak_equals_the_plan(fused, dtype, monkeypatch):
    monkeypatch.setattr(moe_triton, "_grouped_gemm", lambda *args, **kwargs: None)
    monkeypatch.setattr(moe_triton, "_launch_sum_pairs", lambda *args, **kwargs: None)  # writes its output only
    # The one-launch alignment (up to 128 pairs) is a Triton kernel; its outputs are align_to_blocks'
    # and it has no temporaries, so the plan (align_to_blocks' peak) bounds it.
    monkeypatch.setattr(moe_triton, "align_fused", moe_triton.align_to_blocks)
    # bfloat16 with float32 router weights (Mixtral's), which the plan counts (an upper bound otherwise).
    spec = Spec(routing_weights_float32=dtype != torch.float32)
    shape = dataclasses.replace(read_shape(json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())),
                                num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                                hidden_size=spec.hidden_size, moe_intermediate_size=spec.moe_intermediate_size)
    kernels = dataclasses.replace(torch_kernels(), grouped_experts=moe_triton.triton_grouped_experts,
                                  **({"silu_and_mul": fused_silu_and_mul} if fused else {}))
    block = MoEBlock(spec, kernels).to(dtype)
    assert block.uses_grouped_kernel()
    for tokens in (1, 7, 96, 300, 600):  # 16-row blocks up to 1,024 pairs, 64-row above
        x, tracker = torch.randn(tokens, spec.hidden_size).to(dtype), TensorBytesTracker()
        with torch.inference_mode(), tracker:
            block(x)
        assert tracker.peak == moe_grouped_phase_bytes(shape, tokens, dtype.itemsize, fused), tokens


def test_planner_covers_both_paths_on_the_real_shape():
    shape = read_shape(json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text()))
    for tokens in (1, 8192):
        grouped, pytorch = moe_grouped_phase_bytes(shape, tokens, 2), moe_phase_bytes(shape, tokens, 2)
        assert 0 < grouped < pytorch  # k·(I_e·b + 4h) + 2h < 3kh·b per token at h 2048, I_e 768, b 2


def test_the_slot_path_with_several_waves_stays_within_the_plan(monkeypatch):
    """Fewer experts resident than a step routes to: each wave after the first holds its own pair
    outputs beside the step's (mempath/model/moe_slots.py), which the plan counts for an offloaded shape."""
    monkeypatch.setattr(moe_triton, "_grouped_gemm", lambda *args, **kwargs: None)
    monkeypatch.setattr(moe_triton, "align_fused", moe_triton.align_to_blocks)
    monkeypatch.setattr(moe_triton, "_launch_sum_pairs", lambda *args, **kwargs: None)
    spec = Spec()
    shape = dataclasses.replace(read_shape(json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())),
                                num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                                hidden_size=spec.hidden_size, moe_intermediate_size=spec.moe_intermediate_size)
    kernels = dataclasses.replace(torch_kernels(), grouped_expert_pairs=moe_triton.triton_grouped_expert_pairs,
                                  silu_and_mul=fused_silu_and_mul)
    block = MoEBlock(spec, kernels)
    block.experts.set_resident(4)
    offloaded = dataclasses.replace(shape, num_expert_slots=4)
    for tokens in (7, 96, 300):
        x, tracker = torch.randn(tokens, spec.hidden_size), TensorBytesTracker()
        with torch.inference_mode(), tracker:
            block(x)
        assert len(block.experts.cache.waves(list(range(spec.num_experts)))) > 1
        assert moe_grouped_phase_bytes(shape, tokens, 4, True) < tracker.peak, tokens
        assert tracker.peak <= moe_grouped_phase_bytes(offloaded, tokens, 4, True), tokens
