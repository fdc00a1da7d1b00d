"""A model's shape as the byte formulas read it (memory/formulas.py): the engine's own config reader's
fields, so the planner and the engine agree on every model and refuse the same configs."""

from __future__ import annotations

from dataclasses import dataclass

from mempath.constants import DTYPE_ALIASES, DTYPE_BYTES


@dataclass
class ModelShape:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tied_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    config_dtype: str | None
    qk_norm: str | None = None  # "head": one d-wide norm each for q and k (Qwen3); "full": over all heads (OLMoE)
    num_experts: int = 0  # routed experts per MoE layer (0: dense)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_moe_layers: int = 0  # the other layers have a dense MLP of intermediate_size
    quantization: str | None = None  # "fp8": the projections in one byte per weight (weight_bytes)
    num_expert_slots: int = 0  # experts per MoE layer on the device when fewer than all (0: all)
    # The projections an fp8 checkpoint keeps in the model dtype, by module name
    # ("model.layers.0.self_attn.qkv_proj"): ModelSpec.unquantized. The others follow quantization.
    unquantized: frozenset[str] = frozenset()
    model_len_limit: int | None = None  # ModelSpec.max_model_len_limit (None: max_position_embeddings)

    @property
    def max_model_len_limit(self) -> int:
        """The engine's longest sequence."""
        return self.model_len_limit or self.max_position_embeddings


def read_shape(config: dict, source: str = "config.json") -> ModelShape:
    """The planner's view of a config, read and validated by the engine's own reader
    (ModelSpec.from_hf_config), so the two agree on every field and refuse the same configs."""
    from mempath.model.spec import ModelSpec
    return shape_from_spec(ModelSpec.from_hf_config(config, source=source))


def shape_from_spec(spec) -> ModelShape:
    return ModelShape(
        architecture=spec.architecture,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        model_len_limit=spec.max_model_len_limit,
        tied_embeddings=spec.tie_word_embeddings,
        attention_bias=spec.qkv_bias,
        mlp_bias=spec.mlp_bias,
        config_dtype=spec.torch_dtype,
        qk_norm=("head" if spec.qk_norm_per_head else "full") if spec.qk_norm else None,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_moe_layers=len(spec.moe_layers),
        quantization=spec.quantization,
        unquantized=spec.unquantized,
    )


def resolve_dtype(dtype: str, shape: ModelShape) -> tuple[str, int]:
    """(name, bytes); "auto" takes the checkpoint's dtype, bfloat16 if it names none."""
    if dtype == "auto":
        # A checkpoint that names no dtype we know is served in bfloat16, like vLLM's auto.
        name = DTYPE_ALIASES.get(str(shape.config_dtype).lower().removeprefix("torch."), "bfloat16")
        return name, DTYPE_BYTES[name]
    name = DTYPE_ALIASES.get(str(dtype).lower().removeprefix("torch."))
    if name is None:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, bfloat16, float16 or float32")
    return name, DTYPE_BYTES[name]
