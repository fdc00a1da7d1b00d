"""`mempath diagnose A B`: every model's pathways and the shared KV pages' split (CPU, tiny random models)."""
import json
from pathlib import Path

import pytest
import torch

from mempath.memory.budget import ALLOCATION_ROUNDING
from mempath.cli import main
from mempath.tools.diagnose.multi import diagnose_models
from mempath.tools.diagnose.multi_report import format_multi_table


@pytest.fixture(scope="module")
def report(two_models, tmp_path_factory):
    pytest.importorskip("matplotlib", reason="the HTML report plots with matplotlib (a dependency)")
    llama, qwen = two_models
    torch.set_num_threads(2)
    out = tmp_path_factory.mktemp("diag-multi-out")
    # max_model_len 96: the Llama's 32-token blocks still fill three pages per request, in few steps.
    return diagnose_models([f"a={llama}", f"b={qwen}"], device="cpu", dtype="float32", probe_tokens=64,
                           probe_seqs=4, leak_requests=3, growth_requests=2, split_requests=3, out_dir=out,
                           cpu_kv_cache_bytes=2 << 20, max_model_len=96)


ROWS = ("weights", "weights.embedding", "weights.attention", "weights.mlp", "weights.norms",
        "kv_cache (its view of the shared pages)", "embedding (forward output)", "decoder layer peak",
        "decoder forward peak", "logits", "kv growth (peak during generation)")


def test_every_pathway_of_each_model(report):
    data = json.loads(Path(report["files"]["json"]).read_text())
    assert [m["name"] for m in data["models"]] == ["a", "b"]
    for section in data["models"]:
        rows = {r["pathway"]: r for r in section["pathways"]}
        for name in ROWS:
            row = rows[name]
            assert row["predicted"] is not None and row["measured"] is not None, (section["name"], name)
        for exact in ("weights", "weights.attention", "weights.mlp", "kv_cache (its view of the shared pages)",
                      "kv growth (peak during generation)"):
            assert rows[exact]["error_pct"] == 0.0, (section["name"], rows[exact])
        assert "kv_cache" not in rows and "kv_cache capacity" not in rows  # the pool is the shared section's
        assert section["leak"]["ok"], section["leak"]
        # Its own stages only, named by the model.
        assert {s["name"] for s in section["stages"]} >= {f"{section['name']}: load weights",
                                                           f"{section['name']}: decoder forward"}
        assert all(s["name"].startswith(section["name"] + ": ") for s in section["stages"])


def test_shared_pages_against_the_plan(report):
    shared = report["shared_kv_pages"]
    rows = {r["pathway"]: r for r in shared["rows"]}
    for name in ("shared KV pages", "page", "a: one block", "b: one block"):
        assert rows[name]["error_pct"] == 0.0, rows[name]
    assert shared["num_pages"] == shared["planned_num_pages"] == (2 << 20) // shared["page_bytes"]
    a, b = shared["models"]["a"], shared["models"]["b"]
    assert (a["block_size"], b["block_size"]) == (32, 16) == (a["planned_block_size"], b["planned_block_size"])
    assert a["tokens_per_page"] == 32 and b["page_fill"] == 1.0


def test_split_moves_and_every_page_is_free_at_the_end(report):
    split = report["shared_kv_pages"]["split"]
    assert split["columns"] == ["step", "a", "b", "free"]
    for name in ("a", "b"):
        assert split["by_model"][name]["max"] > 0 and split["by_model"][name]["final"] == 0, split["by_model"]
    assert any(s[1] > 0 and s[2] > 0 for s in split["samples"])  # the bursts overlap: both hold pages at once
    assert split["all_free_at_end"] and split["free_at_end"] == report["shared_kv_pages"]["num_pages"]


def test_text_and_html(report):
    text = format_multi_table(report)
    assert "mempath diagnose: a (" in text and "mempath diagnose: b (" in text
    assert "shared KV pages:" in text and "every page free at the end" in text
    page = Path(report["files"]["html"]).read_text()
    assert page.count("<h2>Predicted vs measured</h2>") == 2 and "Shared KV pages" in page
    assert "<script" not in page and "Pool ledger" in page
    assert report["shared_kv_pages"]["ledger"]["kv_cache"]["bytes"] == 2 << 20  # the pool's ledger: one allocation


@pytest.mark.parametrize("extra, says", [
    (["b={missing}"], "nowhere"),
    (["{qwen}", "--served-model-name", "x"], "--served-model-name"),
    (["{qwen}", "--kv-min-share", "0.9"], "--kv-min-share 0.50"),
    (["{qwen}", "--train"], "--train"),
])
def test_cli_bad_argument_is_one_line(two_models, tmp_path, capsys, extra, says):
    llama, qwen = two_models
    args = [a.format(missing=tmp_path / "nowhere", qwen=qwen) for a in extra]
    rc = main(["diagnose", llama, *args, "--device", "cpu", "--cpu-kv-cache-bytes", str(1 << 20),
               "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and says in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "r").exists()


def test_cli_several_model_flags_refused_for_one(tmp_path, capsys):
    from mempath.assets import default_model_path
    rc = main(["diagnose", default_model_path(), "--kv-min-share", "0.2", "--device", "cpu",
               "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--kv-min-share" in err[0], err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_models_on_cuda(two_models):
    """Each model's profile step and graphs measured under its name; the pool's split on the device."""
    llama, qwen = two_models
    report = diagnose_models([f"a={llama}", f"b={qwen}"], device="cuda", dtype="float32", probe_tokens=256,
                             probe_seqs=4, leak_requests=3, growth_requests=2, out_dir=None,
                             gpu_memory_utilization=0.3, max_model_len=256)
    for section in report["models"]:
        rows = {r["pathway"]: r for r in section["pathways"]}
        for name in ROWS + ("activation_peak (engine profile step)", "cuda_graphs"):
            assert rows[name]["measured"] is not None, (section["name"], name)
        for exact in ("weights.attention", "kv growth (peak during generation)"):
            assert rows[exact]["error_pct"] == 0.0, (section["name"], rows[exact])
        assert f"{section['name']}: profile step" in {s["name"] for s in section["stages"]}
        assert section["leak"]["kv_blocks_used_after"] == 0
    shared = report["shared_kv_pages"]
    rows = {r["pathway"]: r for r in shared["rows"]}
    # The pool as allocated: its pages' bytes, rounded up by the caching allocator when it keeps the segment's
    # last 2 MiB whole (an H100 run measured 393,216 B more than 1,492,712 pages of 16 KiB).
    asked = shared["num_pages"] * shared["page_bytes"]
    assert asked <= rows["shared KV pages"]["measured"] <= -(-asked // ALLOCATION_ROUNDING) * ALLOCATION_ROUNDING
    assert all(m["pages"]["max"] > 0 and m["pages"]["final"] == 0 for m in shared["models"].values())
    assert shared["split"]["all_free_at_end"]


def test_cli_passes_the_models_and_prints_every_section(report, monkeypatch, capsys, tmp_path):
    """`mempath diagnose A B`: the names, share and engine flags reach diagnose_models; the table is printed."""
    import mempath.tools.diagnose.multi as multi
    seen = {}

    def fake(models, **kwargs):
        seen.update(kwargs, models=models)
        return report

    monkeypatch.setattr(multi, "diagnose_models", fake)
    rc = main(["diagnose", "/m/x", "/m/y", "--served-model-name", "a", "b", "--kv-min-share", "0.25",
               "--device", "cpu", "--max-model-len", "96", "--out", str(tmp_path)])
    assert rc == 0
    assert seen["models"] == ["/m/x", "/m/y"] and seen["served_model_name"] == ["a", "b"]
    assert seen["kv_min_share"] == 0.25 and seen["max_model_len"] == 96 and seen["device"] == "cpu"
    out = capsys.readouterr().out
    assert out.count("pathway ") == 2 and "shared KV pages:" in out and "json: " in out


def test_several_models_never_overwrite_a_file_no_diagnose_wrote(two_models, tmp_path):
    llama, qwen = two_models
    (tmp_path / "diagnose.json").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"diagnose.json is there and is not a mempath diagnose report"):
        diagnose_models([f"a={llama}", f"b={qwen}"], device="cpu", out_dir=tmp_path)
    assert (tmp_path / "diagnose.json").read_text() == "[1, 2]\n"
