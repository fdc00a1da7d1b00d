"""The comparison rows of diagnose's report: each measured figure beside the plan's, with its source."""
from __future__ import annotations

from dataclasses import dataclass, field

from mempath.memory.ledger import Pathway, format_bytes
from mempath.tools.diagnose.meters import StageRecord


# ---------------------------------------------------------------- comparison rows

@dataclass
class Row:
    pathway: str
    predicted: int | None
    measured: int | None
    predicted_source: str
    measured_source: str
    detail: str = ""
    error_pct: float | None = field(default=None)

    def __post_init__(self):
        if self.predicted and self.measured is not None:
            self.error_pct = round(100.0 * (self.measured - self.predicted) / self.predicted, 2)


def weight_rows(plan, model, meter, load: StageRecord | None) -> list[Row]:
    """Each weight pathway of the plan against the bytes of the loaded parameters."""
    from mempath.model.moe import expert_cache_stats
    groups = {"embedding": 0, "attention": 0, "mlp": 0, "norms": 0, "lm_head": 0}
    if plan.num_experts:
        groups["experts"] = 0
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue  # a tied head shares the embedding's storage
        seen.add(id(p))
        groups[_weight_group(name, plan.num_experts)] += p.numel() * p.element_size()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # The experts' parameters are the resident ones: every expert, or the cache's slots.
    plan_field = {"norms": "norm_bytes", "experts": "resident_expert_bytes"}
    rows = [Row(f"weights.{group}", getattr(plan, plan_field.get(group, f"{group}_bytes")),
                nbytes, f"plan: {plan_field.get(group, f'{group}_bytes')}", "parameter tensor bytes")
            for group, nbytes in groups.items()]
    if load is not None:
        # The CPU meter counts host tensors too: the experts' host store (fewer resident than all) is loaded
        # with the weights, and is expert_host's row, not the device's weights. The CUDA meter never sees it.
        host = expert_cache_stats(model).get("host_bytes", 0) if meter.kind == "cpu" else 0
        rows.append(Row("weights", plan.resident_weight_bytes, load.delta - buffers - host,
                        "plan: resident_weight_bytes",
                        f"{meter.source} of the load stage minus buffers"
                        + (" and the experts' host store" if host else ""),
                        f"load delta {format_bytes(load.delta)}, buffers {format_bytes(buffers)}"
                        + (f", host store {format_bytes(host)}" if host else "")))
    spec = model.spec
    positions = model.model.rotary.max_positions
    rows.append(Row("rotary tables", 2 * positions * spec.head_dim * 4, buffers,
                    f"derived: cos+sin, {positions} positions x head_dim {spec.head_dim} x fp32 "
                    f"(not in the plan)", "buffer tensor bytes"))
    return rows


def _weight_group(name: str, num_experts: int = 0) -> str:
    if num_experts and ".experts." in name:
        return "experts"
    if "embed_tokens" in name:
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if "norm" in name:
        return "norms"
    if ".self_attn." in name:
        return "attention"
    return "mlp"


def comparison_rows(engine, plan, probe_plan, recorder, forward, growth) -> list[Row]:
    meter = recorder.meter
    rows = weight_rows(plan, engine.model, meter, recorder.last("load weights"))
    kv = recorder.last("kv allocation")
    num_blocks = engine.kv.num_blocks
    rows.append(Row("kv_cache", plan.kv_bytes_per_block * num_blocks, kv.delta if kv else None,
                    f"plan: kv_bytes_per_block x {num_blocks:,} engine blocks",
                    f"{meter.source} of the KV allocation"))
    if plan.num_kv_blocks is not None:
        rows.append(Row("kv_cache capacity", plan.num_kv_blocks * plan.kv_bytes_per_block,
                        num_blocks * plan.kv_bytes_per_block,
                        f"plan: {plan.num_kv_blocks:,} blocks (device memory x utilization - weights - workspace)",
                        f"engine: {num_blocks:,} blocks after its profile step"))
    graphs = engine.ledger.entries.get(Pathway.CUDA_GRAPHS)
    if graphs is not None:
        rows.append(Row("cuda_graphs", plan.cuda_graph_bytes, graphs.bytes,
                        f"plan: cuda_graph_bytes (batch <= {plan.cuda_graph_batch})",
                        f"engine ledger: {graphs.detail}"))
    rows += expert_cache_rows(engine, plan)
    # Figures the plan has no formula for: measured or derived by the engine alone.
    for name in (Pathway.STEP_BUFFERS, Pathway.NON_TORCH, Pathway.TORCH_OTHER, Pathway.OUTSIDE_TORCH_GROWTH):
        entry = engine.ledger.entries.get(name)
        if entry is not None:
            rows.append(Row(name.value, None, entry.bytes, "not in the plan", f"engine ledger ({entry.source})",
                            entry.detail))
    if Pathway.ACTIVATION_PEAK in engine.ledger.entries:
        rows.append(Row("activation_peak (engine profile step)",
                        plan.step_peak_bytes, engine.ledger.get(Pathway.ACTIVATION_PEAK),
                        f"plan: step_peak_bytes at {plan.max_num_batched_tokens} tokens, "
                        f"{plan.logits_rows} sampled rows",
                        "engine ledger (peak allocation of its profile step)"))
    if Pathway.ACTIVATION_SPARE in engine.ledger.entries:
        rows.append(Row("activation_spare (the step's largest tensor)",
                        plan.step_largest_block_bytes, engine.ledger.get(Pathway.ACTIVATION_SPARE),
                        f"plan: step_largest_block_bytes at {plan.max_num_batched_tokens} tokens",
                        "engine ledger (the same formula at its profile step's tokens)"))
    tokens, h, b = forward["tokens"], probe_plan.hidden_size, probe_plan.dtype_bytes
    rows += [
        Row("embedding (forward output)", tokens * h * b, forward["embedding"],
            f"derived from plan: {tokens} tokens x hidden {h} x {b} B", meter.source),
        Row("decoder layer peak", probe_plan.activation_peak_bytes, forward["layer_peak"],
            f"plan: activation_peak_bytes at {tokens} tokens",
            f"{meter.peak_source} over layer 0, from before the embedding"),
        Row("decoder forward peak", probe_plan.activation_peak_bytes, forward["forward_peak"],
            f"plan: activation_peak_bytes at {tokens} tokens", f"{meter.peak_source} over the forward"),
        Row("logits", probe_plan.logits_bytes, forward["logits_peak"],
            f"plan: logits_bytes ({probe_plan.logits_rows} rows: lm_head output + sampler peak)",
            f"{meter.peak_source} over lm_head + sampler"),
    ]
    if growth:
        top = max(growth, key=lambda s: s["measured_bytes"])
        rows.append(Row("kv growth (peak during generation)", top["predicted_bytes"], top["measured_bytes"],
                        "plan: kv_bytes_per_block x blocks the live tokens need",
                        "engine: kv_blocks_used x KV tensor bytes per block",
                        f"step {top['step']}, {top['tokens']} tokens in the cache"))
    return rows


def expert_cache_rows(engine, plan) -> list[Row]:
    """A MoE model's expert slots and host store (fewer resident than all) against the plan."""
    rows = []
    for pathway, predicted, field_name in ((Pathway.EXPERT_CACHE, plan.resident_expert_bytes, "resident_expert_bytes"),
                                           (Pathway.EXPERT_HOST, plan.host_expert_bytes, "host_expert_bytes")):
        entry = engine.ledger.entries.get(pathway)
        if entry is not None:
            rows.append(Row(pathway.value, predicted, entry.bytes,
                            f"plan: {field_name} ({plan.expert_cache_size} experts/layer resident)",
                            f"engine ledger ({entry.device}, {entry.source})", entry.detail))
    return rows


def train_rows(plan, training: dict, meter) -> list[Row]:
    return [
        Row("train.weights", plan.train_weight_bytes, training["weights_tensor_bytes"],
            "plan: train_weight_bytes (adamw-fp32)", "parameter tensor bytes"),
        Row("train.gradients", plan.grad_bytes, training["gradients"], "plan: grad_bytes (adamw-fp32)",
            f"{meter.source} from before the forward to after the backward",
            f"tensor bytes of .grad: {format_bytes(training['gradients_tensor_bytes'])}"),
        Row("train.optimizer_state", plan.optimizer_bytes, training["optimizer_state"],
            "plan: optimizer_bytes (adamw-fp32, 8 B/param)", f"{meter.source} of the first AdamW step",
            f"tensor bytes of the state: {format_bytes(training['optimizer_state_tensor_bytes'])}"),
        Row("train.activations", plan.train_activation_bytes + plan.train_logits_bytes,
            training["activations"], f"plan: train_activation_bytes + train_logits_bytes at "
            f"seq-len {plan.seq_len}, {plan.activation_dtype_bytes}-byte activations (adamw-fp32)",
            f"{meter.source} across the forward (kept for the backward, with the logits it returns)",
            "the plan's figure is an estimate: Korthikanti et al.'s count for a GPT layer with dropout "
            "masks and the attention score matrix, taken at this run's element size, not a count of this "
            "model's saved tensors; negative: the model kept less than that"),
    ]

