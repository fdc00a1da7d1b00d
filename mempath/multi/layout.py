"""How each model's KV blocks sit in the shared page pool (docs/multi_model.md, "Pages").

A page is the largest model's block at the configured block size, with every layer's K
and V of its tokens in it. Every other model's block size is the configured one times the
largest power of two whose block still fits a page, so one block is one page for every
model: a block id is a page id, any free page serves any model, and a model with a
quarter of the largest one's KV per token holds four times the tokens per page.
"""
from __future__ import annotations

import torch


def kv_bytes_per_token(spec, kv_dtype: torch.dtype) -> int:
    """One token's K and V over all of a model's layers (ModelRunner.kv_bytes_per_block's terms)."""
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * kv_dtype.itemsize


def page_layout(bytes_per_token: list[int], block_size: int) -> tuple[int, list[int]]:
    """The page's bytes and each model's block size (tokens), one block per page."""
    page_bytes = max(bytes_per_token) * block_size
    sizes = []
    for per_token in bytes_per_token:
        size = block_size
        while per_token * size * 2 <= page_bytes:
            size *= 2
        sizes.append(size)
    return page_bytes, sizes


def allocate_pages(num_pages: int, page_bytes: int, device: torch.device) -> torch.Tensor:
    """The pool's one allocation: ``num_pages`` pages of ``page_bytes`` bytes."""
    return torch.empty(num_pages, page_bytes, dtype=torch.uint8, device=device)


def attach_pages(runner, pages: torch.Tensor) -> None:
    """Point a model's KV cache at the pool: block p of every layer lies in page p.

    ``runner.kv_cache`` keeps the runner's ``[layers, 2, blocks, block_size, kv_heads,
    head_dim]`` shape as a view whose block stride is one page; the attention layers'
    caches are its slices, as ModelRunner.allocate_kv_cache makes them.
    """
    s = runner.spec
    kv_dtype = runner.config.kv_torch_dtype(runner.dtype)
    storage_dtype = torch.uint8 if kv_dtype.itemsize == 1 else kv_dtype
    num_pages = pages.shape[0]
    block_elems = runner.kv_bytes_per_block() // storage_dtype.itemsize
    per_page = pages.view(storage_dtype)  # [num_pages, page_bytes / itemsize]
    blocks = per_page[:, :block_elems].view(num_pages, s.num_layers, 2, runner.block_size, s.num_kv_heads, s.head_dim)
    runner.graphs.clear()  # graphs captured against an old cache would read freed memory
    runner.graph_logits = None
    runner.kv_cache = blocks.permute(1, 2, 0, 3, 4, 5)
    for i, attn in enumerate(runner.model.attention_layers()):
        attn.k_cache = runner.kv_cache[i, 0].view(kv_dtype)
        attn.v_cache = runner.kv_cache[i, 1].view(kv_dtype)
