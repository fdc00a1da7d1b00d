"""Damaged checkpoints are refused in one line naming the tensor, never served: a tensor in two shards (which
hid a missing one), NaN codes in an fp8 weight, weight scales that are negative, all zero or beyond float32."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mempath import LLM
from tests.conftest import make_model
from tests.test_fp8_weights import write_fp8_checkpoint

PROJ = "model.layers.0.self_attn"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    hf = make_model(root / "float", "llama")
    write_fp8_checkpoint(root / "float", root / "fp8", hf, "compressed-tensors", "channel")
    return root


def damaged(checkpoints, tmp_path, which: str, change) -> str:
    """A copy of the float or fp8 checkpoint whose tensors ``change`` edits (it returns the shards to write)."""
    shutil.copytree(checkpoints / which, tmp_path / which)
    tensors = load_file(tmp_path / which / "model.safetensors")
    (tmp_path / which / "model.safetensors").unlink()
    for shard, part in change(tensors).items():
        save_file(part, str(tmp_path / which / shard), metadata={"format": "pt"})
    return str(tmp_path / which)


def refused(path: str, says: str) -> str:
    with pytest.raises(ValueError) as error:
        LLM(path, dtype="float32", show_progress=False)
    message = str(error.value)
    assert says in message and "\n" not in message, message
    return message


def test_a_tensor_in_two_shards_is_refused_even_where_it_stands_in_for_a_missing_one(checkpoints, tmp_path):
    """The loader counted the pieces a parameter received: a second copy of q_proj made up for a missing k_proj,
    whose rows of the fused q/k/v then held whatever memory was there."""
    def split(tensors):
        k = tensors.pop(f"{PROJ}.k_proj.weight")
        assert k is not None
        return {"a.safetensors": tensors, "b.safetensors": {f"{PROJ}.q_proj.weight": tensors[f"{PROJ}.q_proj.weight"]}}
    message = refused(damaged(checkpoints, tmp_path, "float", split), f"'{PROJ}.q_proj.weight' is in both")
    assert "a.safetensors" in message and "b.safetensors" in message


def test_nan_codes_in_an_fp8_weight_are_refused(checkpoints, tmp_path):
    """float8_e4m3fn has no infinity: 0x7f is NaN. They were loaded, and the logits came out NaN, served as
    token 0."""
    def nan(tensors):
        weight = tensors[f"{PROJ}.o_proj.weight"]
        weight.view(torch.uint8).reshape(-1)[:5] = 0x7F
        return {"model.safetensors": tensors}
    refused(damaged(checkpoints, tmp_path, "fp8", nan), f"'{PROJ}.o_proj.weight' holds 5 NaN")


@pytest.mark.parametrize("scale, says", [
    (lambda s: -s, "negative"),
    (lambda s: torch.zeros_like(s), "all zero"),
    (lambda s: torch.where(torch.arange(s.numel()).reshape(s.shape) == 0, 1e300, s.double()), "not finite"),
])
def test_weight_scales_no_fp8_export_writes_are_refused(checkpoints, tmp_path, scale, says):
    """A negative scale flipped the layer's outputs, a zero one zeroed them, and a float64 1e300 became inf in
    the float32 scale after the check had passed it: each was served."""
    def change(tensors):
        name = f"{PROJ}.o_proj.weight_scale"
        tensors[name] = scale(tensors[name])
        return {"model.safetensors": tensors}
    refused(damaged(checkpoints, tmp_path, "fp8", change), f"'{PROJ}.o_proj.weight_scale' ")
    with pytest.raises(ValueError, match=says):
        LLM(str(tmp_path / "fp8"), dtype="float32", show_progress=False)


def test_an_fp8_config_over_float_weights_is_said(checkpoints, tmp_path, caplog):
    """No fp8 weight arrived, so the warning for a mixed export never came: every projection was quantized at load
    without a word."""
    shutil.copytree(checkpoints / "fp8", tmp_path / "fp8")
    shutil.copy(checkpoints / "float" / "model.safetensors", tmp_path / "fp8" / "model.safetensors")
    with caplog.at_level("WARNING", logger="mempath"):
        llm = LLM(str(tmp_path / "fp8"), dtype="float32", show_progress=False)
    assert llm.engine.spec.quantization == "fp8"
    assert any("none of its 14 projection weights is fp8" in r.getMessage() for r in caplog.records)


def test_weights_beyond_float16s_range_are_refused_under_dtype_float16(checkpoints, tmp_path):
    """Copied into float16 they became infinity, and the logits NaN, served as token 0."""
    def large(tensors):
        tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e6
        return {"model.safetensors": tensors}
    path = damaged(checkpoints, tmp_path, "float", large)
    with pytest.raises(ValueError, match="'model.layers.0.mlp.down_proj.weight' holds values beyond float16's "
                                         "range .*--dtype bfloat16 or float32"):
        LLM(path, dtype="float16", show_progress=False)
    LLM(path, dtype="bfloat16", show_progress=False)  # its range holds it


def test_a_compressed_tensors_transform_config_is_refused(checkpoints, tmp_path):
    """Rotated or Hadamard-transformed weights read as they are give wrong outputs: it loaded without a word."""
    import json
    shutil.copytree(checkpoints / "fp8", tmp_path / "fp8")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"]["transform_config"] = {"config_groups": {"u": {"type": "hadamard"}}}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    refused(str(tmp_path / "fp8"), "field 'quantization_config.transform_config' holds")


def test_an_fp8_torch_dtype_is_told_where_fp8_is_declared(checkpoints, tmp_path):
    import json
    shutil.copytree(checkpoints / "fp8", tmp_path / "fp8")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["torch_dtype"] = "float8_e4m3fn"
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    refused(str(tmp_path / "fp8"), "names the model's unquantized dtype (e.g. bfloat16); an fp8 checkpoint says fp8 "
                                   "in quantization_config")


def test_a_checkpoint_overwritten_while_it_loads_is_refused(tmp_path, monkeypatch):
    """Its identity was taken before the read and never again: weights read from the new bytes took the old
    bytes' digest from the cache, and the disk KV tier served the old weights' KV to them (and stored theirs
    under the old weights' name)."""
    from mempath.model import loader
    make_model(tmp_path / "m", "llama", seed=0)
    make_model(tmp_path / "other", "llama", seed=1)
    real_open = loader.safe_open

    def overwritten_first(path, *args, **kwargs):
        shutil.copy2(tmp_path / "other" / "model.safetensors", path)  # cp -p lands between the stat and the read
        monkeypatch.setattr(loader, "safe_open", real_open)
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(loader, "safe_open", overwritten_first)
    refused(str(tmp_path / "m"), "changed on disk while mempath loaded it")
