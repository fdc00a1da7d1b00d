"""Byte formulas: every pathway's bytes from a model's shape, with no GPU needed.

The runtime sizes and checks its memory with these (the engine's graph-pool room, the
loader's refusal of a load that cannot fit, the out-of-memory advice), and the planner
(mempath.tools.plan) reports them; so the two cannot disagree.

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

import math
from collections import Counter
from dataclasses import dataclass

from mempath.constants import MAX_GRAPH_BATCH, MAX_SIZE_GIB, SAMPLER_SORT_ROWS
# The formulas' callers take the shape from here too.
from mempath.memory.shape import ModelShape, read_shape, resolve_dtype, shape_from_spec  # noqa: F401


# cuBLAS takes a workspace per (handle, stream) through PyTorch's allocator; capture
# runs on its own stream, so the graph pool gets one. PyTorch's default size:
# 32 MiB on compute capability 9.x and later, 4096·2 + 16·8 KiB before.
CUBLAS_WORKSPACE_BYTES_SM90 = 32 << 20
CUBLAS_WORKSPACE_BYTES_OLDER = (4096 * 2 + 16 * 8) << 10


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


# mempath.model.quant.Fp8Linear: one float32 scale per output channel.
FP8_SCALE_BYTES = 4


# mempath's module of each linear_shapes layer: q/k/v and gate/up are one fused matrix each (model.llama).
FUSED_INTO = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
              "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")


def fp8_projection_counts(shape: ModelShape) -> dict[str, int]:
    """How many of each of mempath's projections (qkv_proj, o_proj, gate_up_proj, down_proj) the model
    holds in fp8: every layer's attention projections and every dense layer's MLP projections, less
    those ``shape.unquantized`` keeps in the model dtype; all zero unless ``shape.quantization`` is fp8."""
    dense = shape.num_layers - shape.num_moe_layers
    kept = Counter(name.rpartition(".")[2] for name in shape.unquantized)
    counts = {}
    for name in linear_shapes(shape):
        module = FUSED_INTO.get(name, name)
        layers = shape.num_layers if name in ATTENTION_PROJECTIONS else dense
        counts[module] = layers - kept[module] if shape.quantization == "fp8" else 0
    return counts


def weight_bytes(shape: ModelShape, dtype_bytes: int) -> dict[str, int]:
    """Bytes per pathway, keyed as count_params: parameters · b, except that with
    ``shape.quantization == "fp8"`` each layer's attention projections and each dense
    layer's MLP projections hold one byte per weight plus FP8_SCALE_BYTES per output
    channel (their biases stay b), but for those ``shape.unquantized`` names: an fp8
    checkpoint keeps them in the model dtype, as the engine builds them (b per weight, no
    scales). Embeddings, norms, the LM head, routers and routed experts stay in the model dtype."""
    counts = count_params(shape)
    out = {name: params * dtype_bytes for name, params in counts.items() if name != "total"}
    fp8 = fp8_projection_counts(shape)
    for name, (fan_in, fan_out, _) in linear_shapes(shape).items():
        saved = fan_in * fan_out * (dtype_bytes - 1) - fan_out * FP8_SCALE_BYTES
        out["attention" if name in ATTENTION_PROJECTIONS else "mlp"] -= fp8[FUSED_INTO.get(name, name)] * saved
    out["total"] = sum(out.values())
    return out


# mempath.kernels.fp8_gemv_triton.GemvWorkspace: the split-K partial sums of the fp8 GEMV (decode
# batches), float32, this many rows of the widest fp8 layer (two-pass splits · rows fit in
# them), and one int32 arrival counter per tile of FP8_GEMV_MIN_BLOCK_N outputs.
FP8_GEMV_WORKSPACE_ROWS = 32
FP8_GEMV_MIN_BLOCK_N = 16


def fp8_gemv_workspace_bytes(max_out_features: int) -> int:
    """Device bytes of the fp8 GEMV's workspace for fp8 layers at most ``max_out_features`` wide."""
    return 4 * FP8_GEMV_WORKSPACE_ROWS * max_out_features + 4 * -(-max_out_features // FP8_GEMV_MIN_BLOCK_N)


def gemv_workspace_bytes(shape: ModelShape, dtype_bytes: int = 4, fused_kernels: bool = False) -> int:
    """The GEMV workspace of a model, sized by the widest projection (fused q/k/v and gate/up count as
    one), where the Triton kernels run (``fused_kernels``: CUDA): an fp8 model's (the fp8 GEMV,
    mempath.model.quant.set_fp8_matmul: the widest projection held in fp8, not one the checkpoint keeps
    in 16 bits) or a 16-bit one's (``dtype_bytes`` 2: the dense GEMV, set_dense_gemv, which an fp8
    model whose checkpoint keeps every projection in 16 bits gets too); else 0 (the PyTorch path
    allocates none)."""
    if not fused_kernels:
        return 0
    widths, fp8 = Counter(), fp8_projection_counts(shape)
    for name, (_, fan_out, _) in linear_shapes(shape).items():
        widths[FUSED_INTO.get(name, name)] += fan_out
    if any(fp8.values()):
        return fp8_gemv_workspace_bytes(max(widths[module] for module, count in fp8.items() if count))
    if dtype_bytes != 2:
        return 0
    dense = shape.num_layers > shape.num_moe_layers
    return fp8_gemv_workspace_bytes(max(width for module, width in widths.items()
                                        if dense or module in ("qkv_proj", "o_proj")))


def expert_bytes(shape: ModelShape, dtype_bytes: int, cache_size: int | None = None) -> tuple[int, int]:
    """(bytes of every routed expert, bytes of those resident on the device): with
    ``cache_size`` experts per layer resident (None: all), the device holds
    M·cache_size·3·h·I_e·b and host memory the rest."""
    total = count_params(shape)["experts"] * dtype_bytes
    if not shape.num_experts:
        return 0, 0
    resident = shape.num_experts if cache_size is None else cache_size
    return total, total // shape.num_experts * resident


def resident_weight_bytes(shape: ModelShape, dtype_bytes: int, cache_size: int | None = None) -> int:
    """The weights on the device: every parameter's bytes (weight_bytes) less the routed experts that
    ``cache_size`` experts per layer leave in host memory (None: all resident). The expert cache's
    slots are these resident experts, and a miss is copied from pinned host memory straight into its
    slot (model.moe.Experts), so no staging buffer adds to them; a cut decode graph's slot tables
    (model.moe_slots.SlotTable) are the runner's step buffers, not weights."""
    experts, resident = expert_bytes(shape, dtype_bytes, cache_size)
    return weight_bytes(shape, dtype_bytes)["total"] - experts + resident


def expert_cache_size_for_bytes(shape: ModelShape, dtype_bytes: int, nbytes: int) -> int:
    """Experts per layer whose slots fit in ``nbytes`` of device memory: nbytes // (M·3·h·I_e·b),
    at most E (0 when not even one expert per layer fits)."""
    per_layer_expert = 3 * shape.hidden_size * shape.moe_intermediate_size * dtype_bytes
    return min(shape.num_experts, nbytes // (shape.num_moe_layers * per_layer_expert))


def expert_cache_size_that_fits(shape: ModelShape, dtype_bytes: int, on_device: int, free: int,
                                size: int | None) -> int | None:
    """The most experts a MoE layer can keep on the device for ``on_device`` bytes, planned with ``size``
    experts a layer resident (None: all), to fit ``free`` (the rest wait in pinned host memory:
    --moe-expert-cache-size), if that is fewer than now and at least the experts a token routes to; else None."""
    if not shape.num_experts or not shape.num_moe_layers:
        return None
    room = free - (on_device - expert_bytes(shape, dtype_bytes, size)[1])  # what the slots may take
    fits = expert_cache_size_for_bytes(shape, dtype_bytes, max(0, room))
    now = shape.num_experts if size is None else size
    return fits if shape.num_experts_per_tok <= fits < now else None


def check_expert_cache_size(size) -> None:
    """Refuse a --moe-expert-cache-size that is not a whole number of experts above 0 (a bool is a mistake)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"moe_expert_cache_size must be a whole number of experts per layer >= 1, got {size!r}")


def check_expert_cache_gb(gb) -> None:
    """Refuse a --moe-expert-cache-gb that is not a finite number of GiB above 0 (inf, nan, a string, a bool)."""
    if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not 0 < gb < math.inf:
        raise ValueError(f"moe_expert_cache_gb must be > 0 GiB, a finite number (the device GiB for the expert "
                         f"slots; leave it unset to keep every expert resident), got {gb!r}")
    if gb > MAX_SIZE_GIB:
        raise ValueError(f"moe_expert_cache_gb {gb:g} is more than 1 PiB, which is no device's memory: give the "
                         f"device GiB for the expert slots (leave it unset to keep every expert resident)")


def resolve_expert_cache_size(shape: ModelShape, dtype_bytes: int, size: int | None, gb: float | None,
                              source: str) -> int | None:
    """The engine's experts per layer from --moe-expert-cache-size or --moe-expert-cache-gb (None: all).

    Refused in one line: either flag on a dense model, fewer than the k experts one token
    routes to (every token's experts would not fit in one wave's slots), more than the model has.
    """
    flag = ("--moe-expert-cache-size", size) if size is not None else ("--moe-expert-cache-gb", gb)
    if flag[1] is None:
        return None
    if size is not None:  # the planner's callers have not been through EngineConfig
        check_expert_cache_size(size)
    else:
        check_expert_cache_gb(gb)
    if not shape.num_experts or not shape.num_moe_layers:
        raise ValueError(f"{flag[0]} {flag[1]:g}: {source} describes a dense model ({shape.architecture}, no "
                         f"MoE layer): drop the flag")
    k, experts = shape.num_experts_per_tok, shape.num_experts
    per_expert = expert_bytes(shape, dtype_bytes)[0] // experts  # one expert of every MoE layer
    if gb is not None:
        size = expert_cache_size_for_bytes(shape, dtype_bytes, int(gb * (1 << 30)))
        if size < k:
            # Rounded up: the GiB named must hold the k experts, or the advice is refused in turn.
            enough = math.ceil(k * per_expert / (1 << 30) * 100) / 100
            raise ValueError(f"--moe-expert-cache-gb {gb:g} holds {size} experts per layer, fewer than the {k} "
                             f"each token routes to: give at least {enough:.2f} GiB")
        return None if size == experts else size
    if not k <= size <= experts:
        raise ValueError(f"--moe-expert-cache-size {size}: must be from {k} (the experts each token routes to) "
                         f"to {experts} (the experts per layer in {source})")
    return None if size == experts else size


def moe_missed_bytes_per_token(shape: ModelShape, dtype_bytes: int, hit_rate: float) -> float:
    """Expert bytes one decoded token (batch 1) copies to the device: M·k·(1 − hit rate) experts of 3·h·I_e·b."""
    per_expert = 3 * shape.hidden_size * shape.moe_intermediate_size * dtype_bytes
    return shape.num_moe_layers * shape.num_experts_per_tok * (1.0 - hit_rate) * per_expert


# The planner's rates for a MoE decode prediction when the user gives none (mempath plan --h2d-gbps,
# --device-read-gbps), as bench_moe.py measured them on the H200 (BENCHMARKS.md, "Mixture of experts on the
# H200", 2026-12-01/02): pinned host-to-device copies of one 9.4 MB expert at a time, 54.5 GB/s; a device
# copy's bytes read and written per second, 4.28 TB/s. bench_moe.py measures both on the machine at hand.
ASSUMED_H2D_BYTES_PER_S = 54.5e9
ASSUMED_DEVICE_READ_BYTES_PER_S = 4.28e12
# --moe-cpu-experts auto's host rates for the planner (mempath plan --host-read-gbps): bench_moe.py on the
# H200 (2026-12-02, run 5): one Qwen3-30B-A3B expert's row on the host from the huge-page store took
# 390 us for its 9,437,184 bytes (24.2 GB/s), a row's read-back round trip 31 us, a copy's issue 23 us.
ASSUMED_HOST_READ_BYTES_PER_S = 24.2e9
ASSUMED_HOST_SYNC_SECONDS = 31e-6
ASSUMED_COPY_ISSUE_SECONDS = 23e-6
# The host step between a cut decode graph's pieces, per MoE layer (mempath/engine/piecewise.py):
# bench_moe.py's cut_us_per_layer on the H200 (2026-12-02, Qwen3-30B-A3B shape: 42.5 us).
ASSUMED_CUT_SECONDS = 42e-6


def moe_offload_tokens_per_second(shape: ModelShape, dtype_bytes: int, hit_rate: float, h2d_bytes_per_s: float,
                                  resident_step_seconds: float, cut_seconds: float = 0.0,
                                  host_row_seconds: float | None = None, sync_seconds: float = 0.0,
                                  issue_seconds: float = 0.0) -> float:
    """Batch-1 decode tokens/s with an expert cache: the step with every expert resident, plus the
    misses' copies at the host-to-device bandwidth (the copies do not overlap the compute), plus
    ``cut_seconds`` per MoE layer: the host step between the decode graph's pieces
    (mempath/engine/piecewise.py: a read-back, the cache's bookkeeping, one more graph launch).

    With ``host_row_seconds`` (--moe-cpu-experts auto: one expert's MLP of one row on the host) a
    layer's k·(1 − hit rate) misses are split as moe_host.HostExpertCost.split_misses does: h run
    on the host after ``sync_seconds`` and the issue of the others' copies (``issue_seconds``
    each) while those are copied, the layer waiting for the longer side, at the h that makes it
    shortest."""
    copy = 3 * shape.hidden_size * shape.moe_intermediate_size * dtype_bytes / h2d_bytes_per_s
    misses = shape.num_experts_per_tok * (1.0 - hit_rate)
    layer = misses * copy
    if host_row_seconds is not None:
        layer = min(max(sync_seconds + min(h, misses) * host_row_seconds + max(0.0, misses - h) * issue_seconds,
                        max(0.0, misses - h) * copy)
                    for h in range(1, math.ceil(misses) + 1)) if misses else 0.0
        layer = min(layer, misses * copy)
    return 1.0 / (resident_step_seconds + shape.num_moe_layers * (cut_seconds + layer))


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
    checkpoints saved that way); quantize_build (fp8 weights): the device copy of the
    largest projection (from a float checkpoint, or drawn by load_format dummy) and its
    float32 copy while it is quantized (mempath.model.quant.copy_quantized), 0 otherwise.
    """
    h, d = shape.hidden_size, shape.head_dim
    projection_rows = max(shape.num_heads * d + 2 * shape.num_kv_heads * d, 2 * shape.intermediate_size)
    fused_rows = max(projection_rows, shape.vocab_size, shape.num_experts * 2 * shape.moe_intermediate_size)
    kept = 8 * positions * d
    experts, resident = expert_bytes(shape, dtype_bytes, expert_cache_size)
    quantize_build = projection_rows * h * ((checkpoint_dtype_bytes or dtype_bytes) + 4)
    return {
        "weights": resident_weight_bytes(shape, dtype_bytes, expert_cache_size),
        "quantize_build": quantize_build if shape.quantization == "fp8" else 0,
        "host_experts": experts if resident < experts else 0,
        "rotary_tables": kept,
        "rotary_build": positions * rotary_bytes_per_position(d) - kept,
        "modules": shape.num_layers * MODULE_BYTES_PER_LAYER,
        "largest_tensor": fused_rows * h * (checkpoint_dtype_bytes or dtype_bytes),
    }


def load_device_bytes(need: dict[str, int]) -> int:
    """load_bytes' device part: resident weights, rotary tables and their build, fp8's quantization copy."""
    return need["weights"] + need["rotary_tables"] + need["rotary_build"] + need["quantize_build"]


def decoder_peak_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, fused: bool = True) -> int:
    """Peak bytes of one forward pass over `tokens` tokens, excluding the logits.

    Layers run one after another and free their temporaries before the next starts, so
    the pass peaks inside one layer, on top of the streams that cross layer boundaries.
    Two code paths (mempath.kernels, elementwise_triton and elementwise_torch):

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
    Mixture-of-experts layers replace the MLP phase with the larger of moe_phase_bytes (the
    PyTorch path) and moe_grouped_phase_bytes (the grouped kernel's), so either path fits.
    """
    h, i, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    attention = (q + 2 * kv) + (q + kv) + q + h
    streams, mlp = (2 * h, 3 * i) if fused else (4 * h, 4 * i)
    if not shape.num_moe_layers:
        return tokens * dtype_bytes * (streams + max(attention, mlp))
    dense = tokens * dtype_bytes * mlp if shape.num_moe_layers < shape.num_layers else 0
    moe = max(moe_phase_bytes(shape, tokens, dtype_bytes, fused), moe_grouped_phase_bytes(shape, tokens, dtype_bytes, fused))
    phase = max(tokens * dtype_bytes * attention, dense, moe)
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


def moe_grouped_phase_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, fused: bool = True) -> int:
    """Bytes a MoE block on the grouped-kernel path (kernels/moe_triton.py) holds at its peak, beside the streams.

    With P = T·k pairs, BLOCK_M rows per block (16 up to 1,024 pairs, 64 above),
    B = cdiv(P, BLOCK_M) + min(P, E) blocks and R = B·BLOCK_M padded rows:
        routing:  logits T·E·b, float32 softmax T·E·4, top-k values and ids, the sum T·4;
                  then kept: ids T·k·8 and weights T·k·4 (float32: an upper bound)
        maps:     align_to_blocks' pair of each row R·8 and expert of each block B·8; while it
                  runs, at most 8 int64 arrays of R rows (a bound, not the measured 7.8); none for
                  one token, whose pairs run unsorted (moe_triton.ONE_TOKEN_UNALIGNED)
        gate/up:  the pairs' gate/up P·2I_e and activation P·I_e (+ silu(gate) P·I_e unfused), ·b
        down:     activation P·I_e·b and float32 outputs P·h·4
        sum:      the outputs P·h·4 and their sum over k in the model dtype T·h·b (one kernel:
                  triton_sum_pairs adds in float32 in registers)
        with an expert cache (``num_expert_slots`` below the experts), a wave after the first
        also holds its own outputs P·h·4, slot ids P·8 (two while the next is made) and mask P
        during gate/up and down
    Equal to the allocations the code makes (tests/test_moe_grouped_memory.py, the launches faked).
    """
    h, i, k, experts = shape.hidden_size, shape.moe_intermediate_size, shape.num_experts_per_tok, shape.num_experts
    pairs = tokens * k
    block_m = 16 if pairs <= 1024 else 64  # kernels/moe_triton.py block_m_for
    blocks = -(-pairs // block_m) + min(pairs, experts)
    rows = blocks * block_m
    routing = pairs * 12
    routing_peak = tokens * (experts * (dtype_bytes + 4) + 4) + pairs * (dtype_bytes + 8)
    one_token = tokens == 1  # no sort, so no maps and no align temporaries
    maps = 0 if one_token else rows * 8 + blocks * 8
    aligning = 0 if one_token else routing + pairs * 16 + 8 * rows * 8
    # An expert cache's later waves (mempath/model/moe_slots.py) hold their own pair outputs, slot ids
    # and mask beside the step's pair outputs.
    slot_waves = pairs * (h * 4 + 17) if 0 < shape.num_expert_slots < experts else 0
    gate_up = pairs * i * dtype_bytes * (3 if fused else 4) + slot_waves
    down = pairs * i * dtype_bytes + pairs * h * 4 + slot_waves
    summed = pairs * h * 4 + tokens * h * dtype_bytes
    return max(routing_peak, aligning, routing + maps + max(gate_up, down, summed))



# Bytes per [row, V] entry the penalties (mempath.engine.penalties) hold at their peak, for one
# slice of SAMPLER_SORT_ROWS rows: counts over the generated tokens (4, float32), the mask of
# tokens seen (1), the rows' logits (4), the repetition divisor (4) and its masks (2).
SAMPLER_PENALTY_BYTES_PER_ENTRY = 15


def sampler_peak_bytes(vocab_size: int, rows: int) -> int:
    """The sampler's peak at its costliest settings (temperature, top-k/top-p, logprobs, penalties).

    It works in place on one float32 copy of the logits (4 B per entry), and then
    needs either the exponential noise (4 B per entry) or, when top-p rows without
    top-k are sorted SAMPLER_SORT_ROWS at a time, a slice's values (4), indices (8),
    mask (1), probabilities (4) and cumulative sums (4): 21 B per entry of the slice.
    (With a top-k on every row only the top k are taken: the noise phase is the
    peak.) Penalties come before, on slices of the same rows, at
    SAMPLER_PENALTY_BYTES_PER_ENTRY; the token counts they need are built per step
    in those slices, nothing per batch slot is kept. Logprobs keep only per-row
    constants and the top-n. Measured on the CPU by tests/test_sampler.py and
    tests/test_penalties.py; on CUDA the sort's own temporaries come on top.
    """
    slice_bytes = max(21, SAMPLER_PENALTY_BYTES_PER_ENTRY) * min(rows, SAMPLER_SORT_ROWS)
    return vocab_size * max(8 * rows, 4 * rows + slice_bytes)


def prompt_logprobs_peak_bytes(vocab_size: int, rows: int, dtype_bytes: int) -> int:
    """Prompt logprobs (mempath.engine.prompt_logprobs), after the sampler has run: a slice of
    min(rows, SAMPLER_SORT_ROWS) positions' lm_head output (b), its float32 copy (4), the
    log-normaliser's exponentials (4) and the rank comparison (1). Never above the sampler's
    peak (at least 25 B per entry of such a slice), so logits_bytes' max is the sampler's."""
    return min(rows, SAMPLER_SORT_ROWS) * vocab_size * (dtype_bytes + 9)


def grammar_bitmask_bytes(vocab_size: int, rows: int) -> int:
    """Structured output's allowed-token bitmask: one bit per token, in int32 words, a row
    per sampled sequence (max_num_seqs); allocated once on the device with the step buffers
    (the ledger's step_buffers), and as much pinned on the host."""
    return rows * -(-vocab_size // 32) * 4


def logits_bytes(shape: ModelShape, rows: int, dtype_bytes: int = 4) -> int:
    """Logits only for the rows that are sampled (the last token of each sequence), so
    at most max_num_seqs rows: the lm_head output in the model dtype (rows · V · b),
    alive while the sampler runs, plus the sampler's peak (sampler_peak_bytes) or the prompt
    logprobs' (prompt_logprobs_peak_bytes), whichever is larger. The grammar bitmask the
    sampler's rows are masked with is a static buffer, counted with the step buffers
    (grammar_bitmask_bytes)."""
    return rows * shape.vocab_size * dtype_bytes + max(
        sampler_peak_bytes(shape.vocab_size, rows), prompt_logprobs_peak_bytes(shape.vocab_size, rows, dtype_bytes))


def step_peak_bytes(shape: ModelShape, tokens: int, rows: int, dtype_bytes: int, fused: bool = True) -> int:
    """Peak of one whole step over its weights and KV: the decoder forward, or the
    sampling phase after it (the final hidden states T·h·b, the sampled rows'
    hidden states, and the logits with the sampler), whichever is larger."""
    sampling = (tokens + rows) * shape.hidden_size * dtype_bytes + logits_bytes(shape, rows, dtype_bytes)
    return max(decoder_peak_bytes(shape, tokens, dtype_bytes, fused), sampling)


# The caching allocator rounds a large allocation's segment up to a multiple of this.
ALLOCATOR_LARGE_ROUNDING = 2 << 20


def step_largest_block_bytes(shape: ModelShape, tokens: int, rows: int, dtype_bytes: int) -> int:
    """The largest tensor one step over ``tokens`` tokens and ``rows`` sampled rows allocates, rounded up as the
    caching allocator reserves its segment: a layer's fused q/k/v output T·(n_q+2·n_kv)·d·b, a dense MLP's gate/up
    output T·2·I·b, a MoE block's pairs' gate/up P·2·I_e·b or float32 outputs P·h·4 (P = T·k), or the sampler's
    float32 logits rows·V·4.

    A serving step starts from what the last step left cached, and the allocator may put the step's first, smaller
    tensors in the last step's largest segment; the step's own largest tensor then takes a fresh segment. The
    engine keeps one such block spare beside the profile step's peak (its ledger's activation_spare)."""
    h, d = shape.hidden_size, shape.head_dim
    largest = [tokens * (shape.num_heads + 2 * shape.num_kv_heads) * d * dtype_bytes, rows * shape.vocab_size * 4]
    if shape.num_moe_layers < shape.num_layers:
        largest.append(tokens * 2 * shape.intermediate_size * dtype_bytes)
    if shape.num_moe_layers:
        pairs = tokens * shape.num_experts_per_tok
        largest += [pairs * 2 * shape.moe_intermediate_size * dtype_bytes, pairs * h * 4]
    return -(-max(largest) // ALLOCATOR_LARGE_ROUNDING) * ALLOCATOR_LARGE_ROUNDING


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



# ---------------------------------------------------------------- one serving configuration


@dataclass
class ServingFigures:
    """The bytes of serving a model with one set of engine settings, before any device
    budget: what the planner reports and the out-of-memory advice spends."""
    dtype_bytes: int
    vocab_size: int
    total_params: int
    weight_bytes: int  # every parameter (resident or not), in the model dtype or fp8 (formulas.weight_bytes)
    resident_weight_bytes: int  # on the device: weight_bytes less the experts an expert cache leaves on the host
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    blocks_per_seq: int
    kv_bytes_per_seq: int
    kv_bytes_wanted: int  # max_num_seqs sequences at max_model_len
    logits_rows: int
    activation_peak_bytes: int
    logits_bytes: int
    step_peak_bytes: int  # max(activation peak, sampling phase) + the serving stream's cuBLAS workspace (+ fp8 GEMV's)
    step_largest_block_bytes: int  # kept spare beside the step peak: a cached segment may hold the next step's tensors
    cuda_graph_batch: int
    cuda_graph_bytes: int


def serving_figures(shape: ModelShape, dtype_bytes: int, *, max_model_len: int, max_num_seqs: int,
                    max_num_batched_tokens: int, block_size: int, cuda_graphs: bool = True,
                    fused_kernels: bool = True, cublas_workspace: int = CUBLAS_WORKSPACE_BYTES_SM90,
                    kv_cache_dtype: str = "auto") -> ServingFigures:
    """Weights, KV per token / block / sequence, the step's activations and logits, and the
    decode graphs for these settings; raises ValueError for settings no engine accepts.

    An expert cache is ``shape.num_expert_slots`` (0: every expert resident): it sets both the
    resident weights and the slot waves in the activation peak, so the two cannot disagree."""
    check_serving_settings(shape, max_model_len, max_num_seqs, max_num_batched_tokens, block_size)
    if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        raise ValueError(f"kv_cache_dtype must be auto, fp8, fp8_e4m3 or fp8_e5m2, got {kv_cache_dtype!r}")
    b = dtype_bytes
    # EngineConfig.kv_cache_dtype: an fp8 cache holds one byte per element whatever the model dtype.
    per_token = kv_bytes_per_token(shape, b if kv_cache_dtype == "auto" else 1)
    per_block = per_token * block_size
    blocks_per_seq = -(-max_model_len // block_size)
    rows = min(max_num_seqs, max_num_batched_tokens)
    graph_batch = min(max_num_seqs, MAX_GRAPH_BATCH) if cuda_graphs else 0
    total_params = count_params(shape)["total"]
    return ServingFigures(
        dtype_bytes=b, vocab_size=shape.vocab_size, total_params=total_params,
        weight_bytes=weight_bytes(shape, b)["total"],
        resident_weight_bytes=resident_weight_bytes(shape, b, shape.num_expert_slots or None),
        block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_bytes_per_token=per_token, kv_bytes_per_block=per_block, blocks_per_seq=blocks_per_seq,
        kv_bytes_per_seq=blocks_per_seq * per_block, kv_bytes_wanted=max_num_seqs * blocks_per_seq * per_block,
        logits_rows=rows,
        activation_peak_bytes=decoder_peak_bytes(shape, max_num_batched_tokens, b, fused_kernels),
        logits_bytes=logits_bytes(shape, rows, b),
        # The first matmul on the serving stream allocates cuBLAS's workspace; it stays. So does the
        # GEMV's, allocated with the model.
        step_peak_bytes=(step_peak_bytes(shape, max_num_batched_tokens, rows, b, fused_kernels) + cublas_workspace
                         + gemv_workspace_bytes(shape, b, fused_kernels)),
        step_largest_block_bytes=step_largest_block_bytes(shape, max_num_batched_tokens, rows, b),
        cuda_graph_batch=graph_batch,
        cuda_graph_bytes=cuda_graph_bytes(shape, graph_batch, b, cublas_workspace) if cuda_graphs else 0,
    )


def check_serving_settings(shape: ModelShape, max_model_len, max_num_seqs, max_num_batched_tokens,
                           block_size) -> None:
    for name, value in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_model_len > shape.max_model_len_limit:
        limit = shape.max_model_len_limit
        window = " / sliding_window" if limit < shape.max_position_embeddings else ""
        raise ValueError(f"max_model_len {max_model_len} exceeds what this model supports ({limit}: "
                         f"max_position_embeddings{window}): pass --max-model-len {limit} or less")


def decoder_peak_bytes_per_token(figures: ServingFigures) -> int:
    # The activation peak is linear in the token count, so one token's share is exact.
    return figures.activation_peak_bytes // figures.max_num_batched_tokens
