"""The engine's command-line flags, declared once, named as in vLLM, defaulting to EngineConfig's values.

`generate`, `chat`, `serve` and `diagnose` take every flag (add_engine_arguments); `plan`
takes the ones that size memory (add_memory_arguments), so a plan is of the settings the
engine would run with. vLLM flags that mempath cannot honour are declared too, so that
they are refused with the reason (REFUSED) instead of "unrecognized arguments"; the ones
whose only value here changes nothing are accepted (IGNORED). docs/vllm.md has the table.
"""
import argparse
import logging
import math

from mempath.config import KV_CACHE_DTYPES, EngineConfig

log = logging.getLogger(__name__)

# The EngineConfig fields the flags set (besides the model).
ENGINE_OPTIONS = ("dtype", "device", "seed", "block_size", "max_model_len", "max_num_seqs",
                  "max_num_batched_tokens", "gpu_memory_utilization", "num_gpu_blocks_override",
                  "enable_prefix_caching", "enforce_eager", "cpu_kv_gb", "disk_kv_path", "disk_kv_gb",
                  "disk_write_policy", "preemption_mode", "cpu_kv_cache_bytes", "load_format", "async_scheduling",
                  "kv_cache_dtype", "tokenizer", "generation_config", "enable_chunked_prefill", "max_logprobs",
                  "speculative_config", "quantization", "moe_expert_cache_size", "moe_expert_cache_gb",
                  "moe_cpu_experts")

ONE_DEVICE = "mempath runs a model on one device"
LOCAL_ONLY = ("mempath loads a local directory: download it first (huggingface-cli download MODEL "
              "[--revision R] --local-dir DIR) and pass DIR")
# vLLM flag -> (the values that ask for nothing mempath does not do, why any other is refused).
# A flag with no values is refused whenever it is given.
REFUSED = {
    "--trust-remote-code": ((), "mempath never runs code from a checkpoint, and every architecture it "
                                "supports loads without it: drop the flag"),
    "--tensor-parallel-size": (("1",), f"{ONE_DEVICE}; tensor parallelism is not implemented (mempath "
                                       f"plan MODEL --gpu-mem SIZE shows whether one device fits it)"),
    "--pipeline-parallel-size": (("1",), f"{ONE_DEVICE}; pipeline parallelism is not implemented"),
    "--data-parallel-size": (("1",), f"{ONE_DEVICE}: run one server per device behind a load balancer"),
    "--enable-lora": ((), "LoRA adapters are not supported while serving: merge the adapter into the weights"),
    "--lora-modules": ((), "LoRA adapters are not supported while serving: merge the adapter into the weights"),
    "--cpu-offload-gb": (("0",), "weights stay on the device (the CPU tier holds KV: --cpu-kv-gb)"),
    "--revision": ((), LOCAL_ONLY),
    "--tokenizer-revision": ((), LOCAL_ONLY),
    "--download-dir": ((), LOCAL_ONLY),
    "--hf-token": ((), LOCAL_ONLY),
    "--tokenizer-mode": (("auto", "hf"), "the tokenizer is the checkpoint's Hugging Face tokenizer"),
    "--limit-mm-per-prompt": ((), "mempath serves text-only models"),
    "--reasoning-parser": ((), "reasoning output is not parsed out of the text"),
    "--kv-transfer-config": ((), "disaggregated prefill (KV transfer between servers) is not implemented"),
    "--enable-sleep-mode": ((), "sleep mode is not implemented"),
    "--scheduling-policy": (("fcfs",), "requests are scheduled first come, first served"),
}
SWITCHES = ("--trust-remote-code", "--enable-lora", "--enable-sleep-mode")  # the refused flags without a value
SHORT_FORMS = {"--tensor-parallel-size": "-tp", "--pipeline-parallel-size": "-pp",
               "--data-parallel-size": "-dp"}
# vLLM flags accepted because here they change nothing; --help says why.
IGNORED = {
    "--disable-custom-all-reduce": "accepted, changes nothing: one device has no all-reduce",
    "--disable-frontend-multiprocessing": "accepted, changes nothing: the server is one process",
    "--enable-prompt-tokens-details": "accepted, changes nothing: usage always has cached_tokens",
}
# --quantization none (vLLM's spelling of its default): what leaving the flag out does, which is not "unquantized"
# for an fp8 checkpoint.
QUANTIZATION_NONE = ("without the flag the checkpoint loads as it is (float, or fp8 where config.json's "
                     "quantization_config says so; an fp8 checkpoint cannot be loaded unquantized: use the model's "
                     "bfloat16 checkpoint for that): drop the flag")


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, except where there is none to show (None or a switch's False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


class Refuse(argparse.Action):
    """Records a flag mempath cannot honour; main() refuses it with one line before anything loads, with the
    reason ``reasons`` gives for the value (lower-cased) where it names one, else ``reason``."""

    def __init__(self, option_strings, dest, allowed=(), reason="", reasons=None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.allowed, self.reason, self.reasons = allowed, reason, reasons or {}

    def __call__(self, parser, namespace, values, option_string=None):
        if values in self.allowed:
            return
        given = option_string if self.nargs == 0 else f"{option_string} {values}"
        reason = self.reasons.get(values.lower(), self.reason) if isinstance(values, str) else self.reason
        namespace.refused = getattr(namespace, "refused", None) or f"{given}: {reason}"


class StoreOrRefuse(Refuse):
    """A flag whose allowed values are stored; any other is refused as Refuse does."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values in self.allowed:
            setattr(namespace, self.dest, values)
        else:
            super().__call__(parser, namespace, values, option_string)


def block_size_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a power of two or 'auto', got {text!r}") from None


def max_num_seqs_arg(text: str) -> int | None:
    """--max-num-seqs: a number, or auto (None: the engine picks it for the device)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that size the engine's memory: dtype, KV blocks, batch limits, budget, graphs."""
    d = EngineConfig(model="", device="cpu")  # the defaults, without touching a GPU
    parser.add_argument("--dtype", default=d.dtype, help="auto | float32 | float16 | bfloat16")
    parser.add_argument("--block-size", type=block_size_arg, default=d.block_size,
                        help="tokens per KV block (power of two) or auto (16: measured, see BENCHMARKS.md)")
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len,
                        help="longest prompt + output (default: the model's max_position_embeddings)")
    parser.add_argument("--max-num-seqs", type=max_num_seqs_arg, default="auto",
                        help="most requests running at once; auto: 1024 on a GPU of 70 GiB or more, else 256")
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                        help="most tokens one step computes")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                        help="share of the device's memory the engine may use")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=d.enforce_eager,
                        help="no CUDA graphs")
    parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=("auto", *KV_CACHE_DTYPES),
                        help="auto: the model dtype; fp8 (= fp8_e4m3) or fp8_e5m2: one byte per element")
    parser.add_argument("--quantization", "-q", default=d.quantization, action=StoreOrRefuse, allowed=("fp8",),
                        reason="only fp8 is supported (weights quantized at load, or an fp8 checkpoint: "
                               "docs/quantization.md); other schemes (AWQ, GPTQ, ...) need kernels mempath "
                               "does not have: use the unquantized checkpoint",
                        reasons={value: QUANTIZATION_NONE for value in ("none", "")},
                        help="fp8: weights of the linear layers in float8_e4m3fn, quantized at load "
                             "(default: as the checkpoint is; docs/quantization.md)")

    add_expert_cache_arguments(parser)


def add_expert_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Mixture-of-experts models: how many experts per layer stay on the device (docs/moe.md)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--moe-expert-cache-size", type=int, default=None, metavar="N",
                       help="experts per MoE layer resident on the device, the rest in pinned host memory and "
                            "copied in when routed (default: all; from top_k to the experts per layer)")
    group.add_argument("--moe-expert-cache-gb", type=float, default=None, metavar="GiB",
                       help="device GiB for the expert slots of all MoE layers instead: start-up turns it into "
                            "experts per layer (--moe-expert-cache-size)")
    parser.add_argument("--moe-cpu-experts", default=EngineConfig(model="").moe_cpu_experts,
                        choices=("never", "auto", "always"),
                        help="MoE with --moe-expert-cache-size/-gb: where a missed expert runs. never: copied "
                             "into a device slot; always: on the host from its pinned copy; auto: the cheaper "
                             "by a cost model measured at start-up (docs/moe.md)")


def add_engine_arguments(parser: argparse.ArgumentParser, model_flag: bool = True) -> None:
    """Every engine knob (model_flag=False where MODEL is positional), and vLLM's flags refused here."""
    d = EngineConfig(model="")
    if model_flag:
        parser.add_argument("--model", default=None,
                            help="model directory (default: the built-in mempath-tiny)")
    add_memory_arguments(parser)
    parser.add_argument("--tokenizer", default=d.tokenizer, metavar="DIR",
                        help="the tokenizer's directory (default: the model directory)")
    parser.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--seed", type=int, default=d.seed, help="the engine's seed")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=d.num_gpu_blocks_override,
                        help="KV blocks to allocate instead of what the budget leaves")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=d.enable_prefix_caching, help="share the KV blocks of equal prompt prefixes")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=d.enable_chunked_prefill,
                        help="split long prompts across steps; off: a prompt is prefilled in one step and "
                             "waits for a step with room for all of it (needs --max-num-batched-tokens >= "
                             "--max-model-len)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                        help="launch each decode step before reading the previous one's tokens")
    parser.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                        help="most top logprobs a request may ask for (more is a 400)")
    parser.add_argument("--generation-config", default=d.generation_config, metavar="auto|vllm|DIR",
                        help="default sampling parameters: auto, the model's generation_config.json; vllm, "
                             "none (SamplingParams' defaults); DIR, that directory's generation_config.json. "
                             "A request's own values win")
    parser.add_argument("--load-format", default=d.load_format, choices=("auto", "dummy"),
                        help="dummy: random weights of the config's shapes (benchmarks)")
    add_tier_arguments(parser, d)
    add_refused_arguments(parser)


def add_tier_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    parser.add_argument("--cpu-kv-gb", type=float, default=None,
                        help=f"GiB of pinned host memory for the warm KV tier (default {d.cpu_kv_gb:g}: none)")
    parser.add_argument("--swap-space", type=float, default=None, metavar="GiB",
                        help="vLLM's name for --cpu-kv-gb (vLLM's default is 4; here none unless given); "
                             "--cpu-kv-gb wins if both are given")
    parser.add_argument("--disk-kv-path", default=d.disk_kv_path, help="directory of the cold KV tier")
    parser.add_argument("--disk-kv-gb", type=float, default=d.disk_kv_gb, help="GiB of the cold KV tier")
    parser.add_argument("--disk-write-policy", default=d.disk_write_policy,
                        choices=("write-back", "write-through"), help="when blocks reach the disk tier")
    parser.add_argument("--preemption-mode", default=d.preemption_mode, choices=("auto", "recompute", "swap"),
                        help="how a preempted request gives its blocks back")
    parser.add_argument("--cpu-kv-cache-bytes", type=int, default=d.cpu_kv_cache_bytes,
                        help="KV cache bytes when the device is the CPU")
    # Speculative decoding (docs/speculative.md): vLLM's JSON option, validated by EngineConfig.
    parser.add_argument("--speculative-config", default=None,
                        help='JSON: {"model": DRAFT_DIR, "num_speculative_tokens": K} or '
                             '{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4}')


def add_refused_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM flags refused or ignored here")
    for flag, (allowed, reason) in REFUSED.items():
        names = [flag] + ([SHORT_FORMS[flag]] if flag in SHORT_FORMS else [])
        takes_value = flag not in SWITCHES
        group.add_argument(*names, action=Refuse, allowed=allowed, reason=reason,
                           nargs=None if takes_value else 0, dest=f"refused_{flag[2:].replace('-', '_')}",
                           **({"metavar": "VALUE"} if takes_value else {}),
                           help=f"refused{' unless ' + ' or '.join(allowed) if allowed else ''}: {reason}")
    for flag, why in IGNORED.items():
        group.add_argument(flag, action="store_true", dest=f"ignored_{flag[2:].replace('-', '_')}", help=why)


def engine_options(args: argparse.Namespace) -> dict:
    """The parsed engine flags as EngineConfig keyword arguments."""
    options = {k: getattr(args, k) for k in ENGINE_OPTIONS if k != "cpu_kv_gb"}
    cpu_kv_gb, swap_space = args.cpu_kv_gb, getattr(args, "swap_space", None)
    if cpu_kv_gb is not None and swap_space is not None and cpu_kv_gb != swap_space:
        log.warning("--cpu-kv-gb %g and --swap-space %g both given: --cpu-kv-gb wins", cpu_kv_gb, swap_space)
    chosen = cpu_kv_gb if cpu_kv_gb is not None else swap_space
    if cpu_kv_gb is None and swap_space is not None and not 0 <= swap_space < math.inf:  # else named cpu_kv_gb
        raise ValueError(f"--swap-space {swap_space:g} must be >= 0 and finite (GiB of host memory for the KV "
                         f"cache's host tier)")
    if chosen is not None:
        options["cpu_kv_gb"] = chosen
    return options
