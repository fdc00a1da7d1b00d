"""Start-up: an engine's parts built stage by stage, each stage's memory granted by the budget.

Stages, in order: read and validate the config; load the weights; build the runner
(static step buffers); size the KV cache (on CUDA: run the largest step once and give
the rest of the budget to KV); allocate it; compile the attention kernels; capture the
decode graphs; attach the KV tiers; cap PyTorch's allocator at what the budget leaves
it. An observer (``stage``) can wrap each stage: `mempath diagnose` measures them so.
"""
import contextlib
import hashlib
import json
import logging
import weakref
from pathlib import Path
from typing import Callable, ContextManager

import torch

from mempath.config import EngineConfig
from mempath.constants import DEFAULT_BLOCK_SIZE, DEFAULT_GPU_MEMORY_UTILIZATION, KV_NUMERICS_VERSION, VERSION
from mempath.engine.probes import Probes
from mempath.engine.runner import ModelRunner, kv_block_nbytes
from mempath.kv.manager import KVCacheManager, blocks_for
from mempath.kv.tiers.disk import check_disk_tier_holds_a_block
from mempath.kv.tiers.host import check_host_tier_holds_a_block
from mempath.memory.arena import mapped_bytes
from mempath.memory.budget import OUTSIDE_TORCH_GROWTH, DeviceBudget, check_host_room
from mempath.memory.device_cap import hold_device_cap
from mempath.memory.formulas import count_params, resolve_expert_cache_size, shape_from_spec
from mempath.memory.ledger import Pathway, format_bytes
from mempath.memory.oom import oom_guard
from mempath.model.moe import expert_slot_bytes, forget_start_up_routing
from mempath.model.moe_host import check_cpu_experts, set_cpu_experts
from mempath.model.spec import ConfigFields, ModelSpec
from mempath.model.quant import check_fp8_kv_device
from mempath.model.digest import digest_cache_file, weights_digest
from mempath.model.loader import checkpoint_dtype, load_model, read_config, read_json_object, refuse_special_file

log = logging.getLogger(__name__)
# The figures an operator reads (server/stats_log.py: `mempath serve` shows them at INFO).
capacity_log = logging.getLogger("mempath.stats")

# One fresh segment of each of PyTorch's caching-allocator pools (2 MiB small, 20 MiB
# large): the least a step reserves when it finds no cached block that fits.
ALLOCATOR_SEGMENTS = 22 << 20

# Start-up stages an observer can wrap: the name and the ledger pathway the stage
# fills, None for one that only warms up.
StageObserver = Callable[[str, "str | None"], ContextManager]


def no_observer(name: str, pathway: str | None) -> ContextManager:
    return contextlib.nullcontext()


def larger_block_fix(block_size: int) -> str:
    """The other fix for a CPU KV cache that holds no block, where the block is larger than the default."""
    return f", or lower --block-size ({block_size}; the default is {DEFAULT_BLOCK_SIZE})" \
        if block_size > DEFAULT_BLOCK_SIZE else ""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or None when the directory has none."""
    path = Path(model_dir)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    for name in TOKENIZER_FILES:  # a FIFO there: transformers waited on it forever
        refuse_special_file(path / name, "the tokenizer's file", "replace it with the checkpoint's file (download "
                                                                 "it again)")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # The engine checks a prompt against max_model_len and says so in one line; the tokenizer's own limit
    # only printed a warning above that line ("Token indices sequence length is longer than ..."). Marked as
    # already given, it is not given; model_max_length (truncation's limit) stays the checkpoint's.
    tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


def load_generation_eos(model_dir: str, source: str = "auto") -> list[int]:
    """The end-of-sequence ids of a generation_config.json: a directory's that --generation-config names, else
    the model directory's (``vllm`` drops the file's sampling defaults only, as in vLLM)."""
    path = Path(model_dir if source in ("auto", "vllm") else source) / "generation_config.json"
    if not path.exists():
        return []
    fields = ConfigFields(read_json_object(path, "a JSON object of generation settings"), str(path))
    return fields.token_ids("eos_token_id")


def resolve_max_model_len(wanted: int | None, spec: ModelSpec) -> int:
    limit = spec.max_model_len_limit
    if wanted is None:
        return limit
    if wanted > limit:
        raise ValueError(
            f"max_model_len {wanted} exceeds what this model supports ({limit}: "
            f"max_position_embeddings{' / sliding_window' if spec.sliding_window else ''}); "
            f"use --max-model-len {limit} or less")
    return wanted


def kv_capacity_lines(device_type: str, kv: KVCacheManager, block_size: int, max_model_len: int) -> list[str]:
    """vLLM's two start-up lines (KV cache size in tokens, the concurrency it allows at
    max_model_len, counted in whole blocks per request), and the tiers' sizes."""
    per_request = blocks_for(max_model_len, block_size)
    lines = [f"{'GPU' if device_type == 'cuda' else 'CPU'} KV cache size: {kv.num_blocks * block_size:,} tokens "
             f"({kv.num_blocks:,} blocks of {block_size})",
             f"Maximum concurrency for {max_model_len:,} tokens per request: {kv.num_blocks / per_request:.2f}x"]
    if kv.tiers is not None:
        tiers = [("CPU", kv.tiers.host.num_blocks)]
        if kv.tiers.disk is not None:  # its capacity in blocks' bytes (files add a small header)
            tiers.append(("disk", kv.tiers.disk.capacity_bytes // kv.tiers.block_nbytes))
        lines.append(", ".join(f"{name} KV tier: {blocks * block_size:,} tokens ({blocks:,} blocks)"
                               for name, blocks in tiers))
    return lines


class Startup:
    """The parts under construction; ``run`` builds them, LLMEngine takes them."""

    def __init__(self, config: EngineConfig, stage: StageObserver = no_observer,
                 budget: DeviceBudget | None = None, tenant: str | None = None):
        self.config = config
        self.stage = stage
        self.device = config.torch_device()
        self.hf_config = read_config(config.model)
        # Validate the architecture and lengths before anything is allocated.
        self.spec = ModelSpec.from_hf_config(self.hf_config, source=str(Path(config.model) / "config.json"))
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.spec)
        self.dtype = config.torch_dtype(checkpoint_dtype(self.hf_config))
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.expert_cache_size = resolve_expert_cache_size(
            shape_from_spec(self.spec), self.dtype.itemsize, config.moe_expert_cache_size,
            config.moe_expert_cache_gb, str(Path(config.model) / "config.json"))
        check_cpu_experts(config.moe_cpu_experts, self.expert_cache_size,
                          None if self.spec.num_experts else f"{config.model} describes a dense model "
                                                              f"({self.spec.architecture}, no MoE layer)")
        check_fp8_kv_device(self.device, config.kv_cache_dtype)
        self._check_tiers_hold_a_block()
        self.tenant = tenant or Path(config.model).name or config.model
        # Given back when start-up fails, or by the engine that takes it over (LLMEngine.close).
        self.device_cap = weakref.finalize(self, hold_device_cap(self.device)) if self.device.type == "cuda" else None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # The whole budget until start-up has measured what it may leave PyTorch (cap_device_memory).
            torch.cuda.set_per_process_memory_fraction(config.gpu_memory_utilization, self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if budget is not None:  # another tenant of a device shared by several models (mempath/multi)
            self.budget = budget
        elif self.device.type == "cuda":
            self.budget = DeviceBudget.of_cuda(self.device, config.gpu_memory_utilization)
        else:
            self.budget = DeviceBudget(self.device.type, None)
        self.ledger = self.budget.ledger(self.tenant)
        self.spec_config = config.speculative_config
        self.draft_runner = self.draft_ledger = self.spec_decoder = None
        self.draft_spec = self.read_draft_spec()

    def read_draft_spec(self) -> ModelSpec | None:
        """The draft model's config.json, checked against the target's before any weights load (None: no draft)."""
        sc = self.spec_config
        if sc is None or not sc.uses_draft_model:
            return None
        draft_dir = sc.model
        spec = ModelSpec.from_hf_config(read_config(draft_dir), source=str(Path(draft_dir) / "config.json"))
        if spec.vocab_size != self.spec.vocab_size:
            raise ValueError(f"speculative_config: the draft's vocabulary ({spec.vocab_size} tokens, {draft_dir}) "
                             f"differs from the target's ({self.spec.vocab_size}); use a draft with the target's tokenizer")
        if spec.max_position_embeddings < self.max_model_len:
            raise ValueError(f"speculative_config: the draft supports {spec.max_position_embeddings} positions, "
                             f"fewer than max_model_len {self.max_model_len}; lower --max-model-len")
        draft_params, target_params = (count_params(shape_from_spec(s))["total"] for s in (spec, self.spec))
        if draft_params >= target_params:
            log.warning("speculative_config: the draft (%s, %d parameters) is no smaller than the target (%d): "
                        "each step runs both, so it is slower than the target alone; use a smaller draft",
                        draft_dir, draft_params, target_params)
        return spec

    def _check_draft_tokenizer(self) -> None:
        """A draft whose tokenizer gives other ids than the target's proposes tokens the target reads as others:
        nothing would be accepted. Refused where both have a tokenizer (a draft directory without one is taken
        to share the target's)."""
        if self.draft_spec is None or self.tokenizer is None:
            return
        draft_tokenizer = load_tokenizer(self.spec_config.model)
        # The ids alone: a base draft beside an instruct target names another eos, and serves it well.
        if draft_tokenizer is not None and draft_tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"speculative_config: the draft's tokenizer ({self.spec_config.model}) maps text to "
                             f"other token ids than the target's, so the target would accept none of its tokens; "
                             f"use a draft with the target's tokenizer")

    def _check_tiers_hold_a_block(self) -> None:
        """A KV tier too small for one block, refused from config.json before the weights load (minutes on a
        large model), not when the tier opens after them; the tiers check the exact sizes again then."""
        c = self.config
        block_nbytes = kv_block_nbytes(self.spec, c.block_size, c.kv_torch_dtype(self.dtype).itemsize)
        if c.cpu_kv_gb > 0:
            check_host_tier_holds_a_block(int(c.cpu_kv_gb * (1 << 30)), block_nbytes, c.cpu_kv_gb)
        if c.disk_kv_path:
            check_disk_tier_holds_a_block(int(c.disk_kv_gb * (1 << 30)), block_nbytes, c.disk_kv_gb,
                                          payload_only=True)

    def _guard(self, stage: str, **kwargs):
        return oom_guard(stage, self.ledger, self.config, dtype=self.dtype_name, **kwargs)

    def run(self, show_progress: bool) -> "Startup":
        self.prepare(show_progress)
        num_blocks = self.size_kv_cache()
        self.allocate_kv_cache(num_blocks)
        self.finish(num_blocks)
        return self

    def prepare(self, show_progress: bool) -> None:
        """Everything before the KV cache: weights, tokenizer, runner, the draft."""
        config = self.config
        # Before the weights (minutes on a large model): a tokenizer that fails to load fails first.
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        if self.tokenizer is None and config.tokenizer:
            raise ValueError(f"tokenizer {config.tokenizer}: no tokenizer.json, tokenizer.model or vocab.json there")
        self._check_draft_tokenizer()
        self.load_weights(show_progress)
        generation_eos = load_generation_eos(config.model, config.generation_config)
        self.eos_token_ids = set(self.spec.eos_token_ids) | set(generation_eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        beyond = sorted(t for t in self.eos_token_ids if not 0 <= t < self.spec.vocab_size)
        if beyond:  # never sampled: outputs would run to max_tokens without a word of why
            kept = sorted(set(self.eos_token_ids) - set(beyond))
            log.warning("end-of-sequence id%s %s %s outside the model's %d logits and can never be sampled; %s",
                        "s" * (len(beyond) > 1), ", ".join(map(str, beyond)), "are" if len(beyond) > 1 else "is",
                        self.spec.vocab_size, f"outputs end on {kept} only" if kept else
                        "no output ends before max_tokens or a stop string: fix eos_token_id in config.json or "
                        "generation_config.json")
        self.runner = ModelRunner(config, self.model, self.spec, self.device, self.dtype, self.max_model_len)
        self.probes = Probes(config, self.runner, self.max_model_len)
        self.budget.grant(self.tenant, Pathway.STEP_BUFFERS, self.runner.workspace_bytes(), "measured",
                          "static inputs and decode split workspace")
        if self.spec_config is not None:
            self.load_draft(show_progress)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        config, stage = self.config, self.stage
        with self._guard("kv_allocation", requested_bytes=num_blocks * self.kv_bytes_per_block()), \
                stage("kv allocation", Pathway.KV_CACHE.value):
            self.runner.allocate_kv_cache(num_blocks)
            if self.draft_runner is not None:
                self.draft_runner.allocate_kv_cache(num_blocks)
        self.budget.grant(self.tenant, Pathway.KV_CACHE, self.runner.kv_cache.numel() * self.runner.kv_cache.element_size(),
                          "measured", f"{num_blocks} blocks x {config.block_size} tokens")
        if self.draft_runner is not None:
            draft_kv = self.draft_runner.kv_cache
            self.budget.grant(self.draft_tenant, Pathway.KV_CACHE, draft_kv.numel() * draft_kv.element_size(),
                              "measured", f"{num_blocks} blocks x {config.block_size} tokens, the target's block tables")

    def finish(self, num_blocks: int) -> None:
        """Everything after the KV cache: kernels, graphs, the KV manager, the allocator's cap."""
        config, stage = self.config, self.stage
        if self.runner.use_triton:
            with stage("compile kernels", None):
                self.probes.compile_kernels(num_blocks)
                if self.draft_runner is not None:
                    Probes(config, self.draft_runner, self.max_model_len).compile_kernels(num_blocks)
        self.capture_graphs()
        self.kv = self.make_kv_manager(num_blocks)
        if self.spec_config is not None:
            self.build_spec_decoder()
        if self.device.type == "cuda":
            self.cap_device_memory()
        forget_start_up_routing(self.model)
        if self.draft_runner is not None:
            forget_start_up_routing(self.draft_runner.model)
        for line in kv_capacity_lines(self.device.type, self.kv, config.block_size, self.max_model_len):
            capacity_log.info("%s", line)
        pool_tokens = self.kv.pool.num_admissible * config.block_size  # this model's share, where pools are shared
        if pool_tokens < self.max_model_len:  # vLLM refuses to start; shorter requests still run here
            more = ("raise num_gpu_blocks_override" if config.num_gpu_blocks_override is not None else
                    "give the KV cache more memory (" + ("--gpu-memory-utilization" if self.device.type == "cuda"
                                                          else "--cpu-kv-cache-bytes") + ")")
            log.warning("the KV pool holds %d tokens, fewer than max_model_len %d: a request whose prompt and "
                        "output need more is refused, and the server's default max_tokens stops there; use "
                        "--max-model-len %d, or %s", pool_tokens, self.max_model_len, pool_tokens, more)
        log.info("memory by pathway:\n%s", self.ledger.table())
        if self.draft_ledger is not None:
            log.info("memory by pathway, %s:\n%s", self.draft_tenant, self.draft_ledger.table())

    def make_kv_manager(self, num_blocks: int) -> KVCacheManager:
        if self.config.tiers_enabled:
            with self.stage("attach tiers", None):
                return self.kv_manager_with_tiers(num_blocks)
        return KVCacheManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching,
                              draft_kv=self.draft_runner is not None)

    def load_weights(self, show_progress: bool) -> None:
        config, device = self.config, self.device
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        with self._guard("load"), self.stage("load weights", Pathway.WEIGHTS.value):
            self.model, self.spec, self.load_report = load_model(
                config.model, self.dtype, device, self.max_model_len, show_progress,
                dummy=config.load_format == "dummy", seed=config.seed, spec=self.spec,
                quantization=config.quantization, expert_cache_size=self.expert_cache_size,
                weights_arena=config.weights_arena, expert_cache_gb=config.moe_expert_cache_gb)
            set_cpu_experts(self.model, config.moe_cpu_experts)
        fp8 = ", fp8 linear layers" if self.spec.quantization else ""
        slots = expert_slot_bytes(self.model)
        self.budget.grant(self.tenant, Pathway.WEIGHTS, self.load_report.weight_bytes - slots, "measured",
                          f"{self.load_report.tensors_loaded} tensors, {self.dtype_name}{fp8}"
                          + (", less the expert slots" if slots else "")
                          + (", in an arena outside PyTorch's allocator" if config.weights_arena else ""))
        if slots:
            layers = len(self.model.moe_blocks())
            self.budget.grant(self.tenant, Pathway.EXPERT_CACHE, slots, "measured",
                              f"{self.expert_cache_size} of {self.spec.num_experts} experts x {layers} MoE layers")
            self.ledger.record(Pathway.EXPERT_HOST, self.load_report.host_weight_bytes, "cpu", "measured",
                               f"all {self.spec.num_experts} experts x {layers} layers, "
                               f"{'pinned' if device.type == 'cuda' else 'pageable'}")
        if device.type == "cuda":
            measured = torch.cuda.memory_allocated(device) - before
            log.info("weights: %s of parameters, %s allocated on the device",
                     format_bytes(self.load_report.weight_bytes), format_bytes(measured))

    # ----------------------------------------------------------------- the draft tenant
    def load_draft(self, show_progress: bool) -> None:
        """The draft model: a second tenant of the device budget, with its weights, step buffers
        and the speculative step's temporaries in its own ledger (its KV blocks come with the target's)."""
        from mempath.engine.spec.decoder import SPEC_MAX_ROWS, spec_workspace_bytes
        c, sc = self.config, self.spec_config
        if sc.uses_draft_model:
            draft_dir, spec = sc.model, self.draft_spec
            self.draft_tenant = f"{Path(draft_dir).name or draft_dir} (draft)"
        else:
            self.draft_tenant = "ngram (draft)"
        self.draft_ledger = self.budget.ledger(self.draft_tenant)
        grant = self.budget.grant
        if sc.uses_draft_model:
            with self._guard("load"), self.stage("load draft weights", Pathway.WEIGHTS.value):
                model, spec, report = load_model(draft_dir, self.dtype, self.device, self.max_model_len, show_progress,
                                                 dummy=c.load_format == "dummy", seed=c.seed, spec=spec)
            grant(self.draft_tenant, Pathway.WEIGHTS, report.weight_bytes, "measured",
                  f"{report.tensors_loaded} tensors, {self.dtype_name}")
            self.draft_runner = ModelRunner(c, model, spec, self.device, self.dtype, self.max_model_len)
        rows = min(c.max_num_seqs, SPEC_MAX_ROWS)
        buffers = 2 * self.runner.max_tokens * 8 + (self.draft_runner.workspace_bytes() if self.draft_runner else 0)
        grant(self.draft_tenant, Pathway.STEP_BUFFERS, buffers, "measured",
              "the draft's static inputs and the logit-row indices")
        grant(self.draft_tenant, Pathway.ACTIVATION_PEAK,
              spec_workspace_bytes(rows, sc.num_speculative_tokens, self.spec.vocab_size, 0), "derived",
              f"float32 p and q of {rows} speculating rows x {sc.num_speculative_tokens} positions")

    def grant_spec_graphs_estimate(self, per_graph: int) -> None:
        """Room for the speculative step's CUDA graphs, granted to the draft tenant before KV sizing."""
        from mempath.engine.spec.decoder import SPEC_MAX_ROWS, spec_graph_bytes
        from mempath.memory.formulas import cublas_workspace_bytes, shape_from_spec
        major, _ = torch.cuda.get_device_capability(self.device)
        draft = shape_from_spec(self.draft_runner.spec) if self.draft_runner is not None else None
        pool, count = spec_graph_bytes(shape_from_spec(self.spec), draft, min(self.config.max_num_seqs, SPEC_MAX_ROWS),
                                       self.spec_config.num_speculative_tokens, self.dtype.itemsize,
                                       cublas_workspace_bytes(major))
        self.budget.grant(self.draft_tenant, Pathway.CUDA_GRAPHS, pool, "derived",
                          "memory.formulas.cuda_graph_bytes of the verify and draft graphs, until captured")
        self.budget.grant(self.draft_tenant, Pathway.CUDA_GRAPHS_DRIVER, per_graph * count, "derived",
                          f"{count} graphs x the driver memory of a decode graph as the trial captures held it")

    def build_spec_decoder(self) -> None:
        from mempath.engine.spec.decoder import SpeculativeDecoder
        self.spec_decoder = SpeculativeDecoder(self.spec_config, self.runner, self.draft_runner, self.kv,
                                               self.max_model_len)
        if not self.config.enforce_eager:
            with self._guard("cuda_graphs"), self.stage("speculative cuda graph capture", Pathway.CUDA_GRAPHS.value):
                graph_bytes = self.spec_decoder.capture_graphs()
            if self.spec_decoder.num_graphs():
                self.budget.grant(self.draft_tenant, Pathway.CUDA_GRAPHS, graph_bytes, "measured",
                                  f"{self.spec_decoder.num_graphs()} verify and draft graphs, up to {self.spec_decoder.verify_graphs.sizes[-1]} rows")
            else:
                self.draft_ledger.discard(Pathway.CUDA_GRAPHS)
                self.draft_ledger.discard(Pathway.CUDA_GRAPHS_DRIVER)
        if self.spec_config.adaptive:
            with self.stage("calibrate speculation", None):
                self.spec_decoder.calibrate(self.config.max_num_seqs)

    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block: the target's, plus the draft's under the same block id."""
        draft = self.draft_runner.kv_bytes_per_block() if self.draft_runner is not None else 0
        return self.runner.kv_bytes_per_block() + draft

    # ----------------------------------------------------------------- KV sizing
    def size_kv_cache(self) -> int:
        """How many KV blocks fit: fixed by override, by the CPU budget, or measured on CUDA."""
        per_block = self.kv_bytes_per_block()
        on_cpu = self.device.type != "cuda"
        override = self.config.num_gpu_blocks_override
        if override is not None:
            if on_cpu:
                check_host_room(override * per_block, f"--num-gpu-blocks-override {override}", "a KV cache")
            return override
        if on_cpu:
            if self.config.gpu_memory_utilization != DEFAULT_GPU_MEMORY_UTILIZATION:
                log.warning("--gpu-memory-utilization %g has no effect on the CPU: the KV cache there is "
                            "--cpu-kv-cache-bytes (%d)", self.config.gpu_memory_utilization,
                            self.config.cpu_kv_cache_bytes)
            num_blocks = self.config.cpu_kv_cache_bytes // per_block
            check_host_room(num_blocks * per_block, f"--cpu-kv-cache-bytes {self.config.cpu_kv_cache_bytes}",
                            "a KV cache")
        else:
            with self._guard("profile"), self.stage("profile step", Pathway.ACTIVATION_PEAK.value):
                num_blocks = self.profile_kv_blocks(per_block)
        if num_blocks < 1:
            raise ValueError(
                f"no memory is left for the KV cache (one block needs {format_bytes(per_block)}); "
                + (f"raise --cpu-kv-cache-bytes{larger_block_fix(self.config.block_size)}" if on_cpu else
                   "raise --gpu-memory-utilization, lower --max-num-batched-tokens, or use a smaller --dtype"))
        tokens = num_blocks * self.config.block_size
        if tokens < self.max_model_len:
            log.warning("the KV cache holds %d tokens, less than max_model_len %d: long requests "
                        "will be rejected", tokens, self.max_model_len)
        return num_blocks

    def profile_kv_blocks(self, per_block: int) -> int:
        """Run the largest step once, measure its peak, grant every other pathway, give KV the rest.

        Everything that takes device memory after the KV cache is allocated is granted
        here: the step's activations, the graph pool and the driver memory of the
        captured graphs (measured on trial captures), the tiers' staging buffers, and
        room for what grows outside PyTorch while serving.
        """
        activation_peak = self.measure_step_peak()
        num_graphs = len(self.runner.graph_sizes())
        # Trial captures replay decode steps over the probe's KV cache: before it is freed.
        trial = self.runner.trial_capture_graphs()
        self.runner.allocate_kv_cache(0)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # Weights in arenas (memory/arena.py) are device memory outside PyTorch's allocator,
        # granted as WEIGHTS: not "outside PyTorch" here, and not in what PyTorch reserved.
        arenas = mapped_bytes()
        in_use = total - free - arenas  # our context and allocator, plus other processes
        reserved = torch.cuda.memory_reserved(self.device)
        grant, tenant = self.budget.grant, self.tenant
        # The other tenants (a draft, the other models of a shared device): what they were
        # granted of these process-wide figures is theirs, not this tenant's.
        others = [ledger for name, ledger in self.budget.ledgers.items() if name != tenant]

        def held_by_others(*pathways: Pathway) -> int:
            return sum(ledger.get(p) for ledger in others for p in pathways)
        grant(tenant, Pathway.NON_TORCH, in_use - reserved - held_by_others(Pathway.NON_TORCH), "derived",
              "device used - torch reserved (context, other processes)")
        own = (Pathway.WEIGHTS, Pathway.EXPERT_CACHE, Pathway.STEP_BUFFERS)
        grant(tenant, Pathway.TORCH_OTHER, reserved + arenas - sum(self.ledger.get(p) for p in own)
              - held_by_others(*own, Pathway.TORCH_OTHER),
              "derived", "torch reserved at the profile - weights - expert slots - step buffers "
              "(model buffers, allocator rounding)")
        grant(tenant, Pathway.ACTIVATION_PEAK, activation_peak, "measured",
              "the profile step's peak as the allocator reserved it")
        grant(tenant, Pathway.ACTIVATION_SPARE, self.step_largest_block(), "derived",
              "memory.formulas.step_largest_block_bytes of the profile step: the segment of a step's largest "
              "tensor, which the next step's smaller tensors may hold")
        if num_graphs:
            # Captured again once the KV cache exists; the pool measured then replaces this.
            grant(tenant, Pathway.CUDA_GRAPHS, trial.pool_bytes, "measured",
                  f"the pool of {num_graphs} decode graphs captured over the profile's KV cache, until captured")
        if trial.driver_bytes:
            grant(tenant, Pathway.CUDA_GRAPHS_DRIVER, trial.driver_bytes, "measured",
                  f"driver memory the {num_graphs} decode graphs captured over the profile's KV cache gave back "
                  "when freed (what the driver kept is in non_torch)")
        # Speculation: its graphs too (none over a target whose decode graphs are cut at its MoE layers).
        if num_graphs and self.draft_ledger is not None and not self.runner.cut_blocks:
            self.grant_spec_graphs_estimate(trial.driver_bytes_per_graph)
        if self.config.tiers_enabled:
            grant(tenant, Pathway.KV_TRANSFER_STAGING, self.tier_staging_bytes(per_block), "derived",
                  "one staging buffer per direction, until the tiers are attached")
        grant(tenant, Pathway.OUTSIDE_TORCH_GROWTH, OUTSIDE_TORCH_GROWTH, "margin",
              "room for kernel modules loaded while serving: 16x the 2 MiB measured over 1,000 steps "
              "(BENCHMARKS.md)")
        num_blocks = self.budget.grant_blocks(tenant, Pathway.KV_CACHE, per_block,
                                              "what the budget leaves, in whole blocks",
                                              allocations=1 + (self.draft_runner is not None))
        if self.draft_runner is not None:
            # Each block is both models' KV: split the grant by their shares (measured once allocated).
            draft_share = num_blocks * self.draft_runner.kv_bytes_per_block()
            grant(tenant, Pathway.KV_CACHE, num_blocks * per_block - draft_share, "derived", "the target's share")
            grant(self.draft_tenant, Pathway.KV_CACHE, draft_share, "derived", "the draft's share")
        return num_blocks

    def measure_step_peak(self) -> int:
        """The largest step's peak over the weights, as allocated or as reserved, whichever is more."""
        device, config = self.device, self.config
        torch.cuda.synchronize(device)
        weights_end = torch.cuda.memory_allocated(device)
        num_tokens, num_seqs = self.profile_step_size()
        longest = -(-num_tokens // num_seqs)  # the probe's sequences differ by at most one token
        self.runner.allocate_kv_cache(num_seqs * blocks_for(longest, config.block_size))
        probe_kv = self.runner.kv_cache.numel() * self.runner.kv_cache.element_size()
        # From an empty cache, as serving steps start once the KV cache and the graphs have
        # taken the rest: the step must reserve its own segments, and the allocator's
        # segment sizes (2 MiB at the least) count, not only the bytes it hands out.
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        reserved_before_step = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        self.probes.run(num_tokens, num_seqs)
        torch.cuda.synchronize(device)
        # The allocator rounds and splits blocks: what the step reserved counts when it exceeds what it used.
        return max(torch.cuda.max_memory_allocated(device) - weights_end - probe_kv,
                   torch.cuda.max_memory_reserved(device) - reserved_before_step,
                   ALLOCATOR_SEGMENTS)

    def profile_step_size(self) -> tuple[int, int]:
        """The profile step's tokens and sequences: the largest step the settings allow."""
        config = self.config
        num_tokens = min(config.max_num_batched_tokens, self.max_model_len * config.max_num_seqs)
        return num_tokens, max(1, min(config.max_num_seqs, num_tokens))

    def step_largest_block(self) -> int:
        """The profile step's largest tensor as the allocator reserves its segment (a serving step may find the
        last step's segment of it cached and put its first, smaller tensors there: its own then takes a fresh
        one; an fp8 engine at batch 2 ran out of memory so on an H100, BENCHMARKS.md, thirty-fifth session)."""
        from mempath.memory.formulas import shape_from_spec, step_largest_block_bytes
        num_tokens, num_seqs = self.profile_step_size()
        return step_largest_block_bytes(shape_from_spec(self.spec), num_tokens, num_seqs, self.dtype.itemsize)

    def tier_staging_bytes(self, per_block: int) -> int:
        from mempath.kv.tiers.coordinator import STAGING_BLOCKS
        return 2 * STAGING_BLOCKS * per_block  # one staging buffer per direction

    # ----------------------------------------------------------------- after the KV cache
    def capture_graphs(self) -> None:
        with self._guard("cuda_graphs"), self.stage("cuda graph capture", Pathway.CUDA_GRAPHS.value):
            graph_bytes = self.runner.capture_cuda_graphs()
        if self.runner.graphs:
            cut = f", each cut at {len(self.runner.cut_blocks)} MoE layers" if self.runner.cut_blocks else ""
            self.budget.grant(self.tenant, Pathway.CUDA_GRAPHS, graph_bytes, "measured",
                              f"{len(self.runner.graphs)} decode graphs, batch 1..{max(self.runner.graphs)}{cut}")
        else:
            self.ledger.discard(Pathway.CUDA_GRAPHS)

    def kv_manager_with_tiers(self, num_blocks: int) -> KVCacheManager:
        """The KV manager with its tiers: the host tier reserved, the disk tier opened, the cost
        model calibrated (docs/tiers.md)."""
        from mempath.kv.tiers.coordinator import TierConfig
        c = self.config
        kv = KVCacheManager(num_blocks, c.block_size, c.enable_prefix_caching, TierConfig(
            self.runner.kv_cache, int(c.cpu_kv_gb * (1 << 30)), c.disk_kv_path, int(c.disk_kv_gb * (1 << 30)),
            c.disk_write_policy == "write-through", self.kv_fingerprint(), c.preemption_mode,
            cpu_gb=c.cpu_kv_gb, disk_gb=c.disk_kv_gb))
        tiers = kv.tiers
        host = tiers.host
        self.ledger.record(Pathway.KV_CPU, host.capacity_bytes, "cpu", "measured",
                           f"{host.num_blocks} blocks, {'pinned' if host.storage.is_pinned() else 'pageable'}")
        if tiers.disk is not None:
            self.ledger.record(Pathway.KV_DISK, tiers.disk.capacity_bytes, "disk", "derived",
                               f"capacity at {tiers.disk.path}, {c.disk_write_policy}")
        self.ledger.record(Pathway.KV_TRANSFER_STAGING, tiers.transfer.staging_nbytes, self.device.type, "measured",
                           f"{tiers.transfer.staging_blocks} blocks per direction")
        tiers.calibrate(lambda: self.probes.prefill_rate(kv.num_blocks))
        return kv

    def kv_fingerprint(self) -> str:
        """What makes a block's bytes this model's: the weights' and config's content, the KV dtype,
        and the version of mempath and of its KV numerics (``KV_NUMERICS_VERSION``).

        Only the disk tier's blocks outlive the process, so without one nothing is hashed.
        Each weights file is hashed once: its digest is cached in mempath's cache directory
        under the file's identity (device, inode, size, mtime, ctime, header hash), never
        in the model directory (docs/tiers.md).
        """
        c = self.config
        kv_dtype = [] if c.kv_cache_dtype == "auto" else [str(c.kv_torch_dtype(self.dtype))]
        parts = [self.dtype_name, c.load_format] + kv_dtype
        if self.spec.quantization:  # fp8 weights compute other KV from the same files
            parts.append(f"weights={self.spec.quantization}")
        if c.disk_kv_path:
            # Another release may compute other KV (kernels, rotary) from the same weights.
            parts += [f"mempath={VERSION}", f"kv_numerics={KV_NUMERICS_VERSION}"]
            parts.append(json.dumps(self.hf_config, sort_keys=True))
            if c.load_format == "dummy":
                # The draws come from torch's generator of the device type: CPU and CUDA give other
                # weights for one seed (every CUDA device the same ones). Only for dummy weights: with
                # real ones the device changes the KV's rounding, as another GPU or batch does, not
                # whose KV it is.
                parts += [f"seed={c.seed}", f"device={self.device.type}", f"torch={torch.__version__}"]
            else:
                parts.append(weights_digest(self.load_report.file_identities, digest_cache_file()))
        return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()

    def cap_device_memory(self) -> None:
        """Hold PyTorch's allocator to what the budget leaves it once start-up is done.

        Serving steps of other shapes than the profile step's make the caching
        allocator reserve more than they allocate (split and cached blocks); capped,
        it hands cached blocks back to the device before it would pass the limit, so
        device use stays within gpu_memory_utilization x total.
        """
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-ups' cached blocks: serving reserves its own
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        outside = total - free - reserved  # with the weights in arenas, which PyTorch may not take
        cap = self.budget.limit - outside - OUTSIDE_TORCH_GROWTH
        # Never below what start-up holds plus room for fresh segments: a budget start-up
        # already passed is reported below, and serving must still be able to run a step.
        allowed = max(cap, reserved + ALLOCATOR_SEGMENTS)
        torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, allowed / total)), self.device)
        self.budget.grant(self.tenant, Pathway.NON_TORCH, outside - mapped_bytes(), "measured",
                          "device used - torch reserved - weight arenas after start-up "
                          "(context, kernels, graphs, other processes)")
        if reserved > cap:
            log.warning("after start-up PyTorch holds %s, more than the %s the budget leaves it "
                        "(gpu_memory_utilization %.2f): lower --max-num-batched-tokens or --max-num-seqs, "
                        "or raise --gpu-memory-utilization",
                        format_bytes(reserved), format_bytes(cap), self.config.gpu_memory_utilization)
        else:
            self.warn_if_no_room_for_a_step(cap - reserved, outside)

    def warn_if_no_room_for_a_step(self, room: int, outside: int) -> None:
        """Say so at start-up when what the cap leaves PyTorch cannot hold what the budget keeps for a step:
        memory outside PyTorch that grew after the KV cache was sized (kernels, graphs) comes out of it, and
        such steps would fail their newest request with out of memory while serving."""
        kept = max(ledger.get(Pathway.ACTIVATION_PEAK) + ledger.get(Pathway.ACTIVATION_SPARE)
                   for ledger in self.budget.ledgers.values())
        if room >= kept:
            return
        short = kept - room
        fewer = ""
        if getattr(self, "pages", None) is None:  # one model: its blocks; a page pool's are every model's
            blocks = self.kv.num_blocks - -(-short // self.kv_bytes_per_block())
            fewer = f" (--num-gpu-blocks-override {max(blocks, 1)})"
        log.warning("after start-up the budget leaves PyTorch %s for a step's activations, %s less than it keeps "
                    "for them (%s: the profile step's peak and a spare segment of its largest tensor): device "
                    "memory outside PyTorch is %s now, more than when the KV cache was sized, so the largest steps "
                    "may run out of memory; leave the KV cache fewer blocks%s or lower --max-num-batched-tokens",
                    format_bytes(room), format_bytes(short), format_bytes(kept), format_bytes(outside), fewer)
