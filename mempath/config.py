"""EngineConfig: every engine knob in one place, validated once."""
from dataclasses import dataclass, fields

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto: the checkpoint's dtype on CUDA, float32 on the CPU
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    # Bytes of KV cache when the device is the CPU (vLLM's VLLM_CPU_KVCACHE_SPACE).
    cpu_kv_cache_bytes: int = 1 << 30
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no CUDA graphs (they are only used on CUDA)
    # auto: read the checkpoint; dummy: random weights of the right shapes (benchmarks,
    # needs only config.json), as vLLM's --load-format dummy.
    load_format: str = "auto"
    # Largest number of top logprobs a request may ask for; bounds the sampler's work.
    max_logprobs: int = 20

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(set(_DTYPES))}, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {sorted(known - {'model'})}")
        return cls(model=model, **kwargs)

    def torch_device(self) -> torch.device:
        name = self.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(name)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def torch_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.torch_device().type == "cpu":
            return torch.float32
        return checkpoint_dtype


def parse_dtype(name: str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if name is None:
        return default
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(set(_DTYPES))}")
    return _DTYPES[name]
