"""The decode attention kernel's memory instructions in its PTX for sm_90, compiled without a GPU (#20).

    python benchmarks/ptx_decode.py               # needs the triton package (CPU is enough)

Compiles ``_decode_split_kernel`` as the engine launches it on the H200 (Llama-3.1-8B attention shape: 4 query
heads a KV head, head_dim 128, block 16; strides of 1 and pointers aligned to 16 bytes, as Triton specializes
them at run time) over a bf16 cache and over an fp8 one, and counts the instructions that move the KV tiles:
global-to-shared copies, shared-memory loads, ldmatrix, the fp8 conversions and the tensor-core products.
Prints a table and one ``RESULT`` JSON line.
"""
import collections
import inspect
import json
import re
import sys
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


def compile_decode(kv: str, tile: int, stages: int) -> dict:
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
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages})
    counts = collections.Counter(OPS.findall(kernel.asm["ptx"]))
    return {"kv": kv.lstrip("*"), "tile": tile, "stages": stages, "shared_bytes": kernel.metadata.shared,
            "kv_tile_bytes": 2 * tile * 128 * (1 if fp8 else 2), "ops": dict(sorted(counts.items()))}


def main():
    rows = [compile_decode("*bf16", attention.DECODE_TILE, 3),
            compile_decode("*fp8e4nv", attention.DECODE_TILE_FP8, attention.FP8_DECODE_STAGES)]
    for row in rows:
        print(f"{row['kv']}: tile {row['tile']} tokens ({row['kv_tile_bytes']} bytes of K and V), "
              f"{row['stages']} stages, {row['shared_bytes']} bytes of shared memory; instructions in the PTX "
              f"(the loop body once, plus the pipeline's prologue):")
        for op, n in row["ops"].items():
            print(f"  {n:5d}  {op}")
    print("RESULT " + json.dumps({"bench": "ptx-decode", "triton": triton.__version__, "target": "sm_90",
                                  "results": rows}))


if __name__ == "__main__":
    main()
