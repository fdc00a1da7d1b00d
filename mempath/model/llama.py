"""One decoder for the Llama family: Llama (incl. Llama-3.1 rope scaling), Mistral,
Qwen2 (qkv bias), Qwen3 (q/k RMSNorm) and Phi-3 (fused checkpoints), and the
mixture-of-experts ones: Qwen3-MoE, Mixtral and OLMoE (q/k RMSNorm over all heads,
clip_qkv), whose MLP is mempath.model.moe.MoEBlock in their sparse layers.

Plain PyTorch, read top to bottom. q/k/v and gate/up are always fused into one
matrix each (fewer, larger matmuls); the loader fills the slices from either the
separate or the fused checkpoint tensors. The model works on a flat batch of
tokens: ``input_ids [T]``, ``positions [T]`` and an :class:`AttentionMetadata`
that says which rows belong to which sequence and where their KV lives. The
config it is built from is read by mempath.model.spec; the kernels each op runs are
chosen once, by mempath.kernels.dispatch. With ``spec.quantization == "fp8"`` the
projections are mempath.model.quant.Fp8Linear, but for those an fp8 checkpoint keeps in 16
bits (``spec.unquantized``); embeddings, norms, the LM head, routers and routed experts stay
in the model dtype. Where such a projection runs the fp8 matmul, the
norm or SiLU-and-mul before it may hand it its input already quantized (an Fp8Activation).
"""
import math
from dataclasses import dataclass

import torch
from torch import nn

from mempath.kernels.dispatch import Kernels
from mempath.model.moe import MoEBlock
from mempath.model.quant import Fp8Activation, Linear, make_linear
from mempath.model.spec import ModelSpec


@dataclass
class AttentionMetadata:
    """Where each row of the flat batch reads and writes KV (see mempath.kernels.attention_torch)."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_query_len: int
    max_seq_len: int | None  # None under CUDA graphs: kernels must not depend on it
    decode_workspace: object = None  # preallocated split-K buffers for the Triton decode kernel
    # int32 [B]: the sequences by descending seq_len, the order the Triton decode kernel starts them in
    # (None: batch order). It changes which program runs when, never a result.
    seq_order: torch.Tensor | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: Kernels):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                quantize_for: nn.Module | None = None):
        """Normalise x (x + residual when given; then also return the new residual).

        float32 statistics, then back to the input dtype before the scale, exactly
        as transformers does, so greedy outputs match it. ``out``: where the fused
        kernel may write the result (see mempath.kernels.dispatch.Kernels).
        ``quantize_for``: the projection the result goes to; where it takes its input quantized
        (an fp8 layer about to run its quantized path: the fp8 GEMM or _scaled_mm) the kernel
        quantizes it too: an Fp8Activation.
        """
        if self.kernels.rms_norm_quant is not None and quantize_for is not None \
                and quantize_for.takes_quantized(x.numel() // x.shape[-1]):
            values, scale, residual_out = self.kernels.rms_norm_quant(x, self.weight, self.eps, residual)
            out = Fp8Activation(values, scale, x.dtype)
        else:
            out, residual_out = self.kernels.rms_norm(x, self.weight, self.eps, residual, out)
        return out if residual is None else (out, residual_out)


def rope_inverse_frequencies(spec: ModelSpec) -> torch.Tensor:
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend between.
        factor = scaling["factor"]
        low = scaling.get("low_freq_factor", 1.0)
        high = scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to max_positions, computed once in float32."""

    def __init__(self, spec: ModelSpec, max_positions: int):
        super().__init__()
        self.spec = spec
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device) -> None:
        inv_freq = rope_inverse_frequencies(self.spec).to(device)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, kernels: Kernels, prefix: str):
        """``prefix``: the module's name in the model (model.layers.N.self_attn), which its projections'
        quantization is looked up by (ModelSpec.projection_quantization)."""
        super().__init__()
        self.kernels = kernels
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.qkv_proj = make_linear(spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias,
                                    spec.projection_quantization(f"{prefix}.qkv_proj"))
        self.o_proj = make_linear(self.q_size, spec.hidden_size, spec.o_bias,
                                  spec.projection_quantization(f"{prefix}.o_proj"))
        self.qk_norm_per_head = spec.qk_norm_per_head
        if spec.qk_norm:
            q_width, k_width = (spec.head_dim, spec.head_dim) if spec.qk_norm_per_head else (
                self.q_size, self.kv_size)
            self.q_norm = RMSNorm(q_width, spec.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(k_width, spec.rms_norm_eps, kernels)
        else:
            self.q_norm = self.k_norm = None
        self.clip_qkv = spec.clip_qkv
        self.rotary = rotary
        # Set by the runner once the KV cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        cache = (self.rotary.cos, self.rotary.sin, self.k_cache, self.v_cache, meta.slot_mapping)
        if self.q_norm is not None and self.qk_norm_per_head and self.clip_qkv is None:
            # Qwen3: the per-head norms run inside the rotary + KV write (one launch, where
            # a norm of the strided heads took a copy and a kernel each for q and for k).
            q = self.kernels.qk_norm_rope_and_store(
                positions, q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim), self.q_norm.weight, self.k_norm.weight,
                self.q_norm.eps, *cache)
        else:
            if self.q_norm is not None:
                width = self.head_dim if self.qk_norm_per_head else None
                q = self.q_norm(q.reshape(-1, width or self.q_size))
                k = self.k_norm(k.reshape(-1, width or self.kv_size))
            if self.clip_qkv is not None:
                q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
            q = self.kernels.rope_and_store(positions, q.view(-1, self.num_heads, self.head_dim),
                                            k.view(-1, self.num_kv_heads, self.head_dim),
                                            v.view(-1, self.num_kv_heads, self.head_dim), *cache)
        out = self.kernels.attention(q, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, kernels: Kernels, prefix: str):
        """``prefix``: the module's name in the model (model.layers.N.mlp), as Attention's."""
        super().__init__()
        self.kernels = kernels
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = make_linear(spec.hidden_size, 2 * spec.intermediate_size, spec.mlp_bias,
                                        spec.projection_quantization(f"{prefix}.gate_up_proj"))
        self.down_proj = make_linear(spec.intermediate_size, spec.hidden_size, spec.mlp_bias,
                                     spec.projection_quantization(f"{prefix}.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels.silu_and_mul_quant is not None \
                and self.down_proj.takes_quantized(gate_up.numel() // gate_up.shape[-1]):
            activated = Fp8Activation(*self.kernels.silu_and_mul_quant(gate_up), gate_up.dtype)
        else:
            activated = self.kernels.silu_and_mul(gate_up)
        del gate_up  # the down projection runs beside the activation alone (the plan's MLP phase)
        return self.down_proj(activated)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, index: int, kernels: Kernels):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels)
        self.self_attn = Attention(spec, rotary, kernels, f"model.layers.{index}.self_attn")
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels)
        self.mlp = (MoEBlock(spec, kernels) if index in spec.moe_layers
                    else MLP(spec, kernels, f"model.layers.{index}.mlp"))

    def forward(self, positions, hidden, residual, meta):
        """Returns (sublayer output, residual stream); the next norm adds them."""
        qkv_proj = self.self_attn.qkv_proj
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, quantize_for=qkv_proj)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, quantize_for=qkv_proj)
        # The normalised input is dead once attention has read it, but in every layer
        # after the first the caller's loop still holds it: the next norm writes there,
        # and the attention output (no name keeps it) is freed as the norm returns, so
        # the MLP runs beside two [T, hidden] streams, not three (on the H200 the third
        # was +8% of Llama-8B's forward peak). An fp8 input (Fp8Activation) is no such buffer.
        hidden, residual = self.post_attention_layernorm(
            self.self_attn(positions, hidden, meta), residual,
            out=hidden if isinstance(hidden, torch.Tensor) else None,
            quantize_for=None if isinstance(self.mlp, MoEBlock) else self.mlp.gate_up_proj)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, max_positions: int, kernels: Kernels):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.rotary = RotaryEmbedding(spec, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(spec, self.rotary, i, kernels) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels)

    def forward(self, input_ids, positions, meta):
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    """The decoder and its LM head. ``kernels``: the ops every layer runs, one instance shared
    by all of them (mempath.kernels.dispatch says how it is chosen)."""

    def __init__(self, spec: ModelSpec, max_positions: int, kernels: Kernels):
        super().__init__()
        self.spec = spec
        self.kernels = kernels
        self.model = DecoderModel(spec, max_positions, kernels)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False, projection=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def moe_blocks(self) -> list[MoEBlock]:
        """The routed MLPs, in layer order (none in a dense model)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoEBlock)]
