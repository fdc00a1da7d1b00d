"""Time the Triton paged-attention kernels against PyTorch twins, on one GPU.

Shape: Llama-3.1-8B attention (32 query heads, 8 KV heads, head_dim 128),
bfloat16 cache, 16-token blocks scattered at random over the cache.

Twins: ``write_kv`` is already vectorised (``index_copy_``), so it is its own
twin. For attention the oracle's per-sequence Python loop would be unfair, so
the twin gathers each sequence's blocks into contiguous K/V and calls SDPA
(flash / memory-efficient backends; GQA through ``enable_gqa``), which is what
a PyTorch-only engine would do. The gather is part of the twin's time: it is
the price of the paged layout without a paged kernel.

Bandwidth is the bytes of K/V the attention must read (plus query and
output) over the median time; the device-to-device copy bandwidth, measured
in the same run, is the practical ceiling.

Prints a table, then one JSON line. Usage:
    PYTHONPATH=. python3 benchmarks/bench_kernels.py [--quick]
"""
import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

from mempath.kernels import attention_triton as ta
from mempath.kernels.attention_torch import write_kv

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"

WRITE_TOKENS = (32, 8192)
DECODE_BATCHES = (1, 32, 256)
DECODE_CONTEXTS = (512, 4096, 32768)
SWEEP_CONTEXT = 32768
SWEEP = {1: (8, 16, 32, 64), 32: (1, 2, 4, 8, 16), 256: (1, 2, 4)}  # batch -> split counts
PREFILL_CASES = {
    "1 x 4096 fresh": [(4096, 4096)],
    "16 x 1024 fresh": [(1024, 1024)] * 16,
    "4 x 512 chunk / 8k prefix": [(512, 8704)] * 4,
    "1 x 2048 chunk / 30k prefix": [(2048, 32768)],
}
MIXED_DECODES, MIXED_CHUNK = [(1, 4096)] * 32, (512, 4608)
PREFILL_SWEEP_CASES = ("1 x 4096 fresh", "4 x 512 chunk / 8k prefix")
# (BLOCK_M, BLOCK_N, num_warps, num_stages); the first is the default for this shape.
PREFILL_SWEEP_CONFIGS = ((128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 8, 4))
DECODE_TILE_SWEEP = ((1, 32768), (32, 32768), (256, 4096))


def bench(fn) -> float:
    """Median milliseconds (L2 flushed between runs by ``do_bench``)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


class PagedBatch:
    """``seqs``: (q_len, seq_len) pairs; blocks scattered at random."""

    def __init__(self, seqs):
        self.seqs = seqs
        needed = [math.ceil(s / BLOCK_SIZE) for _, s in seqs]
        num_blocks = sum(needed) + 1
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.k_cache = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_()
        self.v_cache = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_()
        perm = torch.randperm(num_blocks, device=DEVICE).to(torch.int32)
        self.block_tables = torch.zeros(len(seqs), max(needed), dtype=torch.int32, device=DEVICE)
        used = 0
        for b, n in enumerate(needed):
            self.block_tables[b, :n] = perm[used:used + n]
            used += n
        q_lens = [q for q, _ in seqs]
        self.query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        self.query_start_loc = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
        self.seq_lens = torch.tensor([s for _, s in seqs], dtype=torch.int32, device=DEVICE)
        self.max_query_len = max(q_lens)
        self.max_seq_len = max(s for _, s in seqs)
        self.scale = HEAD_DIM ** -0.5
        self.out = torch.empty_like(self.query)

    def kv_bytes(self) -> int:
        tokens = sum(s for _, s in self.seqs)
        io = 2 * self.query.numel() * self.query.element_size()
        return 2 * tokens * NUM_KV_HEADS * HEAD_DIM * self.k_cache.element_size() + io

    def attention_flops(self) -> int:
        # 2 matmuls x 2 flops per MAC over the keys each query row sees.
        seen = sum(q * (s - q) + q * (q + 1) // 2 for q, s in self.seqs)
        return 4 * seen * NUM_HEADS * HEAD_DIM

    # -- twins ---------------------------------------------------------------
    def gathered(self, cache, b=None):
        """K or V of the (uniform-length) batch as ``[B, num_kv_heads, S, D]``."""
        seq_len = self.seqs[0][1]
        blocks = math.ceil(seq_len / BLOCK_SIZE)
        g = cache[self.block_tables[:, :blocks].long()]  # [B, blocks, bs, Hkv, D]
        g = g.view(len(self.seqs), blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)[:, :seq_len]
        return g.transpose(1, 2)

    def torch_decode(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q = self.query.unsqueeze(2)  # [B, H, 1, D]
        k, v = self.gathered(self.k_cache), self.gathered(self.v_cache)
        # No silent fall-back to the math backend, which would expand K/V per query head.
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=True).squeeze(2)

    def torch_decode_matmul(self):
        """Twin for when no fused SDPA backend takes GQA: grouped matmuls."""
        batch, group = len(self.seqs), NUM_HEADS // NUM_KV_HEADS
        q = self.query.view(batch, NUM_KV_HEADS, group, HEAD_DIM)
        k, v = self.gathered(self.k_cache), self.gathered(self.v_cache)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.scale
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs, v).view(batch, NUM_HEADS, HEAD_DIM)

    def torch_prefill(self):
        from torch.nn.attention.bias import causal_lower_right

        q_len, seq_len = self.seqs[0]
        q = self.query.view(len(self.seqs), q_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        group = NUM_HEADS // NUM_KV_HEADS
        # The causal-bias path has no GQA: spell the head sharing out.
        k = self.gathered(self.k_cache).repeat_interleave(group, dim=1)
        v = self.gathered(self.v_cache).repeat_interleave(group, dim=1)
        mask = causal_lower_right(q_len, seq_len)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)


def copy_bandwidth() -> float:
    """TB/s of a 2 GiB device-to-device copy, counting the read and the write."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e12


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def row(cells, widths):
    return "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="skip the largest decode batches")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not ta.HAS_TRITON:
        sys.exit("needs CUDA and Triton")
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "shape": "llama-3.1-8b bf16 H32/KV8/D128 block16"}

    report["copy_tbps"] = copy_bandwidth()
    print(f"device: {report['device']}   d2d copy: {report['copy_tbps']:.2f} TB/s (read+write)\n")

    # -- write_kv --------------------------------------------------------------
    widths = (10, 12, 12, 10)
    print("write_kv (K and V, bf16)")
    print(row(("tokens", "triton us", "torch us", "speedup"), widths))
    report["write_kv"] = []
    for tokens in WRITE_TOKENS:
        num_blocks = max(4, tokens // BLOCK_SIZE * 4)
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        kc = torch.zeros(shape, dtype=DTYPE, device=DEVICE)
        vc = torch.zeros_like(kc)
        key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:tokens].to(torch.int32)
        t_tri = bench(lambda: ta.triton_write_kv(key, value, kc, vc, slots))
        t_ref = bench(lambda: write_kv(key, value, kc, vc, slots))
        report["write_kv"].append({"tokens": tokens, "triton_us": t_tri * 1e3, "torch_us": t_ref * 1e3})
        print(row((tokens, f"{t_tri * 1e3:.1f}", f"{t_ref * 1e3:.1f}", f"{t_ref / t_tri:.2f}x"), widths))

    # -- decode ----------------------------------------------------------------
    widths = (6, 7, 7, 11, 11, 10, 10, 8, 8)
    print("\ndecode (one query per sequence); TB/s = K/V bytes read / time")
    print(row(("batch", "ctx", "splits", "triton us", "torch us", "tri TB/s", "torch TB/s", "speedup", "rel err"),
              widths))
    report["decode"] = []
    batches = DECODE_BATCHES[:-1] if args.quick else DECODE_BATCHES
    for batch in batches:
        for ctx in DECODE_CONTEXTS:
            pb = PagedBatch([(1, ctx)] * batch)
            splits = ta.decode_num_splits(batch, NUM_KV_HEADS, pb.query.device, ctx)
            ws = ta.alloc_decode_workspace(batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DEVICE)

            def run_triton():
                ta.triton_decode_attention(pb.query, pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens,
                                           pb.scale, out=pb.out, workspace=ws, max_seq_len=ctx)

            t_tri = bench(run_triton)
            t_ref, twin_name, err = float("nan"), "none", float("nan")
            for twin in (pb.torch_decode, pb.torch_decode_matmul):
                try:
                    t_ref = bench(twin)
                    twin_name = twin.__name__
                    err = rel_err(pb.out, twin())
                    break
                except RuntimeError as exc:  # includes OOM: report, keep going
                    print(f"  {twin.__name__} failed: {type(exc).__name__}: {str(exc)[:100]}")
                    torch.cuda.empty_cache()
            nbytes = pb.kv_bytes()
            entry = {"batch": batch, "ctx": ctx, "splits": splits, "twin": twin_name, "triton_us": t_tri * 1e3,
                     "torch_us": t_ref * 1e3, "rel_err": err, "triton_tbps": nbytes / (t_tri * 1e-3) / 1e12,
                     "torch_tbps": nbytes / (t_ref * 1e-3) / 1e12}
            report["decode"].append(entry)
            print(row((batch, ctx, splits, f"{t_tri * 1e3:.1f}", f"{t_ref * 1e3:.1f}",
                       f"{entry['triton_tbps']:.2f}", f"{entry['torch_tbps']:.2f}",
                       f"{t_ref / t_tri:.2f}x", f"{err:.1e}"), widths))
            del pb, ws
            torch.cuda.empty_cache()

    # How the split count matters for a lone or few long requests.
    print(f"\ndecode split sweep, ctx {SWEEP_CONTEXT} (us by number of splits)")
    report["decode_split_sweep"] = []
    for batch, split_counts in SWEEP.items():
        if args.quick and batch == max(SWEEP):
            continue
        pb = PagedBatch([(1, SWEEP_CONTEXT)] * batch)
        times = {}
        for splits in split_counts:
            times[splits] = 1e3 * bench(lambda: ta.triton_decode_attention(
                pb.query, pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, pb.scale, out=pb.out,
                num_splits=splits))
        report["decode_split_sweep"].append({"batch": batch, "us_by_splits": times})
        print(f"  batch {batch:3d}: " + "  ".join(f"{s}:{t:.1f}" for s, t in times.items()))
        del pb
        torch.cuda.empty_cache()

    # -- prefill -----------------------------------------------------------------
    widths = (26, 11, 11, 10, 11, 8, 8)
    print("\nprefill (causal; chunks over a cached prefix)")
    print(row(("case", "triton us", "torch us", "tri TFLOPs", "torch TFLOPs", "speedup", "rel err"), widths))
    report["prefill"] = []
    for name, seqs in PREFILL_CASES.items():
        pb = PagedBatch(seqs)

        def run_triton():
            ta.triton_prefill_attention(pb.query, pb.k_cache, pb.v_cache, pb.block_tables, pb.query_start_loc,
                                        pb.seq_lens, pb.scale, max_query_len=pb.max_query_len, out=pb.out)

        t_tri = bench(run_triton)
        try:
            t_ref = bench(pb.torch_prefill)
            ref = pb.torch_prefill().transpose(1, 2).reshape(-1, NUM_HEADS, HEAD_DIM)
            err = rel_err(pb.out, ref)
        except RuntimeError as exc:
            print(f"  torch twin failed: {type(exc).__name__}: {str(exc)[:120]}")
            t_ref, err = float("nan"), float("nan")
        flops = pb.attention_flops()
        entry = {"case": name, "triton_us": t_tri * 1e3, "torch_us": t_ref * 1e3, "rel_err": err,
                 "triton_tflops": flops / (t_tri * 1e-3) / 1e12, "torch_tflops": flops / (t_ref * 1e-3) / 1e12}
        report["prefill"].append(entry)
        print(row((name, f"{t_tri * 1e3:.1f}", f"{t_ref * 1e3:.1f}", f"{entry['triton_tflops']:.1f}",
                   f"{entry['torch_tflops']:.1f}", f"{t_ref / t_tri:.2f}x", f"{err:.1e}"), widths))
        del pb
        torch.cuda.empty_cache()

    # -- tile sweeps ------------------------------------------------------------
    print("\nprefill tile sweep (us): BLOCK_M x BLOCK_N / warps / stages")
    report["prefill_config_sweep"] = []
    for name in PREFILL_SWEEP_CASES:
        pb = PagedBatch(PREFILL_CASES[name])
        times = {}
        for cfg in PREFILL_SWEEP_CONFIGS:
            config = ta.PrefillConfig(*cfg)
            try:
                times["%dx%d/%d/%d" % cfg] = 1e3 * bench(lambda: ta.triton_prefill_attention(
                    pb.query, pb.k_cache, pb.v_cache, pb.block_tables, pb.query_start_loc, pb.seq_lens,
                    pb.scale, max_query_len=pb.max_query_len, out=pb.out, config=config))
            except Exception as exc:  # out of resources, say: report and go on
                times["%dx%d/%d/%d" % cfg] = f"{type(exc).__name__}"
        report["prefill_config_sweep"].append({"case": name, "us_by_config": times})
        print(f"  {name}: " + "  ".join(f"{c}: {t:.1f}" if isinstance(t, float) else f"{c}: {t}"
                                        for c, t in times.items()))
        del pb
        torch.cuda.empty_cache()

    print("\ndecode tile sweep (us by tokens per KV tile, automatic splits)")
    report["decode_tile_sweep"] = []
    default_tile = ta.DECODE_TILE
    for batch, ctx in DECODE_TILE_SWEEP:
        pb = PagedBatch([(1, ctx)] * batch)
        times = {}
        for tile in (32, 64, 128):
            ta.DECODE_TILE = tile
            times[tile] = 1e3 * bench(lambda: ta.triton_decode_attention(
                pb.query, pb.k_cache, pb.v_cache, pb.block_tables, pb.seq_lens, pb.scale, out=pb.out,
                max_seq_len=ctx))
        ta.DECODE_TILE = default_tile
        report["decode_tile_sweep"].append({"batch": batch, "ctx": ctx, "us_by_tile": times})
        print(f"  batch {batch:3d} ctx {ctx:5d}: " + "  ".join(f"{t}: {v:.1f}" for t, v in times.items()))
        del pb
        torch.cuda.empty_cache()

    # -- mixed batch through the dispatcher ----------------------------------------
    n = len(MIXED_DECODES)
    print(f"\nmixed batch: {n} decodes (ctx {MIXED_DECODES[0][1]}) + one {MIXED_CHUNK[0]}-token chunk (us)")
    mixed = PagedBatch(MIXED_DECODES + [MIXED_CHUNK])
    only = PagedBatch(MIXED_DECODES)
    chunk = PagedBatch([MIXED_CHUNK])

    def dispatch(pb, **kwargs):
        return lambda: ta.paged_attention_triton(
            pb.query, pb.k_cache, pb.v_cache, pb.block_tables, pb.query_start_loc, pb.seq_lens, pb.scale,
            max_query_len=pb.max_query_len, out=pb.out, **kwargs)

    report["mixed_us"] = {
        "mixed, decode rows split off (default)": 1e3 * bench(dispatch(mixed)),
        "mixed, all in the prefill kernel": 1e3 * bench(dispatch(mixed, split_decodes=False)),
        "decodes alone (decode kernel)": 1e3 * bench(dispatch(only)),
        "decodes alone (prefill kernel)": 1e3 * bench(lambda: ta.triton_prefill_attention(
            only.query, only.k_cache, only.v_cache, only.block_tables, only.query_start_loc, only.seq_lens,
            only.scale, max_query_len=1, out=only.out)),
        "chunk alone (prefill kernel)": 1e3 * bench(dispatch(chunk, split_decodes=False)),
    }
    for k, v in report["mixed_us"].items():
        print(f"  {k}: {v:.1f}")

    print("\nJSON " + json.dumps(report))


if __name__ == "__main__":
    main()
