"""One decoder for the Llama family: Llama (incl. Llama-3.1 rope scaling), Mistral,
Qwen2 (qkv bias), Qwen3 (q/k RMSNorm) and Phi-3 (fused checkpoints).

Plain PyTorch, read top to bottom. q/k/v and gate/up are always fused into one
matrix each (fewer, larger matmuls); the loader fills the slices from either the
separate or the fused checkpoint tensors. The model works on a flat batch of
tokens: ``input_ids [T]``, ``positions [T]`` and an :class:`AttentionMetadata`
that says which rows belong to which sequence and where their KV lives.
"""
import math
from dataclasses import dataclass

import torch
from torch import nn

from mempath.kv.attention import attend_torch, write_kv
from mempath.model.ops import rms_norm, rope_and_store, silu_and_mul

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)


@dataclass
class ModelSpec:
    """What the decoder needs from a Hugging Face config.json, resolved once."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    hidden_act: str
    bos_token_id: int | None
    eos_token_ids: list[int]

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> "ModelSpec":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: architecture {arch!r} is not supported; mempath runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{source}: hidden_act {act!r} is not supported; only silu is")
        rope_params = cfg.get("rope_parameters") or {}
        if cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor != 1 is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        # Qwen2 keeps a sliding_window value but only applies it with use_sliding_window.
        window = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            window = None
        if arch == "Qwen3ForCausalLM" and not cfg.get("use_sliding_window", False):
            window = None
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        if rope_params:  # transformers 5 nests the rope settings here
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
            o_bias=arch != "Qwen2ForCausalLM" and cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
            hidden_act=act,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass
class AttentionMetadata:
    """Where each row of the flat batch reads and writes KV (see mempath.kv.attention)."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_query_len: int
    max_seq_len: int | None  # None under CUDA graphs: kernels must not depend on it
    decode_workspace: object = None  # preallocated split-K buffers for the Triton decode kernel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, out: torch.Tensor | None = None):
        """Normalise x (x + residual when given; then also return the new residual).

        float32 statistics, then back to the input dtype before the scale, exactly
        as transformers does, so greedy outputs match it. ``out``: where the fused
        kernel may write the result (see mempath.model.ops.rms_norm).
        """
        out, residual_out = rms_norm(x, self.weight, self.eps, residual, out)
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
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        # Set by the runner once the KV cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.attention_fn = attend_torch
        self.write_kv_fn = write_kv

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(-1, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(-1, self.num_kv_heads, self.head_dim)
        q = rope_and_store(positions, q, k, v, self.rotary.cos, self.rotary.sin, self.k_cache, self.v_cache,
                           meta.slot_mapping, self.write_kv_fn)
        out = self.attention_fn(q, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, rotary)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, positions, hidden, residual, meta):
        """Returns (sublayer output, residual stream); the next norm adds them."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        # The normalised input is dead once attention has read it, but in every layer
        # after the first the caller's loop still holds it: the next norm writes there,
        # and the attention output (no name keeps it) is freed as the norm returns, so
        # the MLP runs beside two [T, hidden] streams, not three (on the H200 the third
        # was +8% of Llama-8B's forward peak).
        hidden, residual = self.post_attention_layernorm(
            self.self_attn(positions, hidden, meta), residual, out=hidden)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.rotary = RotaryEmbedding(spec, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(spec, self.rotary) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, max_positions: int):
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec, max_positions)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]
