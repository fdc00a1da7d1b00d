"""Names and numbers the runtime and the tools share.

Torch-free, so that `mempath plan` answers without importing it; config.py maps the
dtype names to torch dtypes.
"""
import numbers

# The share of the device's memory an engine budgets by default (vLLM's --gpu-memory-utilization).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

# A size above this is a typo, not a size: beyond any device or host memory (1 PiB).
MAX_SIZE_BYTES = 1 << 50
MAX_SIZE_GIB = MAX_SIZE_BYTES >> 30

# Every spelling a user may give for a model dtype, to its canonical name.
DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# The dtypes a checkpoint's config.json may name (torch_dtype / dtype).
CHECKPOINT_DTYPES = ("float32", "float16", "bfloat16")
# vLLM's --kv-cache-dtype names, to torch's name of the format; fp8 means e4m3 (more
# mantissa; K and V rarely need e5m2's range).
KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# fp8 weights and activations (model/quant.py and the Triton kernels that share its arithmetic):
# e4m3's largest finite value, and the floor of a scale, so an all-zero row (padding rows of a
# CUDA-graph batch) divides by something finite and quantizes to zeros.
FP8_MAX = 448.0
MIN_SCALE = 1e-12

VERSION = "0.1.0"  # mempath.__version__; pyproject.toml's version is the same

# The version of the KV cache's numerics, part of the disk tier's fingerprint (with mempath's
# version): bump it with any change that alters the bytes of a block's KV for the same weights
# and tokens (attention or projection kernels, rotary embedding, KV quantization, cache layout),
# so that blocks an older mempath wrote are not served as this one's.
KV_NUMERICS_VERSION = 1

# Decode graphs are captured for batch sizes up to 512 (larger batches run eagerly:
# launch overhead is amortised there), all sharing one memory pool.
MAX_GRAPH_BATCH = 512
# max_num_seqs when none is given: vLLM V1's offline default on H100-class GPUs (70 GiB or
# more) and 256 on smaller ones and the CPU. On the H200 (BENCHMARKS.md, "Realistic mix")
# 1,024 took a 1,000-request mix from 8.4k to 10.1k output tok/s on the Llama-3.1-8B shape
# and from 13.6k to 21.0k on Qwen3-0.6B; its step buffers, workspaces and sampler rows are
# in the plan (what a smaller GPU would rather give to KV blocks).
MAX_NUM_SEQS_LARGE_GPU = 1024
MAX_NUM_SEQS_SMALL = 256
LARGE_GPU_BYTES = 70 << 30


def default_max_num_seqs(gpu_total_bytes: int | None) -> int:
    """The max_num_seqs an engine on a device of this total memory gets (None: the CPU)."""
    return MAX_NUM_SEQS_LARGE_GPU if gpu_total_bytes and gpu_total_bytes >= LARGE_GPU_BYTES else MAX_NUM_SEQS_SMALL


# The default and what --block-size auto picks. Measured on an H200 (BENCHMARKS.md, "Block
# size"): 8-token blocks were the slowest; 16..256 within noise of each other, and larger
# blocks waste more of each sequence's last block and match cached prefixes more
# coarsely, so 16.
DEFAULT_BLOCK_SIZE = 16
# The sampler sorts the logits of this many rows at a time (top-p / top-k); the planner
# counts the sort's temporaries for one slice.
SAMPLER_SORT_ROWS = 16

# A seed torch.Generator.manual_seed takes: a signed or an unsigned 64-bit integer.
SEED_RANGE = (-2**63, 2**64 - 1)


def check_seed(seed: int) -> None:
    """ValueError naming the range for a whole number no generator takes (torch says only 'Overflow')."""
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(f"seed must be from -2**63 to 2**64 - 1, got {seed}")


def as_kind(value, kind: type):
    """``value`` as a ``kind`` (numpy's scalars as Python's), or None where it is not one: a bool is no number
    (Python's bool is an int) and no number is a bool; an int is a float."""
    is_bool = isinstance(value, bool) or (type(value).__module__ == "numpy"
                                          and type(value).__name__ in ("bool", "bool_"))
    if kind is bool:
        return bool(value) if is_bool else None
    if is_bool:
        return None
    if kind is int:
        return int(value) if isinstance(value, numbers.Integral) else None
    if kind is float:
        return value if type(value) in (int, float) else float(value) if isinstance(value, numbers.Real) else None
    return value if isinstance(value, kind) else None
