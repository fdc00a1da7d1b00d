"""A compressed-tensors fp8 checkpoint's `ignore` list and its config groups' `targets`: the projections
the checkpoint leaves in 16 bits are built and loaded as plain linears (vLLM keeps them unquantized too),
greedy outputs match transformers on the dequantized weights, and a bad list is refused in one line
naming the field and the fix (CPU, tiny models)."""
import dataclasses
import json
import logging
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from mempath import LLM
from mempath.memory.formulas import (FP8_SCALE_BYTES, fp8_gemv_workspace_bytes, gemv_workspace_bytes,
                                     resident_weight_bytes, shape_from_spec, weight_bytes)
from mempath.model.loader import load_model
from mempath.model.quant import Fp8Linear, Linear, fp8_gemv_bytes, fp8_layers
from mempath.model.spec import CheckpointError, ModelSpec
from mempath.tools.diagnose.rows import weight_rows
from mempath.tools.plan import plan_memory
from mempath.tools.plan_cli import format_plan
from tests.conftest import make_model, release_cuda
from tests.test_fp8_weights import (QUANT_CONFIGS, check_against_reference, dequantized_reference, needs_fp8_gpu,
                                    write_fp8_checkpoint)

# Layer 0's o projection by its name, layer 1's down projection and its q, k and v (fused in mempath) by
# patterns; "lm_head" as the hub's checkpoints write it (mempath never quantizes the LM head).
IGNORE = ["lm_head", "model.layers.0.self_attn.o_proj", r"re:.*layers\.1\.mlp\.down_proj$",
          r"re:model\.layers\.1\.self_attn\.[qkv]_proj"]
KEPT = {"model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.qkv_proj"}
KEPT_TENSORS = ["model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight",
                *(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv")]
MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


# IGNORE in exact names, as a quant_method "fp8" checkpoint's ignored_layers holds them (vLLM reads no "re:" there).
IGNORED_LAYERS = ["lm_head", "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj",
                  *(f"model.layers.1.self_attn.{p}_proj" for p in "qkv")]


def write_checkpoint(root, ignore=IGNORE, kept_tensors=KEPT_TENSORS, arch="llama", method="compressed-tensors"):
    """A bfloat16 model written as the hub's per-channel FP8-dynamic checkpoints are (``method`` "fp8": as
    vLLM's own fp8 checkpoints, per-tensor scales), but for ``kept_tensors``, stored as the bfloat16 weights
    they were (no weight_scale), and with ``ignore`` (``ignored_layers`` for "fp8").
    Returns the float model (bfloat16) and the checkpoint's quantized projections by tensor name."""
    hf = make_model(root / "float", arch, dtype=torch.bfloat16)
    strategy = "tensor" if method == "fp8" else "channel"
    quantized = write_fp8_checkpoint(root / "float", root / "fp8", hf, method, strategy)
    tensors, state = load_file(root / "fp8" / "model.safetensors"), hf.state_dict()
    for name in kept_tensors:
        tensors[name] = state[name].contiguous()
        del tensors[name + "_scale"], quantized[name]
    save_file(tensors, str(root / "fp8" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "fp8" / "config.json").read_text())
    config["quantization_config"]["ignored_layers" if method == "fp8" else "ignore"] = ignore
    (root / "fp8" / "config.json").write_text(json.dumps(config))
    return hf, quantized


def projections(model):
    """mempath's projections by module name."""
    return {name: m for name, m in model.named_modules() if name.rpartition(".")[2] in MODULES}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # Qwen2: q/k/v biases, tied embeddings
def test_ignored_projections_stay_in_16_bits_and_match_transformers(tmp_path, caplog, arch):
    hf, quantized = write_checkpoint(tmp_path, arch=arch)
    with caplog.at_level(logging.WARNING, logger="mempath"):
        llm = LLM(str(tmp_path / "fp8"), dtype="float32", show_progress=False)
    assert llm.engine.spec.quantization == "fp8" and llm.engine.spec.unquantized == KEPT
    layers = projections(llm.engine.model)
    assert len(layers) == 8
    for name, layer in layers.items():
        if name in KEPT:
            assert type(layer) is Linear and layer.weight.dtype == torch.float32, name
        else:
            assert isinstance(layer, Fp8Linear), name
    assert "not fp8" not in caplog.text and "quantized at load" not in caplog.text, caplog.text
    assert "match no" not in caplog.text and "tensors mempath does not use" not in caplog.text, caplog.text
    dequantized_reference(hf.float(), quantized)  # the kept projections: their bfloat16 values, inputs unquantized
    check_against_reference(llm, hf)


def test_ignored_projections_hold_the_checkpoints_bfloat16_weights_bit_for_bit(tmp_path):
    hf, _ = write_checkpoint(tmp_path)
    model, spec, _ = load_model(tmp_path / "fp8", torch.bfloat16, torch.device("cpu"), 64, False)
    state, layers = hf.state_dict(), projections(model)
    qkv = torch.cat([state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layers["model.layers.1.self_attn.qkv_proj"].weight, qkv)
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"):
        assert layers[name].weight.dtype == torch.bfloat16 and torch.equal(layers[name].weight, state[name + ".weight"])


def test_a_16_bit_projection_the_ignore_list_does_not_name_is_still_quantized_at_load(tmp_path, caplog):
    """Today's behaviour for a float weight in a projection the checkpoint says is fp8: quantized, with a warning."""
    write_checkpoint(tmp_path, kept_tensors=KEPT_TENSORS + ["model.layers.0.mlp.down_proj.weight"])
    with caplog.at_level(logging.WARNING, logger="mempath.model.loader"):
        llm = LLM(str(tmp_path / "fp8"), dtype="float32", show_progress=False)
    assert isinstance(projections(llm.engine.model)["model.layers.0.mlp.down_proj"], Fp8Linear)
    assert ("1 projection weight(s) of this fp8 checkpoint are not fp8 (e.g. 'model.layers.0.mlp.down_proj.weight', "
            "bfloat16)") in caplog.text and "quantized at load" in caplog.text


def test_an_ignored_projection_stored_in_fp8_is_refused_naming_the_ignore_list(tmp_path):
    write_checkpoint(tmp_path, kept_tensors=KEPT_TENSORS[1:])  # layer 0's o_proj left in fp8, but ignored
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.self_attn.o_proj.weight' is float8_e4m3fn.*"
                                              r"quantization_config.*ignore") as error:
        LLM(str(tmp_path / "fp8"), dtype="float32", show_progress=False)
    assert "\n" not in str(error.value)


def test_quantization_fp8_on_a_float_checkpoint_quantizes_every_projection(tmp_path):
    make_model(tmp_path, "llama", tokenizer=False)
    model, spec, _ = load_model(tmp_path, torch.float32, torch.device("cpu"), 64, False, dummy=True,
                                quantization="fp8")
    assert spec.unquantized == frozenset()
    assert all(isinstance(layer, Fp8Linear) for layer in projections(model).values())


# ---------------------------------------------------------------- config.json alone


ABSENT = object()  # a field left out of config.json


def read_spec(ignore=("lm_head",), targets=("Linear",), num_layers=2, arch="LlamaForCausalLM") -> ModelSpec:
    """The spec of a tiny model's compressed-tensors fp8 config.json with these ``ignore`` and ``targets``."""
    quantization_config = QUANT_CONFIGS["compressed-tensors"]("channel")
    for fields, key, value in ((quantization_config, "ignore", ignore),
                               (quantization_config["config_groups"]["group_0"], "targets", targets)):
        fields.pop(key)
        if value is not ABSENT:
            fields[key] = list(value) if isinstance(value, tuple) else value
    return ModelSpec.from_hf_config({
        "architectures": [arch], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": num_layers,
        "num_attention_heads": 4, "vocab_size": 320, "quantization_config": quantization_config})


def refusal(**fields) -> str:
    with pytest.raises(CheckpointError) as error:
        read_spec(**fields)
    message = str(error.value)
    assert "\n" not in message and message.startswith("config.json: field 'quantization_config."), message
    return message


def layer_modules(*layers, kinds=MODULES):
    return {f"model.layers.{i}.{'self_attn' if k in ('qkv_proj', 'o_proj') else 'mlp'}.{k}" for i in layers
            for k in kinds}


def test_ignore_entries_select_projections_as_vllm_matches_them():
    assert read_spec().unquantized == frozenset()  # ["lm_head"]: the hub's usual list
    assert read_spec(ignore=[]).unquantized == frozenset()
    assert read_spec(ignore=None).unquantized == frozenset()
    assert read_spec(ignore=ABSENT).unquantized == frozenset()
    assert read_spec(ignore=IGNORE).unquantized == KEPT
    assert read_spec(ignore=["re:model.layers.0.*"]).unquantized == layer_modules(0)
    # re.match, as vLLM: anchored at the start, not the end
    assert read_spec(ignore=["re:model.layers.1"], num_layers=12).unquantized == layer_modules(1, 10, 11)
    # a fused projection by its own name, or by all of its parts
    assert read_spec(ignore=["model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_proj",
                             "model.layers.1.mlp.up_proj"]).unquantized == {
        "model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"}
    # Phi-3's checkpoints hold q/k/v and gate/up fused: their names are the ones to list
    assert read_spec(ignore=["re:.*gate_up_proj"], arch="Phi3ForCausalLM").unquantized == layer_modules(
        0, 1, kinds=("gate_up_proj",))


def test_ignore_entries_that_match_no_layer_are_named_in_a_warning_not_refused(caplog):
    """vLLM skips such entries; recipes reuse lists across models (a dense model's "re:.*mlp.gate$", written for
    MoE routers), so a checkpoint vLLM serves is not refused for one. Each is named, once."""
    with caplog.at_level(logging.WARNING, logger="mempath.model.spec"):
        spec = read_spec(ignore=["lm_head", "re:.*mlp.gate$", "model.layers.7.mlp.down_proj",
                                 "model.layers.0.mlp.down_proj"])
    assert spec.unquantized == {"model.layers.0.mlp.down_proj"}
    assert len(caplog.records) == 1, caplog.text
    message = caplog.records[0].getMessage()
    assert "quantization_config.ignore" in message and "'re:.*mlp.gate$'" in message
    assert "'model.layers.7.mlp.down_proj'" in message and "lm_head" not in message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mempath.model.spec"):
        read_spec(ignore=["lm_head", "re:.*lm_head"])  # the LM head is a layer: mempath keeps it in 16 bits anyway
    assert not caplog.records


@pytest.mark.parametrize("ignore,expected", [
    ("lm_head", r"'quantization_config.ignore' holds \"lm_head\" \(a string\), expected a list of module names "
                r"and \"re:\" patterns, such as \[\"lm_head\"\]; write its entries as a JSON list of strings$"),
    ([3], r"'quantization_config.ignore' holds \[3\] \(a list\), expected a list of module names"),
    (["lm_head", "re:model.layers.(0"], r"'quantization_config.ignore' .*\"re:model.layers.\(0\" is not a valid "
                                         r"regular expression \(missing \), unterminated subpattern.*correct"),
    (["model.layers.0.self_attn.q_proj"], r"'quantization_config.ignore' .*names model.layers.0.self_attn.q_proj "
                                          r"but not k_proj, v_proj, which mempath fuses with it into one matrix "
                                          r"\(qkv_proj\), fp8 or not as a whole"),
    (["re:.*gate_proj"], r"names model.layers.0.mlp.gate_proj but not up_proj, .* \(gate_up_proj\)"),
])
def test_a_bad_ignore_list_is_refused_in_one_line(ignore, expected):
    message = refusal(ignore=ignore)
    assert re.search(expected, message), message


def test_config_group_targets_linear_or_the_projections():
    assert read_spec(targets=["Linear"]).unquantized == frozenset()
    assert read_spec(targets=["Linear", "re:.*down_proj$"]).unquantized == frozenset()
    # compressed-tensors quantizes the targeted layers only: the others stay in 16 bits
    assert read_spec(targets=["re:.*down_proj$"]).unquantized == layer_modules(
        0, 1, kinds=("qkv_proj", "o_proj", "gate_up_proj"))
    assert read_spec(targets=["re:.*down_proj$"], ignore=["model.layers.0.mlp.down_proj"]).unquantized == \
        layer_modules(0, 1) - {"model.layers.1.mlp.down_proj"}


@pytest.mark.parametrize("targets,expected", [
    ("Linear", r"'quantization_config.config_groups.group_0.targets' holds \"Linear\" \(a string\), expected a list "
               r"of \"Linear\", module names and \"re:\" patterns, such as \[\"Linear\"\]"),
    (ABSENT, r"'quantization_config.config_groups.group_0.targets' is missing, expected a list .*; add it to "
             r"config.json"),
    (["Linear", "Embedding"], r"'quantization_config.config_groups.group_0.targets' .*\"Embedding\" names none of "
                              r"this model's q/k/v, o, gate/up and down projections"),
    (["lm_head"], r"\"lm_head\" names none of this model's q/k/v, o, gate/up and down projections"),
    (["re:(Linear"], r"\"re:\(Linear\" is not a valid regular expression"),
    (["re:.*q_proj"], r"'quantization_config.config_groups.group_0.targets' .*names model.layers.0.self_attn.q_proj "
                      r"but not"),
])
def test_a_bad_targets_list_is_refused_in_one_line(targets, expected):
    message = refusal(targets=targets)
    assert re.search(expected, message), message


# ---------------------------------------------------------------- vLLM's fp8 checkpoints: ignored_layers


def test_vllm_fp8_ignored_layers_stay_in_16_bits_and_match_transformers(tmp_path, caplog):
    hf, quantized = write_checkpoint(tmp_path, ignore=IGNORED_LAYERS, method="fp8")
    with caplog.at_level(logging.WARNING, logger="mempath"):
        llm = LLM(str(tmp_path / "fp8"), dtype="float32", show_progress=False)
    assert llm.engine.spec.quantization == "fp8" and llm.engine.spec.unquantized == KEPT
    for name, layer in projections(llm.engine.model).items():
        assert (type(layer) is Linear) if name in KEPT else isinstance(layer, Fp8Linear), name
    assert "not fp8" not in caplog.text and "quantized at load" not in caplog.text, caplog.text
    assert "match no" not in caplog.text, caplog.text
    dequantized_reference(hf.float(), quantized)
    check_against_reference(llm, hf)


def read_fp8_spec(ignored_layers=("lm_head",), num_layers=2, arch="LlamaForCausalLM") -> ModelSpec:
    """The spec of a tiny model's quant_method "fp8" config.json with these ``ignored_layers``."""
    quantization_config = QUANT_CONFIGS["fp8"]("tensor")
    quantization_config.pop("ignored_layers")
    if ignored_layers is not ABSENT:
        quantization_config["ignored_layers"] = (list(ignored_layers) if isinstance(ignored_layers, tuple)
                                                 else ignored_layers)
    return ModelSpec.from_hf_config({
        "architectures": [arch], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": num_layers,
        "num_attention_heads": 4, "vocab_size": 320, "quantization_config": quantization_config})


def test_vllm_fp8_ignored_layers_select_projections_by_exact_name():
    assert read_fp8_spec().unquantized == frozenset()  # ["lm_head"]: the hub's usual list
    for empty in ([], None, ABSENT):
        assert read_fp8_spec(empty).unquantized == frozenset()
    assert read_fp8_spec(IGNORED_LAYERS).unquantized == KEPT
    # a fused projection by its own name, or by all of its parts
    assert read_fp8_spec(["model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_proj",
                          "model.layers.1.mlp.up_proj"]).unquantized == {
        "model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"}
    # exact names, not prefixes: "model.layers.1" names no projection of layer 1 (nor of layers 10-11)
    assert read_fp8_spec(["model.layers.1"], num_layers=12).unquantized == frozenset()


def test_vllm_fp8_ignored_layers_that_name_no_layer_are_named_in_a_warning(caplog):
    """As the compressed-tensors ignore list's: vLLM skips them. A "re:" entry is no pattern here (vLLM's fp8
    compares names): it names no layer, and the warning says so."""
    with caplog.at_level(logging.WARNING, logger="mempath.model.spec"):
        spec = read_fp8_spec(["lm_head", r"re:.*down_proj", "model.layers.7.mlp.down_proj",
                              "model.layers.0.mlp.down_proj"])
    assert spec.unquantized == {"model.layers.0.mlp.down_proj"}
    assert len(caplog.records) == 1, caplog.text
    message = caplog.records[0].getMessage()
    assert "quantization_config.ignored_layers" in message and "'re:.*down_proj'" in message
    assert "'model.layers.7.mlp.down_proj'" in message and "lm_head" not in message
    assert 'exact module names, not "re:" patterns' in message


@pytest.mark.parametrize("ignored_layers,expected", [
    ("lm_head", r"'quantization_config.ignored_layers' holds \"lm_head\" \(a string\), expected a list of module "
                r"names, such as \[\"lm_head\"\]; write its entries as a JSON list of strings$"),
    ([3], r"'quantization_config.ignored_layers' holds \[3\] \(a list\), expected a list of module names"),
    (["model.layers.0.self_attn.q_proj"], r"'quantization_config.ignored_layers' .*names "
                                          r"model.layers.0.self_attn.q_proj but not k_proj, v_proj, which mempath "
                                          r"fuses with it into one matrix \(qkv_proj\), fp8 or not as a whole"),
    (["model.layers.1.mlp.up_proj"], r"names model.layers.1.mlp.up_proj but not gate_proj, .* \(gate_up_proj\)"),
])
def test_a_bad_ignored_layers_is_refused_in_one_line(ignored_layers, expected):
    with pytest.raises(CheckpointError) as error:
        read_fp8_spec(ignored_layers)
    message = str(error.value)
    assert "\n" not in message and message.startswith("config.json: field 'quantization_config."), message
    assert re.search(expected, message), message


# ---------------------------------------------------------------- the plan


def kept_bytes_over_fp8(model, names) -> int:
    """What the projections ``names`` hold in the model's dtype beyond their fp8 figure: each weight's
    bytes less one byte a weight and FP8_SCALE_BYTES an output channel (its bias is the model dtype's both ways)."""
    layers = projections(model)
    return sum(layers[n].weight.numel() * (layers[n].weight.element_size() - 1)
               - layers[n].out_features * FP8_SCALE_BYTES for n in names)


@pytest.mark.parametrize("method", ["compressed-tensors", "fp8"])
def test_plan_counts_ignored_projections_in_the_model_dtype(tmp_path, method):
    """The planner's weights (and load_bytes, diagnose's rows) are the bytes the engine allocates, the ledger's
    weights: the kept projections in the model dtype, not at fp8's byte a weight."""
    write_checkpoint(tmp_path, ignore=IGNORED_LAYERS if method == "fp8" else IGNORE, method=method)
    llm = LLM(str(tmp_path / "fp8"), dtype="float32", show_progress=False)
    model, spec = llm.engine.model, llm.engine.spec
    plan = plan_memory(str(tmp_path / "fp8"), dtype="float32")
    all_fp8 = weight_bytes(dataclasses.replace(shape_from_spec(spec), unquantized=frozenset()), 4)["total"]
    assert plan.weight_bytes == llm.stats()["ledger"]["weights"]["bytes"] == all_fp8 + kept_bytes_over_fp8(model, KEPT)
    assert plan.weight_bytes > all_fp8
    # the loader's check_load_fits counts the same weights (load_bytes, resident_weight_bytes)
    assert resident_weight_bytes(shape_from_spec(spec), 4) == plan.weight_bytes
    # mempath diagnose's weights rows: each pathway of the plan against the parameters of that pathway
    rows = {row.pathway: row for row in weight_rows(plan, model, None, None)}
    for pathway in ("attention", "mlp", "embedding", "norms", "lm_head"):
        assert rows[f"weights.{pathway}"].predicted == rows[f"weights.{pathway}"].measured, pathway
    # the plan's title says how many projections stay in 16 bits
    assert (plan.fp8_projections, plan.unquantized_projections) == (5, 3)
    title = format_plan(plan).splitlines()[0]
    assert title.endswith("projections in fp8 (1 B/weight + a float32 scale per output channel); 3 of the 8 stay "
                          "in float32, as the checkpoint's quantization_config keeps them"), title


def test_plan_of_an_fp8_checkpoint_without_kept_projections_says_nothing_of_them(tmp_path):
    write_checkpoint(tmp_path, ignore=["lm_head"], kept_tensors=[])
    plan = plan_memory(str(tmp_path / "fp8"), dtype="bfloat16")
    assert (plan.fp8_projections, plan.unquantized_projections) == (8, 0)
    assert format_plan(plan).splitlines()[0].endswith("projections in fp8 (1 B/weight + a float32 scale per output "
                                                      "channel)")


# Every gate/up projection kept: gate_up (2·I = 256 outputs) is the model's widest projection, q/k/v (4 heads
# + 2·2 KV heads of 16 = 128) its widest fp8 one.
GATE_UP_KEPT = ["re:.*mlp\\.(gate|up)_proj$"]
GATE_UP_TENSORS = [f"model.layers.{i}.mlp.{p}_proj.weight" for i in range(2) for p in ("gate", "up")]


def test_gemv_workspace_is_sized_by_the_widest_fp8_projection(tmp_path):
    """set_fp8_matmul sizes the fp8 GEMV's workspace by its fp8 layers (quant.fp8_layers), a kept projection
    runs F.linear; gemv_workspace_bytes agrees. Every projection kept: the model is a 16-bit one, whose dense
    GEMV (set_dense_gemv, bfloat16 / float16 only) is sized by every projection."""
    write_checkpoint(tmp_path, ignore=GATE_UP_KEPT, kept_tensors=GATE_UP_TENSORS)
    model, spec, _ = load_model(tmp_path / "fp8", torch.bfloat16, torch.device("cpu"), 64, False)
    assert spec.unquantized == layer_modules(0, 1, kinds=("gate_up_proj",))
    fp8_widest = max(layer.out_features for layer in fp8_layers(model))
    assert fp8_widest == 128 < max(layer.out_features for layer in projections(model).values()) == 256
    shape = shape_from_spec(spec)
    assert gemv_workspace_bytes(shape, 2, fused_kernels=True) == fp8_gemv_workspace_bytes(128)
    assert gemv_workspace_bytes(shape, 4, fused_kernels=True) == fp8_gemv_workspace_bytes(128)
    assert gemv_workspace_bytes(dataclasses.replace(shape, unquantized=frozenset()), 2,
                                fused_kernels=True) == fp8_gemv_workspace_bytes(256)
    every = dataclasses.replace(shape, unquantized=frozenset(projections(model)))
    assert gemv_workspace_bytes(every, 2, fused_kernels=True) == fp8_gemv_workspace_bytes(256)
    assert gemv_workspace_bytes(every, 4, fused_kernels=True) == 0
    assert gemv_workspace_bytes(shape, 2, fused_kernels=False) == 0


@needs_fp8_gpu
@pytest.mark.parametrize("kept", ["gate_up", "every"])
def test_gpu_gemv_workspace_is_the_plans(tmp_path, kept):
    """On CUDA the engine's GEMV workspace (fp8 GEMV, or the dense one where every projection is kept) is
    gemv_workspace_bytes of its spec, and the planner's weights are the ledger's."""
    if kept == "gate_up":
        write_checkpoint(tmp_path, ignore=GATE_UP_KEPT, kept_tensors=GATE_UP_TENSORS)
    else:
        write_checkpoint(tmp_path, ignore=["re:model\\.layers\\..*"], kept_tensors=[
            f"model.layers.{i}.{m}.{p}_proj.weight" for i in range(2) for m, parts in (
                ("self_attn", "qkvo"), ("mlp", ("gate", "up", "down"))) for p in parts])
    llm = LLM(str(tmp_path / "fp8"), show_progress=False, gpu_memory_utilization=0.3, max_num_seqs=4)
    try:
        model, spec = llm.engine.model, llm.engine.spec
        assert bool(fp8_layers(model)) == (kept == "gate_up")
        assert fp8_gemv_bytes(model) == gemv_workspace_bytes(shape_from_spec(spec), 2, model.kernels.triton) > 0
        assert fp8_gemv_bytes(model) == fp8_gemv_workspace_bytes(128 if kept == "gate_up" else 256)
        plan = plan_memory(str(tmp_path / "fp8"), dtype="bfloat16")
        assert plan.weight_bytes == llm.stats()["ledger"]["weights"]["bytes"]
    finally:
        del llm
        release_cuda()
