"""Streaming loader: sharded checkpoints, clear errors, bounded host memory."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from mempath import LLM, SamplingParams
from mempath.model.loader import load_model
from tests.conftest import hf_greedy, make_model


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    hf = make_model(tmp_path, "qwen2", shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    llm = LLM(str(tmp_path), dtype="float32", show_progress=False)
    out = llm.generate([5, 6, 7, 8], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, [5, 6, 7, 8], 16)


def test_missing_shard_is_named(tmp_path):
    make_model(tmp_path, "llama", shard_size="100KB", tokenizer=False)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    os.remove(tmp_path / shard)
    with pytest.raises(ValueError, match=shard):
        load_model(tmp_path, torch.float32, torch.device("cpu"), show_progress=False)


def test_no_weights_file(tmp_path):
    make_model(tmp_path, "llama", tokenizer=False)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), show_progress=False)


def test_wrong_shape_names_tensor_and_file(tmp_path):
    make_model(tmp_path, "llama", tokenizer=False)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.safetensors.*down_proj.*\(64, 127\).*\(64, 128\)"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), show_progress=False)


def test_missing_tensor_is_named(tmp_path):
    make_model(tmp_path, "phi3", tokenizer=False)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.mlp.gate_up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="gate_up_proj"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), show_progress=False)


def test_dtype_conversion_on_load(tmp_path):
    make_model(tmp_path, "llama", tokenizer=False)
    model, _, report = load_model(tmp_path, torch.bfloat16, torch.device("cpu"), show_progress=False)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert report.weight_bytes == sum(p.numel() * 2 for p in model.parameters())


def test_host_memory_peak_is_one_tensor_not_the_state_dict(tmp_path):
    """Peak extra anonymous host memory while loading stays near the weights themselves.

    On the CPU the parameters live in host memory, so the floor is their size; a
    loader that materialises the whole state dict first would need twice that.
    """
    make_model(tmp_path, "llama", tokenizer=False, hidden_size=512, intermediate_size=2048,
               num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, vocab_size=4096)
    weights = os.path.getsize(tmp_path / "model.safetensors")
    warmup = tmp_path / "warmup"
    make_model(warmup, "llama", tokenizer=False)
    script = textwrap.dedent(f"""
        import json, threading, time, torch
        from mempath.model.loader import load_model
        def anon():
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        # One small load first: torch's one-time set-up (meta-device dispatch, ~80 MB of
        # Python and library state) is not part of what a load of this model costs.
        load_model({str(warmup)!r}, torch.float32, torch.device("cpu"), show_progress=False)
        base = anon(); peak = [base]; done = []
        def watch():
            while not done:
                peak[0] = max(peak[0], anon()); time.sleep(0.0005)
        t = threading.Thread(target=watch); t.start()
        model, _, report = load_model({str(tmp_path)!r}, torch.float32, torch.device("cpu"), show_progress=False)
        done.append(1); t.join()
        print(json.dumps({{"peak_extra": peak[0] - base, "weight_bytes": report.weight_bytes}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    largest_tensor = 4096 * 512 * 4
    print(f"weights {weights / 2**20:.1f} MiB, peak extra host {figures['peak_extra'] / 2**20:.1f} MiB")
    assert figures["weight_bytes"] == pytest.approx(weights, rel=0.01)
    assert figures["peak_extra"] < figures["weight_bytes"] + 2 * largest_tensor + (8 << 20)
