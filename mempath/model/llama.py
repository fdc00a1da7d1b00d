"""One decoder for the Llama family: Llama (incl. Llama-3.1 rope scaling), Mistral,
Qwen2 (qkv bias), Qwen3 (q/k RMSNorm) and Phi-3 (fused checkpoints), and the
mixture-of-experts ones: Qwen3-MoE, Mixtral and OLMoE (q/k RMSNorm over all heads,
clip_qkv), whose MLP is mempath.model.moe.MoEBlock in their sparse layers.

Plain PyTorch, read top to bottom. q/k/v and gate/up are always fused into one
matrix each (fewer, larger matmuls); the loader fills the slices from either the
separate or the fused checkpoint tensors. The model works on a flat batch of
tokens: ``input_ids [T]``, ``positions [T]`` and an :class:`AttentionMetadata`
that says which rows belong to which sequence and where their KV lives.
"""
import json
import math
from dataclasses import dataclass

import torch
from torch import nn

from mempath.constants import CHECKPOINT_DTYPES
from mempath.kernels.dispatch import Kernels
from mempath.model.moe import MoEBlock

# config.json's model_type -> architecture, for configs that name no architectures.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM")
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES.values())
ROPE_TYPES = ("default", "linear", "llama3")


class CheckpointError(ValueError):
    """A checkpoint (config.json or weights) that mempath cannot load.

    The message is one line: the file, the field or tensor, what it holds, what is
    expected, and the fix.
    """


def json_kind(value) -> str:
    """What kind of JSON value this is, as a message says it: "a string", "a list"."""
    kinds = ((bool, "true/false"), (str, "a string"), ((int, float), "a number"),
             (list, "a list"), (dict, "an object"))
    return next((name for types, name in kinds if isinstance(value, types)), "null")


def describe(value) -> str:
    """A JSON value as config.json writes it, with its kind: '"6" (a string)'."""
    text = json.dumps(value, default=str)
    if len(text) > 60:
        text = text[:57] + "..."
    return text if value is None else f"{text} ({json_kind(value)})"


_REQUIRED = object()


class ConfigFields:
    """Typed reads of config.json fields; a bad field raises CheckpointError naming it."""

    def __init__(self, fields: dict, source: str, prefix: str = ""):
        self.fields, self.source, self.prefix = fields, source, prefix

    def fail(self, key: str, expected: str, fix: str | None = None):
        if key in self.fields:
            state, fix = f"holds {describe(self.fields[key])}", fix or "correct it in config.json"
        else:
            state, fix = "is missing", fix or "add it to config.json (the model's original config has it)"
        raise CheckpointError(f"{self.source}: field '{self.prefix}{key}' {state}, expected {expected}; {fix}")

    def integer(self, key: str, default=_REQUIRED, minimum: int = 1, expected: str = "a positive integer"):
        """An int >= minimum; null or absent gives ``default`` (when there is one)."""
        value = self.fields.get(key)
        if value is None and default is not _REQUIRED:
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            self.fail(key, expected)
        return value

    def number(self, key: str, default=_REQUIRED) -> float:
        """A positive int or float; null or absent gives ``default`` (when there is one)."""
        value = self.fields.get(key)
        if value is None and default is not _REQUIRED:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
            self.fail(key, "a positive number")
        return float(value)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.fields.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.fail(key, "true or false")
        return value

    def choice(self, key: str, options, default=None, fix: str | None = None):
        value = self.fields.get(key)
        if value is None:
            return default
        if value not in options:
            self.fail(key, " or ".join((", ".join(options[:-1]), options[-1])) if len(options) > 1
                      else options[0], fix)
        return value

    def mapping(self, key: str) -> dict:
        """An object; null or absent gives {}."""
        value = self.fields.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.fail(key, "an object")
        return value

    def token_ids(self, key: str) -> list[int]:
        """A token id or a list of them; null or absent gives []."""
        value = self.fields.get(key)
        if value is None:
            return []
        ids = [value] if not isinstance(value, list) else value
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            self.fail(key, "a token id (an integer >= 0) or a list of them")
        return list(ids)


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
    torch_dtype: str | None = None  # the checkpoint's dtype as config.json names it
    qk_norm_per_head: bool = True  # OLMoE normalises q and k over all heads at once
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv]
    # Mixture of experts (num_experts 0: a dense model). See mempath.model.moe.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is routed; the others are dense
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    # Qwen3-MoE and OLMoE round the routing weights to the activation dtype before they
    # scale the experts' outputs; Mixtral keeps them in float32.
    routing_weights_float32: bool = False

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> "ModelSpec":
        """Read and validate config.json; anything mempath cannot run raises CheckpointError."""
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{source}: holds {json_kind(cfg)}, expected a JSON object of model "
                                  f"settings; pass the model's config.json")
        f = ConfigFields(cfg, source)
        arch = _architecture(f)
        if cfg.get("quantization_config") is not None:
            f.fail("quantization_config", "none", "quantized checkpoints are not supported: use the model's "
                   "float16 or bfloat16 checkpoint")
        hidden, heads, kv_heads, head_dim = _attention_shape(f)
        act = f.choice("hidden_act", ("silu", "swish"), "silu", "mempath's MLP is SiLU-gated")
        rope_theta, rope_scaling = _rope(f)
        # Qwen2 and Qwen3(-MoE) keep a sliding_window value but only apply it with use_sliding_window.
        window = f.integer("sliding_window", default=None)
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not f.flag(
                "use_sliding_window"):
            window = None
        # Biases as transformers builds them: Qwen2 always biases q/k/v (not o); Llama,
        # Qwen3, Qwen3-MoE and OLMoE follow attention_bias; Mistral, Mixtral and Phi-3 have
        # none whatever the config says.
        attention_bias = f.flag("attention_bias") and arch in (
            "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
        dtype_key = "torch_dtype" if cfg.get("torch_dtype") is not None else "dtype"
        num_layers = f.integer("num_hidden_layers")
        return cls(
            architecture=arch,
            vocab_size=f.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=f.integer("intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.number("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=f.integer("max_position_embeddings", 2048),
            tie_word_embeddings=f.flag("tie_word_embeddings"),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=arch == "LlamaForCausalLM" and f.flag("mlp_bias"),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"),
            sliding_window=window,
            hidden_act=act,
            bos_token_id=f.integer("bos_token_id", default=None, minimum=0, expected="a token id (an integer >= 0)"),
            eos_token_ids=f.token_ids("eos_token_id"),
            torch_dtype=f.choice(dtype_key, CHECKPOINT_DTYPES,
                                 fix="mempath loads float checkpoints; quantized ones are not supported"),
            **_olmoe_attention(f, arch, hidden, heads, head_dim),
            **_moe_fields(f, arch, num_layers),
        )


def _olmoe_attention(f: ConfigFields, arch: str, hidden: int, heads: int, head_dim: int) -> dict:
    """OLMoE's q/k norms span all heads, sized from hidden_size: head_dim must agree with it."""
    if arch != "OlmoeForCausalLM":
        return {}
    if head_dim * heads != hidden:
        f.fail("head_dim", f"hidden_size / num_attention_heads ({hidden} / {heads}): OLMoE sizes its q/k "
               f"norms from hidden_size", "remove head_dim or correct it")
    return {"qk_norm_per_head": False, "clip_qkv": f.number("clip_qkv", None)}


def _moe_fields(f: ConfigFields, arch: str, num_layers: int) -> dict:
    """The router and experts of a mixture-of-experts config, as transformers reads them."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts; either is read.
    experts_key = "num_local_experts" if arch == "MixtralForCausalLM" or (
        f.fields.get("num_experts") is None and "num_local_experts" in f.fields) else "num_experts"
    qwen = arch == "Qwen3MoeForCausalLM"
    num_experts = f.integer(experts_key, minimum=0 if qwen else 1,
                            expected="an integer >= 0" if qwen else "a positive integer")
    top_k = f.integer("num_experts_per_tok")
    if num_experts and top_k > num_experts:
        f.fail("num_experts_per_tok", f"at most {experts_key} ({num_experts})")
    layers = range(num_layers)
    if qwen:  # transformers' Qwen3MoeDecoderLayer: sparse unless listed, every decoder_sparse_step-th
        step = f.integer("decoder_sparse_step", default=1)
        dense = _layer_list(f, "mlp_only_layers", num_layers)
        layers = [i for i in layers if num_experts and i not in dense and (i + 1) % step == 0]
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": f.integer("moe_intermediate_size" if qwen else "intermediate_size"),
        "moe_layers": tuple(layers),
        "norm_topk_prob": arch == "MixtralForCausalLM" or f.flag("norm_topk_prob"),
        "routing_weights_float32": arch == "MixtralForCausalLM",
    }


def _layer_list(f: ConfigFields, key: str, num_layers: int) -> set[int]:
    value = f.fields.get(key)
    if value is None:
        return set()
    if not isinstance(value, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in value):
        f.fail(key, f"a list of layer indices from 0 to {num_layers - 1} (num_hidden_layers {num_layers})")
    return set(value)


def _architecture(f: ConfigFields) -> str:
    archs = f.fields.get("architectures")
    if archs is None and f.fields.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[f.fields["model_type"]]
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        f.fail("architectures", 'a list of architecture names such as ["LlamaForCausalLM"]')
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        f.fail("architectures", f"one of {', '.join(SUPPORTED_ARCHITECTURES)}",
               f"unsupported architecture: {archs[0]} is not supported by mempath")
    return archs[0]


def _attention_shape(f: ConfigFields) -> tuple[int, int, int, int]:
    """(hidden_size, heads, kv heads, head_dim), checked against each other."""
    hidden = f.integer("hidden_size")
    heads = f.integer("num_attention_heads")
    head_dim = f.integer("head_dim", default=None)  # Mistral v0.3 writes null
    if head_dim is None:
        if hidden % heads:
            f.fail("num_attention_heads", f"a number of heads that divides hidden_size ({hidden})",
                   "correct it, or give head_dim")
        head_dim = hidden // heads
        if head_dim % 2:
            f.fail("num_attention_heads", f"one that gives an even head_dim (hidden_size {hidden} / {heads} "
                   f"is {head_dim}; rotary embeddings rotate pairs)")
    elif head_dim % 2:
        f.fail("head_dim", "an even positive integer (rotary embeddings rotate pairs)")
    kv_heads = f.integer("num_key_value_heads", default=heads)
    if heads % kv_heads:
        f.fail("num_key_value_heads", f"a number of key-value heads that divides num_attention_heads ({heads})")
    return hidden, heads, kv_heads, head_dim


def _rope(f: ConfigFields) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling or None); transformers 5 nests both in rope_parameters."""
    params = f.mapping("rope_parameters")
    nested = ConfigFields(params, f.source, "rope_parameters.")
    for where in (f, nested):
        if where.fields.get("partial_rotary_factor", 1.0) != 1.0:
            where.fail("partial_rotary_factor", "1.0", "partial rotary embeddings are not supported")
    theta = nested.number("rope_theta", None) if params else None
    if theta is None:
        theta = f.number("rope_theta", 10000.0)
    if params.get("rope_type", "default") != "default":
        return theta, _rope_scaling(nested)
    scaling = ConfigFields(f.mapping("rope_scaling"), f.source, "rope_scaling.")
    return theta, _rope_scaling(scaling) if scaling.fields else None


def _rope_scaling(f: ConfigFields) -> dict | None:
    """The scaling settings, checked for the rope types mempath implements."""
    kind_key = "rope_type" if "rope_type" in f.fields else "type"
    kind = f.choice(kind_key, ROPE_TYPES, "default",
                    f"rope type {f.fields.get(kind_key)!r} is not supported: use a checkpoint without it")
    if kind == "default":
        return None
    f.number("factor")
    if kind == "llama3":
        f.integer("original_max_position_embeddings")
        low = f.number("low_freq_factor", 1.0)
        high = f.number("high_freq_factor", 4.0)
        if high <= low:
            f.fail("high_freq_factor", f"a number above low_freq_factor ({low})")
    return f.fields


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: Kernels):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, out: torch.Tensor | None = None):
        """Normalise x (x + residual when given; then also return the new residual).

        float32 statistics, then back to the input dtype before the scale, exactly
        as transformers does, so greedy outputs match it. ``out``: where the fused
        kernel may write the result (see mempath.kernels.dispatch.Kernels).
        """
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
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
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
        if self.q_norm is not None:
            width = self.head_dim if self.qk_norm_per_head else None
            q = self.q_norm(q.reshape(-1, width or self.q_size))
            k = self.k_norm(k.reshape(-1, width or self.kv_size))
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q = self.kernels.rope_and_store(positions, q, k, v, self.rotary.cos, self.rotary.sin, self.k_cache,
                                        self.v_cache, meta.slot_mapping)
        out = self.kernels.attention(q, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, index: int, kernels: Kernels):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels)
        self.self_attn = Attention(spec, rotary, kernels)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels)
        self.mlp = MoEBlock(spec, kernels) if index in spec.moe_layers else MLP(spec, kernels)

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
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
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
