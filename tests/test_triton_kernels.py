"""The Triton kernels against their plain-PyTorch oracles, on the GPU.

Every case builds a fresh paged cache whose unused slots (spare blocks, the
tail of each sequence's last block, and the block-table entries past each
sequence) hold NaN, and poisons the output with NaN: a kernel that reads past
``seq_len`` or skips an output element shows up as NaN.

The case builders and checks are shared with ``test_triton_interpret.py``,
which runs small shapes on the CPU under ``TRITON_INTERPRET=1``.
"""
import math
import random

import pytest
import torch

from mempath.kernels.attention_torch import paged_attention, write_kv

# Relative error ||out - ref|| / ||ref|| allowed against the float32 oracle.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}


class Case:
    """A batch of sequences laid out in a paged cache, with its query."""

    def __init__(self, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
                 seed=0, table_garbage="spare"):
        """``seqs``: list of ``(q_len, seq_len)``; ``table_garbage``: what fills the
        block-table entries past a sequence's blocks, "spare" (NaN blocks that
        exist) or "negative" (-1)."""
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.seqs = seqs
        self.block_size = block_size
        needed = [math.ceil(s / block_size) for _, s in seqs]
        spare = 3
        num_blocks = sum(needed) + spare
        max_blocks = max(needed + [1]) + 2
        perm = torch.randperm(num_blocks, generator=gen)
        spare_ids = perm[sum(needed):].tolist()

        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        tables = torch.empty(len(seqs), max_blocks, dtype=torch.int32)
        used = 0
        for b, ((_, seq_len), n) in enumerate(zip(seqs, needed)):
            ids = perm[used:used + n]
            used += n
            if table_garbage == "negative":
                tables[b].fill_(-1)
            else:
                tables[b] = torch.tensor([rng.choice(spare_ids) for _ in range(max_blocks)])
            tables[b, :n] = ids.to(torch.int32)
            slots = ids.repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(n)
            slots = slots[:seq_len]
            k_flat = self.k_cache.view(-1, num_kv_heads, head_dim)
            v_flat = self.v_cache.view(-1, num_kv_heads, head_dim)
            k_flat[slots] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
            v_flat[slots] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)

        q_lens = [q for q, _ in seqs]
        self.num_tokens = sum(q_lens)
        self.query = torch.randn(self.num_tokens, num_heads, head_dim, generator=gen).to(dtype)
        self.query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        self.seq_lens = torch.tensor([s for _, s in seqs], dtype=torch.int32)
        self.block_tables = tables
        self.max_query_len = max(q_lens + [0])
        self.scale = 1.0 / math.sqrt(head_dim)
        for name in ("k_cache", "v_cache", "block_tables", "query", "query_start_loc", "seq_lens"):
            setattr(self, name, getattr(self, name).to(device))

    def reference(self) -> torch.Tensor:
        """The float32 oracle on the same (already rounded) inputs."""
        return paged_attention(
            self.query.float(), self.k_cache.float(), self.v_cache.float(), self.block_tables,
            self.query_start_loc, self.seq_lens, self.scale,
        )

    def poisoned_out(self) -> torch.Tensor:
        return torch.full_like(self.query, float("nan"))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), f"{torch.isnan(out).sum().item()} NaN elements in the output"
    err = (out.float() - ref).norm() / ref.norm().clamp_min(1e-12)
    assert err < TOLERANCE[dtype], f"relative error {err.item():.3g} >= {TOLERANCE[dtype]}"


def check_write_kv(ta, num_tokens, num_kv_heads, head_dim, block_size, src_dtype, cache_dtype, device,
                   seed=0, exact=True):
    """``exact=False`` allows one unit in the last place: the interpreter rounds
    float32 -> bfloat16 towards zero where torch and the GPU round to nearest."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = math.ceil(num_tokens / block_size) + 2
    # Keys as a strided view of a fused QKV-like buffer, as the model produces them.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(src_dtype).to(device)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads:2 * num_kv_heads]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1
    slots = slots.to(torch.int64 if seed % 2 else torch.int32).to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    init_k = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
    init_v = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
    ref_k, ref_v = init_k.clone(), init_v.clone()
    write_kv(key, value, ref_k, ref_v, slots)
    k_cache, v_cache = init_k.clone(), init_v.clone()
    ta.triton_write_kv(key, value, k_cache, v_cache, slots)
    for got, want in ((k_cache, ref_k), (v_cache, ref_v)):
        if exact:
            assert torch.equal(got, want)
        else:
            ulp = torch.finfo(cache_dtype).eps * want.float().abs()
            assert torch.all((got.float() - want.float()).abs() <= ulp)


def check_attention(ta, case: Case, dtype, kernel="auto", **kwargs):
    ref = case.reference()
    out = case.poisoned_out()
    if kernel == "decode":
        result = ta.triton_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                            case.seq_lens, case.scale, out=out, **kwargs)
    elif kernel == "prefill":
        result = ta.triton_prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                             case.query_start_loc, case.seq_lens, case.scale,
                                             max_query_len=case.max_query_len, out=out, **kwargs)
    else:
        result = ta.paged_attention_triton(case.query, case.k_cache, case.v_cache, case.block_tables,
                                           case.query_start_loc, case.seq_lens, case.scale, out=out,
                                           **kwargs)
    assert result is out
    assert_close(out, ref, dtype)


def check_decode_seq_order(ta, device, dtype, head_dim=32, group=2):
    """The order the decode kernel starts the sequences in (``seq_order``) changes no result: the same
    bits as batch order, in one launch or split, alone or as a mixed batch's decode rows."""
    lens = [5, 300, 1, 77, 130, 64, 9, 200]
    case = Case([(1, n) for n in lens], 2 * group, 2, head_dim, 8, dtype, device, seed=11)
    longest_first = torch.tensor(sorted(range(len(lens)), key=lambda i: -lens[i]), dtype=torch.int32, device=device)
    shuffled = torch.tensor([3, 0, 7, 1, 6, 2, 5, 4], dtype=torch.int32, device=device)
    for splits in (1, 4):
        base = ta.triton_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                          case.scale, out=case.poisoned_out(), num_splits=splits)
        assert_close(base, case.reference(), dtype)
        for order in (longest_first, shuffled):
            out = ta.triton_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                             case.seq_lens, case.scale, out=case.poisoned_out(), num_splits=splits,
                                             seq_order=order)
            assert torch.equal(out, base)
    # A mixed batch: the decode kernel takes its one-row sequences in the given order, the prefill kernel the rest.
    mixed = Case([(1, 77), (33, 100), (1, 5), (7, 7), (1, 200)], 2 * group, 2, head_dim, 8, dtype, device, seed=12)
    order = torch.tensor([4, 1, 0, 3, 2], dtype=torch.int32, device=device)
    check_attention(ta, mixed, dtype, "auto", max_query_len=mixed.max_query_len, seq_order=order)


def check_decode_split_rows(ta, device, dtype, head_dim=32, group=2):
    """The splits a sequence fills (``decode_splits_used``, the host's count for the bench's reports) are the
    workspace rows the decode kernel writes; the others are left alone, and the merge gives the attention."""
    lens = [5, 300, 1, 77, 1030, 64, 9, 200]
    num_heads, splits, tile = 2 * group, 8, ta.DECODE_TILE
    case = Case([(1, n) for n in lens], num_heads, 2, head_dim, 8, dtype, device, seed=13)
    rows = len(lens) * num_heads * splits
    ws = ta.DecodeWorkspace(torch.full((rows * head_dim,), float("nan"), device=device),
                            torch.full((rows,), float("nan"), device=device))
    out = ta.triton_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                     case.scale, out=case.poisoned_out(), workspace=ws, num_splits=splits)
    assert_close(out, case.reference(), dtype)
    written = ~torch.isnan(ws.partial_lse.view(len(lens), num_heads, splits)).cpu()
    reported = ta.decode_splits_used(lens, splits, tile)
    assert reported[lens.index(1)] == 1 and 1 < reported[lens.index(1030)] < splits  # one split; several, not all
    for i, n in enumerate(lens):
        used = torch.arange(splits) < reported[i]
        assert torch.equal(written[i], used.expand(num_heads, splits)), (n, reported[i], written[i])


# --------------------------------------------------------------------------- GPU

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels need CUDA")
DEVICE = "cuda"


@pytest.fixture(scope="module")
def ta():
    pytest.importorskip("triton")
    from mempath.kernels import attention_triton

    assert attention_triton.HAS_TRITON
    return attention_triton


@cuda
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 256])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_write_kv(ta, head_dim, block_size, cache_dtype):
    check_write_kv(ta, 300, 8, head_dim, block_size, torch.float32, cache_dtype, DEVICE, seed=block_size)
    check_write_kv(ta, 7, 2, head_dim, block_size, cache_dtype, cache_dtype, DEVICE, seed=block_size + 1)


@cuda
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_block_boundaries(ta, group, head_dim):
    block_size = 16
    lens = [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 511, 512, 513, 1000]
    case = Case([(1, n) for n in lens], 4 * group, 4, head_dim, block_size, torch.bfloat16, DEVICE,
                seed=group * head_dim)
    # Forced splits (many, few, one), the automatic choice, and the dispatcher.
    for splits in (1, 4, 64):
        check_attention(ta, case, torch.bfloat16, "decode", num_splits=splits)
    check_attention(ta, case, torch.bfloat16, "decode")
    check_attention(ta, case, torch.bfloat16, "auto", max_query_len=1)


@cuda
@pytest.mark.parametrize("block_size", [8, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_block_sizes_dtypes(ta, block_size, dtype):
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size, 700]
    case = Case([(1, n) for n in lens], 16, 4, 128, block_size, dtype, DEVICE, seed=block_size,
                table_garbage="negative")
    for splits in (1, 8):
        check_attention(ta, case, dtype, "decode", num_splits=splits)


@cuda
@pytest.mark.parametrize("context", [4096, 32768])
def test_decode_long_context(ta, context):
    # Llama-3.1-8B shape; one long request alone in the batch and beside short ones.
    for seqs in ([(1, context)], [(1, context), (1, 5), (1, context // 3 + 7)]):
        case = Case(seqs, 32, 8, 128, 16, torch.bfloat16, DEVICE, seed=context)
        check_attention(ta, case, torch.bfloat16, "decode")
        check_attention(ta, case, torch.bfloat16, "decode", num_splits=1)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_seq_order_changes_no_result(ta, dtype):
    check_decode_seq_order(ta, DEVICE, dtype, head_dim=128, group=4)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_split_rows_are_the_reported_ones(ta, dtype):
    check_decode_split_rows(ta, DEVICE, dtype, head_dim=128, group=4)


@cuda
def test_decode_workspace_and_padding(ta):
    """Preallocated workspace reused across batch sizes; zero-length padding rows."""
    ws = ta.alloc_decode_workspace(64, 32, 8, 128, DEVICE)
    for batch in (1, 3, 17, 64):
        seqs = [(1, 1 + (i * 977) % 3000) for i in range(batch)]
        case = Case(seqs, 32, 8, 128, 16, torch.bfloat16, DEVICE, seed=batch)
        check_attention(ta, case, torch.bfloat16, "decode", workspace=ws)
    # A CUDA-graph padded batch: the padding sequences have seq_len 0 and get zeros.
    case = Case([(1, 40), (1, 300)], 32, 8, 128, 16, torch.bfloat16, DEVICE, seed=5)
    case.seq_lens[1] = 0
    out = ta.triton_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                     case.seq_lens, case.scale, out=case.poisoned_out(), workspace=ws,
                                     num_splits=4)
    assert torch.all(out[1] == 0)
    assert not torch.isnan(out[0]).any()


@cuda
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill(ta, group, head_dim):
    # Plain prefills at tile boundaries, and prompts over a cached prefix.
    # (5, 35), (5, 67), (5, 68): a chunk starting one or two keys before a KV tile edge.
    seqs = [(1, 1), (7, 7), (63, 63), (64, 64), (65, 65), (200, 200), (17, 100), (64, 1024), (129, 129),
            (5, 35), (5, 67), (5, 68)]
    case = Case(seqs, 4 * group, 4, head_dim, 16, torch.bfloat16, DEVICE, seed=group + head_dim)
    check_attention(ta, case, torch.bfloat16, "prefill")
    check_attention(ta, case, torch.bfloat16, "auto", max_query_len=case.max_query_len)


@cuda
@pytest.mark.parametrize("block_size", [8, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_block_sizes_dtypes(ta, block_size, dtype):
    seqs = [(block_size, block_size), (block_size + 1, 2 * block_size + 1), (30, 30), (1, 500)]
    case = Case(seqs, 8, 2, 128, block_size, dtype, DEVICE, seed=block_size, table_garbage="negative")
    check_attention(ta, case, dtype, "prefill")


@cuda
def test_chunked_prefill_matches_full_prefill(ta):
    """A 3000-token prompt fed in chunks over the cache gives the full prefill's rows."""
    prompt, chunk = 3000, 512
    full = Case([(prompt, prompt)], 32, 8, 128, 16, torch.bfloat16, DEVICE, seed=11)
    ref = full.reference()
    for begin in range(0, prompt, chunk):
        end = min(prompt, begin + chunk)
        rows = slice(begin, end)
        qsl = torch.tensor([0, end - begin], dtype=torch.int32, device=DEVICE)
        lens = torch.tensor([end], dtype=torch.int32, device=DEVICE)
        out = torch.full_like(full.query[rows], float("nan"))
        ta.triton_prefill_attention(full.query[rows], full.k_cache, full.v_cache, full.block_tables, qsl,
                                    lens, full.scale, max_query_len=end - begin, out=out)
        assert_close(out, ref[rows], torch.bfloat16)


@cuda
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch(ta, group):
    """Decode rows, a chunk over a long prefix and a fresh prompt in one launch."""
    seqs = [(1, 900), (1, 17), (256, 8192), (1, 1), (100, 100), (1, 4097), (33, 33 + 16 * 5)]
    case = Case(seqs, 4 * group, 4, 128, 16, torch.bfloat16, DEVICE, seed=group)
    check_attention(ta, case, torch.bfloat16, "auto")
    check_attention(ta, case, torch.bfloat16, "auto", max_query_len=case.max_query_len)
    # Everything through the prefill kernel.
    check_attention(ta, case, torch.bfloat16, "auto", split_decodes=False)
    # The decode rows through the decode kernel in one split and in many, into a preallocated workspace.
    ws = ta.alloc_decode_workspace(len(seqs), 4 * group, 4, 128, DEVICE)
    for splits in (1, 16):
        out = case.poisoned_out()
        ta.triton_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                   case.scale, out=out, workspace=ws,
                                   num_splits=splits, query_start_loc=case.query_start_loc)
        rows = case.query_start_loc[:-1][case.query_start_loc.diff() == 1].long()
        assert_close(out[rows], case.reference()[rows], torch.bfloat16)
        others = torch.ones(case.num_tokens, dtype=torch.bool, device=DEVICE)
        others[rows] = False
        assert torch.isnan(out[others]).all(), "decode kernel wrote rows of multi-row sequences"


@cuda
def test_odd_head_dims(ta):
    for head_dim in (32, 96, 256):
        dec = Case([(1, n) for n in (1, 100, 2000)], 8, 2, head_dim, 16, torch.bfloat16, DEVICE, seed=head_dim)
        check_attention(ta, dec, torch.bfloat16, "decode", num_splits=4)
        pre = Case([(50, 50), (20, 300)], 8, 2, head_dim, 16, torch.bfloat16, DEVICE, seed=head_dim)
        check_attention(ta, pre, torch.bfloat16, "prefill")


@cuda
def test_prefill_long_context(ta):
    case = Case([(1024, 32768), (300, 300)], 32, 8, 128, 16, torch.bfloat16, DEVICE, seed=3)
    check_attention(ta, case, torch.bfloat16, "prefill")
