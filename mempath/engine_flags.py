"""The engine's command-line flags, declared once, named as in vLLM, defaulting to EngineConfig's values.

`generate`, `chat`, `serve` and `diagnose` take every flag (add_engine_arguments); `plan`
takes the ones that size memory (add_memory_arguments), so a plan is of the settings the
engine would run with.
"""
import argparse

from mempath.config import KV_CACHE_DTYPES, EngineConfig

# The EngineConfig fields the flags set (besides the model).
ENGINE_OPTIONS = ("dtype", "device", "seed", "block_size", "max_model_len", "max_num_seqs",
                  "max_num_batched_tokens", "gpu_memory_utilization", "num_gpu_blocks_override",
                  "enable_prefix_caching", "enforce_eager", "cpu_kv_gb", "disk_kv_path", "disk_kv_gb",
                  "disk_write_policy", "preemption_mode", "cpu_kv_cache_bytes", "load_format", "async_scheduling",
                  "kv_cache_dtype", "quantization")


def block_size_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a power of two or 'auto', got {text!r}") from None


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that size the engine's memory: dtype, KV blocks, batch limits, budget, graphs."""
    d = EngineConfig(model="")
    parser.add_argument("--dtype", default=d.dtype, help="auto | float32 | float16 | bfloat16")
    parser.add_argument("--block-size", type=block_size_arg, default=d.block_size,
                        help="tokens per KV block (power of two) or auto (16: measured, see BENCHMARKS.md)")
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=("auto", *KV_CACHE_DTYPES),
                        help="auto: the model dtype; fp8 (= fp8_e4m3) or fp8_e5m2: one byte per element")
    parser.add_argument("--quantization", default=d.quantization, choices=("fp8",),
                        help="fp8: weights of the linear layers in float8_e4m3fn, quantized at load "
                             "(default: as the checkpoint is; docs/quantization.md)")


def add_engine_arguments(parser: argparse.ArgumentParser, model_flag: bool = True) -> None:
    """Every engine knob (model_flag=False where MODEL is positional)."""
    d = EngineConfig(model="")
    if model_flag:
        parser.add_argument("--model", default=None,
                            help="model directory (default: the built-in mempath-tiny)")
    add_memory_arguments(parser)
    parser.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=d.num_gpu_blocks_override)
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                        help="read each decode step's tokens before launching the next")
    parser.add_argument("--load-format", default=d.load_format, choices=("auto", "dummy"),
                        help="dummy: random weights of the config's shapes (benchmarks)")
    parser.add_argument("--cpu-kv-gb", type=float, default=d.cpu_kv_gb,
                        help="GiB of pinned host memory for the warm KV tier (0: none)")
    parser.add_argument("--disk-kv-path", default=d.disk_kv_path, help="directory of the cold KV tier")
    parser.add_argument("--disk-kv-gb", type=float, default=d.disk_kv_gb, help="GiB of the cold KV tier")
    parser.add_argument("--disk-write-policy", default=d.disk_write_policy,
                        choices=("write-back", "write-through"))
    parser.add_argument("--preemption-mode", default=d.preemption_mode, choices=("auto", "recompute", "swap"))
    parser.add_argument("--cpu-kv-cache-bytes", type=int, default=d.cpu_kv_cache_bytes,
                        help="KV cache bytes when the device is the CPU")


def engine_options(args: argparse.Namespace) -> dict:
    """The parsed engine flags as EngineConfig keyword arguments."""
    return {k: getattr(args, k) for k in ENGINE_OPTIONS}
