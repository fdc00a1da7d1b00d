"""Triton kernels for the paged KV cache: the GPU fast path of ``attention_torch.py``.

The layout and the position rule are those of :mod:`mempath.kernels.attention_torch`, whose
plain-PyTorch ``write_kv`` / ``paged_attention`` are the oracles these kernels
are tested against.

Kernels
-------
- :func:`triton_write_kv` — scatter new K/V rows into their slots (quantized
  to an fp8 cache as ``attention_torch.quantize_kv`` does; the attention kernels
  dequantize such a cache in registers, to the query's dtype, or to float16 for a bfloat16
  query in the decode kernel).
- :func:`triton_decode_attention` — one query row per sequence. A program owns
  one (sequence, KV head, split): it handles every query head of its KV head so
  each KV block is read once per KV head, and a long context is cut into splits
  (flash-decoding) whose partial results a second small kernel merges.
- :func:`triton_prefill_attention` — variable-length query chunks on top of a
  cached prefix, flash-attention tiling (query tile x KV tile) with the KV read
  through the block table. Also correct for decode rows, so a mixed batch can
  use it.
- :func:`paged_attention_triton` — drop-in for ``paged_attention``; in a mixed
  batch the decode rows go to the decode kernel and the chunks to the prefill
  kernel (both launched, each skipping the other's sequences on the device);
  :func:`attend_triton` calls it with the model's AttentionMetadata.

Every attention kernel reads K and V through one helper, ``_load_kv_tile``: a
tile of token positions, looked up in the sequence's block-table row.

CUDA graphs
-----------
The decode kernel launches a grid that depends only on the batch size, the
head counts and ``num_splits`` (never on the data), and the splits' partials
go to a workspace that can be allocated once with
:func:`alloc_decode_workspace`. How many tokens a split covers is computed on
the device from ``seq_lens``, so the workspace does not grow with
``max_model_len``: it holds ``max_b(b * num_splits(b)) * num_heads * (head_dim + 1)``
float32 values, b ranging over 1..max_num_seqs (see ``decode_workspace_numel``).
The prefill kernel's grid depends on ``max_query_len``; pass it to avoid a
device-to-host sync.

Importing this module never fails: without Triton, ``HAS_TRITON`` is False
and the launchers raise.
"""
from typing import NamedTuple, Optional

import torch

from mempath.kernels.attention_torch import is_fp8
from mempath.kernels.common import HAS_TRITON, kv_fp8_max, next_pow2, pdl_options

if HAS_TRITON:
    import triton
    import triton.language as tl

    from mempath.kernels.common import pdl_wait, to_cache_dtype

LOG2E = 1.4426950408889634

# Tokens per KV tile in the decode kernel over a 16- or 32-bit cache (DECODE_TILE_FP8 over fp8).
# A split always covers a whole number of tiles, so the tile is also the smallest split.
DECODE_TILE = 64
# An fp8 cache's tile: twice the tokens of a 16-bit tile, the same bytes (BENCHMARKS.md,
# "fp8 KV cache on the H200", has the sweep).
DECODE_TILE_FP8 = 128
# The fp8 decode kernel's software-pipeline depth and warps (None: as over a 16-bit cache). Over
# fp8 the converted tiles fill the registers, so only 2 programs share an SM; a deeper pipeline
# keeps more of the next tiles' bytes in flight in shared memory instead (BENCHMARKS.md, "fp8 KV
# cache on the H200"); benchmarks/bench_fp8_kv.py --parts kernel sweeps them.
FP8_DECODE_STAGES = 5
FP8_DECODE_WARPS = None
# A cap on the fp8 decode kernel's registers a thread (None: the compiler's choice, ~200 at tile 128, so two
# programs an SM); under it the compiler spills to local memory. bench_fp8_kv.py's -r variants sweep it.
FP8_DECODE_MAXNREG = None
# The caps it takes: from 64 (below, a program spills most of its tiles), in the SM's allocation steps of 8.
FP8_DECODE_MAXNREG_CHOICES = range(64, 256, 8)
# Upper bound on splits per (sequence, KV head); beyond it the merge costs
# more than the extra parallelism brings.
MAX_DECODE_SPLITS = 64
# CUDA's limit on a grid's second axis, where the decode kernel puts the sequences.
MAX_GRID_Y = 65535
# Target number of decode programs per SM: enough to hide memory latency.
DECODE_PROGRAMS_PER_SM = 4


class DecodeWorkspace(NamedTuple):
    """Flat float32 buffers for the decode splits' partial results.

    ``partial_out`` holds the per-split normalised outputs and ``partial_lse``
    their log2-sum-exp2; each call views a prefix of them as
    ``[num_seqs, num_heads, num_splits(, head_dim)]``.
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor


_SM_COUNT = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter runs: any small number exercises the splits
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def decode_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    device: torch.device,
    max_seq_len: Optional[int] = None,
    tile: int = DECODE_TILE,
) -> int:
    """How many splits the decode kernel uses for this batch shape.

    Depends only on shapes (and the device), so a CUDA graph captured for a
    batch size keeps a valid choice. A power of two, to bound recompilations.
    """
    programs = max(1, num_seqs * num_kv_heads)
    want = -(-DECODE_PROGRAMS_PER_SM * _sm_count(device) // programs)
    if max_seq_len is not None:
        # A split never covers less than one tile.
        want = min(want, -(-max(1, max_seq_len) // tile))
    return min(MAX_DECODE_SPLITS, next_pow2(max(1, want)))


def decode_splits_used(seq_lens, num_splits: int, tile: int = DECODE_TILE) -> list[int]:
    """How many of its ``num_splits`` programs each sequence's context (host ints) fills in the decode
    kernel: the kernel's ``_split_len`` on the host, for reports (a program past them exits at once)."""
    used = []
    for n in map(int, seq_lens):
        share = -(-n // num_splits)
        per = -(-share // tile) * tile  # whole tiles
        used.append(-(-n // per) if per else 0)
    return used


def decode_workspace_numel(
    max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> int:
    """Elements of ``partial_out`` needed for any batch of up to ``max_num_seqs``.

    ``partial_lse`` needs ``1 / head_dim`` of it. ``max_model_len`` does not
    matter: longer contexts get longer splits, not more of them.
    """
    splits = (decode_num_splits(b, num_kv_heads, device) for b in range(1, max_num_seqs + 1))
    # A batch run in one split writes straight to the output.
    rows = max([b * n for b, n in enumerate(splits, start=1) if n > 1] or [1])
    return rows * num_heads * head_dim


def alloc_decode_workspace(
    max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, device
) -> DecodeWorkspace:
    """Allocate once (e.g. before CUDA-graph capture) and pass to every decode call."""
    device = torch.device(device)
    numel = decode_workspace_numel(max_num_seqs, num_heads, num_kv_heads, head_dim, device)
    return DecodeWorkspace(
        partial_out=torch.empty(numel, dtype=torch.float32, device=device),
        partial_lse=torch.empty(numel // head_dim, dtype=torch.float32, device=device),
    )


def _require_triton():
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed: the GPU attention kernels are unavailable")


def _dot_precision(dtype: torch.dtype) -> str:
    # Plain TF32 would cost float32 caches about three decimal digits; three
    # TF32 products restore float32 accuracy on the tensor cores, where "ieee"
    # falls back to FMAs and spills.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _pipeline_stages(tile_bytes: int) -> int:
    # Keep the K/V double/triple buffers well inside the ~228 KB of shared memory.
    return max(1, min(3, (128 * 1024) // max(1, tile_bytes)))


if HAS_TRITON:

    @triton.jit
    def _decode_row(query_start_ptr, seq, VARLEN: tl.constexpr):
        """Sequence ``seq``'s query row, and whether it is a decode row. VARLEN: a mixed
        batch, whose single-row sequences the decode kernels take (the prefill kernel the rest)."""
        if VARLEN:
            q_row = tl.load(query_start_ptr + seq)
            is_decode = tl.load(query_start_ptr + seq + 1) - q_row == 1
        else:
            q_row = seq
            is_decode = True
        return q_row, is_decode

    @triton.jit
    def _split_len(seq_len, num_splits, TILE: tl.constexpr):
        """Tokens per decode split: whole tiles, so the count of non-empty splits follows."""
        return ((seq_len + num_splits - 1) // num_splits + TILE - 1) // TILE * TILE

    @triton.jit
    def _decode_seq(query_start_ptr, seq_lens_ptr, seq, num_splits, VARLEN: tl.constexpr, TILE: tl.constexpr):
        """What the split and merge kernels both need of sequence ``seq``: its query row, whether it
        is a decode row (``_decode_row``), its context length and its split length (``_split_len``)."""
        q_row, is_decode = _decode_row(query_start_ptr, seq, VARLEN)
        seq_len = tl.load(seq_lens_ptr + seq)
        return q_row, is_decode, seq_len, _split_len(seq_len, num_splits, TILE)

    @triton.jit
    def _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, pos, valid, kv_head, dims, dim_mask,
                      stride_kc_blk, stride_kc_off, stride_kc_h, stride_kc_d,
                      stride_vc_blk, stride_vc_off, stride_vc_h, stride_vc_d,
                      compute_dtype, BLOCK_SIZE: tl.constexpr):
        """K and V of one KV head at token positions ``pos`` of a sequence, found through its
        block-table row ``bt_row``, in ``compute_dtype`` (an fp8 cache is dequantized here, scale
        1.0; otherwise a no-op). ``valid`` masks positions past the range; None: every position
        is in range, and the loads need no mask but the head dimension's."""
        if valid is None:
            block = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
        else:
            block = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = dim_mask[None, :] if valid is None else valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kc_blk + offset[:, None] * stride_kc_off
                    + kv_head * stride_kc_h + dims[None, :] * stride_kc_d,
                    mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vc_blk + offset[:, None] * stride_vc_off
                    + kv_head * stride_vc_h + dims[None, :] * stride_vc_d,
                    mask=kv_mask, other=0.0)
        return k.to(compute_dtype), v.to(compute_dtype)

    @triton.jit
    def _write_kv_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_kc_blk, stride_kc_off, stride_kc_h, stride_kc_d,
        stride_vc_blk, stride_vc_off, stride_vc_h, stride_vc_d,
        num_kv_heads,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HEADS_PER_PROG: tl.constexpr, D_PAD: tl.constexpr, KV_FP8_MAX: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot < 0:
            return
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.program_id(1) * HEADS_PER_PROG + tl.arange(0, HEADS_PER_PROG)
        dims = tl.arange(0, D_PAD)
        mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_DIM)[None, :]
        token64 = token.to(tl.int64)

        k = tl.load(key_ptr + token64 * stride_kt + heads[:, None] * stride_kh
                    + dims[None, :] * stride_kd, mask=mask)
        v = tl.load(value_ptr + token64 * stride_vt + heads[:, None] * stride_vh
                    + dims[None, :] * stride_vd, mask=mask)
        k_dst = (k_cache_ptr + block * stride_kc_blk + offset * stride_kc_off
                 + heads[:, None] * stride_kc_h + dims[None, :] * stride_kc_d)
        v_dst = (v_cache_ptr + block * stride_vc_blk + offset * stride_vc_off
                 + heads[:, None] * stride_vc_h + dims[None, :] * stride_vc_d)
        tl.store(k_dst, to_cache_dtype(k, k_cache_ptr.dtype.element_ty, KV_FP8_MAX), mask=mask)
        tl.store(v_dst, to_cache_dtype(v, v_cache_ptr.dtype.element_ty, KV_FP8_MAX), mask=mask)

    # Integers that vary with the batch are not specialised on (Triton would compile a
    # variant for == 1 and for multiples of 16): a new variant mid-serving costs a
    # compile of hundreds of milliseconds inside a step.
    @triton.jit(do_not_specialize=["num_heads", "num_splits"])
    def _decode_split_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, seq_order_ptr,
        out_ptr, part_out_ptr, part_lse_ptr,
        qk_scale,
        stride_qt, stride_qh, stride_qd,
        stride_kc_blk, stride_kc_off, stride_kc_h, stride_kc_d,
        stride_vc_blk, stride_vc_off, stride_vc_h, stride_vc_d,
        stride_bt,
        stride_ot, stride_oh, stride_od,
        num_heads, num_splits,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
        SPLIT: tl.constexpr, PRECISION: tl.constexpr, VARLEN: tl.constexpr, KV_FP8: tl.constexpr,
        DOTS_FP16: tl.constexpr, ORDERED: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        # The KV heads vary fastest, so a sequence's programs start together; with ORDERED the
        # sequences start in seq_order's order (longest first: the last programs are short ones).
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
        if ORDERED:
            seq = tl.load(seq_order_ptr + seq)
        split = tl.program_id(2)
        q_row, is_decode, seq_len, split_len = _decode_seq(query_start_ptr, seq_lens_ptr, seq, num_splits,
                                                           VARLEN, TILE)
        if not is_decode:
            return
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
        if SPLIT:
            if start >= seq_len:
                return

        g = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, D_PAD)
        heads = kv_head * GROUP + g
        head_mask = g < GROUP
        dim_mask = dims < HEAD_DIM
        q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                    + dims[None, :] * stride_qd,
                    mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
        if not KV_FP8:
            q = q.to(k_cache_ptr.dtype.element_ty)
        elif DOTS_FP16:
            # e4m3 and e5m2 convert to float16 in one instruction per two values, to bfloat16 only
            # through float32; float16 holds every fp8 value, and the query once clamped to its range.
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        # Finite start value: rows padded past GROUP never produce inf - inf.
        m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
        tok = tl.arange(0, TILE)
        for n in range(start, end, TILE):
            pos = n + tok
            valid = pos < end
            k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, pos, valid, kv_head, dims, dim_mask,
                                 stride_kc_blk, stride_kc_off, stride_kc_h, stride_kc_d,
                                 stride_vc_blk, stride_vc_off, stride_vc_h, stride_vc_d, q.dtype, BLOCK_SIZE)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        # An empty sequence (padding in a captured batch) yields zeros.
        out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        out_mask = head_mask[:, None] & dim_mask[None, :]
        if SPLIT:
            row = (seq * num_heads + heads).to(tl.int64) * num_splits + split
            tl.store(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)
            tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=head_mask)
        else:
            tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                     + dims[None, :] * stride_od,
                     out.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit(do_not_specialize=["num_heads", "num_splits"])
    def _decode_merge_kernel(
        seq_lens_ptr, query_start_ptr, part_out_ptr, part_lse_ptr, out_ptr,
        stride_ot, stride_oh, stride_od,
        num_heads, num_splits,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        SPLITS_PAD: tl.constexpr, TILE: tl.constexpr, VARLEN: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        seq = tl.program_id(0)
        head = tl.program_id(1)
        q_row, is_decode, seq_len, split_len = _decode_seq(query_start_ptr, seq_lens_ptr, seq, num_splits,
                                                           VARLEN, TILE)
        if not is_decode:
            return
        # Which splits wrote.
        used = (seq_len + split_len - 1) // tl.maximum(split_len, 1)

        splits = tl.arange(0, SPLITS_PAD)
        dims = tl.arange(0, D_PAD)
        split_mask = splits < used
        row = (seq * num_heads + head).to(tl.int64) * num_splits + splits
        lse = tl.load(part_lse_ptr + row, mask=split_mask, other=float("-inf"))
        lse_max = tl.maximum(tl.max(lse, 0), -1.0e30)
        weight = tl.exp2(lse - lse_max)
        weight = weight / tl.maximum(tl.sum(weight, 0), 1.0e-30)
        part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
                       mask=split_mask[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
        out = tl.sum(part * weight[:, None], 0)
        tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + dims * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)

    @triton.jit(do_not_specialize=["num_q_tiles"])
    def _prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr,
        out_ptr,
        qk_scale,
        stride_qt, stride_qh, stride_qd,
        stride_kc_blk, stride_kc_off, stride_kc_h, stride_kc_d,
        stride_vc_blk, stride_vc_off, stride_vc_h, stride_vc_d,
        stride_bt,
        stride_ot, stride_oh, stride_od,
        num_q_tiles,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr, SKIP_DECODE: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        # The longest-running tiles (the last queries, which see the most keys)
        # are launched first.
        q_tile = num_q_tiles - 1 - tl.program_id(0)
        seq = tl.program_id(1)
        kv_head = tl.program_id(2)
        BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD

        q_begin = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_begin
        q_first = q_tile * BLOCK_Q
        if q_first >= q_len:
            return
        if SKIP_DECODE:
            if q_len == 1:  # done by the decode kernel
                return
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len  # tokens before the first query row

        # A row of the tile is (query token, query head of this KV head): all
        # heads sharing the KV head share each K/V tile load.
        rows = tl.arange(0, BLOCK_M)
        tok = q_first + rows // GROUP_PAD
        g = rows % GROUP_PAD
        heads = kv_head * GROUP + g
        row_mask = (tok < q_len) & (g < GROUP)
        dims = tl.arange(0, D_PAD)
        dim_mask = dims < HEAD_DIM
        q_rows = (q_begin + tok).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh
                    + dims[None, :] * stride_qd,
                    mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
        if not KV_FP8:
            q = q.to(k_cache_ptr.dtype.element_ty)
        q_pos = context + tok

        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        cols = tl.arange(0, BLOCK_N)

        # Keys up to the tile's first query position are seen by every row:
        # those KV tiles need no mask at all.
        first_pos = context + q_first
        full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        for n in range(0, full_end, BLOCK_N):
            pos = n + cols
            k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, pos, None, kv_head, dims, dim_mask,
                                 stride_kc_blk, stride_kc_off, stride_kc_h, stride_kc_d,
                                 stride_vc_blk, stride_vc_off, stride_vc_h, stride_vc_d, q.dtype, BLOCK_SIZE)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        # The diagonal band: causal mask, and never past the context.
        kv_end = tl.minimum(seq_len, context + q_first + BLOCK_Q)
        for n in range(full_end, kv_end, BLOCK_N):
            pos = n + cols
            valid = pos < kv_end
            k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, pos, valid, kv_head, dims, dim_mask,
                                 stride_kc_blk, stride_kc_off, stride_kc_h, stride_kc_d,
                                 stride_vc_blk, stride_vc_off, stride_vc_h, stride_vc_d, q.dtype, BLOCK_SIZE)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh
                 + dims[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def _compute_dtype(query: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """What the attention kernels multiply in: the cache dtype, or the query's over an fp8 cache
    (except the decode kernel's float16 for a bfloat16 query over fp8: its launcher says so)."""
    return query.dtype if is_fp8(k_cache.dtype) else k_cache.dtype


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")


def triton_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton twin of ``write_kv``: store ``[num_tokens, num_kv_heads, head_dim]`` rows.

    Negative slots are skipped; values are cast to the cache dtype.
    """
    _require_triton()
    _check_cache(k_cache, v_cache)
    num_tokens = key.shape[0]
    if slot_mapping.shape[0] != num_tokens or value.shape[0] != num_tokens:
        raise ValueError("key, value and slot_mapping must have one row per token")
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    d_pad = next_pow2(head_dim)
    # ~2K elements per program: one wide vector store per head row.
    heads_per_prog = min(next_pow2(num_kv_heads), max(1, 2048 // d_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_per_prog))
    _write_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        HEADS_PER_PROG=heads_per_prog, D_PAD=d_pad, KV_FP8_MAX=kv_fp8_max(k_cache.dtype),
        **pdl_options(key.device),
        num_warps=4 if heads_per_prog * d_pad >= 1024 else 2,
    )


def triton_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[DecodeWorkspace] = None,
    num_splits: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    query_start_loc: Optional[torch.Tensor] = None,
    seq_order: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of one query row per sequence (``query: [B, num_heads, head_dim]``).

    ``num_splits`` defaults to :func:`decode_num_splits` (shape-only, so safe
    under CUDA graphs); ``max_seq_len``, if given, only lets it pick fewer
    splits for short contexts. With ``workspace`` (see
    :func:`alloc_decode_workspace`) and ``out`` the call allocates nothing.

    With ``query_start_loc``, ``query`` is a mixed batch's flattened rows: only
    the sequences with exactly one query row are computed, the other rows of
    ``out`` are left alone (for :func:`triton_prefill_attention` with
    ``skip_decode=True``).

    ``seq_order`` (int32 [B], a permutation of the sequences): the order in which the kernel starts
    them, all of one sequence's KV heads together. Longest first (the runner's order), a batch of
    unequal contexts ends with short programs instead of a long one started last: BENCHMARKS.md,
    "Decode attention over unequal contexts". It changes no result.
    """
    _require_triton()
    _check_cache(k_cache, v_cache)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError("query and cache head shapes do not match")
    if query_start_loc is None and query.shape[0] != num_seqs:
        raise ValueError("decode takes one query row per sequence (or pass query_start_loc)")
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    varlen = query_start_loc is not None
    query_start = query_start_loc if varlen else seq_lens  # unused by the kernel unless varlen
    group = num_heads // num_kv_heads
    kv_fp8 = is_fp8(k_cache.dtype)
    tile = DECODE_TILE_FP8 if kv_fp8 else DECODE_TILE
    if kv_fp8 and (tile < 16 or tile & (tile - 1) or FP8_DECODE_STAGES not in (None, *range(1, 9))
                   or FP8_DECODE_WARPS not in (None, 1, 2, 4, 8)
                   or not (FP8_DECODE_MAXNREG is None
                           or type(FP8_DECODE_MAXNREG) is int and FP8_DECODE_MAXNREG in FP8_DECODE_MAXNREG_CHOICES)):
        raise ValueError(f"fp8 decode: DECODE_TILE_FP8 must be a power of two >= 16, FP8_DECODE_STAGES None or "
                         f"1-8, FP8_DECODE_WARPS None, 1, 2, 4 or 8 and FP8_DECODE_MAXNREG None or a multiple of 8 "
                         f"in 64-248; got {tile}, {FP8_DECODE_STAGES}, {FP8_DECODE_WARPS} and {FP8_DECODE_MAXNREG}")
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, query.device, max_seq_len, tile)
    d_pad = next_pow2(head_dim)
    split = num_splits > 1
    if split:
        need = num_seqs * num_heads * num_splits
        if workspace is None:
            workspace = DecodeWorkspace(
                torch.empty(need * head_dim, dtype=torch.float32, device=query.device),
                torch.empty(need, dtype=torch.float32, device=query.device),
            )
        elif workspace.partial_lse.numel() < need or workspace.partial_out.numel() < need * head_dim:
            raise ValueError(
                f"decode workspace too small: need {need} rows for {num_seqs} seqs x {num_splits} splits"
            )
        part_out, part_lse = workspace.partial_out, workspace.partial_lse
    else:
        part_out = part_lse = out  # unused by the kernel

    dots_fp16 = kv_fp8 and query.dtype == torch.bfloat16
    stages = _pipeline_stages(2 * tile * d_pad * k_cache.element_size())
    warps = 4
    registers = {}
    if kv_fp8:
        stages = FP8_DECODE_STAGES or stages
        warps = FP8_DECODE_WARPS or warps
        if FP8_DECODE_MAXNREG is not None:
            registers = {"maxnreg": FP8_DECODE_MAXNREG}
    pdl = pdl_options(query.device)
    ordered = seq_order is not None
    if ordered and (seq_order.shape != (num_seqs,) or seq_order.dtype != torch.int32
                    or seq_order.device != query.device or seq_order.stride(0) != 1):
        raise ValueError(f"decode: seq_order must be a contiguous int32 [{num_seqs}] on {query.device} (a "
                         f"permutation of the batch's sequences), got {seq_order.dtype} {tuple(seq_order.shape)} on "
                         f"{seq_order.device}: pass one entry per sequence, or None")
    if num_seqs > MAX_GRID_Y:
        raise ValueError(f"decode: at most {MAX_GRID_Y} sequences a call (the grid's second axis), got {num_seqs}: "
                         f"split the batch")
    _decode_split_kernel[(num_kv_heads, num_seqs, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start, seq_order if ordered else seq_lens,
        out, part_out, part_lse,
        scale * LOG2E,
        *query.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        num_heads, num_splits,
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, TILE=tile,
        SPLIT=split, PRECISION=_dot_precision(torch.float16 if dots_fp16 else _compute_dtype(query, k_cache)),
        VARLEN=varlen, KV_FP8=kv_fp8, DOTS_FP16=dots_fp16, ORDERED=ordered,
        **pdl, **registers, num_warps=warps, num_stages=stages,
    )
    if split:
        _decode_merge_kernel[(num_seqs, num_heads)](
            seq_lens, query_start, part_out, part_lse, out,
            *out.stride(),
            num_heads, num_splits,
            HEAD_DIM=head_dim, D_PAD=d_pad,
            # One width for every split count: one compiled variant (unused splits are masked).
            SPLITS_PAD=next_pow2(MAX_DECODE_SPLITS), TILE=tile, VARLEN=varlen,
            **pdl,
            num_warps=4 if next_pow2(MAX_DECODE_SPLITS) * d_pad <= 8192 else 8,
        )
    return out


class PrefillConfig(NamedTuple):
    block_m: int  # tile rows: query tokens x query heads of one KV head
    block_n: int  # keys per KV tile
    num_warps: int
    num_stages: int


def prefill_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """Default tiles, sized to keep Q, K and V tiles in shared memory."""
    d_pad = next_pow2(head_dim)
    if dtype == torch.float32:
        # Float32 tiles (and the 3-pass TF32 dots) are twice as large: keep them small.
        block_m, block_n, num_warps = 32, 32, 4
    elif d_pad > 128:
        block_m, block_n, num_warps = 64, 32, 8
    elif d_pad <= 64:
        block_m, block_n, num_warps = 128, 64, 4
    else:
        # Measured on an H200 (Llama-8B shape): 8-12% faster than 128x64 with 8 warps.
        block_m, block_n, num_warps = 64, 64, 4
    stages = _pipeline_stages(2 * block_n * d_pad * _element_size(dtype))
    return PrefillConfig(block_m, block_n, num_warps, stages)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def triton_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    skip_decode: bool = False,
    config: Optional[PrefillConfig] = None,
) -> torch.Tensor:
    """Causal attention of variable-length query chunks over paged K/V.

    Same semantics as ``paged_attention``: works for plain prefill, a prefill
    over a cached prefix, a chunk of a chunked prefill and decode rows alike.
    ``max_query_len`` (the longest chunk) sizes the grid; omitting it costs a
    device-to-host sync. Query rows not owned by any sequence are not written,
    nor, with ``skip_decode``, those of single-row sequences. ``config``
    overrides :func:`prefill_config` (for tuning).
    """
    _require_triton()
    _check_cache(k_cache, v_cache)
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError("query and cache head shapes do not match")
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if max_query_len is None:
        max_query_len = _max_query_len(query_start_loc)
    if num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    config = config or prefill_config(head_dim, _compute_dtype(query, k_cache))
    # At least one query token per tile, whatever the group size.
    block_m = max(config.block_m, group_pad)
    num_q_tiles = triton.cdiv(max_query_len, block_m // group_pad)
    _prefill_kernel[(num_q_tiles, num_seqs, num_kv_heads)](
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        out,
        scale * LOG2E,
        *query.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        num_q_tiles,
        GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=config.block_n,
        PRECISION=_dot_precision(_compute_dtype(query, k_cache)), SKIP_DECODE=skip_decode,
        KV_FP8=is_fp8(k_cache.dtype),
        **pdl_options(query.device),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def _max_query_len(query_start_loc: torch.Tensor) -> int:
    """The longest query chunk; a device-to-host sync."""
    if query_start_loc.shape[0] < 2:
        return 0
    return int((query_start_loc[1:] - query_start_loc[:-1]).max().item())


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[DecodeWorkspace] = None,
    split_decodes: bool = True,
    seq_order: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Drop-in for ``paged_attention``.

    - every sequence has one query row: the decode kernel;
    - otherwise the prefill kernel, and with ``split_decodes`` (the default)
      the decode kernel too, for the single-row sequences of the batch, which
      the prefill kernel then skips: its query tiles would be almost empty for
      them. Both choose per sequence on the device, so this stays
      graph-capturable; pass ``split_decodes=False`` for batches known to hold
      no decode rows, to save the decode launch.

    Pass ``max_query_len`` to skip a device-to-host sync (and for CUDA graphs);
    ``max_seq_len``, ``workspace`` and ``seq_order`` go to :func:`triton_decode_attention`.
    """
    num_seqs = seq_lens.shape[0]
    if max_query_len is None:
        max_query_len = _max_query_len(query_start_loc)
    # q_len <= 1 everywhere and num_tokens == num_seqs means q_len == 1
    # everywhere, i.e. row b belongs to sequence b.
    if max_query_len == 1 and query.shape[0] == num_seqs:
        return triton_decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, scale,
            out=out, workspace=workspace, max_seq_len=max_seq_len, seq_order=seq_order,
        )
    if out is None:
        out = torch.empty_like(query)
    if split_decodes and max_query_len > 1:
        triton_decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, scale,
            out=out, workspace=workspace, max_seq_len=max_seq_len, query_start_loc=query_start_loc,
            seq_order=seq_order,
        )
    return triton_prefill_attention(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
        max_query_len=max_query_len, out=out, skip_decode=split_decodes and max_query_len > 1,
    )


def attend_triton(query, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    """`paged_attention_triton` called with an AttentionMetadata (the model's calling convention)."""
    return paged_attention_triton(
        query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, workspace=meta.decode_workspace,
        seq_order=meta.seq_order)
