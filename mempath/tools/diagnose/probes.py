"""The workloads diagnose runs and the device-level figures it reads: the probe forward stage by
stage, KV growth while generating, the leak check, training (--train), fragmentation, memory
outside PyTorch, host<->device bandwidth and the PCIe link."""
from __future__ import annotations

import gc
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import torch

from mempath.memory.ledger import format_bytes
from mempath.tools.diagnose.meters import CpuMeter, Recorder, read_host_memory


MiB = 1 << 20


# ---------------------------------------------------------------- probe workload

def _probe_batch(engine, num_tokens: int, num_seqs: int):
    """The engine's probe prefill (its profile step's sampling settings), on random tokens."""
    generator = torch.Generator().manual_seed(0)
    return engine.probes.batch(num_tokens, num_seqs, lambda n: torch.randint(
        0, engine.spec.vocab_size, (n,), generator=generator).tolist())


def probe_capacity(engine) -> int:
    """Tokens the probe may lay on the KV pool (one block of slack per sequence)."""
    return max(1, (engine.kv.num_blocks - 8) * engine.config.block_size)


def measure_forward(engine, recorder: Recorder, num_tokens: int, num_seqs: int) -> dict:
    """Embedding, one decoder layer, the whole forward and the logits, stage by stage."""
    engine.kv.pool.reset_prefix_cache()  # the probe overwrites blocks: none may stay findable
    batch = _probe_batch(engine, num_tokens, num_seqs)
    runner, model = engine.runner, engine.model
    with torch.inference_mode():
        input_ids, positions, meta, rows = runner.prepare(batch, {id(r) for r in batch.requests})
        with recorder.stage("embedding forward", "embedding"):
            hidden = model.model.embed_tokens(input_ids)
        embed = recorder.last("embedding forward")
        with recorder.stage("decoder layer 0", "activation_peak"):
            layer_out = model.model.layers[0](positions, hidden, None, meta)
        layer = recorder.last("decoder layer 0")
        del hidden, layer_out
        with recorder.stage("decoder forward", "activation_peak"):
            hidden = model(input_ids, positions, meta)
        with recorder.stage("logits + sampler", "logits"):
            logits = model.compute_logits(hidden[rows])
            runner.sampler(logits, [r.params for r in batch.requests], [None] * len(batch.requests))
            del logits
        del hidden
    forward = recorder.last("decoder forward")
    return {
        "tokens": num_tokens, "sequences": num_seqs,
        "embedding": embed.delta,
        # Relative to before the embedding, so the residual stream is counted as the plan does.
        "layer_peak": layer.peak - embed.allocated_start,
        "forward_peak": forward.peak_delta,
        "logits_peak": recorder.last("logits + sampler").peak_delta,
    }


def measure_kv_growth(engine, recorder: Recorder, plan, num_requests: int, prompt_len: int,
                      max_tokens: int) -> list[dict]:
    """Blocks in use after every step of a generation, against the count the tokens need."""
    from mempath.sampling import SamplingParams
    bytes_per_block = engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size() \
        // engine.kv.num_blocks
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):  # distinct prompts: no prefix sharing to blur the count
        ids = torch.randint(0, engine.spec.vocab_size, (prompt_len,), generator=generator).tolist()
        engine.add_request(ids, params, f"diagnose-growth-{i}")
    steps = []
    with recorder.stage("kv growth (generation)", "kv_cache"):
        while engine.has_unfinished_requests():
            engine.step()
            live = [r for r in engine.outputs.requests.values() if r.block_table]
            blocks_needed = sum(engine.kv.blocks_for(r.num_computed_tokens) for r in live)
            steps.append({
                "step": len(steps) + 1,
                "tokens": sum(r.num_computed_tokens for r in live),
                "predicted_bytes": blocks_needed * plan.kv_bytes_per_block,
                "measured_bytes": engine.stats()["kv_blocks_used"] * bytes_per_block,
                "allocated_bytes": recorder.meter.allocated(),
            })
    return steps


def measure_leak(engine, recorder: Recorder, num_requests: int, prompt_len: int) -> dict:
    """Run identical requests one at a time; allocated bytes must not grow per request."""
    from mempath.sampling import SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, prompt_len + 1))
    prompt = [t % engine.spec.vocab_size for t in prompt]
    after, host_after = [], []
    with recorder.stage("leak check", "leak"):
        for i in range(num_requests):
            engine.add_request(prompt, params, f"diagnose-leak-{i}")
            while engine.has_unfinished_requests():
                engine.step()
            recorder.meter.sync()
            after.append(recorder.meter.allocated())
            host_after.append(read_host_memory()["rss_anon"])
    # The first request warms lazily built state (kernels, workspaces); fit from the second.
    fit = after[1:] if len(after) > 2 else after
    slope = _slope(fit)
    blocks_used = engine.stats()["kv_blocks_used"]
    growth = fit[-1] - fit[0]
    return {
        "requests": num_requests,
        "allocated_after_each": after,
        "slope_bytes_per_request": slope,
        "growth_bytes": growth,
        "host_rss_anon_after_each": host_after,
        "host_slope_bytes_per_request": _slope(host_after[1:] if len(host_after) > 2 else host_after),
        "kv_blocks_used_after": blocks_used,
        "source": recorder.meter.source + "; host: RssAnon (noisy: allocator caches)",
        "verdict": ("leak: allocated bytes grow by %s per request" % format_bytes(slope)
                    if growth > 0 and slope > 0 else "no leak: allocated bytes are flat after warm-up")
                   + ("" if blocks_used == 0 else f"; {blocks_used} KV blocks still in use"),
        "ok": growth <= 0 and blocks_used == 0,
    }


def _slope(values: list[int]) -> float:
    """Least-squares slope of values against their index."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


# ---------------------------------------------------------------- training

def measure_training(model_dir: str, recorder: Recorder, device: torch.device, seq_len: int) -> dict:
    """One forward+backward+AdamW step of the transformers model, in float32.

    float32 weights, grads and moments are the planner's `adamw-fp32` setting, so every
    figure has an exact prediction to meet.
    """
    from transformers import AutoModelForCausalLM
    loader = recorder.meter.paused() if isinstance(recorder.meter, CpuMeter) else _nothing()
    with recorder.stage("train: load", "train_weights"):
        with loader:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in params}.values())
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=generator).to(device)
    # The outputs (their logits) are held through the backward, as a training loop holds them: the plan's
    # train_logits_bytes counts them beside the loss's log-softmax, which autograd keeps.
    with recorder.stage("train: forward", "train_activations"):
        outputs = model(input_ids=input_ids, labels=input_ids)
    forward = recorder.last("train: forward")
    with recorder.stage("train: backward", "gradients"):
        outputs.loss.backward()
        del outputs
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    optimizer = torch.optim.AdamW(params, lr=1e-5, foreach=False)
    with recorder.stage("train: optimizer step", "optimizer_state"):
        optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                for t in s.values() if isinstance(t, torch.Tensor))
    backward, step = recorder.last("train: backward"), recorder.last("train: optimizer step")
    result = {
        "seq_len": seq_len,
        "weights_tensor_bytes": weights,
        "activations": forward.delta,  # what the forward kept alive for the backward
        "forward_peak": forward.peak_delta,
        # After backward the saved activations are gone: what stays, relative to before the
        # forward, is the gradients.
        "gradients": backward.allocated_end - forward.allocated_start,
        "gradients_tensor_bytes": grads,
        "backward_peak": backward.peak - forward.allocated_start,
        "optimizer_state": step.delta,
        "optimizer_state_tensor_bytes": state,
    }
    del optimizer, model, params, input_ids
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


@contextmanager
def _nothing():
    yield


# ---------------------------------------------------------------- device-level figures

def measure_fragmentation(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"available": False, "reason": "n/a: no CUDA (the CPU allocator keeps no such counters)"}
    stats = torch.cuda.memory_stats(device)
    reserved = stats.get("reserved_bytes.all.current", 0)
    allocated = stats.get("allocated_bytes.all.current", 0)
    return {
        "available": True,
        "source": "torch.cuda.memory_stats",
        "reserved_bytes": reserved,
        "allocated_bytes": allocated,
        "reserved_minus_allocated": reserved - allocated,
        "inactive_split_bytes": stats.get("inactive_split_bytes.all.current", 0),
        "num_alloc_retries": stats.get("num_alloc_retries", 0),
        "num_ooms": stats.get("num_ooms", 0),
        "num_device_alloc": stats.get("num_device_alloc", 0),
        "num_device_free": stats.get("num_device_free", 0),
    }


def measure_outside_torch(device: torch.device, meter) -> dict:
    host = read_host_memory()
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        return {
            "available": True,
            "source": "derived: device used (cudaMemGetInfo) - torch reserved",
            "device_total": total, "device_used": total - free, "torch_reserved": reserved,
            "outside_torch": total - free - reserved,
            "note": "CUDA context, cuBLAS/NCCL workspaces, and other processes on the device",
        }
    return {
        "available": True,
        "source": "derived: process RssAnon - live tensor bytes created during this run",
        "host_rss_anon": host["rss_anon"], "tensor_bytes": meter.allocated(),
        "outside_torch": host["rss_anon"] - meter.allocated(),
        "note": "interpreter, libraries, allocator caches and tensors made before the run; "
                "untouched tensor pages are counted as tensor bytes but not as RSS",
    }


def measure_bandwidth(device: torch.device, nbytes: int = 256 * MiB, repeats: int = 5) -> dict:
    """Best-of-N host<->device copy rate, pinned and pageable, in GB/s (1e9 B/s)."""
    if device.type != "cuda":
        return {"available": False, "reason": "n/a: no CUDA"}
    result = {"available": True, "bytes": nbytes, "repeats": repeats,
              "source": "measured: CUDA events around one copy, best of the repeats"}
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for pinned in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)  # touch every page so the copy does not pay for page faults
        kind = "pinned" if pinned else "pageable"
        result[f"h2d_{kind}_gbps"] = _copy_rate(lambda: device_buffer.copy_(host, non_blocking=pinned),
                                                nbytes, repeats, device)
        result[f"d2h_{kind}_gbps"] = _copy_rate(lambda: host.copy_(device_buffer, non_blocking=pinned),
                                                nbytes, repeats, device)
        del host
    del device_buffer
    torch.cuda.empty_cache()
    return result


def _copy_rate(copy, nbytes: int, repeats: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        copy()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return round(nbytes / best / 1e9, 2)


def read_pcie_link(device: torch.device) -> dict:
    """Current and maximum PCIe link width and speed, from sysfs or nvidia-smi."""
    if device.type != "cuda":
        return {"available": False, "reason": "n/a: no CUDA"}
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    address = None
    if hasattr(props, "pci_bus_id"):
        address = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        sysfs = Path("/sys/bus/pci/devices") / address
        names = ("current_link_width", "current_link_speed", "max_link_width", "max_link_speed")
        if all((sysfs / n).exists() for n in names):
            link = {n: (sysfs / n).read_text().strip() for n in names}
            return {"available": True, "source": f"sysfs {sysfs}", "pci_address": address, **link}
    if shutil.which("nvidia-smi"):
        query = "pcie.link.width.current,pcie.link.gen.current,pcie.link.width.max,pcie.link.gen.max"
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader",
                                  "-i", str(index)], capture_output=True, text=True, timeout=20)
            width, gen, max_width, max_gen = [v.strip() for v in out.stdout.strip().split(",")]
            return {"available": True, "source": "nvidia-smi", "pci_address": address,
                    "current_link_width": width, "current_link_gen": gen,
                    "max_link_width": max_width, "max_link_gen": max_gen}
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
    return {"available": False, "reason": "the system exposes no PCIe link information",
            "pci_address": address}

