"""`mempath diagnose` end to end on the CPU, and the out-of-memory explanations."""
import json
import os
import re
from pathlib import Path

import pytest
import torch

from mempath.config import EngineConfig
from mempath.memory.ledger import Ledger
from mempath.memory.oom import (MempathOutOfMemoryError, explain_oom, oom_guard,
                                parse_oom_message)
from mempath.tools.diagnose.meters import TensorBytesTracker
from mempath.tools.diagnose.report import format_table
from mempath.tools.diagnose.run import diagnose
from mempath.tools.plan import plan_memory

CONFIGS = Path(__file__).parent / "data" / "configs"
GiB = 1 << 30


PROGRESS: list[str] = []


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    pytest.importorskip("matplotlib", reason="the HTML report plots with matplotlib (a dependency)")
    from tests.conftest import make_model
    model_dir = tmp_path_factory.mktemp("diag-model")
    make_model(model_dir, "qwen3")  # tied embeddings and q/k norms: the awkward weight groups
    out = tmp_path_factory.mktemp("diag-out")
    torch.set_num_threads(2)
    return diagnose(str(model_dir), device="cpu", train=True, probe_tokens=64, probe_seqs=4,
                    leak_requests=4, out_dir=out, cpu_kv_cache_bytes=4 << 20, max_model_len=256,
                    progress=PROGRESS.append)


def test_json_has_every_pathway_with_predicted_measured_error(report):
    data = json.loads(Path(report["files"]["json"]).read_text())
    rows = {r["pathway"]: r for r in data["pathways"]}
    for name in ("weights", "weights.embedding", "weights.attention", "weights.mlp", "weights.norms",
                 "kv_cache", "embedding (forward output)", "decoder layer peak", "decoder forward peak",
                 "logits", "kv growth (peak during generation)", "train.gradients",
                 "train.optimizer_state", "train.activations"):
        row = rows[name]
        assert row["predicted"] is not None and row["measured"] is not None, name
        assert row["predicted_source"] and row["measured_source"], name
        assert row["error_pct"] is not None, name
    # What is sized by a formula over tensor shapes must match exactly.
    for exact in ("weights", "weights.attention", "weights.mlp", "weights.norms", "kv_cache",
                  "embedding (forward output)", "kv growth (peak during generation)",
                  "train.gradients", "train.optimizer_state"):
        assert rows[exact]["error_pct"] == 0.0, (exact, rows[exact])
    assert rows["weights.lm_head"]["predicted"] == 0  # tied: shares the embedding
    # Activations are an estimate, and never above what was measured: the planner counts tensors
    # the forward must hold, and the CPU reference attention (not flash-style) adds per-sequence
    # K/V copies and scores. On this attention-heavy shape (q heads twice the hidden size) that
    # reads +14% in a layer and +29% over the forward; the fused-kernel formula, which is not the
    # CPU's path, would read +33% and +50%.
    assert 0 <= rows["decoder layer peak"]["error_pct"] < 20, rows["decoder layer peak"]
    assert 0 <= rows["decoder forward peak"]["error_pct"] < 40, rows["decoder forward peak"]
    assert abs(rows["logits"]["error_pct"]) < 5, rows["logits"]


def test_every_device_pathway_of_the_engine_ledger_is_a_row(report):
    data = json.loads(Path(report["files"]["json"]).read_text())
    rows = {r["pathway"] for r in data["pathways"]}
    device_pathways = [name for name, entry in data["ledger"].items() if entry["device"] == "cpu"]
    assert device_pathways and not [name for name in device_pathways if name not in rows]


def test_json_side_figures(report):
    assert report["leak"]["kv_blocks_used_after"] == 0
    assert report["leak"]["ok"], report["leak"]
    assert report["bandwidth"]["reason"].startswith("n/a: no CUDA")
    assert report["pcie"]["reason"].startswith("n/a: no CUDA")
    assert report["host"]["load_rss_anon_peak"] >= report["host"]["load_rss_anon_start"] > 0
    growth = report["kv_growth"]
    assert len(growth) > 2 and all(s["predicted_bytes"] == s["measured_bytes"] for s in growth)
    stages = {s["stage"] for s in (dict(zip(report["timeline"]["columns"], x))
                                   for x in report["timeline"]["samples"])}
    assert {"load weights", "decoder forward", "kv growth (generation)"} <= stages


def chart_texts(html_text: str, chart: str) -> list[str]:
    """The text elements (ticks, axis labels, legend) of one chart of the report."""
    figure = re.search(rf'<figure class="chart" id="{chart}">(.*?)</figure>', html_text, re.S)
    assert figure, chart
    return [t.strip() for t in re.findall(r"<text[^>]*>([^<]+)</text>", figure.group(1))]


def test_html_has_the_plots(report):
    text = Path(report["files"]["html"]).read_text()
    assert text.startswith("<!doctype html>")
    assert "<script" not in text and not re.search(r"(src|href)=\"https?:", text)  # nothing fetched
    assert "decoder forward peak" in text


@pytest.mark.parametrize("chart, axis_labels", [
    ("pathways", ["bytes (log scale", "error (% of predicted"]),
    ("timeline", ["time (s)", "live tensor bytes ("]),
    ("kv-growth", ["engine step", "KV cache in use ("]),
    ("leak", ["request", "allocated − request 2 ("]),
])
def test_each_chart_has_one_scale_with_ticks_and_units(report, chart, axis_labels):
    texts = chart_texts(Path(report["files"]["html"]).read_text(), chart)
    for label in axis_labels:
        assert any(label in t for t in texts), (label, texts)
    numbers = [t for t in texts if re.fullmatch(r"[\u2212-]?[0-9.]+( ?[KMGT]?i?B)?", t)]
    assert len(numbers) >= 4, texts  # ticks on both axes


def test_leak_chart_is_scaled_to_the_change_after_warm_up():
    """A 4 KiB-per-request leak on 1 GiB must not be drawn as a flat line at 1 GiB."""
    from mempath.tools.diagnose.report import leak_svg
    base = 1 << 30
    leak = {"allocated_after_each": [base - (5 << 20), base, base + 4096, base + 8192, base + 12288],
            "slope_bytes_per_request": 4096.0, "verdict": "leak"}
    texts = [t.strip() for t in re.findall(r"<text[^>]*>([^<]+)</text>", leak_svg(leak))]
    assert any("KiB" in t and "allocated" in t for t in texts), texts
    assert not any("GiB" in t for t in texts), texts
    assert any("warm-up" in t for t in texts), texts  # request 1, off the scale, is labelled


def test_negative_figures_are_explained(report):
    from mempath.tools.diagnose.report import summary_lines
    negative = {**report, "outside_torch": {**report["outside_torch"], "outside_torch": -707 << 20}}
    line = next(line for line in summary_lines(negative) if line.startswith("outside PyTorch"))
    assert "-707.00 MiB" in line and "negative" in line and "not resident" in line, line
    rows = {r["pathway"]: r for r in report["pathways"]}
    assert "estimate" in rows["train.activations"]["detail"], rows["train.activations"]
    text = Path(report["files"]["html"]).read_text()
    assert "negative: less was measured than planned" in text
    assert "negative: the stage freed more than it kept" in text


def test_progress_is_reported_stage_by_stage(report):
    stages = [s["name"] for s in report["stages"]]
    for name in stages:
        assert any(name in line for line in PROGRESS), (name, PROGRESS)
    order = [next(i for i, line in enumerate(PROGRESS) if name in line) for name in stages]
    assert order == sorted(order)


def test_the_command_prints_progress_to_stderr(report, capsys, monkeypatch):
    """`mempath diagnose` hands diagnose() a progress printer (the run itself is the fixture's)."""
    import mempath.tools.diagnose.run as diagnose_module
    from mempath.cli import main

    def replay(model_dir, progress=None, **kwargs):
        for line in PROGRESS:
            progress(line)
        return report

    monkeypatch.setattr(diagnose_module, "diagnose", replay)
    assert main(["diagnose", "some-model", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    for stage in ("load weights", "decoder forward", "kv growth (generation)", "leak check"):
        assert re.search(rf"^mempath diagnose: +[0-9.]+ s +{re.escape(stage)}$", captured.err, re.M), captured.err
    assert not re.search(r"^mempath diagnose: +[0-9.]+ s ", captured.out, re.M)  # stdout: the table only


def test_without_matplotlib_diagnose_says_how_to_get_it_before_measuring(tmp_path, monkeypatch, model_factory):
    import sys
    path, _ = model_factory("llama")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ValueError, match="pip install matplotlib"):
        diagnose(path, device="cpu", out_dir=tmp_path / "r", cpu_kv_cache_bytes=1 << 20, max_model_len=128)
    assert not (tmp_path / "r").exists()


def test_terminal_table(report):
    table = format_table(report)
    assert re.search(r"^weights\s+\S+ KiB\s+\S+ KiB\s+\+0\.0%", table, re.MULTILINE)
    assert "leak check" in table and "n/a: no CUDA" in table


def test_tracker_counts_allocations_not_views():
    tracker = TensorBytesTracker()
    weight = torch.randn(64, 64)
    with tracker:
        a = torch.empty(1000)
        assert tracker.live == 4000
        view = a.view(10, 100).t()
        assert tracker.live == 4000
        product = weight @ weight
        assert tracker.live == 4000 + 64 * 64 * 4
        del a, view, product
        assert tracker.live == 0
    assert tracker.peak == 4000 + 64 * 64 * 4


# ---------------------------------------------------------------- OOM explanations

def _config(**kw):
    return EngineConfig(model=str(CONFIGS / "llama-3.1-8b.json"), **kw)


def test_parse_oom_messages():
    cuda = ("CUDA out of memory. Tried to allocate 3.10 GiB. GPU 0 has a total capacity of "
            "139.80 GiB of which 1.20 GiB is free.")
    assert parse_oom_message(cuda) == (int(3.10 * GiB), int(1.20 * GiB))
    cpu = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes."
    assert parse_oom_message(cpu) == (4096, None)


def test_kv_oom_names_pathway_and_fix():
    config = _config(max_num_seqs=64, max_model_len=8192)
    ledger = Ledger()
    ledger.record("weights", 16_060_522_496, "cuda", "measured")
    message = ("CUDA out of memory. Tried to allocate 3.10 GiB. GPU 0 has a total capacity of "
               "139.80 GiB of which 1.20 GiB is free.")
    with pytest.raises(MempathOutOfMemoryError) as caught:
        with oom_guard("kv_allocation", ledger, config, dtype="bfloat16"):
            raise torch.OutOfMemoryError(message)
    error = caught.value
    text = str(error)
    assert error.pathway == "kv_cache" and error.stage == "kv_allocation"
    assert "kv_cache pathway exceeded its budget" in text
    assert "weights" in text and "16,060,522,496" in text  # the ledger table
    # 1.2 GiB free / 2 MiB blocks = 614 blocks; 8192 tokens = 512 blocks per sequence.
    assert "--num-gpu-blocks-override 614" in text
    assert "max-num-seqs 64 at max-model-len 8192 needs 64.00 GiB of KV" in text
    assert "--max-num-seqs 1" in text
    assert isinstance(error.__cause__, torch.OutOfMemoryError)


def test_weights_too_big_for_the_budget():
    config = _config()
    # The planner says the fp32 weights alone exceed a 24 GB device ...
    plan = plan_memory(config.model, dtype="float32", gpu_mem_bytes=24 * 10**9)
    assert plan.weight_bytes > plan.budget_bytes
    assert any("does not fit: weights alone" in line for line in plan.advice)
    # ... and an OOM while loading says which pathway and what would fit.
    text = explain_oom("load", Ledger(), 1 << 30, 20 * GiB, config, dtype="float32")
    assert "weights pathway exceeded its budget" in text
    assert "--dtype bfloat16: weights need 14.96 GiB instead of 29.92 GiB" in text


def test_step_oom_gives_a_smaller_batch():
    config = _config(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=8192)
    text = explain_oom("step", Ledger(), 2 * GiB, 1 * GiB, config, dtype="bfloat16")
    assert "activations pathway exceeded its budget" in text
    tokens = int(re.search(r"--max-num-batched-tokens (\d+)", text).group(1))
    plan = plan_memory(config.model, dtype="bfloat16", max_model_len=8192, max_num_batched_tokens=tokens,
                       max_num_seqs=256)
    assert 0 < tokens < 8192
    assert plan.activation_peak_bytes + plan.logits_bytes <= GiB  # the advice really fits


def test_real_cpu_allocation_failure_is_explained():
    config = EngineConfig(model=str(CONFIGS / "qwen3-0.6b.json"), device="cpu")
    with pytest.raises(MempathOutOfMemoryError) as caught:
        with oom_guard("profile", Ledger(), config):
            torch.empty(1 << 50, dtype=torch.uint8)  # far beyond any host: a budget too small
    assert caught.value.requested_bytes == 1 << 50
    assert "activation_peak pathway exceeded its budget" in str(caught.value)


def test_other_errors_pass_through():
    with pytest.raises(ValueError):
        with oom_guard("load", Ledger(), _config()):
            raise ValueError("not memory")


def test_activation_peak_prediction_on_the_cpu_path(tmp_path):
    """The planner's PyTorch-path formula against the measured forward (the issue's target
    is 10%), on a model with real proportions (MLP 3.5x the hidden size, as Llama-3.1-8B)
    where the MLP phase sets the peak, as it does in real models."""
    from tests.conftest import make_model
    make_model(tmp_path / "m", "llama", tokenizer=False, hidden_size=128, intermediate_size=448,
               num_attention_heads=4, num_key_value_heads=2)
    result = diagnose(str(tmp_path / "m"), device="cpu", probe_tokens=512, probe_seqs=4, leak_requests=2,
                      out_dir=tmp_path / "out", cpu_kv_cache_bytes=8 << 20, max_model_len=256)
    rows = {r["pathway"]: r for r in json.loads(Path(result["files"]["json"]).read_text())["pathways"]}
    errors = {k: rows[k]["error_pct"] for k in ("decoder layer peak", "decoder forward peak")}
    print(errors)
    assert abs(errors["decoder forward peak"]) <= 10
    assert abs(errors["decoder layer peak"]) <= 10


def test_float32_training_activations_are_planned_in_float32(model_factory):
    """--train measures a float32 model against the adamw-fp32 plan, which counted 16-bit activations and logits:
    train.activations read +126% on a wide model, where the s·b·h terms dominate."""
    from types import SimpleNamespace
    from mempath.tools.diagnose.meters import CpuMeter, Recorder
    from mempath.tools.diagnose.run import _measure_training
    path, _ = model_factory("llama", hidden_size=512, intermediate_size=1408, num_attention_heads=4,
                            num_key_value_heads=4)
    torch.set_num_threads(2)
    recorder = Recorder(CpuMeter())
    measured = {"plan": SimpleNamespace(max_model_len=128), "rows": []}
    with recorder.meter.active():
        _measure_training(measured, path, recorder, torch.device("cpu"), probe_tokens=128)
    rows = {r.pathway: r for r in measured["rows"]}
    activations = rows["train.activations"]
    plan = plan_memory(path, dtype="float32", train=True, optimizer="adamw-fp32", seq_len=128)
    assert plan.activation_dtype_bytes == 4
    assert activations.predicted == plan.train_activation_bytes + plan.train_logits_bytes
    # The plan is Korthikanti's estimate for a GPT layer, not this model's saved tensors; in float32 on both
    # sides it lands within a third (about +20% here), where 16-bit bytes gave +126%.
    assert abs(activations.error_pct) <= 33, activations
    assert "4-byte" in activations.predicted_source and "16-bit" not in activations.detail, activations
    # The logits the forward returns are held, as a training loop's outputs are, and gone after the backward:
    # the gradients row still matches the .grad tensors.
    assert rows["train.gradients"].error_pct == 0.0, rows["train.gradients"]


@pytest.mark.parametrize("name,content", [("diagnose.json", '{"mine": 1}\n'), ("diagnose.html", "<p>my notes</p>"),
                                          ("diagnose.json", '"my notes, not mempath_diagnose output"\n'),
                                          ("diagnose.json", '["mempath_diagnose"]\n')])
def test_a_file_no_diagnose_wrote_is_never_overwritten(name, content, tmp_path, model_factory, capsys):
    """--out into a folder holding the user's own diagnose.json (or .html): one line naming the
    file and the fix, before anything loads; the file stays."""
    from mempath.cli import main
    path, _ = model_factory("llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text(content)
    assert main(["diagnose", path, "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"mempath diagnose: error: --out {out}: {name} is there and is not a mempath diagnose "
                       f"report; give another --out folder, or move the file")
    assert (out / name).read_text() == content and sorted(p.name for p in out.iterdir()) == [name]


def test_an_out_that_is_a_file_is_refused_in_one_line_and_kept(tmp_path, model_factory, capsys):
    """--out names a folder: a file there is refused before anything loads, and stays as it was."""
    from mempath.cli import main
    path, _ = model_factory("llama")
    out = tmp_path / "notes.txt"
    out.write_text("precious\n")
    assert main(["diagnose", path, "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"mempath diagnose: error: --out {out} is a file, not a folder; "
                       "give a folder for the report (it is made if missing)")
    assert out.read_text() == "precious\n"


def test_a_report_replaces_an_earlier_report(report, tmp_path):
    """The folder of an earlier run is reused: its files are a report's, so they are replaced."""
    from mempath.tools.diagnose.report import refuse_foreign_outputs
    out = Path(report["files"]["json"]).parent
    refuse_foreign_outputs(out, snapshot=True)  # no error: the earlier report's JSON and HTML
    (out / "memory_snapshot.pickle").write_bytes(b"\x80")  # beside a report: one of a run's files
    refuse_foreign_outputs(out, snapshot=True)
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "memory_snapshot.pickle").write_bytes(b"mine")  # no report beside it: not ours
    refuse_foreign_outputs(alone)  # a run without --snapshot does not write it
    with pytest.raises(ValueError, match=r"memory_snapshot.pickle is there and is not a mempath diagnose report"):
        refuse_foreign_outputs(alone, snapshot=True)


@pytest.mark.parametrize("flag,value,says", [
    ("--leak-requests", "0", "--leak-requests 0 must be an integer of at least 2"),
    ("--leak-requests", "1", "--leak-requests 1 must be an integer of at least 2"),
    ("--probe-tokens", "-5", "--probe-tokens -5 must be an integer of at least 1"),
    ("--probe-seqs", "0", "--probe-seqs 0 must be an integer of at least 1")])
def test_probe_counts_out_of_range_are_refused_before_measuring(flag, value, says, tmp_path, model_factory, capsys,
                                                                monkeypatch):
    """--leak-requests 0 crashed with an IndexError after the whole run; --probe-tokens -5 was run as 1."""
    from mempath.cli import main
    from mempath.engine import startup
    path, _ = model_factory("llama")
    monkeypatch.setattr(startup, "load_model", lambda *a, **k: pytest.fail("measuring started"))
    capsys.readouterr()
    assert main(["diagnose", path, "--device", "cpu", flag, value, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mempath diagnose: error: {says}"), err


@pytest.mark.parametrize("where", ["under a file", "not writable", "a dangling link"])
def test_an_out_folder_that_cannot_be_made_is_refused_before_measuring(where, tmp_path, model_factory, capsys,
                                                                       monkeypatch):
    """It was made only after the whole run, which then ended in a traceback."""
    from mempath.cli import main
    from mempath.engine import startup
    path, _ = model_factory("llama")
    monkeypatch.setattr(startup, "load_model", lambda *a, **k: pytest.fail("measuring started"))
    (tmp_path / "notes.txt").write_text("mine")
    if where == "under a file":
        out = tmp_path / "notes.txt" / "report"
    elif where == "a dangling link":
        out = tmp_path / "link" / "report"
        (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    else:
        out = tmp_path / "ro" / "report"
        (tmp_path / "ro").mkdir()
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: not str(p).startswith(str(tmp_path / "ro"))
                            and real_access(p, mode, **kw))
    capsys.readouterr()
    assert main(["diagnose", path, "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mempath diagnose: error: --out {out} cannot be made"), err
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux's /proc")
@pytest.mark.parametrize("where,says", [("/proc/mempath-nope/report", "cannot be made"),
                                        ("/proc/self", "cannot be written")])
def test_an_out_folder_that_os_access_calls_writable_but_is_not_is_refused_before_measuring(
        where, says, model_factory, capsys, monkeypatch):
    """os.access says yes to root, on /proc and on a read-only mount: the folder was made only after the whole
    run, which then ended in a FileNotFoundError traceback. Now it is made, and written to, before loading."""
    from mempath.cli import main
    from mempath.engine import startup
    path, _ = model_factory("llama")
    monkeypatch.setattr(startup, "load_model", lambda *a, **k: pytest.fail("measuring started"))
    monkeypatch.setattr(os, "access", lambda *a, **k: True)  # as root sees it
    capsys.readouterr()
    assert main(["diagnose", path, "--device", "cpu", "--out", where]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mempath diagnose: error: --out {where} {says}"), err
    assert "give a folder you can write" in err[0]


def test_the_out_folder_is_made_up_front_and_left_as_it_was(tmp_path):
    """refuse_foreign_outputs makes a missing folder (parents too) before the run; its write check leaves no
    file behind and touches none that is there."""
    from mempath.tools.diagnose.report import refuse_foreign_outputs
    out = tmp_path / "a" / "b" / "report"
    refuse_foreign_outputs(out)
    assert out.is_dir() and list(out.iterdir()) == []
    (out / "notes.txt").write_text("mine")
    (out / "diagnose.json").write_text(json.dumps({"mempath_diagnose": 1}))
    refuse_foreign_outputs(out, snapshot=True)
    assert sorted(p.name for p in out.iterdir()) == ["diagnose.json", "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"


def test_a_failed_run_removes_only_the_empty_folders_it_made(tmp_path):
    """The folder is made before the run now; a run that fails leaves no folder of its own behind, and
    removes nothing that was there before it or that holds a file."""
    from mempath.tools.diagnose.report import out_folder
    mine = tmp_path / "mine"
    mine.mkdir()
    for out in (mine / "a" / "b", mine):
        with pytest.raises(RuntimeError):
            with out_folder(out):
                assert out.is_dir()
                raise RuntimeError("the run failed")
        assert mine.is_dir() and list(mine.iterdir()) == []
    out = tmp_path / "new"
    with pytest.raises(RuntimeError):
        with out_folder(out):
            (out / "diagnose.json").write_text('{"mempath_diagnose": 1}')
            raise RuntimeError("the run failed after writing")
    assert (out / "diagnose.json").is_file()


def test_a_report_that_cannot_be_written_after_the_run_is_one_line_and_keeps_the_table(tmp_path, model_factory,
                                                                                      capsys, monkeypatch):
    """A disk that fills during the run: the OSError of writing escaped run_and_print as a traceback and the
    measurement was lost. Now the table is printed and one line says what failed."""
    from mempath.cli import main
    from mempath.tools.diagnose import report as report_module
    path, _ = model_factory("llama")

    def full_disk(report, target):
        raise OSError(28, "No space left on device", str(target))
    monkeypatch.setattr(report_module, "write_html", full_disk)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["diagnose", path, "--device", "cpu", "--out", str(out), "--probe-tokens", "32", "--probe-seqs",
                 "2", "--leak-requests", "2", "--max-model-len", "128"]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    errors = [line for line in captured.err.splitlines() if "error" in line]
    assert errors == [f"mempath diagnose: error: --out {out}: the report could not be written: "
                      f"{out / 'diagnose.html'}: No space left on device; the table is the measurement; "
                      f"free some space or give another --out folder"], captured.err
    assert "kv_cache" in captured.out and "measured by" in captured.out  # the table
    assert f"html: {out}" not in captured.out  # no file listed that was not written


def test_load_oom_advice_for_a_moe_config_that_names_no_dtype(tmp_path):
    """checkpoint_dtype gives None where config.json names none: the expert-cache advice read its itemsize."""
    cfg = json.loads((Path(__file__).parent / "data" / "configs" / "qwen3-30b-a3b.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = EngineConfig(model=str(tmp_path / "config.json"), max_model_len=8192, max_num_seqs=64,
                          max_num_batched_tokens=8192)
    text = explain_oom("load", Ledger(), 1 << 30, 10 * GiB, config, dtype="bfloat16")
    assert "--moe-expert-cache-size" in text
