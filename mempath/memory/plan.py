"""Memory planner: every pathway's bytes from a model's config.json, with no GPU needed.

`plan_memory` turns (config, dtype, device size, engine settings) into a `MemoryPlan`;
`format_plan` renders it as a terminal table; `add_plan_arguments` and `run_plan` are
the `mempath plan MODEL ...` command.

Notation used in the docstrings below: L layers, h hidden size, I intermediate (MLP)
size, n_q / n_kv attention / key-value heads, d head dim, V vocabulary, b bytes per
element of the model dtype, T tokens in one forward pass.

Supported architectures: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
(q/k/v bias), Qwen3ForCausalLM (q/k RMSNorm), Phi3ForCausalLM (fused qkv_proj and
gate_up_proj), and the mixture-of-experts Qwen3MoeForCausalLM, MixtralForCausalLM and
OlmoeForCausalLM (E experts of I_e intermediate size, k active per token). Parameter
counts are exact: the tests compare them with the transformers models instantiated
on the meta device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mempath.constants import DEFAULT_BLOCK_SIZE, DTYPE_ALIASES, DTYPE_BYTES, MAX_GRAPH_BATCH, SAMPLER_SORT_ROWS

GiB = 1 << 30


# Bytes per *trainable* parameter: (weights, grads, fp32 master copy, optimizer moments).
# None means "the model dtype": 8-bit AdamW is normally paired with 16-bit weights and
# grads and no master copy, so its only saving over `mixed` is in the moments.
OPTIMIZERS = {
    "adamw-fp32": (4, 4, 0, 8),
    "mixed": (2, 2, 4, 8),
    "adamw-8bit": (None, None, 0, 2),
}
CHECKPOINTING = ("none", "full", "selective")

# cuBLAS takes a workspace per (handle, stream) through PyTorch's allocator; capture
# runs on its own stream, so the graph pool gets one. PyTorch's default size:
# 32 MiB on compute capability 9.x and later, 4096·2 + 16·8 KiB before.
CUBLAS_WORKSPACE_BYTES_SM90 = 32 << 20
CUBLAS_WORKSPACE_BYTES_OLDER = (4096 * 2 + 16 * 8) << 10
DEFAULT_TRAIN_SEQ_LEN = 4096
# The most of the host's memory the advice proposes pinning for the host KV tier: vLLM
# refuses a --swap-space above 70% of the host's memory.
HOST_KV_FRACTION = 0.7


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


@dataclass
class MemoryPlan:
    # model
    architecture: str
    dtype: str
    dtype_bytes: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    # weights, per pathway (parameters, then bytes in `dtype`)
    embedding_params: int
    attention_params: int
    mlp_params: int
    norm_params: int
    lm_head_params: int
    total_params: int
    embedding_bytes: int
    attention_bytes: int
    mlp_bytes: int
    norm_bytes: int
    lm_head_bytes: int
    weight_bytes: int
    # KV cache
    block_size: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    blocks_per_seq: int
    kv_bytes_per_seq: int
    # settings
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_mem_bytes: int | None
    gpu_memory_utilization: float
    cuda_graphs: bool
    fused_kernels: bool  # the activation peak assumes the fused CUDA path (else the PyTorch one)
    # workspace
    activation_peak_bytes: int
    logits_rows: int
    logits_bytes: int
    step_peak_bytes: int  # max(activation peak, sampling phase): what the engine's profile step measures
    cuda_graph_batch: int
    cuda_graph_bytes: int
    context_bytes: int
    workspace_bytes: int
    # capacity (None without gpu_mem_bytes)
    budget_bytes: int | None = None
    kv_budget_bytes: int | None = None
    num_kv_blocks: int | None = None
    kv_capacity_tokens: int | None = None
    max_concurrency: int | None = None
    kv_bytes_wanted: int = 0
    fits: bool | None = None  # serving: at least one max-model-len sequence fits
    host_mem_bytes: int | None = None  # bounds the host KV tier the advice may propose
    kv_cache_dtype: str = "auto"  # auto: the model dtype; fp8*: one byte per element
    # mixture of experts (zeros for a dense model); the routed experts are not in mlp_*
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_cache_size: int = 0  # experts per layer resident on the device
    expert_params: int = 0
    expert_bytes: int = 0  # every routed expert
    resident_expert_bytes: int = 0
    resident_weight_bytes: int = 0  # what the device holds: weight_bytes less the experts not resident
    host_expert_bytes: int = 0  # with fewer resident, host memory holds every expert (slots copy from it)
    active_params: int = 0  # parameters one token reads: all but the routed experts, plus k of them per layer
    # training (zeros unless train=True)
    train: bool = False
    optimizer: str = "adamw-fp32"
    micro_batch: int = 1
    seq_len: int = 0
    checkpointing: str = "none"
    checkpoint_layers: list[int] = field(default_factory=list)
    lora_rank: int = 0
    lora_targets: list[str] = field(default_factory=list)
    trainable_params: int = 0
    train_weight_bytes: int = 0
    grad_bytes: int = 0
    master_weight_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes_per_layer: int = 0
    train_activation_bytes: int = 0
    train_logits_bytes: int = 0
    train_total_bytes: int = 0
    train_fits: bool | None = None
    advice: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- config and sizes


def config_path(model: str | os.PathLike) -> Path:
    """Where a model's config.json is: in a model directory, the path itself, or the hub cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path / "config.json"
    if not path.exists():
        return _cached_hub_config(str(model)) or path
    return path


def load_config(model: str | os.PathLike | dict) -> dict:
    """The config as a dict, from a dict, a model directory, a config.json path, or a
    Hugging Face hub id already in the local cache (no network)."""
    if isinstance(model, dict):
        return dict(model)
    path = config_path(model)
    if not path.exists():
        raise ValueError(
            f"no config.json at {path}: pass a model directory, a path to its config.json, "
            f"or a hub id that is already downloaded"
        )
    from mempath.model.loader import read_json_object
    return read_json_object(path, "a JSON object of model settings")


def _cached_hub_config(repo_id: str) -> Path | None:
    if repo_id.count("/") != 1:
        return None
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    snapshots = Path(hub) / ("models--" + repo_id.replace("/", "--")) / "snapshots"
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def read_shape(config: dict, source: str = "config.json") -> ModelShape:
    """The planner's view of a config, read and validated by the engine's own reader
    (ModelSpec.from_hf_config), so the two agree on every field and refuse the same configs."""
    from mempath.model.llama import ModelSpec
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
        tied_embeddings=spec.tie_word_embeddings,
        attention_bias=spec.qkv_bias,
        mlp_bias=spec.mlp_bias,
        config_dtype=spec.torch_dtype,
        qk_norm=("head" if spec.qk_norm_per_head else "full") if spec.qk_norm else None,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_moe_layers=len(spec.moe_layers),
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


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """"80GiB" -> 85899345920, "24GB" -> 24000000000, "1.5T" -> 1.5e12, "123" -> 123.

    KiB/MiB/GiB/TiB (and Ki, Mi, ...) are powers of 1024; KB/MB/GB/TB and bare K/M/G/T
    are powers of 1000, as on GPU spec sheets.
    """
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        if not match:
            raise ValueError(f"cannot read {text!r} as a size: write e.g. 80GiB, 24GB or a byte count")
        number, unit = match.groups()
        unit = unit.lower().rstrip("b")
        base = 1024 if unit.endswith("i") else 1000
        power = "kmgt".find(unit[:1]) + 1 if unit else 0
        value = int(float(number) * base**power)
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def parse_size_flag(flag: str, text: str) -> int:
    """A size from the command line, which must name its unit: `--gpu-mem 80` meant 80 GiB, not bytes."""
    if re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", str(text)):
        raise ValueError(f"{flag} {text.strip()} has no unit: write {text.strip()}GiB (or {text.strip()}GB, "
                         f"or {text.strip()}B for bytes)")
    return parse_bytes(text)


def detect_gpu_mem() -> int | None:
    """Total memory of the current CUDA device, or None when there is none."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


# ---------------------------------------------------------------- weights and KV


def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int, bool]]:
    """One decoder layer's linear layers: name -> (in_features, out_features, has_bias).

    The names are the checkpoint's, so they double as LoRA target names.
    """
    h, i, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    if shape.architecture == "Phi3ForCausalLM":
        return {
            "qkv_proj": (h, q + 2 * kv, False),
            "o_proj": (q, h, False),
            "gate_up_proj": (h, 2 * i, False),
            "down_proj": (i, h, False),
        }
    o_bias = shape.attention_bias and shape.architecture != "Qwen2ForCausalLM"
    return {
        "q_proj": (h, q, shape.attention_bias),
        "k_proj": (h, kv, shape.attention_bias),
        "v_proj": (h, kv, shape.attention_bias),
        "o_proj": (q, h, o_bias),
        "gate_proj": (h, i, shape.mlp_bias),
        "up_proj": (h, i, shape.mlp_bias),
        "down_proj": (i, h, shape.mlp_bias),
    }


def count_params(shape: ModelShape) -> dict[str, int]:
    """Parameters per pathway: embedding, attention, mlp, experts, norms, lm_head.

    embedding V·h; attention L·(h·(n_q+2·n_kv)·d + n_q·d·h + biases); mlp (L−M)·(3·h·I +
    biases) over the L−M dense layers, plus M·E·h for the M MoE layers' routers;
    experts M·E·3·h·I_e; norms L·2·h + h for the final norm, plus L·2·d for Qwen3's q/k
    norms or L·(n_q+n_kv)·d for OLMoE's (counted as norms, not attention, because they
    are RMSNorm weights); lm_head V·h, or 0 when tied, because a tied head reads the
    embedding's storage.
    """
    attention = mlp = 0
    for name, (fan_in, fan_out, bias) in linear_shapes(shape).items():
        params = fan_in * fan_out + (fan_out if bias else 0)
        if name.endswith(("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")):
            attention += params
        else:
            mlp += params
    L, h, d = shape.num_layers, shape.hidden_size, shape.head_dim
    norms = L * 2 * h + h
    if shape.qk_norm == "head":
        norms += L * 2 * d
    elif shape.qk_norm == "full":
        norms += L * (shape.num_heads + shape.num_kv_heads) * d
    embedding = shape.vocab_size * h
    moe_layers, experts = shape.num_moe_layers, shape.num_experts
    counts = {
        "embedding": embedding,
        "attention": L * attention,
        "mlp": (L - moe_layers) * mlp + moe_layers * experts * h,
        "experts": moe_layers * experts * 3 * h * shape.moe_intermediate_size,
        "norms": norms,
        "lm_head": 0 if shape.tied_embeddings else embedding,
    }
    counts["total"] = sum(counts.values())
    return counts


def expert_bytes(shape: ModelShape, dtype_bytes: int, cache_size: int | None = None) -> tuple[int, int]:
    """(bytes of every routed expert, bytes of those resident on the device): with
    ``cache_size`` experts per layer resident (None: all), the device holds
    M·cache_size·3·h·I_e·b and host memory the rest."""
    total = count_params(shape)["experts"] * dtype_bytes
    if not shape.num_experts:
        return 0, 0
    resident = shape.num_experts if cache_size is None else cache_size
    return total, total // shape.num_experts * resident


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """2 (K and V) · L · n_kv · d · b. Every layer keeps full KV: Mistral's sliding
    window is not used to trim the cache, so this is an upper bound for Mistral."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes


# ---------------------------------------------------------------- inference workspace


# nn.Module objects of one decoder layer in host memory (about 24 KiB measured in
# CPython 3.11 for the Llama layer), rounded up.
MODULE_BYTES_PER_LAYER = 32 << 10


def rotary_bytes_per_position(head_dim: int) -> int:
    """float32 bytes per position the rotary tables cost while built (RotaryEmbedding.build):
    kept cos and sin (2·4·d), and the positions (4), angles (4·d/2) and doubled angles
    (4·d) alive while they are computed."""
    return 8 * head_dim + 4 + 2 * head_dim + 4 * head_dim


def load_bytes(shape: ModelShape, dtype_bytes: int, positions: int,
               checkpoint_dtype_bytes: int | None = None, expert_cache_size: int | None = None) -> dict[str, int]:
    """What loading a model allocates, by part, before any KV cache or step buffer.

    weights: every parameter on the device in the model dtype (with ``expert_cache_size``,
    only the resident experts); host_experts: every expert, when fewer are resident (the
    device slots are filled from them);
    rotary_tables: cos and sin kept for ``positions`` positions (float32); rotary_build:
    the temporaries of their build; modules: the Python module objects (host);
    largest_tensor: the one checkpoint tensor the streaming loader holds in host memory
    at a time, in the checkpoint's dtype (a layer's stacked experts, E·2·I_e rows, in
    checkpoints saved that way).
    """
    h, d = shape.hidden_size, shape.head_dim
    fused_rows = max(shape.num_heads * d + 2 * shape.num_kv_heads * d, 2 * shape.intermediate_size,
                     shape.vocab_size, shape.num_experts * 2 * shape.moe_intermediate_size)
    kept = 8 * positions * d
    experts, resident = expert_bytes(shape, dtype_bytes, expert_cache_size)
    return {
        "weights": count_params(shape)["total"] * dtype_bytes - experts + resident,
        "host_experts": experts if resident < experts else 0,
        "rotary_tables": kept,
        "rotary_build": positions * rotary_bytes_per_position(d) - kept,
        "modules": shape.num_layers * MODULE_BYTES_PER_LAYER,
        "largest_tensor": fused_rows * h * (checkpoint_dtype_bytes or dtype_bytes),
    }


def decoder_peak_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, fused: bool = True) -> int:
    """Peak bytes of one forward pass over `tokens` tokens, excluding the logits.

    Layers run one after another and free their temporaries before the next starts, so
    the pass peaks inside one layer, on top of the streams that cross layer boundaries.
    Two code paths (mempath.model.ops):

    fused (CUDA with Triton): RMSNorm adds the residual and normalises in place, and
    SiLU-and-mul writes one I-wide output:
        streams:   residual T·h + normed input T·h
        MLP phase: gate/up T·2·I + activated T·I
    PyTorch (the CPU path): each op makes a new tensor while the caller still holds
    the previous sublayer output and residual, and silu(gate) and its product with
    up are alive together:
        streams:   old residual, new residual, sublayer output, normed input: 4·T·h
        MLP phase: gate/up T·2·I + silu(gate) T·I + product T·I
    Both:
        attention phase: qkv T·(n_q+2·n_kv)·d + rotated q, k T·(n_q+n_kv)·d
                         + attention output T·n_q·d + o_proj output T·h
        peak = b · (streams + max(attention phase, MLP phase))

    Attention is taken as flash-style (no T×T score matrix), as in paged attention
    kernels; the PyTorch reference attention adds one sequence's scores on top.
    Not modelled: the PyTorch RMSNorm's float32 temporaries on 16-bit input. They
    matter only for Qwen3's wide q/k norms on the PyTorch path (measured on the CPU,
    Qwen3-0.6B shape in bf16: +50%); the fused CUDA kernels make none.
    Mixture-of-experts layers replace the MLP phase with moe_phase_bytes.
    """
    h, i, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    attention = (q + 2 * kv) + (q + kv) + q + h
    streams, mlp = (2 * h, 3 * i) if fused else (4 * h, 4 * i)
    if not shape.num_moe_layers:
        return tokens * dtype_bytes * (streams + max(attention, mlp))
    dense = tokens * dtype_bytes * mlp if shape.num_moe_layers < shape.num_layers else 0
    phase = max(tokens * dtype_bytes * attention, dense, moe_phase_bytes(shape, tokens, dtype_bytes, fused))
    return tokens * dtype_bytes * streams + phase


def moe_phase_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, fused: bool = True) -> int:
    """Bytes a MoE block (mempath.model.moe) holds at its peak over `tokens` tokens, beside the streams.

    With k experts per token, b bytes per element: the tokens per expert (E·8 B), per
    token the pairs' expert ids, sort order and float32 weights (k·20 B), and the larger of
        experts:   the inputs gathered in expert order k·h and the outputs k·h, plus one
                   group's work, up to T rows (all of a batch's tokens may pick one
                   expert): gate/up 2·I_e and activated I_e (+ silu(gate) I_e on the
                   PyTorch path) or, at the down projection, gate/up, activated and its h
        combining: the outputs k·h, weighted k·h, back in token order k·h, summed h
        routing:   logits E·b and their float32 softmax E·4
    """
    h, i, k, experts = shape.hidden_size, shape.moe_intermediate_size, shape.num_experts_per_tok, shape.num_experts
    group = 3 * i + h if fused else max(4 * i, 3 * i + h)
    per_token = k * 20 + max(dtype_bytes * (2 * k * h + group), dtype_bytes * (3 * k * h + h),
                             experts * (dtype_bytes + 4))
    return experts * 8 + tokens * per_token



def sampler_peak_bytes(vocab_size: int, rows: int) -> int:
    """The sampler's peak at its costliest settings (temperature, top-k/top-p, logprobs).

    It works in place on one float32 copy of the logits (4 B per entry), and then
    needs either the exponential noise (4 B per entry) or, when top-p rows without
    top-k are sorted SAMPLER_SORT_ROWS at a time, a slice's values (4), indices (8),
    mask (1), probabilities (4) and cumulative sums (4): 21 B per entry of the slice.
    (With a top-k on every row only the top k are taken: the noise phase is the
    peak.) Logprobs keep only per-row constants and the top-n. Measured on the CPU by
    tests/test_sampler.py; on CUDA the sort's own temporaries come on top.
    """
    return vocab_size * max(8 * rows, 4 * rows + 21 * min(rows, SAMPLER_SORT_ROWS))


def logits_bytes(shape: ModelShape, rows: int, dtype_bytes: int = 4) -> int:
    """Logits only for the rows that are sampled (the last token of each sequence), so
    at most max_num_seqs rows: the lm_head output in the model dtype (rows · V · b),
    alive while the sampler runs, plus the sampler's peak (sampler_peak_bytes)."""
    return rows * shape.vocab_size * dtype_bytes + sampler_peak_bytes(shape.vocab_size, rows)


def step_peak_bytes(shape: ModelShape, tokens: int, rows: int, dtype_bytes: int, fused: bool = True) -> int:
    """Peak of one whole step over its weights and KV: the decoder forward, or the
    sampling phase after it (the final hidden states T·h·b, the sampled rows'
    hidden states, and the logits with the sampler), whichever is larger."""
    sampling = (tokens + rows) * shape.hidden_size * dtype_bytes + logits_bytes(shape, rows, dtype_bytes)
    return max(decoder_peak_bytes(shape, tokens, dtype_bytes, fused), sampling)


def cublas_workspace_bytes(capability_major: int) -> int:
    return CUBLAS_WORKSPACE_BYTES_SM90 if capability_major >= 9 else CUBLAS_WORKSPACE_BYTES_OLDER


def cuda_graph_bytes(shape: ModelShape, batch: int, dtype_bytes: int,
                     cublas_workspace: int = CUBLAS_WORKSPACE_BYTES_SM90) -> int:
    """What capturing the decode CUDA graphs adds: the graphs' output buffer and their pool.

    Graphs are captured largest batch first and share one pool, so the pool holds one
    decode step at the largest batch (one token per sequence): the forward's
    intermediates decoder_peak(batch), the lm_head output batch·V·b, and the cuBLAS
    workspace of the capture stream. The graphs copy their logits into one static
    output buffer, batch·V·b more. (The step's input buffers exist before capture and
    are counted with them.)
    """
    logits = batch * shape.vocab_size * dtype_bytes
    return decoder_peak_bytes(shape, batch, dtype_bytes) + 2 * logits + cublas_workspace


# ---------------------------------------------------------------- training


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


def layer_activation_bytes(seq_len: int, micro_batch: int, shape: ModelShape) -> int:
    """Korthikanti et al. (2022): s·b·h·(34 + 5·a·s/h) bytes per layer, 16-bit, no
    tensor or sequence parallelism; written as s·b·(34·h + 5·a·s) so it stays exact.
    The 5·a·s² term is the attention score matrix, softmax and dropout mask."""
    s, b = seq_len, micro_batch
    return s * b * (34 * shape.hidden_size + 5 * shape.num_heads * s)


def plan_training(shape: ModelShape, dtype_bytes: int, *, optimizer: str, micro_batch: int,
                  seq_len: int, checkpointing: str, checkpoint_layers, lora_rank: int,
                  lora_targets) -> dict:
    """Training memory for one micro-batch.

    State, per trainable parameter (OPTIMIZERS): adamw-fp32 4+4+8; mixed 2 (16-bit
    weights) + 2 (grads) + 4 (fp32 master) + 8 (moments); adamw-8bit model-dtype
    weights and grads + 2 (two 8-bit moments; the block-wise scales, ~0.2%, are left
    out). With LoRA the base is frozen in the model dtype with no grads or optimizer
    state, and only the adapters carry the optimizer's state.

    Activations with A = layer_activation_bytes (+ 2·s·b·r per adapted matrix for the
    LoRA intermediate):
        none:       L·A
        full:       L·2·s·b·h (each layer's input) + A (one layer recomputed at a time)
        selective:  C checkpointed layers: C·2·s·b·h + (L−C)·A + A
    Logits: s·b·V·(2 + 4), the 16-bit LM-head output and its fp32 copy for the loss.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: use {', '.join(OPTIMIZERS)}")
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"unknown checkpointing {checkpointing!r}: use {', '.join(CHECKPOINTING)}")
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"lora_rank must be 0 (full fine-tune) or a positive integer, got {lora_rank!r}")

    L = shape.num_layers
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

    total_params = count_params(shape)["total"]
    targets = resolve_lora_targets(shape, lora_targets) if lora_rank else []
    trainable = lora_trainable_params(shape, lora_rank, targets) if lora_rank else total_params
    frozen = total_params if lora_rank else 0

    w, g, master, moments = OPTIMIZERS[optimizer]
    w = dtype_bytes if w is None else w
    g = dtype_bytes if g is None else g

    s, b, h = seq_len, micro_batch, shape.hidden_size
    per_layer = layer_activation_bytes(s, b, shape) + 2 * s * b * lora_rank * len(targets)
    stored = len(layers) * 2 * s * b * h + (L - len(layers)) * per_layer
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
        "activation_bytes_per_layer": per_layer,
        "train_activation_bytes": activations,
        "train_logits_bytes": s * b * shape.vocab_size * (2 + 4),
    }
    figures["train_total_bytes"] = sum(figures[k] for k in (
        "train_weight_bytes", "grad_bytes", "master_weight_bytes", "optimizer_bytes",
        "train_activation_bytes", "train_logits_bytes"))
    return figures


# ---------------------------------------------------------------- the plan


def plan_memory(model: str | dict, *, dtype: str = "auto", gpu_mem_bytes: int | None = None,
                host_mem_bytes: int | None = None,
                gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                block_size: int = DEFAULT_BLOCK_SIZE, cuda_graphs: bool = True,
                fused_kernels: bool = True, context_bytes: int = 0,
                cublas_workspace: int = CUBLAS_WORKSPACE_BYTES_SM90, train: bool = False,
                optimizer: str = "adamw-fp32", kv_cache_dtype: str = "auto",
                micro_batch: int = 1, seq_len: int | None = None, checkpointing: str = "none",
                checkpoint_layers=(), lora_rank: int = 0,
                lora_targets=("q_proj", "v_proj"), moe_expert_cache_size: int | None = None) -> MemoryPlan:
    """Plan every pathway's bytes for serving (and, with train=True, training) a model.

    Capacity, when gpu_mem_bytes is given (no device is probed here; `run_plan` does
    that for the CLI):
        budget    = floor(gpu_mem · gpu_memory_utilization)
        kv budget = budget − weights − step peak − CUDA graphs − context
        step peak = max(activation peak, final hidden states + logits + sampler)
        blocks    = floor(kv budget / block bytes); tokens = blocks · block_size
        max concurrency = blocks // ceil(max_model_len / block_size), which equals
                          tokens // max_model_len when max_model_len is a multiple of
                          block_size (a sequence holds whole blocks).
    Training (train=True) is planned for seq_len tokens per sequence, by default
    min(max_model_len, 4096), against the same budget; see plan_training.

    host_mem_bytes (the host's total memory) bounds the --cpu-kv-gb the advice proposes
    (HOST_KV_FRACTION of it); without it the advice proposes no host tier.

    context_bytes is what the caller knows must stay free for non-PyTorch memory (CUDA
    context, cuBLAS workspaces); it cannot be derived from the config, so it defaults
    to 0 and the headroom left by gpu_memory_utilization is expected to hold it.
    cublas_workspace is the bytes of one cuBLAS workspace (cublas_workspace_bytes gives
    it for a compute capability; the default is Hopper's; 0 for the CPU): one for the
    serving stream, counted in the step peak, and one for the graph-capture stream.

    Mixture-of-experts models: moe_expert_cache_size experts per layer stay on the
    device (None: all) and the KV budget is taken after the resident weights only
    (resident_weight_bytes); the others' bytes are in host memory.
    """
    source = "config.json" if isinstance(model, dict) else str(config_path(model))
    shape = read_shape(load_config(model), source)
    dtype_name, b = resolve_dtype(dtype, shape)
    max_model_len = shape.max_position_embeddings if max_model_len is None else max_model_len
    _check_settings(shape, gpu_mem_bytes, host_mem_bytes, gpu_memory_utilization, max_model_len, max_num_seqs,
                    max_num_batched_tokens, block_size, context_bytes)

    params = count_params(shape)
    experts = _plan_experts(shape, b, params, moe_expert_cache_size)
    if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        raise ValueError(f"kv_cache_dtype must be auto, fp8, fp8_e4m3 or fp8_e5m2, got {kv_cache_dtype!r}")
    # EngineConfig.kv_cache_dtype: an fp8 cache holds one byte per element whatever the model dtype.
    per_token = kv_bytes_per_token(shape, b if kv_cache_dtype == "auto" else 1)
    per_block = per_token * block_size
    blocks_per_seq = -(-max_model_len // block_size)
    rows = min(max_num_seqs, max_num_batched_tokens)
    graph_batch = min(max_num_seqs, MAX_GRAPH_BATCH) if cuda_graphs else 0
    activation = decoder_peak_bytes(shape, max_num_batched_tokens, b, fused_kernels)
    logits = logits_bytes(shape, rows, b)
    # The first matmul on the serving stream allocates cuBLAS's workspace; it stays.
    step_peak = step_peak_bytes(shape, max_num_batched_tokens, rows, b, fused_kernels) + cublas_workspace
    graphs = cuda_graph_bytes(shape, graph_batch, b, cublas_workspace) if cuda_graphs else 0

    plan = MemoryPlan(
        architecture=shape.architecture, dtype=dtype_name, dtype_bytes=b,
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        vocab_size=shape.vocab_size, tied_embeddings=shape.tied_embeddings,
        embedding_params=params["embedding"], attention_params=params["attention"],
        mlp_params=params["mlp"], norm_params=params["norms"],
        lm_head_params=params["lm_head"], total_params=params["total"],
        embedding_bytes=params["embedding"] * b, attention_bytes=params["attention"] * b,
        mlp_bytes=params["mlp"] * b, norm_bytes=params["norms"] * b,
        lm_head_bytes=params["lm_head"] * b, weight_bytes=params["total"] * b,
        block_size=block_size, kv_bytes_per_token=per_token, kv_bytes_per_block=per_block,
        blocks_per_seq=blocks_per_seq, kv_bytes_per_seq=blocks_per_seq * per_block,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, gpu_mem_bytes=gpu_mem_bytes, host_mem_bytes=host_mem_bytes,
        kv_cache_dtype=kv_cache_dtype,
        gpu_memory_utilization=gpu_memory_utilization, cuda_graphs=cuda_graphs,
        fused_kernels=fused_kernels,
        activation_peak_bytes=activation, logits_rows=rows, logits_bytes=logits, step_peak_bytes=step_peak,
        cuda_graph_batch=graph_batch, cuda_graph_bytes=graphs, context_bytes=context_bytes,
        workspace_bytes=step_peak + graphs + context_bytes,
        kv_bytes_wanted=max_num_seqs * blocks_per_seq * per_block, **experts,
    )
    if gpu_mem_bytes is not None:
        plan.budget_bytes = int(gpu_mem_bytes * gpu_memory_utilization)
        plan.kv_budget_bytes = plan.budget_bytes - plan.resident_weight_bytes - plan.workspace_bytes
        plan.num_kv_blocks = max(0, plan.kv_budget_bytes) // per_block
        plan.kv_capacity_tokens = plan.num_kv_blocks * block_size
        plan.max_concurrency = plan.num_kv_blocks // blocks_per_seq
        plan.fits = plan.max_concurrency >= 1

    if train:
        if seq_len is None:
            seq_len = min(max_model_len, DEFAULT_TRAIN_SEQ_LEN)
        figures = plan_training(
            shape, b, optimizer=optimizer, micro_batch=micro_batch, seq_len=seq_len,
            checkpointing=checkpointing, checkpoint_layers=checkpoint_layers,
            lora_rank=lora_rank, lora_targets=lora_targets)
        plan.train = True
        for key, value in figures.items():
            setattr(plan, key, value)
        if plan.budget_bytes is not None:
            plan.train_fits = plan.train_total_bytes <= plan.budget_bytes

    plan.advice = advise(plan, shape)
    return plan


def _plan_experts(shape: ModelShape, b: int, params: dict[str, int], cache_size: int | None) -> dict:
    """The plan's mixture-of-experts fields; resident_weight_bytes and active_params for any model."""
    if cache_size is not None and not shape.num_experts:
        raise ValueError(f"moe_expert_cache_size is {cache_size} but {shape.architecture} is a dense model "
                         f"(no experts): leave it unset")
    if cache_size is not None and (isinstance(cache_size, bool) or not isinstance(cache_size, int)
                                   or not 1 <= cache_size <= shape.num_experts):
        raise ValueError(f"moe_expert_cache_size must be an integer from 1 to {shape.num_experts} (experts "
                         f"per layer), got {cache_size!r}")
    total, resident = expert_bytes(shape, b, cache_size)
    active = params["experts"] // shape.num_experts * shape.num_experts_per_tok if shape.num_experts else 0
    return {
        "num_experts": shape.num_experts,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "expert_cache_size": shape.num_experts if cache_size is None else cache_size,
        "expert_params": params["experts"],
        "expert_bytes": total,
        "resident_expert_bytes": resident,
        "resident_weight_bytes": params["total"] * b - total + resident,
        "host_expert_bytes": total if resident < total else 0,
        "active_params": params["total"] - params["experts"] + active,
    }


def _check_settings(shape, gpu_mem, host_mem, utilization, max_model_len, max_num_seqs,
                    max_num_batched_tokens, block_size, context_bytes):
    for name, value in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if host_mem is not None and (not isinstance(host_mem, int) or host_mem <= 0):
        raise ValueError(f"host_mem_bytes must be a positive byte count, got {host_mem!r}")
    if gpu_mem is not None and (not isinstance(gpu_mem, int) or gpu_mem <= 0):
        raise ValueError(f"gpu_mem_bytes must be a positive byte count, got {gpu_mem!r} "
                         f"(parse_bytes('80GiB') reads sizes)")
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    if not isinstance(context_bytes, int) or context_bytes < 0:
        raise ValueError(f"context_bytes must be a byte count >= 0, got {context_bytes!r}")
    if max_model_len > shape.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{shape.max_position_embeddings}: pass --max-model-len {shape.max_position_embeddings} or less"
        )


# ---------------------------------------------------------------- advice


def human(n: int | float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def advise(plan: MemoryPlan, shape: ModelShape) -> list[str]:
    lines = [_block_size_advice(plan)]
    if plan.max_num_batched_tokens < plan.max_model_len:
        lines.append(
            f"max-num-batched-tokens {plan.max_num_batched_tokens} < max-model-len "
            f"{plan.max_model_len}: longer prompts are prefilled in chunks of "
            f"{plan.max_num_batched_tokens} tokens")
    if plan.budget_bytes is None:
        lines.append(
            f"capacity needs --gpu-mem (no CUDA device visible): weights + workspace need "
            f"{human(plan.resident_weight_bytes + plan.workspace_bytes)} before any KV, and one "
            f"max-model-len {plan.max_model_len} sequence needs {human(plan.kv_bytes_per_seq)} of KV")
    else:
        lines += _capacity_advice(plan)
    if plan.train:
        lines += _training_advice(plan, shape)
    return lines


def _block_size(text: str) -> int:
    return DEFAULT_BLOCK_SIZE if text == "auto" else int(text)


def _block_size_advice(plan: MemoryPlan) -> str:
    which = "the default" if plan.block_size == DEFAULT_BLOCK_SIZE else f"chosen; the default is {DEFAULT_BLOCK_SIZE}"
    return (f"block size {plan.block_size} ({which}): one block holds {human(plan.kv_bytes_per_block)} of KV. "
            f"On an H200 (BENCHMARKS.md) 8 was the slowest and 16-256 were within noise for short and "
            f"long requests; larger blocks only waste more of each sequence's last block")


def _capacity_advice(plan: MemoryPlan) -> list[str]:
    lines = []
    budget, b = plan.budget_bytes, plan.dtype_bytes
    headroom = plan.gpu_mem_bytes - budget
    if plan.resident_weight_bytes > budget:
        fix = (f"use --dtype bfloat16 ({human(plan.resident_weight_bytes // 2)} of weights)" if b == 4 else
               "use a GPU with more memory or a smaller model")
        if plan.num_experts:
            fix += f", or keep fewer of the {plan.num_experts} experts per layer resident (moe_expert_cache_size)"
        return [f"does not fit: weights alone ({human(plan.resident_weight_bytes)}) exceed the budget "
                f"({human(budget)} = {human(plan.gpu_mem_bytes)} x {plan.gpu_memory_utilization}): {fix}"]

    free_for_kv = max(0, plan.kv_budget_bytes)
    if plan.max_concurrency == 0:
        fixed = plan.resident_weight_bytes + plan.logits_bytes + plan.cuda_graph_bytes + plan.context_bytes
        per_token_act = decoder_peak_bytes_per_token(plan)
        room = budget - fixed - plan.kv_bytes_per_seq
        if room >= per_token_act:
            lines.append(
                f"does not fit: activations at max-num-batched-tokens {plan.max_num_batched_tokens} "
                f"({human(plan.activation_peak_bytes)}) leave {human(free_for_kv)} for KV, less than one "
                f"max-model-len sequence ({human(plan.kv_bytes_per_seq)}): use "
                f"--max-num-batched-tokens {room // per_token_act}")
        fit_len = plan.kv_capacity_tokens
        # A running sequence's KV is all on the device: a host tier would not make it fit.
        fp8 = _fp8_kv_advice(plan, plan.kv_bytes_per_seq) if plan.kv_bytes_per_seq // b <= free_for_kv else ""
        lines.append(
            f"does not fit: one max-model-len {plan.max_model_len} sequence needs "
            f"{human(plan.kv_bytes_per_seq)} of KV; {human(free_for_kv)} is available: use "
            + (f"--max-model-len {fit_len}" if fit_len else "a GPU with more memory or a smaller model") + fp8)
        return lines

    if plan.kv_bytes_wanted > free_for_kv:
        lines.append(
            f"max-num-seqs {plan.max_num_seqs} at max-model-len {plan.max_model_len} needs "
            f"{human(plan.kv_bytes_wanted)} of KV; {human(free_for_kv)} is available: use "
            f"--max-num-seqs {plan.max_concurrency}" + _fp8_kv_advice(plan, plan.kv_bytes_wanted)
            + _host_tier_advice(plan, plan.kv_bytes_wanted - free_for_kv))
    else:
        lines.append(
            f"fits: max-num-seqs {plan.max_num_seqs} at max-model-len {plan.max_model_len} needs "
            f"{human(plan.kv_bytes_wanted)} of KV; {human(free_for_kv)} is available "
            f"({plan.max_concurrency} full-length sequences, {plan.kv_capacity_tokens:,} tokens)")
    lines.append(
        f"{human(headroom)} (1 - {plan.gpu_memory_utilization} of {human(plan.gpu_mem_bytes)}) stays "
        f"outside the budget for the CUDA context and allocator fragmentation, which the config "
        f"cannot tell; measure them with `mempath diagnose`")
    return lines


def _fp8_kv_advice(plan: MemoryPlan, kv_bytes: int) -> str:
    """--kv-cache-dtype fp8 where the cache is in the model dtype: one byte per element instead of b."""
    if plan.kv_cache_dtype != "auto" or plan.dtype_bytes == 1:
        return ""
    return (f", or --kv-cache-dtype fp8 ({human(kv_bytes // plan.dtype_bytes)} of KV for the same tokens; "
            f"its accuracy: docs/architecture.md)")


def _host_tier_advice(plan: MemoryPlan, missing: int) -> str:
    """The --cpu-kv-gb that holds the sequences the device cannot, within what the host may pin."""
    if plan.host_mem_bytes is None:
        return ""
    pinnable = int(plan.host_mem_bytes * HOST_KV_FRACTION)
    why = "to keep the KV of the sequences that wait or are preempted instead of recomputing it"
    if _gib_ceil(missing) * GiB <= pinnable:
        return f", or --cpu-kv-gb {_gib_ceil(missing)} {why}"
    limit = f"more than {HOST_KV_FRACTION:.0%} of this host's {human(plan.host_mem_bytes)}"
    most = pinnable // GiB
    if most * GiB < plan.kv_bytes_per_seq:
        return f" (a host tier for the rest would need {human(missing)}, {limit})"
    return (f"; a host tier for the rest would need {human(missing)}, {limit}: --cpu-kv-gb {most} "
            f"holds {most * GiB // plan.kv_bytes_per_seq:,} of those sequences")


def decoder_peak_bytes_per_token(plan: MemoryPlan) -> int:
    # The activation peak is linear in the token count, so one token's share is exact.
    return plan.activation_peak_bytes // plan.max_num_batched_tokens


def _gib_ceil(n: int) -> int:
    # --cpu-kv-gb counts GiB (as vLLM's *-gb flags do); round up so the advice suffices.
    return max(1, math.ceil(n / GiB))


def _training_advice(plan: MemoryPlan, shape: ModelShape) -> list[str]:
    if plan.budget_bytes is None:
        return [f"training needs {human(plan.train_total_bytes)} per GPU; pass --gpu-mem to check the fit"]
    if plan.train_total_bytes <= plan.budget_bytes:
        return [f"training fits: {human(plan.train_total_bytes)} of {human(plan.budget_bytes)}"]
    current = dict(optimizer=plan.optimizer, micro_batch=plan.micro_batch, seq_len=plan.seq_len,
                   checkpointing=plan.checkpointing, checkpoint_layers=plan.checkpoint_layers,
                   lora_rank=plan.lora_rank, lora_targets=plan.lora_targets or ("q_proj", "v_proj"))
    options = []
    if plan.checkpointing != "full":
        options.append(("--checkpointing full", dict(checkpointing="full", checkpoint_layers=())))
    if plan.optimizer != "adamw-8bit":
        options.append(("--optimizer adamw-8bit", dict(optimizer="adamw-8bit")))
    if plan.lora_rank == 0:
        options.append(("--lora-rank 16", dict(lora_rank=16)))
    if plan.micro_batch > 1:
        options.append(("--micro-batch 1", dict(micro_batch=1)))
    options.append(("all of these", {k: v for _, o in options for k, v in o.items()}))
    fixes = []
    for flag, change in options:
        total = plan_training(shape, plan.dtype_bytes, **{**current, **change})["train_total_bytes"]
        fixes.append(f"{flag} -> {human(total)}{'' if total <= plan.budget_bytes else ' (still too big)'}")
    return [f"training does not fit: {human(plan.train_total_bytes)} needed, "
            f"{human(plan.budget_bytes)} available; " + "; ".join(fixes)]


# ---------------------------------------------------------------- the table


def _row(label: str, n: int, params: int | None = None) -> str:
    count = f"{params:>16,}" if params is not None else " " * 16
    return f"  {label:<34}{count}  {human(n):>12}  {n:>19,} B"


def format_plan(plan: MemoryPlan) -> str:
    p = plan
    out = [
        f"mempath plan: {p.architecture}, {p.dtype} ({p.dtype_bytes} B/element)",
        f"  {p.num_layers} layers, hidden {p.hidden_size}, {p.num_heads} heads "
        f"({p.num_kv_heads} KV, head dim {p.head_dim}), intermediate {p.intermediate_size}, "
        f"vocab {p.vocab_size}, embeddings {'tied' if p.tied_embeddings else 'untied'}",
        "",
        f"{'weights':<36}{'params':>16}  {'size':>12}  {'bytes':>21}",
        _row("embedding", p.embedding_bytes, p.embedding_params),
        _row("attention", p.attention_bytes, p.attention_params),
        _row("mlp" + (" (dense layers, routers)" if p.num_experts else ""), p.mlp_bytes, p.mlp_params),
        *([_row(f"experts ({p.num_experts}/layer, {p.num_experts_per_tok} active)",
                p.expert_bytes, p.expert_params)] if p.num_experts else []),
        _row("norms", p.norm_bytes, p.norm_params),
        _row("lm head" + (" (tied: no extra bytes)" if p.tied_embeddings else ""),
             p.lm_head_bytes, p.lm_head_params),
        _row("total", p.weight_bytes, p.total_params),
        *([_row(f"on the device ({p.expert_cache_size} experts/layer)", p.resident_weight_bytes),
           _row("in host memory (every expert)", p.host_expert_bytes),
           _row("read per token (k experts/layer)", p.active_params * p.dtype_bytes, p.active_params)]
          if p.num_experts else []),
        "",
        "KV cache",
        _row("per token", p.kv_bytes_per_token),
        _row(f"per block ({p.block_size} tokens)", p.kv_bytes_per_block),
        _row(f"per sequence ({p.max_model_len} tokens)", p.kv_bytes_per_seq),
        _row(f"max-num-seqs {p.max_num_seqs} at full length", p.kv_bytes_wanted),
        "",
        f"workspace (max-num-batched-tokens {p.max_num_batched_tokens}, max-num-seqs {p.max_num_seqs})",
        _row("activation peak (one layer)", p.activation_peak_bytes),
        _row(f"logits + sampler ({p.logits_rows} rows)", p.logits_bytes),
        _row("step peak (+ cuBLAS workspace)", p.step_peak_bytes),
        _row(f"CUDA graphs (batch <= {p.cuda_graph_batch})" if p.cuda_graphs else "CUDA graphs (off)",
             p.cuda_graph_bytes),
        _row("context (given; not derivable)", p.context_bytes),
        _row("total", p.workspace_bytes),
        "",
    ]
    if p.budget_bytes is None:
        out += ["capacity: needs --gpu-mem (no CUDA device visible)", ""]
    else:
        out += [
            f"capacity (gpu-mem {human(p.gpu_mem_bytes)} x {p.gpu_memory_utilization})",
            _row("budget", p.budget_bytes),
            _row("- weights" + (" (resident)" if p.num_experts else ""), p.resident_weight_bytes),
            _row("- workspace", p.workspace_bytes),
            _row("= KV budget", p.kv_budget_bytes),
            f"  {'KV blocks':<34}{p.num_kv_blocks:>16,}",
            f"  {'KV tokens':<34}{p.kv_capacity_tokens:>16,}",
            f"  {f'max concurrency at {p.max_model_len}':<34}{p.max_concurrency:>16,}",
            "",
        ]
    if p.train:
        setup = f"{p.optimizer}, micro-batch {p.micro_batch}, seq-len {p.seq_len}, checkpointing {p.checkpointing}"
        if p.checkpoint_layers:
            setup += f" (layers {_layer_ranges(p.checkpoint_layers)})"
        if p.lora_rank:
            setup += f", LoRA r={p.lora_rank} on {','.join(p.lora_targets)}"
        out += [
            f"training ({setup})",
            f"  {'trainable params':<34}{p.trainable_params:>16,}",
            _row("weights", p.train_weight_bytes),
            _row("gradients", p.grad_bytes),
            _row("fp32 master weights", p.master_weight_bytes),
            _row("optimizer moments", p.optimizer_bytes),
            _row("activations per layer", p.activation_bytes_per_layer),
            _row("activations", p.train_activation_bytes),
            _row("logits (16-bit + fp32 for the loss)", p.train_logits_bytes),
            _row("total", p.train_total_bytes),
            "",
        ]
    out.append("advice")
    out += [f"  - {line}" for line in p.advice]
    return "\n".join(out)


def _layer_ranges(layers) -> str:
    runs, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            runs.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(runs)


# ---------------------------------------------------------------- CLI


def parse_layers(text: str) -> list[int]:
    """"0,2,4" or "0-15,20" -> layer indices."""
    layers = []
    for part in filter(None, (s.strip() for s in text.split(","))):
        try:
            lo, _, hi = part.partition("-")
            layers += range(int(lo), int(hi or lo) + 1)
        except ValueError:
            raise ValueError(f"cannot read layer list {text!r}: write e.g. 0,2,4 or 0-15") from None
    return layers


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model directory, config.json, or a cached hub id")
    parser.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32")
    parser.add_argument("--gpu-mem", default=None,
                        help="device memory with its unit, e.g. 80GiB, 24GB or 85899345920B; a bare "
                             "number is refused (default: the CUDA device's)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=_block_size, default=DEFAULT_BLOCK_SIZE,
                        help="tokens per KV block or auto (16, measured)")
    parser.add_argument("--enforce-eager", action="store_true", help="plan without CUDA graphs")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                        help="auto: the model dtype; fp8: K and V in one byte (as the engine's flag)")
    parser.add_argument("--context-mem", default="0",
                        help="non-PyTorch memory to hold back (CUDA context etc.) with its unit, e.g. 500MiB")
    parser.add_argument("--train", action="store_true", help="also plan training memory")
    parser.add_argument("--optimizer", default="adamw-fp32", choices=list(OPTIMIZERS))
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--checkpointing", default="none", choices=list(CHECKPOINTING))
    parser.add_argument("--checkpoint-layers", default="", help="e.g. 0,2,4 or 0-15")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--lora-targets", default="q_proj,v_proj", help="comma list or all-linear")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run_plan(args: argparse.Namespace) -> int:
    import sys

    try:
        gpu_mem = parse_size_flag("--gpu-mem", args.gpu_mem) if args.gpu_mem else detect_gpu_mem()
        context = 0 if str(args.context_mem).strip() in ("", "0") else parse_size_flag("--context-mem",
                                                                                       args.context_mem)
        import psutil
        plan = plan_memory(
            args.model, dtype=args.dtype, gpu_mem_bytes=gpu_mem, host_mem_bytes=psutil.virtual_memory().total,
            gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size, cuda_graphs=not args.enforce_eager, context_bytes=context,
            kv_cache_dtype=args.kv_cache_dtype,
            train=args.train, optimizer=args.optimizer, micro_batch=args.micro_batch,
            seq_len=args.seq_len, checkpointing=args.checkpointing,
            checkpoint_layers=parse_layers(args.checkpoint_layers), lora_rank=args.lora_rank,
            lora_targets=args.lora_targets)
    except ValueError as e:
        print(f"mempath plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0
