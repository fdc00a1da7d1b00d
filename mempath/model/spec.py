"""ModelSpec: a Hugging Face config.json read into what mempath's decoder needs, validated.

Torch-free, so the planner can read a config without importing torch. A field that
mempath cannot run raises CheckpointError with a one-line message naming the field,
what it holds, what is expected, and the fix (ConfigFields).
"""
import json
import logging
import math
import re
from dataclasses import dataclass

from mempath.constants import CHECKPOINT_DTYPES

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
# What transformers' config class of each architecture takes for a field config.json leaves out (null is not
# left out: a null sliding_window is none). One default for all gave a Mixtral without rope_theta 10,000 for
# transformers' 1e6 (other tokens). num_key_value_heads None: as many as num_attention_heads.
# tests/test_hostile_loading.py checks the table against the installed transformers.
ARCH_DEFAULTS = {
    "LlamaForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=2048,
                             num_key_value_heads=None, sliding_window=None),
    "MistralForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=131072,
                               num_key_value_heads=8, sliding_window=4096),
    "Qwen2ForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=32768,
                             num_key_value_heads=32, sliding_window=None),
    "Qwen3ForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=32768,
                             num_key_value_heads=32, sliding_window=None),
    "Phi3ForCausalLM": dict(rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=4096,
                            num_key_value_heads=None, sliding_window=None),
    "Qwen3MoeForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=32768,
                                num_key_value_heads=4, sliding_window=None),
    "MixtralForCausalLM": dict(rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=131072,
                               num_key_value_heads=8, sliding_window=None),
    "OlmoeForCausalLM": dict(rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=4096,
                             num_key_value_heads=None, sliding_window=None),
}
ROPE_TYPES = ("default", "linear", "llama3")

log = logging.getLogger(__name__)

MAX_CONFIG_INTEGER = 1 << 32


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
            named = self.source.rsplit("/", 1)[-1] if self.source.endswith(".json") else "config.json"
            state, fix = f"holds {describe(self.fields[key])}", fix or f"correct it in {named}"
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
        if value >= MAX_CONFIG_INTEGER:  # no model's count or length comes near: a corrupted file
            self.fail(key, f"{expected} below 2^32")
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
    # "fp8": the q/k/v, o, gate/up and down projections hold float8_e4m3fn weights with
    # per-channel scales (mempath.model.quant): a pre-quantized checkpoint's
    # quantization_config, or the engine's quantization option. None: the model dtype.
    quantization: str | None = None
    # The projections, by module name ("model.layers.0.self_attn.qkv_proj"), that an fp8 checkpoint
    # keeps in the model dtype: its compressed-tensors ignore list names them, or no config group
    # targets them (_unquantized). Built as 16-bit linears; the other projections follow quantization.
    unquantized: frozenset[str] = frozenset()

    @property
    def max_model_len_limit(self) -> int:
        """The longest sequence served: max_position_embeddings, and no longer than a sliding window (the
        attention has no sliding-window mask: it stays where the window makes no difference)."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    def projection_quantization(self, name: str) -> str | None:
        """The quantization of the projection ``name`` (its module name): None where the checkpoint keeps it."""
        return None if name in self.unquantized else self.quantization

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> "ModelSpec":
        """Read and validate config.json; anything mempath cannot run raises CheckpointError."""
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{source}: holds {json_kind(cfg)}, expected a JSON object of model "
                                  f"settings; pass the model's config.json")
        f = ConfigFields(cfg, source)
        arch = _architecture(f)
        num_layers = f.integer("num_hidden_layers")
        quantization, unquantized = _quantization(f, arch, num_layers)
        defaults = ARCH_DEFAULTS[arch]
        hidden, heads, kv_heads, head_dim = _attention_shape(f, defaults["num_key_value_heads"])
        act = f.choice("hidden_act", ("silu", "swish"), "silu", "mempath's MLP is SiLU-gated")
        rope_theta, rope_scaling = _rope(f, defaults["rope_theta"])
        # Qwen2 and Qwen3(-MoE) keep a sliding_window value but only apply it with use_sliding_window.
        window = f.integer("sliding_window", default=None) if "sliding_window" in cfg else defaults["sliding_window"]
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not f.flag(
                "use_sliding_window"):
            window = None
        # Biases as transformers builds them: Qwen2 always biases q/k/v (not o); Llama,
        # Qwen3, Qwen3-MoE and OLMoE follow attention_bias; Mistral, Mixtral and Phi-3 have
        # none whatever the config says.
        attention_bias = f.flag("attention_bias") and arch in (
            "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
        dtype_key = "torch_dtype" if cfg.get("torch_dtype") is not None else "dtype"
        return cls(
            architecture=arch,
            vocab_size=f.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=f.integer("intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.number("rms_norm_eps", defaults["rms_norm_eps"]),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=f.integer("max_position_embeddings", defaults["max_position_embeddings"]),
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
                                 fix="it names the model's unquantized dtype (e.g. bfloat16); an fp8 checkpoint "
                                     "says fp8 in quantization_config, which mempath reads"),
            quantization=quantization,
            unquantized=unquantized,
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
        if not layers:  # every layer dense (mlp_only_layers, decoder_sparse_step): a dense model, as in transformers
            num_experts = top_k = 0
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


def _attention_shape(f: ConfigFields, default_kv_heads: int | None) -> tuple[int, int, int, int]:
    """(hidden_size, heads, kv heads, head_dim), checked against each other; ``default_kv_heads``: the
    architecture's when config.json leaves it out (None: as many as the heads)."""
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
    kv_heads = f.integer("num_key_value_heads", default=default_kv_heads or heads)
    if heads % kv_heads:
        f.fail("num_key_value_heads", f"a number of key-value heads that divides num_attention_heads ({heads})")
    return hidden, heads, kv_heads, head_dim


def _rope(f: ConfigFields, default_theta: float) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling or None); transformers 5 nests both in rope_parameters."""
    params = f.mapping("rope_parameters")
    nested = ConfigFields(params, f.source, "rope_parameters.")
    for where in (f, nested):
        if where.fields.get("partial_rotary_factor", 1.0) != 1.0:
            where.fail("partial_rotary_factor", "1.0", "partial rotary embeddings are not supported")
    theta = nested.number("rope_theta", None) if params else None
    if theta is None:
        theta = f.number("rope_theta", default_theta)
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


_FP8_FIX = ("mempath loads float16 / bfloat16 checkpoints (optionally quantized at load with --quantization fp8) "
            "and fp8 ones (compressed-tensors or vLLM's fp8, dynamic per-token activation scales)")


def _quantization(f: ConfigFields, arch: str, num_layers: int) -> tuple[str | None, frozenset[str]]:
    """("fp8", the projections it keeps in the model dtype) for the pre-quantized fp8 checkpoints mempath
    runs, (None, none) for a float one; any other quantization_config raises CheckpointError naming the field."""
    if f.fields.get("quantization_config") is None:
        return None, frozenset()
    q = ConfigFields(f.mapping("quantization_config"), f.source, "quantization_config.")
    method = q.choice("quant_method", ("compressed-tensors", "fp8"), fix=_FP8_FIX)
    if method is None:
        q.fail("quant_method", '"compressed-tensors" or "fp8"', _FP8_FIX)
    if method == "fp8":  # vLLM's own fp8 checkpoints: per-tensor weight scales
        q.choice("activation_scheme", ("dynamic",), "dynamic", "static activation scales are not supported: use "
                 "the model's bfloat16 checkpoint with --quantization fp8 (dynamic per-token scales)")
        if q.fields.get("weight_block_size") is not None:
            q.fail("weight_block_size", "null (per-tensor or per-channel weight scales)",
                   "block-wise fp8 is not supported: use a per-channel fp8 checkpoint or the bfloat16 one")
    else:
        _compressed_tensors_fp8(q)
    if arch in MOE_ARCHITECTURES:
        f.fail("quantization_config", "none for a mixture-of-experts model", "mempath keeps experts in the "
               "model dtype: use the model's bfloat16 checkpoint, with --quantization fp8 for its dense layers")
    return "fp8", _unquantized(q, arch, num_layers, method)


def _compressed_tensors_fp8(q: ConfigFields) -> None:
    """Every config group: fp8 weights (8-bit float, per channel or tensor, static) and dynamic
    per-token fp8 input activations, as the hub's FP8-Dynamic checkpoints are written."""
    q.choice("format", ("float-quantized", "naive-quantized"), fix=_FP8_FIX)
    if q.fields.get("kv_cache_scheme") is not None:
        q.fail("kv_cache_scheme", "null", "KV scales from the checkpoint are not supported: remove it and "
               "use --kv-cache-dtype fp8")
    if q.fields.get("transform_config") is not None:  # rotated weights, read as they are, would give wrong outputs
        q.fail("transform_config", "null", "weights stored with rotations or Hadamard transforms are not "
               "supported: use the model's fp8 checkpoint without them, or its bfloat16 one with --quantization fp8")
    # A sparsity_config with format "dense" describes weights stored whole; any other format packs them.
    sparsity = ConfigFields(q.mapping("sparsity_config"), q.source, q.prefix + "sparsity_config.")
    sparsity.choice("format", ("dense",), fix="weights stored in a sparse layout (2:4 bitmask and the like) are not "
                    "supported: use the model's dense fp8 checkpoint, or its bfloat16 one with --quantization fp8")
    groups = q.mapping("config_groups")
    if not groups:
        q.fail("config_groups", "an object of quantization schemes", _FP8_FIX)
    for name in groups:
        g = ConfigFields(ConfigFields(groups, q.source, q.prefix + "config_groups.").mapping(name), q.source,
                         f"{q.prefix}config_groups.{name}.")
        for part, strategies, dynamic in (("weights", ("channel", "tensor"), False),
                                          ("input_activations", ("token",), True)):
            if g.fields.get(part) is None:  # weight-only fp8 needs a kernel mempath does not have
                g.fail(part, f"an fp8 scheme ({'static' if part == 'weights' else 'dynamic'}, per "
                       f"{' or '.join(strategies)})", _FP8_FIX)
            s = ConfigFields(g.mapping(part), g.source, f"{g.prefix}{part}.")
            s.choice("type", ("float",), fix=_FP8_FIX)
            if s.fields.get("num_bits") != 8:
                s.fail("num_bits", "8", _FP8_FIX)
            if s.fields.get("strategy") not in strategies:
                s.fail("strategy", " or ".join(f'"{x}"' for x in strategies), _FP8_FIX)
            if s.flag("dynamic") != dynamic:
                s.fail("dynamic", str(dynamic).lower(), _FP8_FIX)
            if not s.flag("symmetric", True):
                s.fail("symmetric", "true", _FP8_FIX)
        if g.fields.get("output_activations") is not None:
            g.fail("output_activations", "null", _FP8_FIX)


# mempath's projections in a decoder layer, and the checkpoint's names of a fused one's parts (Phi-3's
# checkpoints hold them fused, under mempath's names).
_PROJECTIONS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": (),
                "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ()}


def _unquantized(q: ConfigFields, arch: str, num_layers: int, method: str) -> frozenset[str]:
    """The projections an fp8 checkpoint keeps in the model dtype, as vLLM and compressed-tensors match them
    (``_select``). compressed-tensors: those its ``ignore`` list names and those no config group's ``targets``
    name. vLLM's own fp8 (``method`` "fp8"): those its ``ignored_layers`` names, by exact module name (vLLM's
    fp8 compares names: no "re:" patterns). An entry that names no layer of the model is named in a warning,
    not refused: vLLM skips it, and recipes reuse one list across models (a MoE model's "re:.*mlp.gate$")."""
    projections = {f"model.layers.{i}.{name}": tuple(f"model.layers.{i}.{name.partition('.')[0]}.{part}"
                                                     for part in parts)
                   for i in range(num_layers) for name, parts in _PROJECTIONS.items()}
    linears = set(projections).union(*projections.values())
    if method == "fp8":
        return frozenset(_ignored(q, "ignored_layers", 'a list of module names, such as ["lm_head"]', projections,
                                  linears, arch, num_layers, patterns=False))
    groups = ConfigFields(q.mapping("config_groups"), q.source, q.prefix + "config_groups.")
    targeted = set()
    for name in groups.fields:
        g = ConfigFields(groups.fields[name], q.source, f"{groups.prefix}{name}.")
        targets = _module_patterns(g, "targets", 'a list of "Linear", module names and "re:" patterns, such as '
                                   '["Linear"]', required=True)
        for target in targets:
            if target != "Linear" and not any(_matches(target, linear) for linear in linears):
                g.fail("targets", '"Linear" or names / "re:" patterns of the projections', f'"{target}" names none of '
                       f"this model's q/k/v, o, gate/up and down projections, the only layers mempath holds in fp8: "
                       f"correct it, or use the model's bfloat16 checkpoint with --quantization fp8")
        targeted |= set(projections) if "Linear" in targets else _select(g, "targets", targets, projections)
    ignored = _ignored(q, "ignore", 'a list of module names and "re:" patterns, such as ["lm_head"]', projections,
                       linears, arch, num_layers)
    return frozenset(set(projections) - targeted | ignored)


def _ignored(q: ConfigFields, key: str, expected: str, projections: dict, linears: set[str], arch: str,
             num_layers: int, patterns: bool = True) -> set[str]:
    """The projections the list ``key`` (compressed-tensors' ignore, vLLM fp8's ignored_layers) keeps in the
    model dtype; its entries that name no linear layer of the model are named in a warning. ``patterns``:
    whether its "re:" entries are patterns (else names, as vLLM's fp8 reads them)."""
    entries = _module_patterns(q, key, expected, patterns=patterns)
    ignored = _select(q, key, entries, projections, patterns)
    unmatched = [entry for entry in entries
                 if not any(_matches(entry, name, patterns) for name in linears | {"lm_head"})]
    if unmatched:
        names_only = ("; it takes exact module names, not \"re:\" patterns, as vLLM's fp8 reads it"
                      if not patterns and any(entry.startswith("re:") for entry in unmatched) else "")
        log.warning("%s: %s%s entries %s match no linear layer of this %s (%d layers): nothing is kept unquantized "
                    "for them (vLLM skips them too)%s", q.source, q.prefix, key, unmatched, arch, num_layers,
                    names_only)
    return ignored


def _module_patterns(f: ConfigFields, key: str, expected: str, required: bool = False,
                     patterns: bool = True) -> list[str]:
    """A list of strings whose "re:" patterns compile (``patterns``: else they are names, not compiled); null or
    absent gives [] (refused where ``required``)."""
    value = f.fields.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list) or not all(isinstance(entry, str) for entry in value):
        f.fail(key, expected, None if value is None else "write its entries as a JSON list of strings")
    for entry in value if patterns else ():
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as error:
                f.fail(key, expected, f'its entry "{entry}" is not a valid regular expression ({error}): correct '
                       f'the pattern (after "re:", Python\'s re syntax)')
    return value


def _matches(entry: str, name: str, patterns: bool = True) -> bool:
    """vLLM's match of a module name: a "re:" pattern matched from the start (re.match), else equality
    (equality alone without ``patterns``)."""
    return re.match(entry[3:], name) is not None if patterns and entry.startswith("re:") else entry == name


def _select(f: ConfigFields, key: str, entries: list[str], projections: dict, patterns: bool = True) -> set[str]:
    """The projections ``entries`` name (``_matches``): a fused one by its own name or by every one of its parts.
    Naming some parts of one but not all is refused: its parts are one matrix, fp8 or not as a whole."""
    selected = set()
    for name, parts in projections.items():
        named = [part for part in parts if any(_matches(entry, part, patterns) for entry in entries)]
        if any(_matches(entry, name, patterns) for entry in entries) or (named and len(named) == len(parts)):
            selected.add(name)
        elif named:
            missed = ", ".join(part.rpartition(".")[2] for part in parts if part not in named)
            f.fail(key, "entries that name every part of a fused projection or none", f"it names {named[0]} but not "
                   f"{missed}, which mempath fuses with it into one matrix ({name.rpartition('.')[2]}), fp8 or not as "
                   f"a whole (vLLM refuses this too): name all of them or none")
    return selected
