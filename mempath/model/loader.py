"""Streaming loader for Hugging Face checkpoints.

The model is built on the meta device, materialised once on the target device
(empty, no random init), and then each checkpoint tensor is read from a
memory-mapped safetensors file and copied into its slice of the preallocated
parameter. Host memory holds one tensor at a time, never the whole state dict:
that second full copy is what kills loads of large models on small hosts.
"""
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from mempath.model.llama import CausalLM, ModelSpec

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
# Buffers some checkpoints carry that we recompute instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadReport:
    weight_files: list[str]
    tensors_loaded: int
    weight_bytes: int  # bytes of the materialised parameters
    checkpoint_dtype: torch.dtype


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir)
    if path.is_file() and path.name.endswith(".json"):
        config_path = path
    else:
        config_path = path / "config.json"
    if not config_path.exists():
        raise ValueError(
            f"{config_path}: no config.json found; pass a Hugging Face model directory "
            f"(config.json + *.safetensors + tokenizer files)")
    with open(config_path) as f:
        return json.load(f)


def checkpoint_dtype(cfg: dict) -> torch.dtype:
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(
        name, torch.float32)


def find_weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).exists()]
        if missing:
            raise ValueError(
                f"{index}: names shard(s) {missing} that are not in {model_dir}; "
                f"download the complete checkpoint")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
        raise ValueError(
            f"{model_dir}: only PyTorch pickle weights (*.bin) found; mempath loads safetensors. "
            f"Convert with transformers: model.save_pretrained(dir, safe_serialization=True)")
    raise ValueError(f"{model_dir}: no model.safetensors or *.safetensors weights file found")


def build_model(spec: ModelSpec, max_positions: int, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Allocate the model's parameters once, uninitialised, on the target device."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # so each parameter is born in its final dtype
    try:
        with torch.device("meta"):
            model = CausalLM(spec, max_positions)
    finally:
        torch.set_default_dtype(previous)
    if spec.tie_word_embeddings:
        # to_empty would give the tied head its own storage; share it instead.
        del model.lm_head.weight
    model = model.to_empty(device=device)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.build(device)
    return model.eval().requires_grad_(False)


def _target(params: dict[str, torch.Tensor], name: str, spec: ModelSpec):
    """The parameter (or slice of it) a checkpoint tensor is copied into."""
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


def _skipped(name: str, model: CausalLM) -> bool:
    """Checkpoint tensors not copied: buffers we recompute, a tied model's lm_head."""
    return name.endswith(_IGNORED_SUFFIXES) or (model.spec.tie_word_embeddings and name == "lm_head.weight")


def copy_checkpoint_tensors(model: CausalLM, tensors, source: str) -> int:
    """Copy checkpoint tensors, named as in transformers, into the model.

    ``tensors`` yields ``(where, name, read)``: ``read()`` returns the tensor and is
    called only for tensors the model uses; ``where`` (a file) names its origin in
    errors, ``source`` the whole checkpoint. Raises if a tensor's shape does not match
    config.json or a parameter (or a slice of a fused one) receives nothing. Returns
    how many tensors were copied.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    # Each fused parameter must receive every one of its slices.
    expected_pieces = {name: 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1
                       for name in params}
    received = {name: 0 for name in params}
    tied = model.spec.tie_word_embeddings
    loaded = 0
    unexpected = []
    for where, name, read in tensors:
        if _skipped(name, model):
            continue
        target_name, target = _target(params, name, model.spec)
        if target is None:
            unexpected.append(name)
            continue
        tensor = read()
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(target.shape)} from config.json; the weights and config do not match")
        with torch.no_grad():
            target.copy_(tensor)
        del tensor  # one checkpoint tensor in host memory at a time
        # A slice counts one piece; a whole (already fused) tensor counts them all.
        whole = target.shape == params[target_name].shape
        received[target_name] += expected_pieces[target_name] if whole else 1
        loaded += 1
    if unexpected:
        log.warning("ignored %d checkpoint tensors mempath does not use, e.g. %s",
                    len(unexpected), unexpected[:3])
    if tied:
        received["lm_head.weight"] = expected_pieces["lm_head.weight"]
    missing = [n for n in params if received[n] < expected_pieces[n]]
    if missing:
        raise ValueError(
            f"{source}: weights missing from the checkpoint: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} ({len(missing)} in all); the checkpoint is "
            f"incomplete or does not match config.json")
    return loaded


def load_weights(model: CausalLM, model_dir: Path, show_progress: bool = True) -> LoadReport:
    files = find_weight_files(model_dir)
    bar = tqdm(total=sum(os.path.getsize(f) for f in files), unit="B", unit_scale=True,
               desc="Loading weights", disable=not show_progress)

    def tensors():
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    def read(f=f, name=name):
                        tensor = f.get_tensor(name)
                        bar.update(tensor.numel() * tensor.element_size())
                        return tensor
                    yield path, name, read

    try:
        loaded = copy_checkpoint_tensors(model, tensors(), str(model_dir))
    finally:
        bar.close()
    seen = set()
    weight_bytes = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            weight_bytes += p.numel() * p.element_size()
    return LoadReport([str(f) for f in files], loaded, weight_bytes, torch.float32)


def fill_dummy_weights(model: CausalLM, seed: int = 0) -> LoadReport:
    """Random weights of the right shapes, drawn on the device (no checkpoint read)."""
    generator = torch.Generator(device=model.lm_head.weight.device)
    generator.manual_seed(seed)
    weight_bytes = 0
    seen = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
            weight_bytes += p.numel() * p.element_size()
    return LoadReport([], 0, weight_bytes, model.lm_head.weight.dtype)


def load_model(model_dir: str | Path, dtype: torch.dtype | None, device: torch.device,
               max_positions: int | None = None, show_progress: bool = True, dummy: bool = False):
    """Read config.json, build the model on `device` and stream the weights into it."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    spec = ModelSpec.from_hf_config(cfg, source=str(model_dir / "config.json"))
    ckpt_dtype = checkpoint_dtype(cfg)
    dtype = dtype or ckpt_dtype
    model = build_model(spec, max_positions or spec.max_position_embeddings, dtype, device)
    report = fill_dummy_weights(model) if dummy else load_weights(model, model_dir, show_progress)
    report.checkpoint_dtype = ckpt_dtype
    return model, spec, report
