"""The decode attention kernel's memory instructions in its PTX for sm_90, compiled without a GPU (#20).

    python benchmarks/ptx_decode.py                      # needs the triton package (CPU is enough)
    python benchmarks/ptx_decode.py --registers 168,128  # the fp8 kernel under register caps too

Compiles ``_decode_split_kernel`` as the engine launches it on the H200 (Llama-3.1-8B attention shape: 4 query
heads a KV head, head_dim 128, block 16; strides of 1 and pointers aligned to 16 bytes, as Triton specializes
them at run time) over a bf16 cache and over an fp8 one, and counts the instructions that move the KV tiles:
global-to-shared copies, shared-memory loads, ldmatrix, the fp8 conversions and the tensor-core products.
Also reads the compiled cubin's resources (triton's bundled ``cuobjdump``): registers and spill bytes a thread and
shared memory, and from them how many programs fit an SM (an H100/H200 SM: 65,536 registers, allocated in
256-register steps a warp; 228 KB of shared memory, 1 KB of it reserved a program; 64 warps), which is what
``FP8_DECODE_MAXNREG`` trades spills for. Prints a table and one ``RESULT`` JSON line.
"""
import argparse
import collections
import inspect
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:
    import triton
    from triton.backends.compiler import GPUTarget
except ImportError:
    sys.exit("ptx_decode needs the triton package (pip install triton)")

from mempath.kernels import attention_triton as attention  # noqa: E402

OPS = re.compile(r"(cp\.async\.c[ag]\.shared\.global|ld\.shared\.[a-z0-9.]+|ldmatrix\.[a-z0-9.]+|"
                 r"cvt\.rn\.f16x2\.e[45]m[23]x2|mma\.sync\.[a-z0-9.]+|wgmma\.mma_async[a-z0-9.]*)")


SM_REGISTERS, SM_SHARED, SM_WARPS, SM_PROGRAMS, RESERVED_SHARED = 65536, 228 * 1024, 64, 32, 1024


CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def resources(cubin: bytes) -> dict:
    """Registers and stack-frame bytes (where spills go) a thread, from the cubin."""
    if not CUOBJDUMP.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    fields = dict(re.findall(r"(REG|STACK):(\d+)", text))
    if "REG" not in fields:
        return {}
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields.get("STACK", 0))}


def programs_per_sm(registers: int, shared_bytes: int, warps: int) -> int:
    """Programs of ``warps`` warps an SM holds at once, bounded by registers, shared memory, warps and programs."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(SM_REGISTERS // (per_warp * warps), SM_SHARED // (shared_bytes + RESERVED_SHARED), SM_WARPS // warps,
               SM_PROGRAMS)


def compile_decode(kv: str, tile: int, stages: int, maxnreg: int | None = None, warps: int = 4) -> dict:
    fn = attention._decode_split_kernel
    params = list(inspect.signature(fn.fn).parameters)
    pointers = {"q_ptr": "*bf16", "k_cache_ptr": kv, "v_cache_ptr": kv, "block_tables_ptr": "*i32",
                "seq_lens_ptr": "*i32", "query_start_ptr": "*i32", "seq_order_ptr": "*i32", "out_ptr": "*bf16",
                "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "qk_scale": "fp32"}
    fp8 = kv != "*bf16"
    constants = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, TILE=tile, SPLIT=True,
                     PRECISION="ieee", VARLEN=False, KV_FP8=fp8, DOTS_FP16=fp8, ORDERED=True, PDL=True,
                     stride_qd=1, stride_kc_d=1, stride_vc_d=1, stride_od=1)
    signature = {p: "constexpr" if p in constants else pointers.get(p, "i32") for p in params}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
               if p not in constants and (signature[p].startswith("*") or p.startswith("stride"))}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=aligned)
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    counts = collections.Counter(OPS.findall(kernel.asm["ptx"]))
    shared = kernel.metadata.shared
    row = {"kv": kv.lstrip("*"), "tile": tile, "stages": stages, "maxnreg": maxnreg, "shared_bytes": shared,
           "kv_tile_bytes": 2 * tile * 128 * (1 if fp8 else 2), "ops": dict(sorted(counts.items())),
           **resources(kernel.asm["cubin"])}
    if "registers" in row:
        row["programs_per_sm"] = programs_per_sm(row["registers"], shared, warps)
        row["warps_per_sm"] = row["programs_per_sm"] * warps
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registers", type=lambda s: [int(x) for x in s.split(",")], default=[],
                        help="register caps a thread for more compiles of the fp8 kernel, e.g. 168,128")
    args = parser.parse_args(argv)
    if any(cap not in attention.FP8_DECODE_MAXNREG_CHOICES for cap in args.registers):
        parser.error(f"--registers: each a multiple of 8 in 64-248 (as FP8_DECODE_MAXNREG), got {args.registers}")
    fp8 = ("*fp8e4nv", attention.DECODE_TILE_FP8, attention.FP8_DECODE_STAGES)
    rows = [compile_decode("*bf16", attention.DECODE_TILE, 3), compile_decode(*fp8)]
    rows += [compile_decode(*fp8, maxnreg=cap) for cap in args.registers]
    for row in rows:
        cap = f", at most {row['maxnreg']} registers" if row["maxnreg"] else ""
        fit = (f"; {row['registers']} registers a thread, a {row['stack_bytes']}-byte stack frame (spills), "
               f"{row['programs_per_sm']} programs ({row['warps_per_sm']} warps) an SM" if "registers" in row else "")
        print(f"{row['kv']}: tile {row['tile']} tokens ({row['kv_tile_bytes']} bytes of K and V), "
              f"{row['stages']} stages{cap}, {row['shared_bytes']} bytes of shared memory{fit}; instructions in "
              f"the PTX (the loop body once, plus the pipeline's prologue):")
        for op, n in row["ops"].items():
            print(f"  {n:5d}  {op}")
    print("RESULT " + json.dumps({"bench": "ptx-decode", "triton": triton.__version__, "target": "sm_90",
                                  "results": rows}))


if __name__ == "__main__":
    main()
