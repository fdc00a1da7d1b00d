"""The grouped expert GEMM's launch configuration (kernels/moe_triton.py): the chooser and its table.

The kernel under these configurations is checked against the twin in tests/test_moe_triton.py.
"""
import json

import pytest
import torch

from mempath.kernels import fp8_gemv_triton
from mempath.kernels.moe_triton import (DEFAULT_CONFIG, GroupedGemmConfig, default_config, grouped_gemm_config,
                                        load_moe_gemm_table, moe_gemm_table_json)


def test_default_is_the_fixed_launch_the_kernel_always_had():
    assert default_config(4096, 14336) == DEFAULT_CONFIG == GroupedGemmConfig(64, 64, 4, 3)
    assert default_config(48, 32) == GroupedGemmConfig(block_n=32, block_k=32, num_warps=4, num_stages=3)
    assert default_config(96, 40) == GroupedGemmConfig(block_n=64, block_k=32, num_warps=4, num_stages=3)


def test_a_listed_shape_gets_the_table_entry_and_others_the_default(tmp_path):
    mine = {"1536x2048": {"16": GroupedGemmConfig(block_n=16, block_k=256, num_warps=2, num_stages=4)},
            "2048x768": {"64": GroupedGemmConfig(block_n=128, block_k=64, num_warps=8, num_stages=2)}}
    path = tmp_path / "t.json"
    path.write_text(moe_gemm_table_json(mine, device="test"))
    table = load_moe_gemm_table(path)
    assert table == mine
    assert grouped_gemm_config(1536, 2048, 16, torch.bfloat16, table) == mine["1536x2048"]["16"]
    assert grouped_gemm_config(1536, 2048, 16, torch.float16, table) == mine["1536x2048"]["16"]
    assert grouped_gemm_config(1536, 2048, 64, torch.bfloat16, table) == default_config(1536, 2048)  # other block_m
    assert grouped_gemm_config(2048, 768, 64, torch.bfloat16, table) == mine["2048x768"]["64"]
    assert grouped_gemm_config(4096, 14336, 16, torch.bfloat16, table) == DEFAULT_CONFIG  # not listed
    # Measured on 16-bit tiles: float32 (twice the shared memory per stage) keeps the default.
    assert grouped_gemm_config(1536, 2048, 16, torch.float32, table) == default_config(1536, 2048)


def test_the_environment_variable_points_at_another_table(tmp_path, monkeypatch):
    mine = {"64x32": {"16": GroupedGemmConfig(block_n=16, block_k=32, num_warps=2, num_stages=2)}}
    path = tmp_path / "swept.json"
    path.write_text(moe_gemm_table_json(mine))
    monkeypatch.setenv("MEMPATH_MOE_GEMM_CONFIGS", str(path))
    assert load_moe_gemm_table() == mine
    assert grouped_gemm_config(64, 32, 16, torch.bfloat16) == mine["64x32"]["16"]  # what the kernel launches by
    monkeypatch.setenv("MEMPATH_MOE_GEMM_CONFIGS", str(tmp_path / "absent.json"))
    with pytest.raises(ValueError, match=r"^MEMPATH_MOE_GEMM_CONFIGS names .*absent\.json, which does not exist: "
                                         r"point it at a table .* or unset it$"):
        load_moe_gemm_table()
    with pytest.raises(ValueError, match=r"^MEMPATH_MOE_GEMM_CONFIGS names .*absent\.json"):
        grouped_gemm_config(64, 32, 16, torch.bfloat16)


def test_without_the_shipped_table_every_shape_gets_its_default(tmp_path, monkeypatch):
    from mempath.kernels import moe_triton
    monkeypatch.delenv("MEMPATH_MOE_GEMM_CONFIGS", raising=False)
    monkeypatch.setattr(moe_triton, "DEFAULT_MOE_GEMM_TABLE", tmp_path / "not_swept_yet.json")
    assert load_moe_gemm_table() == {}


def test_the_choice_never_depends_on_how_many_experts_or_groups():
    import inspect
    assert list(inspect.signature(grouped_gemm_config).parameters) == ["n", "k", "block_m", "dtype", "table"]


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
    assert fp8_gemv_triton.load_table(tmp_path / "absent.json") == {}


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
