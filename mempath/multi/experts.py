"""Several models, some of them mixture-of-experts: the expert-cache options are the MoE models'.

The engine's options are one value for all models (docs/multi_model.md), but
``moe_expert_cache_size``, ``moe_expert_cache_gb`` and ``moe_cpu_experts`` mean nothing to a
dense model (its own load refuses them). ``options_by_model`` gives each model its options:
a dense model's without them, a MoE model's with them. Decisions (docs/multi_model.md,
"Mixture-of-experts models among them"):

- none of the models is MoE: refused in one line naming the flag (as one dense model is);
- ``moe_expert_cache_size`` N is every MoE model's N experts per MoE layer, refused in one
  line naming the model for which N is out of range (below its top-k or above its experts);
- ``moe_expert_cache_gb`` with several MoE models is refused: the GiB are "device GiB for the
  expert slots of all MoE layers", and with two models nothing says whether G is each one's
  or both together's, nor how to split it (equally? by expert size? by layers?), and each
  choice gives other sizes; N per layer is each model's own and unambiguous. With one MoE
  model among several the GiB are that model's, as alone;
- ``moe_cpu_experts`` goes with the cache: to the MoE models that keep fewer than all experts
  on the device. A MoE model for which N is all its experts has no misses and gets ``never``
  (alone the policy would be refused as useless; here another model uses it); when no model
  would miss, the MoE models get it and start-up refuses it in its one line.

``plan_models`` (mempath/tools/plan_multi.py) gives each model's plan the same options, so the
shared budget is planned with the MoE model's resident experts, as start-up holds them.
"""
from __future__ import annotations

from typing import Callable

from mempath.config import check_expert_cache_options
from mempath.memory.formulas import ModelShape, resolve_expert_cache_size, shape_from_spec

# The options, each with the value that asks for nothing (the dense model's).
EXPERT_OPTIONS = {"moe_expert_cache_size": None, "moe_expert_cache_gb": None, "moe_cpu_experts": "never"}
FLAGS = {"moe_expert_cache_size": "--moe-expert-cache-size", "moe_expert_cache_gb": "--moe-expert-cache-gb",
         "moe_cpu_experts": "--moe-cpu-experts"}


def engine_shape(path: str) -> tuple[ModelShape, str]:
    """A model directory's shape as start-up reads it (ModelSpec.from_hf_config), and its config.json's path."""
    from mempath.model.loader import config_path, read_spec
    return shape_from_spec(read_spec(path)), str(config_path(path))


def options_by_model(models: list[tuple[str, str]], options: dict,
                     shape_of: Callable[[str], tuple[ModelShape, str]] = engine_shape) -> dict[str, dict]:
    """Each model's options (``models``: (served name, directory) pairs): the expert-cache ones for the
    MoE models only. ``shape_of(directory)``: (shape, config source); read only when an option is given."""
    given = {key: options[key] for key, nothing in EXPERT_OPTIONS.items() if options.get(key, nothing) != nothing}
    if not given:
        return {name: options for name, _ in models}
    check_values(given)
    shapes = {name: shape_of(path) for name, path in models}
    moe = [name for name, (shape, _) in shapes.items() if shape.num_experts]
    flags = " and ".join(f"{FLAGS[key]} {value:g}" if isinstance(value, float) else f"{FLAGS[key]} {value}"
                         for key, value in given.items())
    if not moe:
        served = ", ".join(f"'{name}' {shape.architecture}" for name, (shape, _) in shapes.items())
        raise ValueError(f"{flags} is for mixture-of-experts models, and none of the models served ({served}) "
                         f"has experts: drop the flag")
    gb = given.get("moe_expert_cache_gb")
    if gb is not None and len(moe) > 1:
        names = ", ".join(f"'{name}'" for name in moe)
        raise ValueError(f"--moe-expert-cache-gb {gb:g} with several mixture-of-experts models ({names}): one GiB "
                         f"figure does not say how to split it between them; give --moe-expert-cache-size N, the "
                         f"experts per MoE layer each of them keeps on the device")
    misses = set(moe)  # the MoE models that will keep fewer than all their experts on the device
    size = given.get("moe_expert_cache_size")
    if size is not None:
        for name in moe:
            shape, source = shapes[name]
            try:  # the size's range does not depend on the dtype: 1 byte stands in for it
                resident = resolve_expert_cache_size(shape, 1, size, None, source)
            except ValueError as error:
                raise ValueError(f"model '{name}': {error}") from None
            if resident is None:
                misses.discard(name)
    per_model = {}
    for name, _ in models:
        if name not in moe:
            per_model[name] = {**options, **EXPERT_OPTIONS}
        elif name not in misses and misses:  # all its experts resident while another model's cache misses
            per_model[name] = {**options, "moe_cpu_experts": "never"}
        else:
            per_model[name] = options
    return per_model


def check_values(given: dict) -> None:
    """The model-free checks EngineConfig makes, before any config is read for the model-dependent ones."""
    check_expert_cache_options(given.get("moe_expert_cache_size"), given.get("moe_expert_cache_gb"),
                               given.get("moe_cpu_experts", "never"))


def expert_cache_line(startups) -> str | None:
    """The start-up log's line of which model got the expert cache (None: no model has experts), from each
    model's spec, its resolved cache size and its ledger's measured rows."""
    from mempath.memory.ledger import Pathway
    if not any(s.spec.num_experts for s in startups):
        return None
    parts = []
    for s in startups:
        experts = s.spec.num_experts
        if not experts:
            parts.append(f"{s.tenant}: a dense model, no experts")
        elif s.expert_cache_size is None:
            parts.append(f"{s.tenant} keeps all {experts} experts per MoE layer on the device (no expert cache)")
        else:
            slots, host = s.ledger.get(Pathway.EXPERT_CACHE), s.ledger.get(Pathway.EXPERT_HOST)
            policy = s.config.moe_cpu_experts
            parts.append(f"{s.tenant} keeps {s.expert_cache_size} of {experts} experts per MoE layer on the device "
                         f"({len(s.model.moe_blocks())} MoE layers, {slots:,} B of slots, all {experts} in host "
                         f"memory, {host:,} B" + ("" if policy == "never" else f"; misses: --moe-cpu-experts "
                                                                                 f"{policy}") + ")")
    return "expert cache: " + "; ".join(parts)
