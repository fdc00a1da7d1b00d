"""Bad input to the quantization and mixture-of-experts options, through the API, the command line
and checkpoints: one line that names the problem and the fix, never a traceback, never a value
silently ignored or changed (CPU, tiny random models)."""
import json
import logging
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mempath import LLM
from mempath.config import EngineConfig
from mempath.memory.formulas import read_shape, resolve_expert_cache_size
from mempath.model.spec import CheckpointError
from mempath.tools.plan import plan_memory
from tests.conftest import make_model
from tests.test_fp8_weights import write_fp8_checkpoint


def moe_llm(path, **options) -> LLM:
    return LLM(path, dtype="float32", device="cpu", show_progress=False, **options)


def one_line_error(capsys, argv: list[str]) -> str:
    """What `mempath ARGV` prints when it refuses ARGV: exit status 2 and one line, no traceback."""
    from mempath.cli import main
    capsys.readouterr()  # what came before (a model written with its progress bars) is not this command's
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- the expert cache's byte form


@pytest.mark.parametrize("gb", [math.inf, "1", True])
def test_an_expert_cache_gb_that_is_not_a_finite_number_is_refused_in_one_line(gb):
    with pytest.raises(ValueError, match=r"^moe_expert_cache_gb must be > 0 GiB, a finite number .*, got "):
        EngineConfig(model="x", device="cpu", moe_expert_cache_gb=gb)


def test_expert_cache_gb_inf_on_the_command_line_is_one_line(model_factory, capsys):
    path, _ = model_factory("qwen3_moe")
    for command in (["generate", "--model", path, "--quiet"], ["plan", path]):
        argv = command + ["--moe-expert-cache-gb", "inf"] + (["hi"] if command[0] == "generate" else [])
        assert "moe_expert_cache_gb must be > 0 GiB, a finite number" in one_line_error(capsys, argv)


@pytest.mark.parametrize("gb", [-1.0, math.nan, math.inf])
def test_plan_refuses_the_expert_cache_gb_the_engine_refuses(gb, model_factory):
    path, _ = model_factory("qwen3_moe")
    with pytest.raises(ValueError, match=r"^moe_expert_cache_gb must be > 0 GiB, a finite number"):
        plan_memory(path, dtype="float32", moe_expert_cache_gb=gb)


def test_the_gib_advised_for_a_too_small_expert_cache_are_enough(model_factory):
    """The advice rounds up: the GiB it names hold the k experts a token routes to."""
    path, _ = model_factory("qwen3_moe")
    shape = read_shape(json.loads((Path(path) / "config.json").read_text()))
    with pytest.raises(ValueError, match=r"give at least") as error:
        resolve_expert_cache_size(shape, 4, None, 1e-9, "m")
    advised = float(re.search(r"give at least ([0-9.]+) GiB", str(error.value)).group(1))
    assert resolve_expert_cache_size(shape, 4, None, advised, "m") in (None, *range(2, 9))


# ---------------------------------------------------------------- the expert cache's size in a plan


def test_plan_refuses_fewer_experts_than_a_token_routes_to_as_the_engine_does(model_factory, capsys):
    path, _ = model_factory("qwen3_moe")  # 8 experts, 2 a token
    message = r"--moe-expert-cache-size 1: must be from 2 \(the experts each token routes to\) to 8"
    with pytest.raises(ValueError, match=message):
        moe_llm(path, moe_expert_cache_size=1)
    with pytest.raises(ValueError, match=message):
        plan_memory(path, dtype="float32", moe_expert_cache_size=1)
    assert re.search(message, one_line_error(capsys, ["plan", path, "--moe-expert-cache-size", "1"]))
    assert plan_memory(path, dtype="float32", moe_expert_cache_size=2).expert_cache_size == 2


# ---------------------------------------------------------------- --quantization


@pytest.mark.parametrize("value", ["none", "None"])
def test_quantization_none_names_the_default_not_other_schemes(value, tmp_path, capsys):
    make_model(tmp_path, "llama", tokenizer=False)
    err = one_line_error(capsys, ["generate", "--model", str(tmp_path), "--quantization", value, "hi"])
    assert f"--quantization {value}: " in err and "drop the flag" in err and "AWQ" not in err, err


def test_kv_cache_dtype_of_the_wrong_type_is_one_line():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be auto, fp8, fp8_e4m3, fp8_e5m2, got \['fp8'\]"):
        EngineConfig(model="x", device="cpu", kv_cache_dtype=["fp8"])


# ---------------------------------------------------------------- fp8 checkpoints


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A per-tensor fp8 checkpoint (vLLM's fp8 method) and the float model it was made from."""
    root = tmp_path_factory.mktemp("fp8")
    hf = make_model(root / "float", "llama")
    write_fp8_checkpoint(root / "float", root / "fp8", hf, "fp8", "tensor")
    return root / "fp8"


def edited_copy(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> str:
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def dequantize(tensors: dict, name: str = Q_PROJ, keep_scale: bool = True) -> None:
    """One projection's weight stored as bfloat16 values, its weight_scale kept or dropped."""
    tensors[name] = (tensors[name].float() * tensors[name + "_scale"]).to(torch.bfloat16)
    if not keep_scale:
        del tensors[name + "_scale"]


def test_a_float_weight_beside_its_weight_scale_is_refused(fp8_checkpoint, tmp_path):
    """The checkpoint's scale belongs to an fp8 weight: applied to a weight quantized at load with
    scales of its own, it would load wrong weights without a word."""
    path = edited_copy(fp8_checkpoint, tmp_path / "mixed", dequantize)
    with pytest.raises(CheckpointError, match=rf"tensor '{Q_PROJ}' is bfloat16 but the checkpoint also has its "
                                              rf"weight_scale.*download it again") as error:
        LLM(path, dtype="float32", show_progress=False)
    assert "\n" not in str(error.value)


def test_projections_an_fp8_checkpoint_leaves_unquantized_are_named_when_quantized_at_load(
        fp8_checkpoint, tmp_path, caplog):
    path = edited_copy(fp8_checkpoint, tmp_path / "ignored", lambda t: dequantize(t, keep_scale=False))
    with caplog.at_level(logging.WARNING, logger="mempath.model.loader"):
        LLM(path, dtype="float32", show_progress=False)
    assert f"1 projection weight(s) of this fp8 checkpoint are not fp8 (e.g. {Q_PROJ!r}, bfloat16)" in caplog.text
    assert "quantized at load" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mempath.model.loader"):
        LLM(str(fp8_checkpoint), dtype="float32", show_progress=False)
    assert "not fp8" not in caplog.text


def test_fp8_weights_without_a_quantization_config_name_the_missing_config(fp8_checkpoint, tmp_path):
    path = edited_copy(fp8_checkpoint, tmp_path / "no-config", edit_config=lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"is float8_e4m3fn, .* config.json has no quantization_config"):
        LLM(path, dtype="float32", show_progress=False)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_weight_scale_that_is_not_a_finite_number_is_refused(fp8_checkpoint, tmp_path, bad):
    """A NaN scale zeroes or poisons every output of its rows: refused at load, not served."""
    def poison(tensors):
        tensors[Q_PROJ + "_scale"] = torch.full_like(tensors[Q_PROJ + "_scale"], bad)
    path = edited_copy(fp8_checkpoint, tmp_path / "poisoned", poison)
    with pytest.raises(CheckpointError, match=rf"tensor '{Q_PROJ}_scale' holds 1 value\(s\) that are not finite "
                                              rf"\(e.g. {bad}\).*download it again") as error:
        LLM(path, dtype="float32", show_progress=False)
    assert "\n" not in str(error.value)


def test_a_moe_model_too_large_for_the_gpu_is_told_the_expert_cache_that_fits(model_factory, monkeypatch):
    """The refusal names the flag made for this case, at the largest size whose load fits what is free."""
    from mempath.memory.formulas import load_bytes, load_device_bytes, shape_from_spec
    from mempath.model.loader import check_load_fits, read_spec
    path, _ = model_factory("qwen3_moe")  # 8 experts, 2 a token
    spec = read_spec(path)
    shape = shape_from_spec(spec)

    def device_need(size):
        return load_device_bytes(load_bytes(shape, 4, 64, 4, size))
    free = device_need(5)  # 5 experts a layer fit, 6 do not
    assert device_need(6) > free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 10 * free))

    def refusal(size, gb=None):
        with pytest.raises(CheckpointError) as error:
            check_load_fits(spec, 64, torch.float32, torch.device("cuda", 0), dummy=True,
                            checkpoint_dtype=torch.float32, source="m/config.json", expert_cache_size=size,
                            expert_cache_gb=gb)
        assert "\n" not in str(error.value)
        return str(error.value)
    assert "pass --moe-expert-cache-size 5 or less (experts a layer on the GPU" in refusal(None)
    assert "pass --moe-expert-cache-size 5 or less (" in refusal(7)
    # A cache given in GiB: the size takes that flag's place (the engine refuses the two together).
    assert "pass --moe-expert-cache-size 5 or less in place of --moe-expert-cache-gb 0.5 (" in refusal(7, gb=0.5)
    free = device_need(2) - 1  # not even the 2 experts a token routes to
    assert "--moe-expert-cache-size" not in refusal(None)


def test_numpy_expert_cache_sizes_are_taken_as_other_integer_fields_are():
    """np.int64(4) was refused as "must be a whole number of experts ... got np.int64(4)"."""
    import numpy as np
    assert EngineConfig(model="m", moe_expert_cache_size=np.int64(4)).moe_expert_cache_size == 4
    assert type(EngineConfig(model="m", moe_expert_cache_size=np.int64(4)).moe_expert_cache_size) is int
    with pytest.raises(ValueError, match="moe_expert_cache_size"):
        EngineConfig(model="m", moe_expert_cache_size=np.True_)


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_cpu_experts_on_a_dense_model_say_it_is_dense(model_factory, mode):
    """It said every expert was resident and to keep fewer on the device, a flag then refused as dense."""
    path, _ = model_factory("llama")
    with pytest.raises(ValueError, match=rf"--moe-cpu-experts {mode} is for mixture-of-experts models; .*describes "
                                         r"a dense model \(LlamaForCausalLM, no MoE layer\): drop the flag"):
        LLM(path, dtype="float32", show_progress=False, moe_cpu_experts=mode)
    with pytest.raises(ValueError, match=rf"--moe-cpu-experts {mode} is for mixture-of-experts models"):
        plan_memory(path, moe_cpu_experts=mode)
