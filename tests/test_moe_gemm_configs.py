"""The grouped expert GEMM's launch configuration (kernels/moe_triton.py): the chooser and its table.

The kernel under these configurations is checked against the twin in tests/test_moe_triton.py.
"""
import dataclasses
import json

import pytest
import torch

from mempath.kernels import fp8_gemv_triton
from mempath.kernels.common import config_table_json
from mempath.kernels.moe_triton import (DEFAULT_CONFIG, DEFAULT_MOE_GEMM_TABLE, GroupedGemmConfig, default_config,
                                        grouped_gemm_config, load_moe_gemm_table)


def test_default_is_the_fixed_launch_the_kernel_always_had():
    assert default_config(4096, 14336) == DEFAULT_CONFIG == GroupedGemmConfig(64, 64, 4, 3)
    assert default_config(48, 32) == GroupedGemmConfig(block_n=32, block_k=32, num_warps=4, num_stages=3)
    assert default_config(96, 40) == GroupedGemmConfig(block_n=64, block_k=32, num_warps=4, num_stages=3)


def test_a_listed_shape_gets_the_table_entry_and_others_the_default(tmp_path):
    """An old table (one config per block_m): that config for every pair count of its row block."""
    mine = {"1536x2048": {"16": GroupedGemmConfig(block_n=16, block_k=256, num_warps=2, num_stages=4)},
            "2048x768": {"64": GroupedGemmConfig(block_n=128, block_k=64, num_warps=8, num_stages=2)}}
    path = tmp_path / "t.json"
    path.write_text(config_table_json(mine, device="test"))
    table = load_moe_gemm_table(path)
    assert table == mine
    for pairs in (1, 8, 13, 1024):  # block_m 16
        assert grouped_gemm_config(1536, 2048, pairs, torch.bfloat16, table) == mine["1536x2048"]["16"]
    assert grouped_gemm_config(1536, 2048, 16, torch.float16, table) == mine["1536x2048"]["16"]
    assert grouped_gemm_config(1536, 2048, 2048, torch.bfloat16, table) == default_config(1536, 2048)  # block_m 64
    assert grouped_gemm_config(2048, 768, 1025, torch.bfloat16, table) == mine["2048x768"]["64"]
    assert grouped_gemm_config(2048, 768, 8192, torch.bfloat16, table) == mine["2048x768"]["64"]
    assert grouped_gemm_config(2048, 768, 1024, torch.bfloat16, table) == default_config(2048, 768)
    assert grouped_gemm_config(4096, 14336, 16, torch.bfloat16, table) == DEFAULT_CONFIG  # not listed
    # Measured on 16-bit tiles: float32 (twice the shared memory per stage) keeps the default.
    assert grouped_gemm_config(1536, 2048, 16, torch.float32, table) == default_config(1536, 2048)


A, B, C = (GroupedGemmConfig(64, 256, 4, 4), GroupedGemmConfig(16, 256, 2, 3), GroupedGemmConfig(128, 128, 4, 4))
PREFILL = GroupedGemmConfig(128, 64, 4, 3)


def test_decode_entries_are_per_bucket_of_pairs_rounded_up_to_a_power_of_two(tmp_path):
    """Below a bucket's power of two the next one up is used; past the largest listed, the largest;
    below the smallest, the smallest; block_m 64 keeps one entry."""
    mine = {"4096x14336": {"16": {"2": A, "4": B, "16": C}, "64": PREFILL}}
    path = tmp_path / "t.json"
    path.write_text(config_table_json(mine, device="test"))
    table = load_moe_gemm_table(path)
    assert table == mine
    chosen = {pairs: grouped_gemm_config(4096, 14336, pairs, torch.bfloat16, table)
              for pairs in (1, 2, 3, 4, 5, 8, 9, 16, 17, 1024, 1025, 4096)}
    assert chosen == {1: A, 2: A, 3: B, 4: B, 5: B, 8: B, 9: C, 16: C, 17: C, 1024: C, 1025: PREFILL, 4096: PREFILL}


def test_the_table_file_keeps_one_config_a_line():
    text = config_table_json({"64x32": {"16": {"2": A, "8": B}, "64": PREFILL}}, device="test")
    assert json.loads(text)["configs"]["64x32"]["16"]["8"] == dataclasses.asdict(B)
    assert sum('"block_n"' in line for line in text.splitlines()) == 3


def test_the_shipped_table_has_a_decode_entry_per_measured_bucket():
    table = load_moe_gemm_table(DEFAULT_MOE_GEMM_TABLE)
    assert sorted(table["1536x2048"]["16"], key=int) == ["8", "16", "32", "64"]  # Qwen3-30B-A3B: 8 of 128
    assert sorted(table["4096x14336"]["16"], key=int) == ["2", "4", "8", "16"]  # Mixtral-8x7B: 2 of 8
    assert all(isinstance(entries["64"], GroupedGemmConfig) for entries in table.values())
    # Mixtral's down projection at batch 1 (2 pairs): run 2's best there, not the summed best.
    assert table["4096x14336"]["16"]["2"] == GroupedGemmConfig(64, 256, 4, 4)


@pytest.mark.parametrize("text, message", [
    ("{", r"t\.json: not JSON .*: rewrite it with benchmarks/bench_moe_gemm\.py --out .*t\.json or delete it$"),
    ('{"configs": {"64x32": {"16": {"block_n": 64, "blockk": 32}}}}',
     r"t\.json: 64x32 block_m 16 has unknown fields \['blockk'\]: the fields are \['block_k', 'block_n', "
     r"'num_stages', 'num_warps'\]$"),
    ('{"configs": {"64x32": {"16": {"block_n": 48}}}}',
     r"t\.json: 64x32 block_m 16: block_n must be a power of two >= 16, got 48: fix the entry or re-sweep"),
    ('{"configs": {"64x32": {"16": {"num_warps": "4"}}}}',
     r"t\.json: 64x32 block_m 16: num_warps must be one of 1, 2, 4, 8, 16, got '4'"),
    ('{"configs": {"64x32": {"16": {"num_stages": 0}}}}', r"t\.json: 64x32 block_m 16: num_stages must be an integer"),
    ('{"configs": {"64x32": [1]}}', r"t\.json: 64x32 must map block_m to configurations"),
    ('{"configs": {"64by32": {"16": {}}}}', r"t\.json: shape '64by32' is not NxK"),
    ('{"configs": {"64x32": {"sixteen": {}}}}', r"t\.json: 64x32 block_m 'sixteen' is not an integer"),
    ('{"configs": {"64x32": {"16": {"2": {"block_n": 48}}}}}',
     r"t\.json: 64x32 block_m 16 pairs 2: block_n must be a power of two >= 16, got 48: fix the entry or re-sweep"),
    ('{"configs": {"64x32": {"16": {"3": {}}}}}',
     r"t\.json: 64x32 block_m 16: pairs bucket '3' is not a power of two \(the pairs of a call rounded up\)"),
    ('{"configs": {"64x32": {"16": {"2": {}, "block_n": 64}}}}',
     r"t\.json: 64x32 block_m 16 mixes pairs buckets and fields: .*rewrite it with benchmarks/bench_moe_gemm\.py"),
    ('{"configs": {"64x32": {"16": {"2": [1]}}}}', r"t\.json: 64x32 block_m 16 pairs 2 must be an object of fields"),
    ('[]', r"t\.json: the table must be a JSON object with a \"configs\" object"),
])
def test_bad_tables_are_refused_in_one_line(tmp_path, text, message):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as caught:
        load_moe_gemm_table(path)
    assert "\n" not in str(caught.value)


def test_the_fp8_gemv_table_reads_as_before(tmp_path):
    """The loader both tables share (kernels/common.py) keeps the fp8 table's keys and messages."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"configs": {"64x256": {"1": {"block_n": 64, "blockk": 128}}}}))
    with pytest.raises(ValueError, match=r"^.*t\.json: 64x256 bucket 1 has unknown fields \['blockk'\]"):
        fp8_gemv_triton.load_table(path)
    # A table given by path must exist (only the shipped one may be absent): kernels/common.py::table_path.
    with pytest.raises(ValueError, match=r"^the table .*absent\.json, which does not exist: point it at a table"):
        fp8_gemv_triton.load_table(tmp_path / "absent.json")


# ---------------------------------------------------------------- benchmarks/bench_moe_gemm.py


def test_the_sweep_prunes_what_cannot_fit_or_is_pointless():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_moe_gemm import DECODE_GRID, fits, layers_needed
    smem = 227 << 10  # the H200's shared memory per block
    assert fits(GroupedGemmConfig(128, 256, 8, 3), 1536, 2048, 16, smem)  # 3 x (16 + 128) x 256 x 2 bytes
    assert not fits(GroupedGemmConfig(128, 256, 8, 4), 1536, 2048, 16, smem)  # a fourth stage does not fit
    assert not fits(GroupedGemmConfig(64, 256, 4, 5), 2048, 768, 16, smem)  # 5 stages for 3 steps of K
    assert not fits(GroupedGemmConfig(16, 64, 4, 3), 2048, 768, 16, smem)  # 4 warps on 2 MMA columns
    assert fits(GroupedGemmConfig(16, 64, 2, 3), 2048, 768, 16, smem)
    assert fits(GroupedGemmConfig(64, 64, 4, 2), 48, 64, 16, smem)
    assert not fits(GroupedGemmConfig(128, 64, 4, 2), 48, 64, 16, smem)  # a tile twice as wide as N needs
    assert not fits(GroupedGemmConfig(64, 128, 4, 2), 48, 64, 16, smem)  # a K step twice K
    tiles_n, tiles_k, warps, stages = DECODE_GRID
    assert 16 in tiles_n and max(tiles_k) == 256 and set(warps) == {2, 4, 8} and set(stages) == {2, 3, 4, 5}
    # Rotated layers: 8 Qwen3-30B-A3B gate/up experts (50 MB) against a 50 MiB L2 need four layers.
    assert layers_needed(8 * 1536 * 2048 * 2, 50 << 20, "cuda") == 4
    assert layers_needed(2 * 28672 * 4096 * 2, 50 << 20, "cuda") == 1 and layers_needed(1, 1 << 20, "cpu") == 1


def test_a_table_is_built_from_an_earlier_runs_result_lines(tmp_path):
    """bench_moe_gemm.py --from-results: each decode point's best config under its pairs bucket, the
    prefill sweep's config under block_m 64; other lines (the batch-1 sums, other benches) are skipped."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    point = {"bench": "moe_gemm", "model": "m", "gemm": "down", "shape": "64x32", "block_m": 16}
    lines = [dict(point, tokens=1, pairs=2, best_here="n64 k256 w4 s4", table="n16 k32 w2 s2"),
             dict(point, tokens=2, pairs=4, best_here="n16 k256 w2 s3", table="n16 k32 w2 s2"),
             dict(point, tokens=3, pairs=6, best_here="n32 k32 w2 s2", table="n16 k32 w2 s2"),
             dict(point, tokens=4, pairs=8, best_here="n128 k128 w4 s4", table="n16 k32 w2 s2"),
             dict(point, tokens=1024, pairs=2048, block_m=64, best_here="n128 k64 w4 s3", table="n128 k64 w4 s3"),
             {"bench": "moe_gemm", "model": "m", "batch1_experts": True, "bytes": 1.0},
             {"part": "pinned", "h2d_GBps": 50.0}]
    results = tmp_path / "run.jsonl"
    results.write_text("not a result line\n" + "".join(f"RESULT {json.dumps(p)}\n" for p in lines))
    out = tmp_path / "table.json"
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_moe_gemm.py"), "--from-results",
                           str(results), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    table = load_moe_gemm_table(out)
    # Tokens 3 and 4 share bucket 8: the point at the bucket's top (8 pairs) is kept.
    assert table == {"64x32": {"16": {"2": GroupedGemmConfig(64, 256, 4, 4), "4": GroupedGemmConfig(16, 256, 2, 3),
                                      "8": GroupedGemmConfig(128, 128, 4, 4)},
                               "64": GroupedGemmConfig(128, 64, 4, 3)}}
    assert json.loads(out.read_text())["made_by"] == f"benchmarks/bench_moe_gemm.py --from-results {results}"
    results.write_text("RESULT {\"part\": \"pinned\"}\n")
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_moe_gemm.py"), "--from-results",
                           str(results), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout.strip().splitlines()[-1] == (
        f"bench_moe_gemm: {results} has no moe_gemm RESULT lines (bench_moe_gemm.py prints them): "
        "pass the output of a sweep")
