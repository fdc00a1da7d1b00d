"""Which tensors the fused (CUDA) forward keeps alive, checked on the CPU against the planner.

The fused kernels' memory behaviour is emulated with their PyTorch twins: a norm
with a residual writes in place (into ``out`` when given), rotary embedding
rotates in place (and the fused rotary + KV write makes nothing), SiLU-and-mul and attention each make one output. The twins'
own temporaries are kept out of the count, as the kernels make none. What is
left is the model code's liveness: which [tokens, width] tensors it holds at once.
"""
import torch
from torch.utils._python_dispatch import _pop_mode_temporarily

from mempath import LLM
from mempath.kernels.attention_torch import attend_torch, write_kv
from mempath.kernels.elementwise_torch import apply_rope_torch, rms_norm_torch, silu_and_mul_torch
from mempath.memory.formulas import decoder_peak_bytes, read_shape
from mempath.tools.diagnose.meters import TensorBytesTracker
from mempath.tools.diagnose.probes import _probe_batch
from mempath.tools.plan import load_config


def _untracked(fn, *args):
    with _pop_mode_temporarily():
        return fn(*args)


def fake_rms_norm(x, weight, eps, residual=None, out=None):
    normed, new_residual = _untracked(rms_norm_torch, x, weight, eps, residual)
    if residual is not None:
        residual.copy_(new_residual)
        dest = x if out is None else out
    else:
        dest = torch.empty_like(x)
    dest.copy_(normed)
    return dest, residual


def fake_rope_and_store(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    q2, k2 = _untracked(apply_rope_torch, positions, q, k, cos, sin)
    q.copy_(q2)
    _untracked(write_kv, k2, v, k_cache, v_cache, slot_mapping)
    return q


def fake_silu_and_mul(x):
    out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype)
    out.copy_(_untracked(silu_and_mul_torch, x))
    return out


def fake_attention(q, k_cache, v_cache, meta, scale):
    out = torch.empty_like(q)
    out.copy_(_untracked(attend_torch, q, k_cache, v_cache, meta, scale))
    return out


def run_fused_fakes(model, monkeypatch):
    """Every layer of ``model`` runs the fakes (its layers share one Kernels)."""
    for name in ("rms_norm", "rope_and_store", "silu_and_mul", "attention"):
        monkeypatch.setattr(model.kernels, name, globals()[f"fake_{name}"])


def test_fused_forward_peak_equals_the_plan(model_factory, monkeypatch):
    path, _ = model_factory("llama")
    llm = LLM(path, dtype="float32", show_progress=False)
    engine = llm.engine
    run_fused_fakes(engine.model, monkeypatch)
    tokens = 96
    batch = _probe_batch(engine, tokens, 1)
    with torch.inference_mode():
        input_ids, positions, meta, _ = engine.runner.prepare(batch, {id(r) for r in batch.requests})
        tracker = TensorBytesTracker()
        with tracker:
            engine.model(input_ids, positions, meta)
    shape = read_shape(load_config(path))
    # The MLP phase is the peak for this shape: residual + normalised input + gate/up + activation.
    assert 3 * shape.intermediate_size > (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim * 2
    assert tracker.peak == decoder_peak_bytes(shape, tokens, 4, fused=True)
