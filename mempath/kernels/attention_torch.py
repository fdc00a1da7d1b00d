"""Attention over the paged KV cache and the KV write, in plain PyTorch.

This is the CPU path and the oracle for the Triton kernels (attention_triton.py). Layout, shared by
every implementation:

- one layer's cache is ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``;
- a *slot* is ``block_id * block_size + offset``; ``slot_mapping[i] < 0`` means
  "do not write token i" (padding);
- a batch of sequences is flattened: ``q: [num_tokens, num_heads, head_dim]``,
  sequence ``b`` owns query rows ``query_start_loc[b]:query_start_loc[b + 1]``;
- ``seq_lens[b]`` is the sequence's context length *including* the new tokens,
  whose K/V have already been written to the cache; query row ``i`` of sequence
  ``b`` sits at position ``seq_lens[b] - q_len_b + i`` and sees keys at positions
  up to and including its own. That one rule covers decode, plain prefill, a
  prefill on top of a cached prefix, and a chunk of a chunked prefill.

An fp8 cache (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``) holds K and V
with a static scale of 1.0 (docs/architecture.md, "fp8 KV cache", for the
measurement behind it): written as the value clamped to the format's finite
range and rounded to nearest even, read back by a plain cast. Every
implementation does exactly this, so the twins agree bit for bit.
"""
import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it. For fp8, saturating: a plain cast turns values past
    the format's largest into NaN (e4m3) or inf (e5m2), which would poison every score."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    return x.float().clamp(-limit, limit).to(cache_dtype)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # Indexed by (block, offset), not through a flattened view: a model sharing a page pool
    # with others (mempath/multi) has blocks a page apart, and such a cache has no flat view.
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    for rows, cache in ((key, k_cache), (value, v_cache)):
        stored = quantize_kv(rows[keep], cache.dtype)
        if is_fp8(cache.dtype):
            # PyTorch's CPU indexing kernels have no float8 variant; the bytes are the same.
            cache, stored = cache.view(torch.uint8), stored.view(torch.uint8)
        cache[blocks, offsets] = stored


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence, ``[seq_len, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged K/V.

    Computed in float32 whatever the cache dtype, so it can serve as the oracle;
    an fp8 cache is dequantized by the cast (scale 1.0).
    """
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_begin, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len).float()
        v = gather_kv(v_cache, block_tables[b], seq_len).float()
        # GQA: each KV head serves `group` consecutive query heads.
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[q_begin:q_end].float().transpose(0, 1)  # [H, Q, D]
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, Q, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_begin:q_end] = torch.matmul(probs, v).transpose(0, 1).to(query.dtype)
    return out


def attend_torch(query, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    """`paged_attention` called with an AttentionMetadata (the model's calling convention)."""
    return paged_attention(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                           meta.seq_lens, scale)
