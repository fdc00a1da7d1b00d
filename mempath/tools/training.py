"""Training memory for one micro-batch: weights, gradients, optimizer state, activations, logits.

Notation as in mempath.memory.formulas; s tokens per sequence, b sequences per micro-batch.
"""

from __future__ import annotations

from mempath.memory.formulas import ModelShape, count_params, linear_shapes


# Bytes per *trainable* parameter: (weights, grads, fp32 master copy, optimizer moments).
# None means "the model dtype": 8-bit AdamW is normally paired with 16-bit weights and
# grads and no master copy, so its only saving over `mixed` is in the moments.
OPTIMIZERS = {
    "adamw-fp32": (4, 4, 0, 8),
    "mixed": (2, 2, 4, 8),
    "adamw-8bit": (None, None, 0, 2),
}
CHECKPOINTING = ("none", "full", "selective")


def lora_trainable_params(shape: ModelShape, rank: int, targets) -> int:
    """r·(in + out) per adapted matrix per layer (A is r×in, B is out×r)."""
    shapes = linear_shapes(shape)
    return shape.num_layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)


def resolve_lora_targets(shape: ModelShape, targets) -> list[str]:
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    names = list(linear_shapes(shape))
    if list(targets) == ["all-linear"]:
        return names
    unknown = [t for t in targets if t not in names]
    if unknown or not targets:
        raise ValueError(
            f"LoRA targets {list(unknown) or list(targets)} are not linear layers of "
            f"{shape.architecture}: choose from {', '.join(names)} or all-linear"
        )
    return list(dict.fromkeys(targets))


def activation_dtype_bytes(optimizer: str, dtype_bytes: int, lora: bool) -> int:
    """Bytes of an activation element: the dtype the forward computes in. mixed computes in 16-bit (16-bit
    weights, or autocast over fp32 ones); a LoRA base is frozen in the model dtype and the forward runs
    through it in that dtype; a full fine-tune computes in its weights' dtype (adamw-fp32: fp32)."""
    if optimizer == "mixed":
        return 2
    weights = OPTIMIZERS[optimizer][0]
    return dtype_bytes if lora or weights is None else weights


def layer_activation_bytes(seq_len: int, micro_batch: int, shape: ModelShape, element_bytes: int = 2) -> int:
    """Korthikanti et al. (2022), no tensor or sequence parallelism, at `element_bytes` per element.

    Their 16-bit count, s·b·h·(34 + 5·a·s/h), is 16·s·b·h elements at 2 B (attention 5: its input,
    Q, K, V, the output projection's input; MLP 9: its input and two 4h-wide tensors; the two
    LayerNorms' inputs 2) plus two 1-byte dropout masks of s·b·h (34 = 16·2 + 2), and per head
    two s×s tensors (softmax output, its dropout's output) at 2 B plus a 1-byte mask (5 = 2·2 + 1).
    At e bytes an element the masks stay 1 byte: s·b·((16·e + 2)·h + (2·e + 1)·a·s), exact in
    integers; e = 2 gives theirs, e = 4 (fp32) s·b·(66·h + 9·a·s).
    """
    s, b, e = seq_len, micro_batch, element_bytes
    return s * b * ((16 * e + 2) * shape.hidden_size + (2 * e + 1) * shape.num_heads * s)


def plan_training(shape: ModelShape, dtype_bytes: int, *, optimizer: str, micro_batch: int,
                  seq_len: int, checkpointing: str, checkpoint_layers, lora_rank: int,
                  lora_targets) -> dict:
    """Training memory for one micro-batch.

    State, per trainable parameter (OPTIMIZERS): adamw-fp32 4+4+8; mixed 2 (16-bit
    weights) + 2 (grads) + 4 (fp32 master) + 8 (moments); adamw-8bit model-dtype
    weights and grads + 2 (two 8-bit moments; the block-wise scales, ~0.2%, are left
    out). With LoRA the base is frozen in the model dtype with no grads or optimizer
    state, and only the adapters carry the optimizer's state.

    Activations are e bytes an element, e = activation_dtype_bytes (adamw-fp32 4; mixed 2;
    adamw-8bit and LoRA the model dtype's). With A = layer_activation_bytes at e (+ e·s·b·r per
    adapted matrix for the LoRA intermediate):
        none:       L·A
        full:       L·e·s·b·h (each layer's input) + A (one layer recomputed at a time)
        selective:  C checkpointed layers: C·e·s·b·h + (L−C)·A + A
    Logits: s·b·V·(e + 4), the LM-head output in the compute dtype (the outputs a training loop
    holds through the backward) and the fp32 log-softmax the cross-entropy keeps for its backward.
    """
    _check_training(optimizer, micro_batch, seq_len, checkpointing, lora_rank)
    _check_against_the_model(shape, lora_rank)
    L = shape.num_layers
    layers = _checkpointed_layers(L, checkpointing, checkpoint_layers)

    total_params = count_params(shape)["total"]
    targets = resolve_lora_targets(shape, lora_targets) if lora_rank else []
    trainable = lora_trainable_params(shape, lora_rank, targets) if lora_rank else total_params
    frozen = total_params if lora_rank else 0

    w, g, master, moments = OPTIMIZERS[optimizer]
    w = dtype_bytes if w is None else w
    g = dtype_bytes if g is None else g

    s, b, h = seq_len, micro_batch, shape.hidden_size
    e = activation_dtype_bytes(optimizer, dtype_bytes, bool(lora_rank))
    per_layer = layer_activation_bytes(s, b, shape, e) + e * s * b * lora_rank * len(targets)
    stored = len(layers) * e * s * b * h + (L - len(layers)) * per_layer
    activations = stored + (per_layer if layers else 0)

    figures = {
        "optimizer": optimizer,
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "checkpointing": checkpointing,
        "checkpoint_layers": layers if checkpointing == "selective" else [],
        "lora_rank": lora_rank,
        "lora_targets": targets,
        "trainable_params": trainable,
        "train_weight_bytes": frozen * dtype_bytes + trainable * w,
        "grad_bytes": trainable * g,
        "master_weight_bytes": trainable * master,
        "optimizer_bytes": trainable * moments,
        "activation_dtype_bytes": e,
        "activation_bytes_per_layer": per_layer,
        "train_activation_bytes": activations,
        "train_logits_bytes": s * b * shape.vocab_size * (e + 4),
    }
    figures["train_total_bytes"] = sum(figures[k] for k in (
        "train_weight_bytes", "grad_bytes", "master_weight_bytes", "optimizer_bytes",
        "train_activation_bytes", "train_logits_bytes"))
    return figures


def _check_training(optimizer, micro_batch, seq_len, checkpointing, lora_rank) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: use {', '.join(OPTIMIZERS)}")
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"unknown checkpointing {checkpointing!r}: use {', '.join(CHECKPOINTING)}")
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"lora_rank must be 0 (full fine-tune) or a positive integer, got {lora_rank!r}")


def _check_against_the_model(shape: ModelShape, lora_rank: int) -> None:
    if lora_rank > shape.hidden_size:
        raise ValueError(f"lora_rank {lora_rank} is above the hidden size {shape.hidden_size}, where an adapter "
                         f"adds nothing a full fine-tune would not: give a rank below it")


def _checkpointed_layers(L: int, checkpointing: str, checkpoint_layers) -> list[int]:
    """The layers whose inputs are kept (all with full checkpointing), checked against the model's L."""
    layers = sorted(set(checkpoint_layers))
    bad = [i for i in layers if not 0 <= i < L]
    if bad:
        raise ValueError(f"checkpoint layers {bad} out of range: the model has layers 0..{L - 1}")
    if checkpointing == "selective" and not layers:
        raise ValueError("checkpointing='selective' needs checkpoint_layers (e.g. 0,2,4 or 0-15)")
    if checkpointing != "selective" and layers:
        raise ValueError(f"checkpoint_layers given with checkpointing={checkpointing!r}: use 'selective'")
    if checkpointing == "full":
        layers = list(range(L))
    return layers
