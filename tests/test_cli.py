"""The command line: one line for each mistake, no tracebacks, an unambiguous usage."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mempath.assets import default_model_path
from mempath.cli import main

ROOT = Path(__file__).resolve().parent.parent


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA is not usable")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_device_without_cuda_is_one_line(capsys, device):
    rc = main(["generate", "hi", "--device", device, "--quiet"])
    err = one_error_line(capsys)
    assert rc == 2
    assert err.startswith("mempath: error: ") and "--device cpu" in err, err


def test_cuda_device_index_beyond_the_visible_devices_is_one_line(capsys):
    rc = main(["generate", "hi", "--device", "cuda:99", "--quiet"])
    err = one_error_line(capsys)
    assert rc == 2 and "cuda:99" in err, err


def test_unknown_device_is_one_line(capsys):
    rc = main(["generate", "hi", "--device", "gpu", "--quiet"])
    err = one_error_line(capsys)
    assert rc == 2 and "'gpu'" in err and "cpu" in err and "cuda" in err, err


def test_diagnose_refuses_a_cuda_device_without_cuda_before_measuring(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("needs a machine where CUDA is not usable")
    rc = main(["diagnose", default_model_path(), "--device", "cuda", "--out", str(tmp_path / "r")])
    assert rc == 2 and "--device cpu" in one_error_line(capsys)
    assert not (tmp_path / "r").exists()


def test_a_closed_pipe_ends_quietly():
    """`mempath plan MODEL --json | head`: the reader went away; no traceback, no message."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # closed before the child writes: its first write meets EPIPE
    try:
        result = subprocess.run([sys.executable, "-m", "mempath", "plan", default_model_path(), "--json"],
                                stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 141  # 128 + SIGPIPE, what a shell reports for `yes | head`


def test_a_closed_stdout_ends_quietly_in_process(monkeypatch):
    read_end, write_end = os.pipe()
    os.close(read_end)
    closed = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", closed)
    try:
        assert main(["plan", default_model_path(), "--json"]) == 141
    finally:
        monkeypatch.undo()
        closed.close()


def test_two_prompts_are_not_read_as_a_model_and_a_prompt(capsys):
    """`generate "a" "b"` must not try to load a model directory called "a"."""
    rc = main(["generate", "def f(x):", "return x", "--quiet"])
    err = one_error_line(capsys)
    assert rc == 2
    assert "--model" in err and "one PROMPT" in err and "config.json" not in err, err


def test_an_existing_directory_before_the_prompt_is_the_model(capsys):
    rc = main(["generate", default_model_path(), "def f(x):", "--max-tokens", "2", "--quiet"])
    assert rc == 0
    assert capsys.readouterr().out.startswith("def f(x):")


def test_model_given_twice_is_one_line(capsys):
    rc = main(["generate", default_model_path(), "hi", "--model", default_model_path(), "--quiet"])
    assert rc == 2 and "not both" in one_error_line(capsys)


def test_generate_help_names_one_prompt_and_how_to_give_the_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "[[MODEL] PROMPT" not in out
    assert "--model" in out and "PROMPT" in out and "existing directory" in out, out
