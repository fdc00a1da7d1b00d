"""Streaming loader for Hugging Face checkpoints.

The model is built on the meta device, materialised once on the target device
(empty, no random init), and then each checkpoint tensor is read from a
memory-mapped safetensors file and copied into its slice of the preallocated
parameter. Host memory holds one tensor at a time, never the whole state dict:
that second full copy is what kills loads of large models on small hosts.
"""
import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

from mempath.constants import CHECKPOINT_DTYPES
from mempath.kernels.dispatch import kernels_for
from mempath.memory.arena import aligned, make_arena
from mempath.memory.arena import view as arena_view
from mempath.model.digest import file_identity
from mempath.model.llama import CausalLM
from mempath.model.spec import CheckpointError, ModelSpec, describe, json_kind
from mempath.model.moe import offloaded_weights, set_expert_cache_size, set_expert_prefetch
from mempath.model.quant import (FP8_DTYPE, check_fp8_device, check_fp8_mix, copy_quantized, copy_scale,
                                 fp8_nan_count, quantized_targets, scale_problem, set_dense_gemv, set_fp8_matmul)
from mempath.safe_io import loads_json

log = logging.getLogger(__name__)

# Checkpoint names that map onto a slice of one of our fused parameters:
# suffix -> (fused suffix, index of the slice).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# One expert's projection in a checkpoint, as Qwen3-MoE / OLMoE (gate/up/down_proj) and
# Mixtral (w1/w3/w2 under block_sparse_moe) name them; each is one slice of the layer's
# stacked experts.gate_up_proj [experts, 2I, h] or experts.down_proj [experts, h, I].
_EXPERT_TENSOR = re.compile(r"^(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                            r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_SLICES = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0),
                  "up_proj": ("gate_up_proj", 1), "w3": ("gate_up_proj", 1),
                  "down_proj": ("down_proj", None), "w2": ("down_proj", None)}
# Buffers some checkpoints carry that we recompute instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Checkpoint dtypes converted to the model dtype on copy (float64 too: a cast loses nothing
# mempath keeps); any other (integers, float8) is a quantized or damaged tensor, which a
# cast would silently turn into garbage.
_FLOAT_DTYPES = tuple(getattr(torch, name) for name in CHECKPOINT_DTYPES) + (torch.float64,)


@dataclass
class LoadReport:
    weight_files: list[str]
    tensors_loaded: int
    weight_bytes: int  # bytes of the materialised parameters
    checkpoint_dtype: torch.dtype
    # file_identity() of each weights file, taken before it was read (see weights_digest)
    file_identities: dict[str, str] = field(default_factory=dict)
    host_weight_bytes: int = 0  # experts kept in host memory (moe_expert_cache_size)


def refuse_special_file(path: Path, expected: str, fix: str) -> None:
    """A named pipe or a device where a checkpoint's file should be: reading it may wait forever."""
    if path.exists() and not path.is_file():
        raise CheckpointError(f"{path}: is not a regular file, expected {expected}; {fix}")


def read_json_object(path: Path, expected: str) -> dict:
    """The JSON object in ``path``; anything else raises CheckpointError naming the file."""
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, expected a file holding {expected}; "
                              f"replace it with the model's file")
    refuse_special_file(path, f"a file holding {expected}", "replace it with the model's file")
    try:
        value = loads_json(path.read_bytes())
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror}); check that it exists and "
                              f"that its permissions let you read it") from None
    except ValueError as error:  # also bytes that are not UTF-8
        raise CheckpointError(f"{path}: is not valid JSON ({error}); restore the model's original "
                              f"file or download it again") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: holds {json_kind(value)}, expected {expected}; restore the "
                              f"model's original file or download it again")
    return value


def config_path(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    return path if path.is_file() and path.name.endswith(".json") else path / "config.json"


def read_config(model_dir: str | Path) -> dict:
    """config.json as a dict (a JSON object; its fields are checked by ModelSpec.from_hf_config)."""
    try:
        path = config_path(model_dir)
        found = path.exists()
    except OSError as error:  # e.g. a name longer than a path may be
        shown = str(model_dir) if len(str(model_dir)) <= 80 else str(model_dir)[:80] + "..."
        raise CheckpointError(f"{shown}: not a model directory ({error.strerror}); pass a Hugging Face model "
                              f"directory (config.json + *.safetensors + tokenizer files)") from None
    if not found and Path(model_dir).is_file():
        raise CheckpointError(f"{model_dir} is a file, not a model directory; pass a Hugging Face model directory "
                              f"(config.json + *.safetensors + tokenizer files)")
    if not found:
        raise CheckpointError(
            f"{path}: no config.json found; pass a Hugging Face model directory "
            f"(config.json + *.safetensors + tokenizer files)")
    return read_json_object(path, "a JSON object of model settings")


def read_spec(model_dir: str | Path) -> ModelSpec:
    """config.json read and validated (ModelSpec.from_hf_config), errors naming its path."""
    return ModelSpec.from_hf_config(read_config(model_dir), source=str(config_path(model_dir)))


def checkpoint_dtype(cfg: dict) -> torch.dtype | None:
    """The dtype config.json names (torch_dtype, or transformers 5's dtype); None when it names none."""
    name = cfg.get("torch_dtype") or cfg.get("dtype")
    return _torch_dtype(name) if name in CHECKPOINT_DTYPES else None


def _torch_dtype(name: str | None) -> torch.dtype:
    return getattr(torch, name) if name in CHECKPOINT_DTYPES else torch.float32


def _leaves_directory(shard: str) -> bool:
    """Whether an index's shard name points outside the model directory, judged by the name.

    Symlinks are not resolved: the Hugging Face cache links every snapshot file to a blob
    outside the snapshot directory, and those are the files the index means.
    """
    normal = os.path.normpath(shard)
    return os.path.isabs(shard) or normal == os.pardir or normal.startswith(os.pardir + os.sep)


def _weights_file(path: Path) -> Path:
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, expected a safetensors weights file; "
                              f"replace it with the checkpoint's file (download it again)")
    refuse_special_file(path, "a safetensors weights file",
                        "replace it with the checkpoint's file (download it again)")
    return path


def _index_shards(index: Path, model_dir: Path) -> list[Path]:
    data = read_json_object(index, "a JSON object with a weight_map (tensor name -> shard file)")
    weight_map = data.get("weight_map")
    if weight_map is None:
        raise CheckpointError(f"{index}: has no 'weight_map' (tensor name -> shard file); download the "
                              f"checkpoint's index again")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: 'weight_map' holds {json_kind(weight_map)}, expected an object "
                              f"(tensor name -> shard file); download the checkpoint's index again")
    shards = set()
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"{index}: tensor {name!r} names shard {describe(shard)}, expected a file "
                                  f"name in {model_dir}; download the checkpoint's index again")
        if _leaves_directory(shard):
            raise CheckpointError(f"{index}: tensor {name!r} names shard {shard!r}, outside {model_dir}; "
                                  f"shards must be files inside the model directory: download the index again")
        shards.add(shard)
    missing = sorted(s for s in shards if not (model_dir / s).exists())
    if missing:
        raise CheckpointError(
            f"{index}: names shard(s) {missing} that are not in {model_dir}; "
            f"download the complete checkpoint")
    return [_weights_file(model_dir / s) for s in sorted(shards)]


def find_weight_files(model_dir: Path) -> list[Path]:
    if model_dir.is_file():
        raise CheckpointError(f"{model_dir} is a file: give the model's directory, {model_dir.parent} (its config.json, "
                              f"weights and tokenizer files)")
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return _index_shards(index, model_dir)
    single = model_dir / "model.safetensors"
    if single.exists():
        return [_weights_file(single)]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return [_weights_file(f) for f in files]
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
        raise CheckpointError(
            f"{model_dir}: only PyTorch pickle weights (*.bin) found; mempath loads safetensors. "
            f"Convert with transformers: model.save_pretrained(dir, safe_serialization=True)")
    raise CheckpointError(f"{model_dir}: no model.safetensors or *.safetensors weights file found; "
                          f"download the checkpoint's weights")


def check_load_fits(spec: ModelSpec, max_positions: int, dtype: torch.dtype, device: torch.device, *,
                    dummy: bool, checkpoint_dtype: torch.dtype, source: str,
                    expert_cache_size: int | None = None, expert_cache_gb: float | None = None) -> None:
    """Refuse, before anything is allocated, a load that the device or the host has no room for.

    The figures are the planner's (memory.formulas.load_bytes): weights (the resident
    ones), rotary tables and their build, module objects, and on the host the experts
    kept there and the one checkpoint tensor read at a time. ``expert_cache_gb``: the
    --moe-expert-cache-gb that gave ``expert_cache_size``, which the size a refusal names replaces.
    """
    import psutil

    from mempath.memory.formulas import load_bytes, load_device_bytes, shape_from_spec
    need = load_bytes(shape_from_spec(spec), dtype.itemsize, max_positions, checkpoint_dtype.itemsize,
                      expert_cache_size)
    on_device = load_device_bytes(need)
    on_host = need["modules"] + need["host_experts"] + (0 if dummy else need["largest_tensor"])
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if on_device > free:
            fits = _expert_cache_that_fits(spec, dtype, on_device, free, expert_cache_size)
            raise CheckpointError(_load_refusal(spec, need, on_device, free, "the GPU has {} free",
                                                max_positions, dtype, source, fits, expert_cache_gb))
    else:
        on_host += on_device
    available = psutil.virtual_memory().available
    if on_host > available:
        raise CheckpointError(_load_refusal(spec, need, on_host, available, "the host has {} available",
                                            max_positions, dtype, source))


def _expert_cache_that_fits(spec, dtype: torch.dtype, on_device: int, free: int, size: int | None) -> int | None:
    from mempath.memory.formulas import expert_cache_size_that_fits, shape_from_spec
    return expert_cache_size_that_fits(shape_from_spec(spec), dtype.itemsize, on_device, free, size)


def _load_refusal(spec, need, total, free, where, positions, dtype, source, expert_cache_size=None,
                  expert_cache_gb=None) -> str:
    from mempath.memory.formulas import rotary_bytes_per_position
    from mempath.memory.ledger import format_bytes
    fixes = []
    if expert_cache_size is not None:
        instead = f" in place of --moe-expert-cache-gb {expert_cache_gb:g}" if expert_cache_gb is not None else ""
        fixes.append(f"pass --moe-expert-cache-size {expert_cache_size} or less{instead} (experts a layer on the "
                     f"GPU, the others in pinned host memory: docs/moe.md; the KV cache needs room too, which "
                     f"`mempath plan` with the flag shows)")
    per_position = rotary_bytes_per_position(spec.head_dim)
    fitting = (free - (total - per_position * positions)) // per_position
    if 0 < fitting < positions:
        fixes.append(f"pass --max-model-len {fitting} or less (the rotary tables hold every position up "
                     f"to max_model_len; config.json's max_position_embeddings is {spec.max_position_embeddings})")
    if dtype.itemsize > 2 and total - need["weights"] // 2 <= free:
        fixes.append("pass --dtype bfloat16 (half the weight bytes)")
    fixes.append(f"check config.json's sizes (num_hidden_layers {spec.num_layers}, hidden_size "
                 f"{spec.hidden_size}, intermediate_size {spec.intermediate_size}, vocab_size "
                 f"{spec.vocab_size}) against the model's original config")
    fixes.append("or load it where more memory is free")
    rotary = need["rotary_tables"] + need["rotary_build"]
    return (f"{source}: loading needs {format_bytes(total)} ({format_bytes(need['weights'])} of {dtype} weights, "
            f"{format_bytes(rotary)} to build the rotary tables for {positions} positions) but "
            f"{where.format(format_bytes(free))}; " + "; ".join(fixes)).replace("torch.", "")


def build_model(spec: ModelSpec, max_positions: int, dtype: torch.dtype, device: torch.device,
                expert_cache_size: int | None = None, weights_arena: bool = False) -> CausalLM:
    """Allocate the model's parameters once, uninitialised, on the target device.

    ``expert_cache_size``: experts per MoE layer kept on the device (None: all); the
    others' weights go to host memory, pinned on CUDA (mempath.model.moe). The model runs
    the kernels for ``device`` (mempath.kernels.dispatch.kernels_for). ``weights_arena``:
    parameters and buffers as views of one arena (``model.weights_arena``, memory/arena.py)
    whose device bytes can be released and restored at the same addresses; else None.
    """
    kernels = kernels_for(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # so each parameter is born in its final dtype
    try:
        with torch.device("meta"):
            model = CausalLM(spec, max_positions, kernels)
    finally:
        torch.set_default_dtype(previous)
    if expert_cache_size is not None:
        set_expert_cache_size(model, expert_cache_size, pin_memory=device.type == "cuda")
    if spec.tie_word_embeddings:
        # to_empty would give the tied head its own storage; share it instead.
        del model.lm_head.weight
    if weights_arena:
        model.weights_arena = place_in_arena(model, device)
    else:
        model = model.to_empty(device=device)
        model.weights_arena = None
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.build(device)
    if expert_cache_size is not None and device.type == "cuda":
        set_expert_prefetch(model, True)  # the slots were shaped on the meta device
    set_fp8_matmul(model, device)
    set_dense_gemv(model, device)
    return model.eval().requires_grad_(False)


def place_in_arena(model: nn.Module, device: torch.device):
    """What to_empty does, into one arena: each meta parameter and buffer a view of its bytes."""
    slots = [(module, table, name, t) for module in model.modules()
             for table in (module._parameters, module._buffers) for name, t in table.items()
             if t is not None and t.is_meta]
    arena = make_arena(sum(aligned(t.numel() * t.element_size()) for *_, t in slots), device)
    offset = 0
    for module, table, name, t in slots:
        placed = arena_view(arena, offset, t.shape, t.dtype)
        table[name] = nn.Parameter(placed, requires_grad=False) if table is module._parameters else placed
        offset += aligned(t.numel() * t.element_size())
    return arena


def _expert_target(params: dict[str, torch.Tensor], match: re.Match, spec: ModelSpec):
    """The slice of a layer's stacked experts that one expert's projection fills."""
    stacked, half = _EXPERT_SLICES[match["proj"]]
    name = f"{match['layer']}.mlp.experts.{stacked}"
    expert = int(match["expert"])
    param = params.get(name)
    if param is None or expert >= param.shape[0]:
        return None, None
    size = spec.moe_intermediate_size
    return name, param[expert] if half is None else param[expert].narrow(0, half * size, size)


def _target(params: dict[str, torch.Tensor], name: str, spec: ModelSpec):
    """The parameter (or slice of it) a checkpoint tensor is copied into."""
    name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for its MoE block
    expert = _EXPERT_TENSOR.match(name)
    if expert:
        return _expert_target(params, expert, spec)
    base, _, kind = name.rpartition(".")  # kind: weight / bias
    for suffix, (fused_suffix, index) in _FUSED.items():
        if base.endswith(suffix):
            fused_name = base[: -len(suffix)] + fused_suffix + "." + kind
            param = params.get(fused_name)
            if param is None:
                return None, None
            if fused_suffix.endswith("qkv_proj"):
                q = spec.num_heads * spec.head_dim
                kv = spec.num_kv_heads * spec.head_dim
                offsets = [0, q, q + kv, q + 2 * kv]
            else:
                size = spec.intermediate_size
                offsets = [0, size, 2 * size]
            return fused_name, param.narrow(0, offsets[index], offsets[index + 1] - offsets[index])
    param = params.get(name)
    return (name, param) if param is not None else (None, None)


def _pieces(name: str, spec: ModelSpec) -> int:
    """How many checkpoint tensors fill a parameter: its slices, or 1 when it is one tensor."""
    if name.endswith(".experts.gate_up_proj"):
        return 2 * spec.num_experts
    if name.endswith(".experts.down_proj"):
        return spec.num_experts
    return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1


def _skipped(name: str, model: CausalLM) -> bool:
    """Checkpoint tensors not copied: buffers we recompute, a tied model's lm_head."""
    return name.endswith(_IGNORED_SUFFIXES) or (model.spec.tie_word_embeddings and name == "lm_head.weight")


def _check_tied_head(where: str, head: torch.Tensor, embedding: torch.Tensor) -> None:
    """A tied model serves its embedding as the LM head: refuse a checkpoint whose own lm_head differs (a head
    untied in training, the config left as it was); transformers then unties them, so its tokens differ."""
    if head.shape != embedding.shape or not torch.equal(head.to(embedding.device, embedding.dtype), embedding):
        raise CheckpointError(f"{where}: holds an lm_head.weight that differs from model.embed_tokens.weight, yet "
                              f"config.json sets tie_word_embeddings true; to serve the head it holds (as "
                              f"transformers does), set \"tie_word_embeddings\": false in config.json")


def copy_checkpoint_tensors(model: CausalLM, tensors, source: str) -> int:
    """Copy checkpoint tensors, named as in transformers, into the model.

    ``tensors`` yields ``(where, name, read)``: ``read()`` returns the tensor and is
    called only for tensors the model uses; ``where`` (a file) names its origin in
    errors, ``source`` the whole checkpoint. Raises if a tensor's shape does not match
    config.json or a parameter (or a slice of a fused one) receives nothing. Returns
    how many tensors were copied.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(offloaded_weights(model))  # experts kept in host memory: their store, not the slots
    expected_pieces = {name: _pieces(name, model.spec) for name in params}
    received = {name: 0 for name in params}
    tied = model.spec.tie_word_embeddings
    scales = quantized_targets(model)  # an fp8 layer's weight -> its weight_scale
    expected_pieces.update({scale: expected_pieces[weight] for weight, scale in scales.items()})
    loaded = 0
    unexpected = []
    # fp8 layers' weights by checkpoint name less ".weight": those that arrived as float and were quantized
    # here (-> where, dtype), those whose weight_scale the checkpoint holds; and how many arrived as fp8.
    quantized_here, scaled, fp8_weights = {}, set(), 0
    tied_head = None  # a tied model's lm_head in the checkpoint: (file, tensor), checked once the embedding is in
    seen = {}  # name -> its file: a second copy would count as pieces a missing tensor never gave
    for where, name, read in tensors:
        if _skipped(name, model):
            tied_head = (where, read()) if name == "lm_head.weight" else tied_head  # read while its file is open
            continue
        if seen.setdefault(name, where) != where:
            raise CheckpointError(f"{source}: tensor {name!r} is in both {seen[name]} and {where}; the checkpoint "
                                  "is damaged or mixes two exports: download it again")
        target_name, target = _target(params, name, model.spec)
        if target is None:
            unexpected.append(name)
            continue
        tensor = read()
        with torch.no_grad():
            filled = _copy_tensor(tensor, target_name, target, name, where, params, scales, model.spec)
        if target_name in scales and tensor.dtype == FP8_DTYPE:
            fp8_weights += 1
        elif target_name in scales:
            quantized_here[name.removesuffix(".weight")] = (where, str(tensor.dtype).removeprefix("torch."))
        elif target_name.endswith(".weight_scale"):
            scaled.add(name.removesuffix(".weight_scale"))
        del tensor  # one checkpoint tensor in host memory at a time
        # A slice counts one piece; a whole (already fused) tensor counts them all.
        whole = target.shape == params[target_name].shape
        for filled_name in filled:
            received[filled_name] += expected_pieces[filled_name] if whole else 1
        loaded += 1
    if unexpected:
        log.warning("ignored %d checkpoint tensors mempath does not use, e.g. %s",
                    len(unexpected), unexpected[:3])
    check_fp8_mix(quantized_here, scaled, fp8_weights, source)
    if tied_head is not None:
        _check_tied_head(*tied_head, params["model.embed_tokens.weight"])
    if tied:
        received["lm_head.weight"] = expected_pieces["lm_head.weight"]
    missing = [n for n in params if received[n] < expected_pieces[n]]
    if missing:
        raise CheckpointError(
            f"{source}: weights missing from the checkpoint: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} ({len(missing)} in all); the checkpoint is "
            f"incomplete or does not match config.json")
    return loaded


def _copy_tensor(tensor, target_name, target, name, where, params, scales, spec) -> tuple[str, ...]:
    """Copy one checkpoint tensor into its target; returns the parameters it filled.

    A float tensor bound for an fp8 layer's weight is quantized as it arrives and fills
    the weight and its scales; a float8 one (a pre-quantized checkpoint) is copied as it
    is, and its ``weight_scale`` tensor arrives on its own (mempath.model.quant).
    """
    dtype = str(tensor.dtype).removeprefix("torch.")
    if target_name.endswith(".weight_scale"):
        if tensor.dtype not in _FLOAT_DTYPES or not copy_scale(target, tensor):
            raise CheckpointError(f"{where}: tensor {name!r} is {dtype} of shape {tuple(tensor.shape)}, expected a "
                                  f"float scale per output channel ({target.shape[0]}) or one per tensor; the "
                                  f"checkpoint is damaged or not an fp8 one mempath reads")
        problem = scale_problem(tensor)  # each scale multiplies a whole row of outputs: never served damaged
        if problem:
            raise CheckpointError(f"{where}: tensor {name!r} {problem}; the checkpoint is damaged: download it again")
        return (target_name,)
    fp8_target = target_name in scales
    if tensor.dtype not in _FLOAT_DTYPES and not (fp8_target and tensor.dtype == FP8_DTYPE):
        expected = "float32, float16, bfloat16" + (", float8_e4m3fn" if fp8_target else "")
        fix = "use the model's unquantized checkpoint"
        if tensor.dtype == FP8_DTYPE and target_name.removesuffix(".weight") in spec.unquantized:
            why = ("config.json's quantization_config keeps this projection in the model dtype (its ignore or "
                   "ignored_layers list names it, or no config group's targets do), but the checkpoint holds it in "
                   "fp8:")
            fix = "restore the checkpoint's config.json, or download the checkpoint again"
        elif tensor.dtype == FP8_DTYPE and not scales and target_name.endswith("_proj.weight"):
            # An fp8 projection, but the model was built unquantized: config.json did not say fp8.
            why = ("config.json has no quantization_config, so the model is built unquantized: restore the fp8 "
                   "checkpoint's config.json, or")
        elif tensor.dtype == FP8_DTYPE:
            why = "mempath's fp8 layers are the q/k/v, o, gate/up and down projections:"
        else:
            why = "the checkpoint is quantized or damaged:"
        raise CheckpointError(f"{where}: tensor {name!r} is {dtype}, expected a floating-point weight ({expected}); "
                              f"{why} {fix}")
    if tuple(tensor.shape) != tuple(target.shape):
        raise CheckpointError(
            f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
            f"{tuple(target.shape)} from config.json; the weights and config do not match")
    if tensor.dtype == FP8_DTYPE and (nans := fp8_nan_count(tensor)):
        raise CheckpointError(f"{where}: tensor {name!r} holds {nans} NaN code(s), which float8_e4m3fn weights "
                              "never hold; the checkpoint is damaged: download it again")
    if target.dtype == torch.float16 and tensor.dtype in (torch.float32, torch.bfloat16) and tensor.numel():
        low, high = tensor.aminmax()  # no temporary the tensor's size, as abs().max() makes
        if (largest := max(-low.item(), high.item())) > torch.finfo(torch.float16).max:  # else inf, NaN logits
            raise CheckpointError(f"{where}: tensor {name!r} holds values beyond float16's range (largest "
                                  f"magnitude {largest:.4g}); load the model with --dtype bfloat16 or float32")
    if not fp8_target or tensor.dtype == FP8_DTYPE:
        target.copy_(tensor)
        return (target_name,)
    scale_name, scale_slice = _target(params, name.removesuffix(".weight") + ".weight_scale", spec)
    copy_quantized(target, scale_slice, tensor)
    return target_name, scale_name


def _damaged(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(f"{path}: not a complete safetensors file ({error}); the file is truncated or "
                           f"damaged: download it again")


def load_weights(model: CausalLM, model_dir: Path, show_progress: bool = True) -> LoadReport:
    files = find_weight_files(model_dir)
    identities = {str(f): file_identity(f) for f in files}  # before reading: what was loaded
    bar = tqdm(total=sum(os.path.getsize(f) for f in files), unit="B", unit_scale=True,
               desc="Loading weights", disable=not show_progress)

    def tensors():
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as error:
                raise _damaged(path, error) from None
            with handle as f:
                for name in f.keys():
                    def read(f=f, name=name, path=path):
                        try:
                            tensor = f.get_tensor(name)
                        except (SafetensorError, OSError) as error:
                            raise _damaged(path, error) from None
                        bar.update(tensor.numel() * tensor.element_size())
                        return tensor
                    yield path, name, read

    try:
        loaded = copy_checkpoint_tensors(model, tensors(), str(model_dir))
    finally:
        bar.close()
    # A write during the read (ctime moves) makes the weights neither file's, and the identity the wrong key for
    # the disk KV tier's digest: the KV of other weights would be served.
    changed = [f for f in files if file_identity(f) != identities[str(f)]]
    if changed:
        raise CheckpointError(f"{changed[0]}: changed on disk while mempath loaded it; restart mempath once the "
                              "new checkpoint is complete")
    device_bytes, host_bytes = _weight_bytes(model)
    return LoadReport([str(f) for f in files], loaded, device_bytes, torch.float32, identities, host_bytes)


def _weight_bytes(model: CausalLM) -> tuple[int, int]:
    """(bytes of the parameters, bytes of the experts kept in host memory); tied weights once."""
    unique = {id(p): p for p in model.parameters()}.values()
    host = offloaded_weights(model).values()
    return sum(p.numel() * p.element_size() for p in unique), sum(t.numel() * t.element_size() for t in host)


def fill_dummy_weights(model: CausalLM, seed: int = 0) -> LoadReport:
    """Random weights of the right shapes, drawn on the device (no checkpoint read).

    Stacked experts are drawn one expert at a time, wherever they are kept, so every
    moe_expert_cache_size gets the same weights (and the same outputs).
    """
    device = model.lm_head.weight.device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    offloaded = offloaded_weights(model)
    params = dict(model.named_parameters())
    scales = quantized_targets(model)
    seen = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in seen or name.endswith(".weight_scale"):  # scales: filled with their weight
                continue
            seen.add(id(p))
            p = offloaded.get(name, p)  # an offloaded expert stack: its host store, not the slots
            if name in scales:  # the same draw as the unquantized model's, then quantized
                drawn = torch.empty(p.shape, dtype=model.lm_head.weight.dtype, device=device)
                copy_quantized(p, params[scales[name]], drawn.normal_(0.0, 0.02, generator=generator))
            elif "norm" in name:
                p.fill_(1.0)
            elif ".experts." in name:
                for expert in p:
                    expert.copy_(torch.empty(expert.shape, dtype=expert.dtype, device=device).normal_(
                        0.0, 0.02, generator=generator))
            else:
                p.normal_(0.0, 0.02, generator=generator)
    device_bytes, host_bytes = _weight_bytes(model)
    return LoadReport([], 0, device_bytes, model.lm_head.weight.dtype, host_weight_bytes=host_bytes)


def load_model(model_dir: str | Path, dtype: torch.dtype | None, device: torch.device,
               max_positions: int | None = None, show_progress: bool = True, dummy: bool = False,
               expert_cache_size: int | None = None, spec: ModelSpec | None = None,
               quantization: str | None = None, weights_arena: bool = False, expert_cache_gb: float | None = None,
               seed: int = 0):
    """Build the model on `device` and stream the weights into it (``weights_arena``: build_model's).

    ``spec``: the caller's ModelSpec of this model's config.json (the engine reads it once);
    None: read here. ``expert_cache_size``: experts per MoE layer resident on `device`
    (None: all; ``expert_cache_gb``: the --moe-expert-cache-gb it came from, for the refusal's advice).
    ``quantization``: "fp8" quantizes a float checkpoint's projections as they
    load (a pre-quantized fp8 checkpoint is fp8 without it); the returned spec says which.
    ``seed``: what the random weights of ``dummy`` are drawn from (EngineConfig.seed).
    Raises CheckpointError (a ValueError) for a config, a checkpoint or a size it cannot load.
    """
    model_dir = Path(model_dir)
    source = str(config_path(model_dir))
    spec = spec or read_spec(model_dir)
    _check_expert_cache_size(spec, expert_cache_size, source)
    if quantization is not None and quantization != spec.quantization:
        spec = dataclasses.replace(spec, quantization=quantization)
    if spec.quantization is not None:
        check_fp8_device(device, source)
    ckpt_dtype = _torch_dtype(spec.torch_dtype)  # as checkpoint_dtype reads the config it came from
    dtype = dtype or ckpt_dtype
    positions = max_positions or spec.max_position_embeddings
    check_load_fits(spec, positions, dtype, device, dummy=dummy, checkpoint_dtype=ckpt_dtype, source=source,
                    expert_cache_size=expert_cache_size, expert_cache_gb=expert_cache_gb)
    model = build_model(spec, positions, dtype, device, expert_cache_size, weights_arena)
    report = fill_dummy_weights(model, seed) if dummy else load_weights(model, model_dir, show_progress)
    report.checkpoint_dtype = ckpt_dtype
    return model, spec, report


def _check_expert_cache_size(spec: ModelSpec, size: int | None, source: str) -> None:
    if size is None:
        return
    if not spec.num_experts:
        raise ValueError(f"moe_expert_cache_size is {size} but {source} describes a dense model "
                         f"({spec.architecture}, no MoE layer): leave it unset")
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= spec.num_experts:
        raise ValueError(f"moe_expert_cache_size must be an integer from 1 to {spec.num_experts} (the experts "
                         f"per layer in {source}), got {size!r}")
