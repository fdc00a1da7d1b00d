"""The command line: one line for each mistake, no tracebacks, an unambiguous usage."""
import os
import re
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


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat", "--model", default_model_path(), "hi"]])
@pytest.mark.parametrize("flags, named", [(["--max-tokens", "-1"], "max_tokens"),
                                          (["--temperature", "-2"], "temperature"), (["--top-p", "1.5"], "top_p")])
def test_a_bad_sampling_flag_fails_before_the_weights_load(capsys, monkeypatch, command, flags, named):
    """A flag SamplingParams refuses is one line before the model loads: a 30B checkpoint takes minutes to load, and
    the mistake does not depend on it."""
    import mempath.llm

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the sampling flags were checked")

    monkeypatch.setattr(mempath.llm, "LLM", no_load)
    rc = main([*command, *flags, "--quiet"])
    err = one_error_line(capsys)
    assert rc == 2 and named in err and "weights were loaded" not in err, err


def test_generate_help_names_one_prompt_and_how_to_give_the_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "[[MODEL] PROMPT" not in out
    assert "--model" in out and "PROMPT" in out and "existing directory" in out, out


# ---------------------------------------------------------------- CPU threads

def test_cgroup_cpu_quota_v2_and_v1(tmp_path):
    from mempath.config import cgroup_cpu_quota
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job\n")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(str(tmp_path), str(proc)) == 1.5
    (tmp_path / "job" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path), str(proc)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(v1), str(tmp_path / "missing")) == 2.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(str(v1), str(tmp_path / "missing")) is None


def test_busy_cores_counts_only_this_process_cpus():
    from mempath.config import busy_cores
    before = "cpu  0 0 0 0 0 0 0 0\ncpu0 100 0 0 100 0 0 0 0\ncpu1 100 0 0 100 0 0 0 0\ncpu2 0 0 0 0 0 0 0 0\n"
    # cpu0 fully busy, cpu1 a quarter busy (iowait counts as idle), cpu2 outside the affinity
    after = "cpu  0 0 0 0 0 0 0 0\ncpu0 120 0 0 100 0 0 0 0\ncpu1 103 0 2 110 5 0 0 0\ncpu2 0 0 0 0 0 0 0 0\n"
    assert busy_cores(before, after, {0, 1}) == pytest.approx(1.25)


@pytest.mark.parametrize("cores, affinity, busy, torch_default, threads", [
    (2, 2, 1.9, 2, 1),    # a busy 2-core machine: one thread
    (2, 2, 0.1, 2, 2),    # an idle one: torch's default
    (2, 64, 10.0, 32, 2),  # a cgroup quota of 2 cores on a big host
    (8, 8, None, 4, 4),   # no /proc/stat: never above torch's default
    (4, 4, 6.0, 4, 1),    # oversubscribed: still one
])
def test_threads_follow_the_idle_cores(cores, affinity, busy, torch_default, threads):
    from mempath.config import pick_cpu_threads
    assert pick_cpu_threads(cores, affinity, busy, torch_default) == threads


@pytest.fixture
def fresh_thread_choice(monkeypatch):
    import psutil

    import mempath.config as config
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(config, "_THREADS_CHOSEN", None)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 2)  # torch's default: 2 threads
    monkeypatch.setattr(config, "measure_cpu_use",
                        lambda: {"affinity": 2, "quota": None, "cores": 2, "busy": 1.9})
    torch.set_num_threads(2)
    return config


def test_generate_on_a_busy_machine_runs_one_thread_and_says_so(fresh_thread_choice, caplog, capsys):
    import logging
    with caplog.at_level(logging.INFO):
        assert main(["generate", "hi", "--max-tokens", "1", "--quiet", "--device", "cpu"]) == 0
    assert torch.get_num_threads() == 1
    assert "CPU threads: 1 (torch's default 2" in caplog.text and "1.9 of them busy" in caplog.text


def test_the_users_thread_count_wins(fresh_thread_choice, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert "OMP_NUM_THREADS=2" in fresh_thread_choice.choose_cpu_threads()
    assert torch.get_num_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(1)  # not torch's default: the user chose it
    assert "torch.set_num_threads chose" in fresh_thread_choice.choose_cpu_threads()
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("level", ["foo", "10", ""])
def test_an_unknown_log_level_is_one_line(capsys, level):
    with pytest.raises(SystemExit) as exited:
        main(["--log-level", level, "plan", "--help"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err and "--log-level" in err.splitlines()[-1], err


def test_a_model_directory_without_a_prompt_is_one_line(capsys):
    """It used to be taken as the prompt: the tiny model completed the directory's path."""
    rc = main(["generate", default_model_path(), "--quiet"])
    err = one_error_line(capsys)
    assert rc == 2 and "no PROMPT after the model directory" in err, err


def test_a_first_word_too_long_for_a_path_is_a_prompt_word(capsys):
    """Checking whether it named a model directory raised 'File name too long'."""
    rc = main(["generate", "a" * 300, "second", "--quiet"])
    err = one_error_line(capsys)
    assert rc == 2 and "generate takes one PROMPT, got 2 arguments" in err, err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_output_to_a_full_device_is_one_line():
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "mempath", "plan",
                               str(ROOT / "tests/data/configs/llama-3.1-8b.json"), "--gpu-mem", "80GiB"],
                              stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "mempath: error: cannot write the output (No space left on device)"], done.stderr


def test_a_closed_stdout_is_one_line_not_a_traceback():
    done = subprocess.run(f"{sys.executable} -m mempath plan tests/data/configs/llama-3.1-8b.json --gpu-mem 80GiB >&-",
                          shell=True, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "mempath: error: cannot write the output (stdout is closed)"], done.stderr


@pytest.mark.parametrize("level", ["critical", "WARN", "Info"])
def test_log_levels_python_knows_are_taken_in_any_case(level):
    from mempath.cli import build_parser
    assert build_parser().parse_args(["--log-level", level, "plan", "x"]).log_level == level.lower()


def test_sampling_flags_at_temperature_zero_are_named_as_having_no_effect(capsys, caplog):
    """The command line decodes greedily by default: --top-p alone changed nothing, without a word."""
    import logging
    with caplog.at_level(logging.WARNING, logger="mempath.cli"):
        assert main(["generate", "hi", "--top-p", "0.5", "--sample-seed", "3", "--max-tokens", "2", "--quiet"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["--top-p 0.5 and --sample-seed 3 have no effect at temperature 0 (greedy decoding, the "
                        "command line's default): add --temperature, e.g. --temperature 0.7"], warnings
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mempath.cli"):
        assert main(["generate", "hi", "--top-k", "5", "--temperature", "0", "--max-tokens", "2", "--quiet"]) == 0
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "--top-k 5 has no effect at temperature 0 (greedy decoding, --temperature 0): add --temperature, e.g. "
        "--temperature 0.7"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mempath.cli"):
        assert main(["generate", "hi", "--top-p", "0.5", "--temperature", "0.7", "--max-tokens", "2", "--quiet"]) == 0
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("flags, says", [
    (["--cpu-kv-cache-bytes", "-1"], "cpu_kv_cache_bytes must be >= 1 (bytes of host memory for a CPU engine's KV "
                                     "cache), got -1"),
    (["--swap-space", "-4"], "--swap-space -4 must be >= 0 and finite (GiB of host memory for the KV cache's host "
                             "tier)"),
    (["--swap-space", "nan"], "--swap-space nan must be >= 0 and finite (GiB of host memory for the KV cache's host "
                              "tier)"),
    (["--block-size", "1048576"], "raise --cpu-kv-cache-bytes, or lower --block-size (1048576; the default is 16)"),
])
def test_kv_sizes_name_the_flag_and_the_fix(capsys, flags, says):
    """A negative cache size was told to be raised, --swap-space was called cpu_kv_gb, and a huge block was told
    to get more memory rather than to be smaller."""
    rc = main(["generate", "hi", "--quiet", "--max-tokens", "1", *flags])
    err = one_error_line(capsys)
    assert rc == 2 and says in err, err


@pytest.mark.parametrize("command", [["generate", "def f():"], ["chat", "hi"]])
def test_an_output_cut_by_max_model_len_says_so(capsys, caplog, command):
    """--max-tokens beyond what max_model_len leaves after the prompt used to stop the output short without a word."""
    import logging
    with caplog.at_level(logging.WARNING, logger="mempath.cli"):
        assert main([*command, "--max-tokens", "100", "--max-model-len", "40", "--ignore-eos", "--quiet"]) == 0
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert re.fullmatch(r"the output stopped at \d+ tokens, not --max-tokens 100: its \d+-token prompt and the output "
                        r"fill --max-model-len 40; raise --max-model-len for a longer output", warning), warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mempath.cli"):
        assert main([*command, "--max-tokens", "3", "--max-model-len", "40", "--ignore-eos", "--quiet"]) == 0
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_the_cut_names_the_max_model_len_start_up_chose(capsys, caplog):
    import logging
    with caplog.at_level(logging.WARNING, logger="mempath.cli"):
        assert main(["generate", "def f():", "--max-tokens", "2000", "--ignore-eos", "--quiet"]) == 0
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.endswith("fill --max-model-len 1024; raise --max-model-len for a longer output"), warning


def test_the_cut_names_where_max_tokens_came_from(capsys, caplog, tmp_path):
    """It named --max-tokens when the flag was not given and the limit was the generation config's."""
    import json
    import logging
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 100}))
    with caplog.at_level(logging.WARNING, logger="mempath.cli"):
        assert main(["generate", "def f():", "--generation-config", str(tmp_path), "--max-model-len", "40",
                     "--ignore-eos", "--quiet"]) == 0
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "stopped" in r.getMessage()]
    assert "not max_tokens 100 (the generation config's max_new_tokens):" in warning, warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mempath.cli"):
        assert main(["generate", "def f():", "--max-model-len", "40", "--ignore-eos", "--quiet"]) == 0
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "stopped" in r.getMessage()]
    assert "not the default max_tokens 64:" in warning, warning


def test_an_unquoted_chat_message_is_told_to_be_quoted(capsys):
    """`mempath chat Hello World` was argparse's 'unrecognized arguments: World' under the whole usage."""
    assert main(["chat", "Hello", "World", "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        'mempath: error: chat takes the message as one argument: quote it, e.g. mempath chat "Hello World"']


@pytest.mark.parametrize("argv, says", [
    (["plan"], "mempath plan: error: the following arguments are required: model"),
    (["chat"], "mempath chat: error: the following arguments are required: MESSAGE"),
])
def test_a_missing_argument_is_two_lines_not_the_whole_usage(capsys, argv, says):
    """argparse printed every option of plan (about 30 lines) above the one line that said what was missing."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 2 and lines[0].startswith("usage: ") and lines[1] == says, lines


def test_a_config_json_that_is_no_regular_file_is_refused_not_waited_on(tmp_path):
    """A named pipe as config.json made plan (and the loader) wait for a writer forever."""
    os.mkfifo(tmp_path / "config.json")
    done = subprocess.run([sys.executable, "-m", "mempath", "plan", str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"mempath plan: error: {tmp_path / 'config.json'}: is not a regular file, expected a file holding a JSON object of "
        f"model settings; replace it with the model's file"], done.stderr
