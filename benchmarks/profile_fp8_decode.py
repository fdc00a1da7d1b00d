"""One launch each of the decode attention kernel over a bf16 and an fp8 cache (Llama-3.1-8B
heads, batch 64 x 8k context), for Nsight Compute: what bounds the fp8 kernel (BENCHMARKS.md,
"fp8 KV cache on the H200").

    TRITON_CACHE_DIR=DIR ncu --clock-control none --kernel-name regex:_decode_split_kernel \\
        --launch-skip 2 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats python3 benchmarks/profile_fp8_decode.py [tile128]

The fp8 variant is bench_fp8_kv's tile name (default tile128). Each cache's kernel runs twice
unprofiled first (compiles), then once each profiled: bf16, then fp8. The compiled PTX lands in
TRITON_CACHE_DIR.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kernels  # noqa: E402
from bench_fp8_kv import set_fp8_variant  # noqa: E402
from mempath.kernels import attention_triton as ta  # noqa: E402

set_fp8_variant(sys.argv[1] if len(sys.argv) > 1 else "tile128")
pb = bench_kernels.PagedBatch([(1, 8192)] * 64)
k8, v8 = pb.k_cache.to(torch.float8_e4m3fn), pb.v_cache.to(torch.float8_e4m3fn)


def run(k, v):
    ta.triton_decode_attention(pb.query, k, v, pb.block_tables, pb.seq_lens, pb.scale, out=pb.out, max_seq_len=8192)


for k, v in ((pb.k_cache, pb.v_cache), (k8, v8)):
    run(k, v)
    torch.cuda.synchronize()
run(pb.k_cache, pb.v_cache)
run(k8, v8)
torch.cuda.synchronize()
print("done")
