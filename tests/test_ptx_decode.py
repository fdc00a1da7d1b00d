"""benchmarks/ptx_decode.py: the occupancy arithmetic behind FP8_DECODE_MAXNREG, and a register cap reaching
the compiled fp8 decode kernel (sm_90, compiled on the CPU; needs triton and its bundled cuobjdump)."""
import inspect
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if "constexprs" not in inspect.signature(triton.compiler.ASTSource).parameters:
    pytest.skip("ptx_decode compiles through ASTSource(constexprs=...), triton 3.3 and later", allow_module_level=True)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ptx_decode  # noqa: E402


@pytest.mark.parametrize("registers, shared, warps, programs", [
    (125, 39168, 4, 4),   # the bf16 kernel: Nsight Compute counted 4 blocks an SM (BENCHMARKS.md, eighth session)
    (202, 74752, 4, 2),   # the fp8 kernel then: 2 blocks an SM
    (168, 41472, 4, 3),   # 168 a thread: three 4-warp programs in 65,536 registers
    (170, 41472, 4, 2),   # rounded up to 176 a thread (256 a warp): two
    (128, 41472, 4, 4),
    (128, 74752, 4, 3),   # then shared memory bounds it
    (32, 0, 2, 32),       # then the 32 programs an SM
    (32, 0, 8, 8),        # and the 64 warps
])
def test_programs_per_sm(registers, shared, warps, programs):
    assert ptx_decode.programs_per_sm(registers, shared, warps) == programs


def test_a_register_cap_reaches_the_compiled_fp8_kernel():
    if not ptx_decode.CUOBJDUMP.exists():
        pytest.skip("triton's cuobjdump is not bundled here")
    free = ptx_decode.compile_decode("*fp8e4nv", 128, 3)
    capped = ptx_decode.compile_decode("*fp8e4nv", 128, 3, maxnreg=128)
    assert "registers" in free and "registers" in capped, "cuobjdump --dump-resource-usage gave no REG field"
    assert capped["maxnreg"] == 128 and capped["registers"] <= 128
    assert capped["programs_per_sm"] >= free["programs_per_sm"]
    if free["registers"] > 128:  # ~200 with triton 3.6-3.9: the cap changed the compile, not only the label
        assert capped["registers"] < free["registers"] and capped["programs_per_sm"] > free["programs_per_sm"]
