"""Names and numbers the runtime and the tools share.

Torch-free, so that `mempath plan` answers without importing it; config.py maps the
dtype names to torch dtypes.
"""

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

# Decode graphs are captured for batch sizes up to 512 (larger batches run eagerly:
# launch overhead is amortised there), all sharing one memory pool.
MAX_GRAPH_BATCH = 512
# The default and what --block-size auto picks. Measured on an H200 (BENCHMARKS.md, "Block
# size"): 8-token blocks were the slowest; 16..256 within noise of each other, and larger
# blocks waste more of each sequence's last block and match cached prefixes more
# coarsely, so 16.
DEFAULT_BLOCK_SIZE = 16
# The sampler sorts the logits of this many rows at a time (top-p / top-k); the planner
# counts the sort's temporaries for one slice.
SAMPLER_SORT_ROWS = 16
