"""Broken checkpoints and configs: one clear line, nothing allocated, no stale KV.

Every failure must be a ``CheckpointError`` (a ValueError) whose one-line message names
the file, the field or tensor, what it holds, what is expected and the fix; the CLI
prints that line and exits 2. Absurd sizes are refused before anything is allocated.
The disk tier's fingerprint follows the weights' content, not their size and mtime.
"""
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from mempath import LLM, SamplingParams
from mempath.cli import main as cli_main
from mempath.tools.plan import plan_memory
from mempath.model import digest, loader
from mempath.model.spec import ModelSpec
from mempath.model.loader import load_model
from tests.conftest import make_model

GiB = 1 << 30
CPU = torch.device("cpu")

# What make_model writes for its default llama, minus the fields the reader defaults.
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32",
}


def refusal(call) -> str:
    """The one-line CheckpointError `call` raises."""
    with pytest.raises(ValueError) as info:
        call()
    assert type(info.value).__name__ == "CheckpointError", repr(info.value)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def write_config(path: Path, config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def edited(**changes) -> dict:
    """CONFIG with fields changed; a value of `del` removes the field."""
    config = dict(CONFIG)
    for key, value in changes.items():
        if value is del_:
            config.pop(key)
        else:
            config[key] = value
    return config


del_ = object()


# ---------------------------------------------------------------- config.json fields

BAD_FIELDS = [
    (edited(num_attention_heads=del_), r"'num_attention_heads' is missing, expected a positive integer"),
    (edited(hidden_size=-384), r"'hidden_size' holds -384 \(a number\), expected a positive integer"),
    (edited(num_hidden_layers=0), r"'num_hidden_layers' holds 0 \(a number\), expected a positive integer"),
    (edited(num_hidden_layers="6"), r"'num_hidden_layers' holds \"6\" \(a string\), expected a positive integer"),
    (edited(num_hidden_layers=True), r"'num_hidden_layers' holds true \(true/false\)"),
    (edited(max_position_embeddings=3e7), r"'max_position_embeddings' holds 30000000.0 \(a number\), "
                                          r"expected a positive integer"),
    (edited(num_key_value_heads=3), r"'num_key_value_heads' holds 3.*divides num_attention_heads \(4\)"),
    (edited(num_attention_heads=5, num_key_value_heads=5),
     r"'num_attention_heads' holds 5.*divides hidden_size \(64\)"),
    (edited(head_dim=15), r"'head_dim' holds 15 \(a number\), expected an even positive integer"),
    (edited(rms_norm_eps="1e-6"), r"'rms_norm_eps' holds \"1e-6\" \(a string\), expected a positive number"),
    (edited(tie_word_embeddings="yes"), r"'tie_word_embeddings' holds \"yes\" \(a string\), expected true or false"),
    (edited(eos_token_id="2"), r"'eos_token_id' holds \"2\" \(a string\), expected a token id"),
    (edited(architectures="LlamaForCausalLM"), r"'architectures' holds \"LlamaForCausalLM\" \(a string\), "
                                               r"expected a list"),
    (edited(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     r"'rope_scaling.rope_type' holds \"yarn\".*not supported"),
    (edited(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}),
     r"'rope_scaling.high_freq_factor' holds 4.0 \(a number\), expected a number above low_freq_factor \(4.0\)"),
    (edited(dtype="float8_e4m3fn"), r"'dtype' holds \"float8_e4m3fn\".*expected float32, float16 or bfloat16"),
    (edited(quantization_config={"quant_method": "gptq"}),
     r"'quantization_config.quant_method' holds \"gptq\".*expected compressed-tensors or fp8"),
    (edited(hidden_act="gelu"), r"'hidden_act' holds \"gelu\".*expected silu"),
]


@pytest.mark.parametrize("config,expected", BAD_FIELDS, ids=[m[:28] for _, m in BAD_FIELDS])
def test_bad_config_field_is_one_line_naming_file_field_value_and_expectation(tmp_path, config, expected):
    write_config(tmp_path, config)
    message = refusal(lambda: load_model(tmp_path, torch.float32, CPU, show_progress=False))
    assert message.startswith(str(tmp_path / "config.json") + ": "), message
    assert re.search(expected, message), message
    # One validated reader: the planner refuses the same config with the same words.
    assert refusal(lambda: plan_memory(str(tmp_path))) == message


@pytest.mark.parametrize("content,expected", [
    ("[1, 2, 3]", r"holds a list, expected a JSON object"),
    ("{\"hidden_size\": 64", r"is not valid JSON"),
    ("", r"is not valid JSON"),
])
def test_config_that_is_not_a_json_object(tmp_path, content, expected):
    (tmp_path / "config.json").write_text(content)
    for call in (lambda: load_model(tmp_path, torch.float32, CPU, show_progress=False),
                 lambda: plan_memory(str(tmp_path))):
        message = refusal(call)
        assert str(tmp_path / "config.json") in message and re.search(expected, message), message


def test_config_json_that_is_a_directory(tmp_path):
    (tmp_path / "config.json").mkdir()
    message = refusal(lambda: load_model(tmp_path, torch.float32, CPU, show_progress=False))
    assert "config.json" in message and "is a directory" in message


def test_a_config_with_only_model_type_reads_as_the_planner_read_it(tmp_path):
    config = edited(architectures=del_)
    write_config(tmp_path, config)
    assert plan_memory(str(tmp_path)).architecture == "LlamaForCausalLM"
    spec = ModelSpec.from_hf_config(config)
    assert spec.architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("arch,bias_fields,expect_qkv_bias", [
    ("MistralForCausalLM", {"attention_bias": True}, False),  # transformers' Mistral has no biases
    ("Phi3ForCausalLM", {"attention_bias": True, "mlp_bias": True}, False),
    ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}, True),
])
def test_engine_and_planner_agree_on_biases(arch, bias_fields, expect_qkv_bias):
    from mempath.memory.formulas import read_shape
    config = {**CONFIG, "architectures": [arch], **bias_fields}
    spec = ModelSpec.from_hf_config(config)
    shape = read_shape(config)
    assert spec.qkv_bias == shape.attention_bias == expect_qkv_bias
    assert spec.mlp_bias == shape.mlp_bias


# ---------------------------------------------------------------- absurd sizes: refused before allocating

def never_build(*args, **kwargs):
    raise AssertionError("the model was allocated")


@pytest.fixture
def host_with(monkeypatch):
    """Pretend the host has this much memory available."""
    def set_available(nbytes):
        import psutil
        monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=nbytes, total=nbytes))
    return set_available


@pytest.mark.parametrize("field,value,fix", [
    ("num_hidden_layers", 100000, r"num_hidden_layers 100000"),
    ("intermediate_size", 2000000, r"intermediate_size 2000000"),
    ("max_position_embeddings", 30000000, r"--max-model-len \d+"),
])
def test_absurd_sizes_are_refused_before_allocating(tmp_path, monkeypatch, host_with, field, value, fix):
    monkeypatch.setattr(loader, "build_model", never_build)
    host_with(GiB)
    write_config(tmp_path, edited(**{field: value}))
    # On the CPU, where the host's memory (pretended 1 GiB) is what the load must fit in.
    message = refusal(lambda: LLM(str(tmp_path), load_format="dummy", device="cpu", show_progress=False))
    assert re.search(r"loading needs [\d.]+ [GT]iB .* but the host has 1.00 GiB available", message), message
    assert re.search(fix, message), message


def test_sizes_beyond_any_machine_are_refused_before_allocating(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "build_model", never_build)
    write_config(tmp_path, edited(num_hidden_layers=10**9, hidden_size=8192, num_attention_heads=64,
                                  num_key_value_heads=8, intermediate_size=28672))
    message = refusal(lambda: LLM(str(tmp_path), load_format="dummy", device="cpu", show_progress=False))
    assert "loading needs" in message and "available" in message


def test_a_huge_context_loads_with_the_max_model_len_the_refusal_names(tmp_path, host_with):
    write_config(tmp_path, edited(max_position_embeddings=30000000))
    host_with(64 << 20)
    message = refusal(lambda: load_model(tmp_path, torch.float32, CPU, show_progress=False, dummy=True))
    fitting = int(re.search(r"--max-model-len (\d+)", message).group(1))
    model, _, _ = load_model(tmp_path, torch.float32, CPU, max_positions=fitting, show_progress=False, dummy=True)
    assert model.model.rotary.cos.shape[0] == fitting


def test_planned_load_bytes_are_what_the_loader_allocates(tmp_path):
    from mempath.memory.formulas import load_bytes, read_shape
    make_model(tmp_path, "qwen3", tokenizer=False)
    model, spec, report = load_model(tmp_path, torch.float32, CPU, max_positions=300, show_progress=False)
    planned = load_bytes(read_shape(json.loads((tmp_path / "config.json").read_text())), 4, 300)
    rotary = model.model.rotary
    assert planned["weights"] == report.weight_bytes
    assert planned["rotary_tables"] == rotary.cos.nbytes + rotary.sin.nbytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_planned_load_bytes_bound_what_the_gpu_allocates(tmp_path):
    """Allocated after the load: weights + rotary tables + the dense GEMV's split-K workspace (a step buffer
    the loader allocates, set_dense_gemv); the peak: also the rotary build."""
    from mempath.memory.formulas import gemv_workspace_bytes, load_bytes, read_shape
    make_model(tmp_path, "llama", tokenizer=False, hidden_size=256, intermediate_size=512, vocab_size=1024)
    device = torch.device("cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model, _, report = load_model(tmp_path, torch.bfloat16, device, max_positions=4096, show_progress=False)
    torch.cuda.synchronize()
    shape = read_shape(json.loads((tmp_path / "config.json").read_text()))
    planned = load_bytes(shape, 2, 4096)
    rounding = 512 * (len(list(model.parameters())) + 8)  # the allocator rounds each block up to 512 bytes
    kept = planned["weights"] + planned["rotary_tables"] + gemv_workspace_bytes(shape, 2, fused_kernels=True)
    assert kept <= torch.cuda.memory_allocated(device) - before <= kept + rounding
    assert torch.cuda.max_memory_allocated(device) - before <= kept + planned["rotary_build"] + rounding


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_absurd_sizes_on_the_gpu_are_refused_with_its_free_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "build_model", never_build)
    write_config(tmp_path, edited(num_hidden_layers=100000, hidden_size=4096, num_attention_heads=32,
                                  num_key_value_heads=8, intermediate_size=14336, dtype="bfloat16"))
    before = torch.cuda.memory_allocated()
    message = refusal(lambda: LLM(str(tmp_path), load_format="dummy", device="cuda", show_progress=False))
    assert re.search(r"loading needs [\d.]+ TiB .* but the GPU has [\d.]+ GiB free", message), message
    assert torch.cuda.memory_allocated() == before


# ---------------------------------------------------------------- checkpoint contents

def test_an_int32_tensor_where_a_float_weight_belongs_is_refused(tmp_path):
    make_model(tmp_path, "llama", tokenizer=False)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = torch.zeros(tensors[name].shape, dtype=torch.int32)
    save_file(tensors, path, metadata={"format": "pt"})
    message = refusal(lambda: load_model(tmp_path, torch.float32, CPU, show_progress=False))
    assert str(path) in message and name in message and "int32" in message, message
    assert "expected a floating-point weight" in message, message


def sharded(tmp_path) -> tuple[Path, dict]:
    make_model(tmp_path, "llama", shard_size="100KB", tokenizer=False)
    index_path = tmp_path / "model.safetensors.index.json"
    return index_path, json.loads(index_path.read_text())


@pytest.mark.parametrize("outside", ["/etc/passwd", "../elsewhere.safetensors", "sub/../../x.safetensors"])
def test_an_index_naming_a_shard_outside_the_model_directory_is_refused(tmp_path, monkeypatch, outside):
    index_path, index = sharded(tmp_path / "model")
    (tmp_path / "elsewhere.safetensors").write_bytes((tmp_path / "model" / index["weight_map"][
        "model.embed_tokens.weight"]).read_bytes())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = outside
    index_path.write_text(json.dumps(index))
    opened = []
    real_open = loader.safe_open
    monkeypatch.setattr(loader, "safe_open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k))
    message = refusal(lambda: load_model(tmp_path / "model", torch.float32, CPU, show_progress=False))
    assert str(index_path) in message and outside in message and "outside" in message, message
    assert not any("passwd" in str(p) or "elsewhere" in str(p) for p in opened)


def test_a_shard_that_is_a_symlink_out_of_the_directory_still_loads(tmp_path):
    """The Hugging Face cache links snapshot files to blobs elsewhere: that is not leaving the directory."""
    index_path, index = sharded(tmp_path / "model")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in set(index["weight_map"].values()):
        target = blobs / shard
        os.replace(tmp_path / "model" / shard, target)
        os.symlink(os.path.relpath(target, tmp_path / "model"), tmp_path / "model" / shard)
    _, _, report = load_model(tmp_path / "model", torch.float32, CPU, show_progress=False)
    assert report.tensors_loaded > 0


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_a_truncated_or_corrupt_safetensors_file_is_one_line(tmp_path, damage):
    make_model(tmp_path, "llama", tokenizer=False)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\xff" * 64, "empty": b""}[damage])
    message = refusal(lambda: load_model(tmp_path, torch.float32, CPU, show_progress=False))
    assert str(path) in message and "not a complete safetensors file" in message, message
    assert "download it again" in message


@pytest.mark.parametrize("index,expected", [
    ({"metadata": {}}, r"has no 'weight_map'"),
    ({"weight_map": ["a.safetensors"]}, r"'weight_map' holds a list, expected an object"),
    ({"weight_map": {"model.embed_tokens.weight": 7}}, r"names shard 7 \(a number\), expected a file name"),
    ([], r"holds a list, expected a JSON object"),
    ("{not json", r"is not valid JSON"),
])
def test_a_broken_index_is_one_line(tmp_path, index, expected):
    index_path, _ = sharded(tmp_path)
    index_path.write_text(index if isinstance(index, str) else json.dumps(index))
    message = refusal(lambda: load_model(tmp_path, torch.float32, CPU, show_progress=False))
    assert str(index_path) in message and re.search(expected, message), message


def test_a_weights_file_that_is_a_directory_is_one_line(tmp_path):
    make_model(tmp_path, "llama", tokenizer=False)
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").mkdir()
    message = refusal(lambda: load_model(tmp_path, torch.float32, CPU, show_progress=False))
    assert str(tmp_path / "model.safetensors") in message and "is a directory" in message, message


def test_a_shard_that_is_a_directory_is_one_line(tmp_path):
    index_path, index = sharded(tmp_path)
    shard = sorted(set(index["weight_map"].values()))[0]
    os.remove(tmp_path / shard)
    (tmp_path / shard).mkdir()
    message = refusal(lambda: load_model(tmp_path, torch.float32, CPU, show_progress=False))
    assert shard in message and "is a directory" in message, message


# ---------------------------------------------------------------- the CLI: exit 2, one line

def broken_checkpoint(path: Path, kind: str) -> Path:
    make_model(path, "llama", tokenizer=False)
    if kind == "truncated":
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[:100])
    elif kind == "config-list":
        (path / "config.json").write_text("[]")
    elif kind == "no-heads":
        config = json.loads((path / "config.json").read_text())
        del config["num_attention_heads"]
        (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("argv", [
    ["generate", "{model}", "hi", "--quiet"],
    ["chat", "hi", "--model", "{model}", "--quiet"],
    ["serve", "{model}"],
    ["plan", "{model}", "--gpu-mem", "80GiB"],
    ["diagnose", "{model}", "--out", "{out}"],
])
def test_every_command_refuses_a_broken_config_with_exit_2_and_one_line(tmp_path, capsys, argv):
    if argv[0] == "serve":
        pytest.importorskip("uvicorn")  # the serve extra
    model = broken_checkpoint(tmp_path / "model", "no-heads")
    capsys.readouterr()  # make_model's progress bar
    rc = cli_main([a.format(model=model, out=tmp_path / "report") for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "num_attention_heads" in err and "config.json" in err, err


@pytest.mark.parametrize("kind", ["truncated", "config-list"])
def test_generate_refuses_a_broken_checkpoint_with_exit_2_and_one_line(tmp_path, capsys, kind):
    model = broken_checkpoint(tmp_path / "model", kind)
    capsys.readouterr()
    rc = cli_main(["generate", str(model), "hi", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("mempath: error: "), err


def test_a_config_json_given_as_the_model_is_refused_naming_the_directory(tmp_path, capsys):
    """The model is a directory: given its config.json (the planner reads one alone), generate names the
    folder to pass instead of asking for weights the folder may well have."""
    model = write_config(tmp_path / "model", CONFIG)
    rc = cli_main(["generate", "--model", str(model / "config.json"), "hi", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"give the model's directory, {model}" in err and "download" not in err


def test_the_command_line_prints_no_traceback(tmp_path):
    model = broken_checkpoint(tmp_path / "model", "truncated")
    result = subprocess.run([sys.executable, "-m", "mempath", "generate", str(model), "hi", "--quiet"],
                            capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)),
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert str(model / "model.safetensors") in result.stderr


# ---------------------------------------------------------------- the disk tier's fingerprint

BLOCK_NBYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers, K/V, tokens, kv heads, head_dim, float32


def gb(blocks: int) -> float:
    return blocks * (BLOCK_NBYTES + 256) / GiB


def tiered(model: Path, disk: Path, **kw) -> LLM:
    llm = LLM(str(model), dtype="float32", show_progress=False, num_gpu_blocks_override=8,
              cpu_kv_gb=gb(8), disk_kv_path=str(disk), disk_kv_gb=gb(64), disk_write_policy="write-through", **kw)
    llm.engine.kv.tiers.rates["prefill_tokens_per_s"] = 1.0  # loading always beats recomputing
    return llm


PROMPTS = [[10 + (7 * c + i) % 200 for i in range(40)] for c in range(4)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def fill_disk_tier(model: Path, disk: Path) -> None:
    llm = tiered(model, disk)
    for prompt in PROMPTS:
        llm.generate(prompt, GREEDY, use_tqdm=False)
    llm.engine.kv.tiers.close()
    assert any(name.endswith(".kv") for _, _, names in os.walk(disk) for name in names)


def replace_in_place(target: Path, source: Path) -> None:
    """Other bytes into the same inode, size and mtime kept: what `cp -p` over a file does."""
    before = target.stat()
    data = source.read_bytes()
    assert len(data) == before.st_size
    with open(target, "r+b") as f:
        f.write(data)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = target.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


@pytest.fixture
def two_models(tmp_path):
    """Two checkpoints of the same shapes, hence of the same file size, with different weights."""
    make_model(tmp_path / "model", "llama", seed=0, tokenizer=False)
    make_model(tmp_path / "other", "llama", seed=1, tokenizer=False)
    return tmp_path / "model", tmp_path / "other"


def test_weights_replaced_with_same_size_and_mtime_do_not_reuse_the_old_kv(tmp_path, two_models):
    model, other = two_models
    fill_disk_tier(model, tmp_path / "disk")
    replace_in_place(model / "model.safetensors", other / "model.safetensors")
    llm = tiered(model, tmp_path / "disk")
    assert llm.engine.kv.tiers.disk.num_blocks == 0  # the old model's blocks were removed, not kept
    out = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    reference = LLM(str(other), dtype="float32", show_progress=False).generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 0 and out.token_ids == reference[0].token_ids


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    """Digests are cached under $XDG_CACHE_HOME/mempath: here, not in the real home."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def test_a_restart_on_unchanged_weights_hashes_nothing_and_writes_nothing_in_the_model_dir(
        tmp_path, two_models, monkeypatch):
    model, _ = two_models
    listing = sorted(os.listdir(model))
    fill_disk_tier(model, tmp_path / "disk")
    assert sorted(os.listdir(model)) == listing
    assert digest.digest_cache_file() == tmp_path / "xdg-cache" / "mempath" / "weight-digests.json"
    assert digest.digest_cache_file().is_file()
    monkeypatch.setattr(digest, "hash_file", lambda path: pytest.fail(f"{path} hashed again"))
    llm = tiered(model, tmp_path / "disk")
    out = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 32  # the disk tier's blocks were kept
    assert sorted(os.listdir(model)) == listing


def test_the_same_bytes_rewritten_are_hashed_again_and_keep_the_kv(tmp_path, two_models, monkeypatch):
    model, _ = two_models
    fill_disk_tier(model, tmp_path / "disk")
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes((model / "model.safetensors").read_bytes())
    replace_in_place(model / "model.safetensors", copy)  # ctime moves: the cached digest is not trusted
    hashed = []
    real_hash = digest.hash_file
    monkeypatch.setattr(digest, "hash_file", lambda path: hashed.append(path) or real_hash(path))
    llm = tiered(model, tmp_path / "disk")
    assert [Path(p).name for p in hashed] == ["model.safetensors"]
    assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].num_cached_tokens == 32

@pytest.mark.parametrize("change", ["numerics", "release"])
def test_kv_of_another_mempath_is_not_served(tmp_path, two_models, monkeypatch, change):
    """KV bytes written by a mempath whose kernels or rotary differ are another model's KV."""
    from mempath.engine import startup
    model, _ = two_models
    fill_disk_tier(model, tmp_path / "disk")
    if change == "numerics":
        monkeypatch.setattr(startup, "KV_NUMERICS_VERSION", startup.KV_NUMERICS_VERSION + 1)
    else:
        monkeypatch.setattr(startup, "VERSION", startup.VERSION + ".post1")
    llm = tiered(model, tmp_path / "disk")
    assert llm.engine.kv.tiers.disk.num_blocks == 0
    assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_dummy_weights_follow_the_seed(tmp_path):
    """docs/tiers.md: with load_format=dummy the seed, which keys the disk tier, determines the weights."""
    make_model(tmp_path, "llama", tokenizer=False)

    def weights(seed):
        # On the CPU, where load_model below draws too (a CUDA generator draws other weights: next test).
        llm = LLM(str(tmp_path), dtype="float32", show_progress=False, load_format="dummy", seed=seed, device="cpu")
        return llm.engine.model.lm_head.weight.detach().clone()

    first = weights(0)
    assert torch.equal(first, weights(0)) and not torch.equal(first, weights(1))
    drawn, _, _ = load_model(tmp_path, torch.float32, CPU, show_progress=False, dummy=True, seed=1)
    assert torch.equal(drawn.lm_head.weight, weights(1))


def test_the_dummy_weights_fingerprint_names_the_device_type(tmp_path):
    """CPU and CUDA generators draw other dummy weights from one seed: other KV."""
    from mempath.config import EngineConfig
    from mempath.engine.startup import Startup
    config = EngineConfig(model=str(tmp_path), load_format="dummy", cpu_kv_gb=gb(8), disk_kv_path=str(tmp_path / "d"),
                          disk_kv_gb=gb(64))
    fake = SimpleNamespace(config=config, dtype_name="float32", spec=SimpleNamespace(quantization=None),
                           hf_config=CONFIG, device=CPU)
    on_cpu = Startup.kv_fingerprint(fake)
    fake.device = torch.device("cuda", 0)
    on_cuda = Startup.kv_fingerprint(fake)
    fake.device = torch.device("cuda", 1)
    assert on_cpu != on_cuda == Startup.kv_fingerprint(fake)  # one generator on every CUDA device



def test_no_disk_tier_no_hashing(tmp_path, monkeypatch):
    make_model(tmp_path, "llama", tokenizer=False)
    monkeypatch.setattr(digest, "hash_file", lambda path: pytest.fail("hashed without a disk tier"))
    LLM(str(tmp_path), dtype="float32", show_progress=False)
    LLM(str(tmp_path), dtype="float32", show_progress=False, num_gpu_blocks_override=8, cpu_kv_gb=gb(8))


def test_a_damaged_digest_cache_is_rebuilt(tmp_path):
    make_model(tmp_path / "model", "llama", tokenizer=False)
    weights = str(tmp_path / "model" / "model.safetensors")
    cache = tmp_path / "digests.json"
    identities = {weights: digest.file_identity(weights)}
    first = digest.weights_digest(identities, cache)
    cache.write_text("{not json")
    assert digest.weights_digest(identities, cache) == first
    cache.write_text(json.dumps([1, 2]))
    assert digest.weights_digest(identities, cache) == first
    assert json.loads(cache.read_text())  # rewritten whole


def test_the_digest_cache_keeps_the_newest_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(digest, "_MAX_CACHED_DIGESTS", 2)
    cache = tmp_path / "digests.json"
    files = []
    for i in range(3):
        files.append(tmp_path / f"w{i}.safetensors")
        save_file({"w": torch.full((4,), float(i))}, files[-1])
        digest.weights_digest({str(files[-1]): digest.file_identity(files[-1])}, cache)
    kept = json.loads(cache.read_text())
    assert list(kept) == [digest.file_identity(f) for f in files[1:]]


@pytest.mark.parametrize("options,flag", [
    (dict(cpu_kv_cache_bytes=GiB), "--cpu-kv-cache-bytes 1073741824"),
    (dict(num_gpu_blocks_override=2**20), "--num-gpu-blocks-override 1048576"),
])
def test_a_cpu_kv_cache_larger_than_the_host_is_refused_in_one_line_naming_its_setting(tmp_path, host_with,
                                                                                      options, flag):
    """A CPU engine's KV cache is host memory. One larger than the host has available was allocated (lazily, so
    the process would be killed once the cache filled), or, past what the kernel grants, failed as out of memory
    with 'use a device with more free memory', which names no setting."""
    make_model(tmp_path)
    host_with(256 << 20)
    with pytest.raises(ValueError) as refused:
        LLM(str(tmp_path), dtype="float32", device="cpu", show_progress=False, **options)
    message = str(refused.value)
    assert "\n" not in message, message
    assert message.startswith(flag) and "more than the 256.00 MiB of host memory available now" in message, message
    assert message.endswith("(or free host memory)") and f"lower {flag.split()[0]}" in message, message
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", show_progress=False, cpu_kv_cache_bytes=64 << 20)
    assert llm.stats()["kv_blocks_total"] > 0


def test_a_cpu_kv_cache_of_less_than_one_block_names_the_cpu_setting(tmp_path):
    make_model(tmp_path)
    with pytest.raises(ValueError, match=r"^no memory is left for the KV cache \(one block needs [\d.]+ KiB\); "
                                         r"raise --cpu-kv-cache-bytes$"):
        LLM(str(tmp_path), dtype="float32", device="cpu", show_progress=False, cpu_kv_cache_bytes=100)


def test_a_cpu_page_pool_larger_than_the_host_is_refused(tmp_path, host_with):
    """Several models on the CPU share one page pool of --cpu-kv-cache-bytes: the same check."""
    make_model(tmp_path / "a")
    make_model(tmp_path / "b", seed=1)
    host_with(256 << 20)
    with pytest.raises(ValueError, match=r"^--cpu-kv-cache-bytes 1073741824 .* more than the 256.00 MiB of host "
                                         r"memory available now; lower --cpu-kv-cache-bytes \(or free host memory\)$"):
        LLM([str(tmp_path / "a"), str(tmp_path / "b")], dtype="float32", device="cpu", show_progress=False,
            cpu_kv_cache_bytes=GiB)


def test_a_cpu_page_pool_of_less_than_one_page_names_the_cpu_setting(tmp_path):
    make_model(tmp_path / "a")
    make_model(tmp_path / "b", seed=1)
    with pytest.raises(ValueError, match=r"^no memory is left for the shared KV pool \(one page needs [\d.]+ KiB\); "
                                         r"raise --cpu-kv-cache-bytes$"):
        LLM([str(tmp_path / "a"), str(tmp_path / "b")], dtype="float32", device="cpu", show_progress=False,
            cpu_kv_cache_bytes=100)


def test_step_buffers_larger_than_the_host_are_refused_naming_max_num_seqs(tmp_path, host_with):
    """--max-num-seqs 99999999 used to end in the allocator's 'can't allocate memory: you tried to allocate
    25599999744 bytes' (the block tables), naming no setting."""
    make_model(tmp_path)
    host_with(256 << 20)
    with pytest.raises(ValueError) as refused:
        LLM(str(tmp_path), dtype="float32", device="cpu", show_progress=False, max_num_seqs=10_000_000,
            cpu_kv_cache_bytes=64 << 20)
    message = str(refused.value)
    assert message.startswith("--max-num-seqs 10000000") and "step buffers" in message, message
    assert message.endswith("lower --max-num-seqs (or free host memory)") and "\n" not in message, message


def test_step_buffers_name_max_num_batched_tokens_when_its_arrays_are_the_larger(tmp_path, host_with):
    make_model(tmp_path)
    host_with(256 << 20)
    with pytest.raises(ValueError, match=r"^--max-num-batched-tokens 100000000 asks for step buffers .*lower "
                                         r"--max-num-batched-tokens \(or free host memory\)$"):
        LLM(str(tmp_path), dtype="float32", device="cpu", show_progress=False, max_num_batched_tokens=10**8,
            cpu_kv_cache_bytes=64 << 20)


def test_a_damaged_digest_cache_is_hashed_again_and_nothing_is_written_through_a_link(tmp_path, two_models):
    """The weights-digest cache is only a cache: nested too deep, a FIFO, or links under its names, it is
    ignored, the weights are hashed again, and the user's file a link points to is left as it was."""
    model, _ = two_models
    cache = digest.digest_cache_file()
    cache.parent.mkdir(parents=True)
    cache.write_text("[" * 100_000 + "]" * 100_000)
    fill_disk_tier(model, tmp_path / "disk")  # raised RecursionError
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for name in (cache.name, cache.name + ".tmp"):
        cache.unlink(missing_ok=True)
        (cache.parent / name).unlink(missing_ok=True)
        (cache.parent / name).symlink_to(notes)
        fill_disk_tier(model, tmp_path / f"disk-{name}")
        assert notes.read_text() == "mine" and not notes.is_symlink()
    for name in os.listdir(cache.parent):
        (cache.parent / name).unlink()
    os.mkfifo(cache)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (fill_disk_tier(model, tmp_path / "disk-fifo"), done.set()), daemon=True)
    worker.start()
    worker.join(60)
    if not done.is_set():
        os.close(os.open(cache, os.O_WRONLY | os.O_NONBLOCK))  # let a reader stuck in open() return
    assert done.is_set()


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "model.safetensors"])
def test_a_fifo_in_place_of_a_tokenizer_or_weights_file_is_one_line_not_a_hang(tmp_path, name):
    """config.json as a FIFO was refused; the tokenizer's files and the weights were opened and waited on."""
    make_model(tmp_path, "llama")
    (tmp_path / name).unlink()
    os.mkfifo(tmp_path / name)
    outcome = {}

    def start():
        try:
            LLM(str(tmp_path), dtype="float32", show_progress=False)
        except ValueError as error:
            outcome["error"] = str(error)

    worker = threading.Thread(target=start, daemon=True)
    worker.start()
    worker.join(60)
    if worker.is_alive():
        os.close(os.open(tmp_path / name, os.O_WRONLY | os.O_NONBLOCK))  # let a reader stuck in open() return
    assert f"{name}: is not a regular file" in outcome.get("error", ""), outcome


# ----------------------------------------------------------------- fields config.json leaves out
def test_each_architectures_defaults_are_transformers_own():
    """A field config.json leaves out takes what transformers' config class of that architecture takes: one
    default for all gave a Mixtral without rope_theta 10,000 where transformers uses 1e6 (other tokens)."""
    import transformers

    from mempath.model.spec import ARCH_DEFAULTS, SUPPORTED_ARCHITECTURES
    assert set(ARCH_DEFAULTS) == set(SUPPORTED_ARCHITECTURES)
    for arch, defaults in ARCH_DEFAULTS.items():
        config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(num_attention_heads=12, hidden_size=96)
        theirs = {"rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_parameters["rope_theta"],
                  "max_position_embeddings": config.max_position_embeddings,
                  "num_key_value_heads": None if config.num_key_value_heads == 12 else config.num_key_value_heads,
                  "sliding_window": getattr(config, "sliding_window", None)}
        assert defaults == theirs, arch


@pytest.mark.parametrize("arch, left_out, field, value", [
    ("mixtral", "rope_theta", "rope_theta", 1e6),
    ("mixtral", "rms_norm_eps", "rms_norm_eps", 1e-5),
    ("phi3", "rms_norm_eps", "rms_norm_eps", 1e-5),
    ("mistral", "sliding_window", "sliding_window", 4096),
])
def test_a_field_left_out_takes_the_architectures_default(tmp_path, arch, left_out, field, value):
    from mempath.model.spec import ModelSpec
    make_model(tmp_path, arch, tokenizer=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop(left_out, None)
    if left_out == "rope_theta":
        config.pop("rope_parameters", None)
    assert getattr(ModelSpec.from_hf_config(config), field) == value
    if left_out == "sliding_window":
        config["sliding_window"] = None  # null is no window, as in transformers
        assert ModelSpec.from_hf_config(config).sliding_window is None


def test_a_tied_model_whose_checkpoint_holds_another_lm_head_is_refused(tmp_path):
    """tie_word_embeddings true and an lm_head.weight unlike the embedding: the tensor was dropped without a word
    (the embedding served as the head), where transformers unties them: other tokens from the first one."""
    from safetensors.torch import load_file, save_file
    make_model(tmp_path, tie_word_embeddings=True, tokenizer=False)
    tensors = load_file(tmp_path / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embedding.clone()}, tmp_path / "model.safetensors")
    load_model(tmp_path, torch.float32, CPU, show_progress=False)  # the same tensor twice: tied as written
    save_file({**tensors, "lm_head.weight": embedding + 0.5}, tmp_path / "model.safetensors")
    message = refusal(lambda: load_model(tmp_path, torch.float32, CPU, show_progress=False))
    assert message.startswith(str(tmp_path / "model.safetensors") + ": holds an lm_head.weight that differs")
    assert 'set "tie_word_embeddings": false in config.json' in message
