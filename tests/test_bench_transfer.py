"""benchmarks/bench_transfer.py: its flags, the arithmetic of the KV dtype comparison, and the
disk cases in both KV dtypes (CPU); the engine path itself needs CUDA."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_transfer  # noqa: E402

MIB = 1 << 20


def test_kv_cache_dtype_flag_picks_the_storage_and_refuses_others(capsys):
    args = bench_transfer.parse_args(["--quick"])
    assert args.kv_cache_dtype == "auto" and not args.compare_kv_dtypes
    assert bench_transfer.STORAGE_DTYPES[bench_transfer.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype] \
        == torch.uint8
    assert bench_transfer.parse_args(["--compare-kv-dtypes", "--quick"]).compare_kv_dtypes
    with pytest.raises(SystemExit) as exit_info:
        bench_transfer.parse_args(["--kv-cache-dtype", "int8"])
    assert exit_info.value.code == 2
    assert "--kv-cache-dtype: invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_transfer.parse_args(["--compare-kv-dtypes", "--kv-cache-dtype", "fp8"])
    assert "--compare-kv-dtypes runs both KV dtypes: drop --kv-cache-dtype" in capsys.readouterr().err


def test_an_fp8_block_of_the_bench_is_half_a_bf16_one():
    # Llama-3.1-8B, 16 tokens: 32 layers x K/V x 16 x 8 heads x 128 = 1 Mi elements.
    assert bench_transfer.block_nbytes_of(torch.bfloat16) == 2 * MIB
    assert bench_transfer.block_nbytes_of(bench_transfer.STORAGE_DTYPES["fp8"]) == MIB


def test_comparison_rows_give_bytes_rates_times_per_block_and_the_ratio():
    seconds = {"auto": {"d2h": 0.02, "h2d": 0.04}, "fp8": {"d2h": 0.011, "h2d": 0.02}}
    rows = bench_transfer.compare_rows(256, seconds)
    by_key = {(r["kv_cache_dtype"], r["direction"]): r for r in rows}
    assert set(by_key) == {(kv, d) for kv in ("auto", "fp8", "fp8/auto") for d in ("d2h", "h2d")}
    auto_d2h, fp8_h2d = by_key["auto", "d2h"], by_key["fp8", "h2d"]
    assert auto_d2h["bytes_per_block"] == 2 * MIB and fp8_h2d["bytes_per_block"] == MIB
    assert auto_d2h["gb_per_s"] == pytest.approx(256 * 2 * MIB / 0.02 / 1e9)
    assert fp8_h2d["gb_per_s"] == pytest.approx(256 * MIB / 0.02 / 1e9)
    assert auto_d2h["us_per_block"] == pytest.approx(0.02 / 256 * 1e6)
    assert by_key["fp8/auto", "d2h"]["time_ratio"] == pytest.approx(0.55)
    assert by_key["fp8/auto", "h2d"]["time_ratio"] == pytest.approx(0.5)
    # One dtype alone: its rows, no ratio.
    assert [r["kv_cache_dtype"] for r in bench_transfer.compare_rows(8, {"fp8": {"d2h": 1.0}})] == ["fp8"]


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_disk_cases_run_in_either_kv_dtype_and_leave_no_file(tmp_path, kv):
    seconds = bench_transfer.disk_cases(str(tmp_path), 3, 2, bench_transfer.STORAGE_DTYPES[kv])
    assert set(seconds) == {"disk write (to fsync)", "disk read (cold)"} and min(seconds.values()) > 0
    assert not list(tmp_path.rglob("*.kv"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_cases_time_both_directions_in_both_dtypes():
    for dtype in bench_transfer.STORAGE_DTYPES.values():
        seconds = bench_transfer.engine_cases(8, 4, dtype)
        assert set(seconds) == {"d2h", "h2d"} and min(seconds.values()) > 0
