"""A MoE layer's routed experts in two grouped-GEMM launches (gate/up, then down), capturable in a CUDA graph.

The PyTorch twin is ``mempath.model.moe.Experts.forward`` with ``combine``: the same
groups, one matmul per expert and projection, with the group sizes read on the host.
Here nothing is read on the host, so a decode CUDA graph can hold the layer:

- ``align_to_blocks`` sorts the (token, choice) pairs by expert on the device and pads
  each expert's group to a multiple of BLOCK_M (the idea of vLLM's
  ``moe_align_block_size``): a row block then belongs to one expert, and a block→expert
  map says which (-1: past the last group). The number of blocks has a bound that
  depends only on the shapes, ``cdiv(pairs, BLOCK_M) + min(pairs, E)``, so the grid is
  fixed for a captured batch size and the empty blocks return at once. A single token (decode
  at batch 1) needs none of it: its k experts are distinct, so each pair is a group of one, and the
  GEMMs run one pair a block straight from the router's ids (``ONE_TOKEN_UNALIGNED``).
- ``_grouped_gemm_kernel``: each program takes one row block and one column tile,
  loads its expert from the map, gathers its rows (the token's hidden state for
  gate/up, the pair's activation for down) and writes the pair's output row, the
  down projection's already weighted by the router.
- ``_sum_pairs_kernel`` (``triton_sum_pairs``, twin ``sum_pairs``): each token's k float32
  pair rows added in float32 and cast to the model dtype in one launch.
- ``_router_logits_kernel`` (``triton_router_logits``, twin ``F.linear``): the router's logits
  of a decode batch (at most ``ROUTER_KERNEL_MAX_ROWS`` tokens), its weight split over about
  16 programs (the matmul library runs a [128, 2048] router on two thread blocks) and its first
  block read before the wait for the kernel before it (programmatic dependent launch: the
  weights are never written by a step).

Every launch here waits for the kernel before it on the device (programmatic dependent launch,
mempath.kernels.common.pdl_options), so at batch 1 a layer's chain of small launches starts each
one while the previous drains; ``MOE_CHAIN_PDL = False`` launches route, align and the grouped GEMMs
plainly, for A/B measurements.

Float32 inputs are multiplied in IEEE float32 (no TF32), so the oracle comparison is
against the twin's float32 arithmetic, not a lower precision.

Each launch's tile and pipeline (:class:`GroupedGemmConfig`) is chosen by the GEMM's shape
(N, K), the dtype and the number of pairs (rows) of the call only (``grouped_gemm_config``):
never by the number of experts or of active groups, so an expert cache running the kernel
over a subset of slots, with the same pairs, computes every row exactly as the all-resident
run does. Measured configurations are read from ``mempath/assets/moe_gemm_configs.json``
(written by benchmarks/bench_moe_gemm.py, ``MEMPATH_MOE_GEMM_CONFIGS`` names another file),
keyed by shape, then row block, then (decode) pairs rounded up to a power of two; a shape it
does not list gets the fixed launch the kernel always had (``default_config``).
"""
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mempath.kernels.common import HAS_TRITON, next_pow2, pdl_options, read_config, read_table_file, table_path

if HAS_TRITON:
    import triton
    import triton.language as tl

    from mempath.kernels.common import pdl_wait

    @triton.jit
    def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, pair_ptr, block_expert_ptr, weight_ptr, n, k, num_experts,
                             stride_am, stride_be, stride_bn, stride_bk, stride_cm, ROWS_PER_A: tl.constexpr,
                             WEIGHTED: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PAIR: tl.constexpr,
                             PDL: tl.constexpr):
        """ONE_PAIR: block b is pair b alone (its row 0; ``block_expert_ptr`` the pairs' experts), for one
        token, whose k experts are distinct: no align launch, and each row is the product it is in a group."""
        pdl_wait(PDL)  # the row blocks' experts are the align (or route) kernel's output
        block = tl.program_id(0)
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        if (expert < 0) | (expert >= num_experts):
            return
        if ONE_PAIR:
            pairs = tl.where(tl.arange(0, BLOCK_M) == 0, block, -1).to(tl.int64)
        else:
            pairs = tl.load(pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = pairs >= 0
        a_rows = tl.where(row_ok, pairs // ROWS_PER_A, 0)  # gate/up reads the token's row, down the pair's
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
        b_ptrs = b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None] * stride_bk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            k_ok = start + ks < k
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
        if WEIGHTED:
            acc = acc * tl.load(weight_ptr + tl.where(row_ok, pairs, 0), mask=row_ok, other=0.0).to(tl.float32)[:, None]
        c_ptrs = c_ptr + tl.where(row_ok, pairs, 0)[:, None] * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


    @triton.jit
    def _sum_pairs_kernel(pairs_ptr, out_ptr, hidden, stride_pair, stride_out, TOP_K: tl.constexpr,
                          BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        """One token's BLOCK_H columns: its k pairs' rows added in float32, j = 0..k-1, then cast."""
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = cols < hidden
        pdl_wait(PDL)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            acc += tl.load(pairs_ptr + (token * TOP_K + j) * stride_pair + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _router_block_product(w, x_ptr, tokens, k, K, stride_x, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
        """[BLOCK_M, BLOCK_E]: each token's x[k] times the weight block w [BLOCK_E, len(k)], summed over k."""
        w = w.to(tl.float32)
        rows = tl.arange(0, BLOCK_M)
        out = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
        for m in tl.static_range(BLOCK_M):
            present = ((tl.zeros_like(k) + m) < tokens) & (k < K)  # the rows BLOCK_M pads to read nothing
            x = tl.load(x_ptr + m * stride_x + k, mask=present, other=0.0).to(tl.float32)
            out += tl.where(rows[:, None] == m, tl.sum(w * x[None, :], axis=1)[None, :], 0.0)
        return out

    @triton.jit(do_not_specialize=["tokens"])
    def _router_logits_kernel(x_ptr, w_ptr, out_ptr, tokens, num_experts, K, stride_x, stride_w, stride_out,
                              BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """logits[t, e] = x[t] · w[e] for BLOCK_E experts and every token, accumulated in float32."""
        experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = experts < num_experts
        k = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + experts[:, None].to(tl.int64) * stride_w
        w = tl.load(w_rows + k[None, :], mask=e_ok[:, None] & (k < K)[None, :], other=0.0)
        pdl_wait(PDL)
        acc = _router_block_product(w, x_ptr, tokens, k, K, stride_x, BLOCK_M, BLOCK_E)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            kk = k0 + k
            w = tl.load(w_rows + kk[None, :], mask=e_ok[:, None] & (kk < K)[None, :], other=0.0)
            acc += _router_block_product(w, x_ptr, tokens, kk, K, stride_x, BLOCK_M, BLOCK_E)
        rows = tl.arange(0, BLOCK_M)
        tl.store(out_ptr + rows[:, None] * stride_out + experts[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows < tokens)[:, None] & e_ok[None, :])

    @triton.jit
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride, TOP_K: tl.constexpr,
                      NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """One token: softmax over its experts in float32, the top k (ties: the lower expert), renormalised."""
        pdl_wait(PDL)
        token = tl.program_id(0).to(tl.int64)
        experts = tl.arange(0, BLOCK_E)
        x = tl.load(logits_ptr + token * stride + experts, mask=experts < num_experts, other=-float("inf"))
        x = x.to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        slots = tl.arange(0, BLOCK_K)
        top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
        top_i = tl.zeros([BLOCK_K], dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(p, axis=0)
            index = tl.min(tl.where(p == best, experts, BLOCK_E), axis=0)
            top_w = tl.where(slots == j, best, top_w)
            top_i = tl.where(slots == j, index, top_i)
            p = tl.where(experts == index, -1.0, p)
        if NORM:
            top_w = top_w / tl.sum(top_w, axis=0)
        keep = slots < TOP_K
        tl.store(weights_ptr + token * TOP_K + slots, top_w.to(weights_ptr.dtype.element_ty), mask=keep)
        tl.store(ids_ptr + token * TOP_K + slots, top_i, mask=keep)

    @triton.jit
    def _align_kernel(ids_ptr, pair_of_row_ptr, block_expert_ptr, num_pairs, num_experts, num_rows, num_blocks,
                      BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr):
        """align_to_blocks in one program, for few pairs (comparisons of every pair with every pair)."""
        pdl_wait(PDL)
        pairs = tl.arange(0, BLOCK_P)
        real = pairs < num_pairs
        expert_of = tl.load(ids_ptr + pairs, mask=real, other=num_experts).to(tl.int32)
        experts = tl.arange(0, BLOCK_E)
        mine = expert_of[None, :] == experts[:, None]  # [E, P]
        counts = tl.sum(mine.to(tl.int32), axis=1)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        padded_end = tl.cumsum(padded, axis=0)
        group_start = tl.sum(tl.where(mine, (padded_end - padded)[:, None], 0), axis=0)  # [P]
        # A pair's place in its group: the earlier pairs of its expert (the stable sort's order).
        earlier = (expert_of[:, None] == expert_of[None, :]) & (pairs[None, :] < pairs[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        rows = tl.arange(0, BLOCK_R)
        tl.store(pair_of_row_ptr + rows, tl.full([BLOCK_R], -1, tl.int64), mask=rows < num_rows)
        tl.debug_barrier()
        tl.store(pair_of_row_ptr + group_start + rank, pairs.to(tl.int64), mask=real)
        blocks = tl.arange(0, BLOCK_B)
        passed = (padded_end[None, :] <= (blocks * BLOCK_M)[:, None]) & (experts[None, :] < num_experts)
        expert_of_block = tl.sum(passed.to(tl.int32), axis=1)
        expert_of_block = tl.where(expert_of_block < num_experts, expert_of_block, -1)
        tl.store(block_expert_ptr + blocks, expert_of_block.to(tl.int64), mask=blocks < num_blocks)


DEFAULT_MOE_GEMM_TABLE = Path(__file__).resolve().parents[1] / "assets" / "moe_gemm_configs.json"
MOE_GEMM_TABLE_ENV = "MEMPATH_MOE_GEMM_CONFIGS"  # another table's path, e.g. one just swept
SWEEP = "benchmarks/bench_moe_gemm.py"


@dataclass(frozen=True)
class GroupedGemmConfig:
    """One launch of ``_grouped_gemm_kernel``: the column tile, the K step, warps and pipeline stages."""
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3  # Triton's default on CUDA

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if type(value) is not int or value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value!r}: "
                                 f"fix the entry or re-sweep with {SWEEP}")
        if self.num_warps not in (1, 2, 4, 8, 16) or type(self.num_warps) is not int:
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps!r}: "
                             f"fix the entry or re-sweep with {SWEEP}")
        if type(self.num_stages) is not int or self.num_stages < 1:
            raise ValueError(f"num_stages must be an integer >= 1, got {self.num_stages!r}: "
                             f"fix the entry or re-sweep with {SWEEP}")

    def describe(self) -> str:
        return f"n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}"


DEFAULT_CONFIG = GroupedGemmConfig()


def default_config(n: int, k: int) -> GroupedGemmConfig:
    """The launch for a shape the table does not list: 64 x 64 tiles (32 where N or K is smaller), 4 warps."""
    return GroupedGemmConfig(block_n=64 if n >= 64 else 32, block_k=64 if k >= 64 else 32)


# A table's entries: {"NxK": {block_m: config, or {pairs bucket: config}}}. block_m stays the outer key
# because a config is measured (and fits shared memory) at its row block, and an old table's one
# config per block_m, or a prefill entry, is then simply "every bucket".
Entry = GroupedGemmConfig | dict[str, GroupedGemmConfig]


def load_moe_gemm_table(path: str | os.PathLike | None = None) -> dict[str, dict[str, Entry]]:
    """{"NxK": {block_m: GroupedGemmConfig or {pairs bucket: GroupedGemmConfig}}} from a table file
    (``MOE_GEMM_TABLE_ENV`` or the shipped one); {} when the shipped one is absent."""
    path = table_path(path, MOE_GEMM_TABLE_ENV, DEFAULT_MOE_GEMM_TABLE, SWEEP)
    remake = f"{SWEEP} --out {path}"
    raw = read_table_file(path, remake)
    table = {}
    for shape, entries in raw.get("configs", {}).items():
        n, _, k = shape.partition("x")
        if not (n.isdigit() and k.isdigit()):
            raise ValueError(f"{path}: shape {shape!r} is not NxK (e.g. \"1536x2048\"): fix it or re-sweep with "
                             f"{remake}")
        if not isinstance(entries, dict):
            raise ValueError(f"{path}: {shape} must map block_m to configurations, got {entries!r}")
        table[shape] = {}
        for block_m, entry in entries.items():
            if not block_m.isdigit():
                raise ValueError(f"{path}: {shape} block_m {block_m!r} is not an integer (the row block, "
                                 f"16 or 64): fix it or re-sweep with {remake}")
            table[shape][block_m] = _read_entry(entry, f"{path}: {shape} block_m {block_m}", remake)
    return table


def _read_entry(entry, where: str, remake: str) -> Entry:
    """One block_m's entry: a config's fields (every bucket), or pairs buckets (powers of two) to configs."""
    if isinstance(entry, dict) and entry and any(key.isdigit() for key in entry):
        if not all(key.isdigit() for key in entry):
            raise ValueError(f"{where} mixes pairs buckets and fields: {sorted(entry)}: it is either one "
                             f"configuration or buckets of them; rewrite it with {remake}")
        for bucket in entry:
            if int(bucket) < 1 or int(bucket) & (int(bucket) - 1):
                raise ValueError(f"{where}: pairs bucket {bucket!r} is not a power of two (the pairs of a call "
                                 f"rounded up): fix it or re-sweep with {remake}")
        return {bucket: read_config(config, GroupedGemmConfig, f"{where} pairs {bucket}") for bucket, config in entry.items()}
    return read_config(entry, GroupedGemmConfig, where)


@functools.lru_cache(maxsize=4)
def _table_for(env_value: str | None) -> dict[str, dict[str, Entry]]:
    return load_moe_gemm_table()


def grouped_gemm_config(n: int, k: int, pairs: int, dtype: torch.dtype, table: dict | None = None) -> GroupedGemmConfig:
    """The launch for an [E, n, k] weight times ``pairs`` rows (blocks of ``block_m_for(pairs)``):
    the table's entry, else the default.

    Decode entries are per bucket, the pairs rounded up to a power of two: that bucket's config,
    else the largest listed below it, else the smallest listed. Only the shape, the dtype and
    the pairs decide, never the experts or active groups: an expert cache's call over its slots
    has the all-resident call's pairs, so it gets the same launch and the same bits.
    The table was measured on 16-bit tiles (bf16); float32 tiles take twice the shared memory
    per stage, so they keep the default.
    """
    bucket = next_pow2(pairs)  # block_m_for(bucket) == block_m_for(pairs): 1,024 is a power of two
    if table is None:  # the engine's table: the choice is cached, as every launch makes it
        return _engine_choice(n, k, bucket, dtype.itemsize, os.environ.get(MOE_GEMM_TABLE_ENV))
    return _choose(table, n, k, bucket, dtype.itemsize)


@functools.lru_cache(maxsize=256)
def _engine_choice(n: int, k: int, bucket: int, itemsize: int, env_value: str | None) -> GroupedGemmConfig:
    return _choose(_table_for(env_value), n, k, bucket, itemsize)


def _choose(table: dict, n: int, k: int, bucket: int, itemsize: int) -> GroupedGemmConfig:
    if itemsize == 2:
        entry = table.get(f"{n}x{k}", {}).get(str(block_m_for(bucket)))
        if isinstance(entry, GroupedGemmConfig):
            return entry
        if entry:
            listed = sorted(int(b) for b in entry)
            below = [b for b in listed if b <= bucket]
            return entry[str(below[-1] if below else listed[0])]
    return default_config(n, k)


# align_to_blocks' fifteen small kernels cost more than the experts' GEMMs at decode batches
# (BENCHMARKS.md, the Qwen3-30B-A3B kernel table); up to this many pairs one program does it.
FUSED_ALIGN_MAX_PAIRS = 128

# The route, align and grouped-GEMM launches with programmatic dependent launch (as the router's
# logits and the pair sum already were). False: those three launched plainly, for A/B measurements
# of them alone (common.USE_PDL switches every kernel).
MOE_CHAIN_PDL = True


# A single token's pairs run one pair a block, unsorted (no align launch). False: aligned as any batch,
# for A/B measurements; the bits are the same either way.
ONE_TOKEN_UNALIGNED = True


def _chain_pdl(device: torch.device) -> dict:
    return pdl_options(device) if MOE_CHAIN_PDL else {"PDL": False}


# Decode batches up to this many tokens take the router kernel (MoEBlock.route); larger ones the matmul library.
ROUTER_KERNEL_MAX_ROWS = 16
# About this many programs share a router's weight, and each holds at most this many of its values per step.
ROUTER_PROGRAMS = 16
ROUTER_BLOCK_VALUES = 8192


def router_blocks(num_experts: int, k: int) -> tuple[int, int]:
    """(experts per program, K per step) of the router kernel."""
    block_e = max(1, next_pow2(num_experts) // ROUTER_PROGRAMS)
    return block_e, min(next_pow2(k), max(16, ROUTER_BLOCK_VALUES // block_e))


def triton_router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` without bias for a decode batch (at most ROUTER_KERNEL_MAX_ROWS rows of x):
    the router's logits [T, E] in x's dtype, accumulated in float32."""
    tokens, k = x.shape
    num_experts = weight.shape[0]
    if tokens > ROUTER_KERNEL_MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"router kernel: x {tuple(x.shape)} and weight {tuple(weight.shape)}: at most "
                         f"{ROUTER_KERNEL_MAX_ROWS} rows of the weight's width (larger batches take F.linear)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(tokens, num_experts, dtype=x.dtype, device=x.device)
    if tokens:
        block_e, block_k = router_blocks(num_experts, k)
        _router_logits_kernel[(triton.cdiv(num_experts, block_e),)](
            x, weight, out, tokens, num_experts, k, x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=next_pow2(tokens), BLOCK_E=block_e, BLOCK_K=block_k, **pdl_options(x.device), num_warps=4)
    return out


def triton_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, weights_dtype: torch.dtype):
    """``route_torch`` (mempath.model.moe) in one launch: (weights [T, k] in ``weights_dtype``, ids [T, k])."""
    tokens, num_experts = logits.shape
    logits = logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=weights_dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                 NORM=norm_topk_prob, BLOCK_E=triton.next_power_of_2(num_experts),
                                 BLOCK_K=triton.next_power_of_2(top_k), **_chain_pdl(logits.device), num_warps=1)
    return weights, ids


def align_fused(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_to_blocks' result in one launch (at most FUSED_ALIGN_MAX_PAIRS pairs)."""
    flat = expert_ids.reshape(-1).contiguous()
    num_pairs = flat.numel()
    num_blocks = -(-num_pairs // block_m) + min(num_pairs, num_experts)
    pair_of_row = torch.empty(num_blocks * block_m, dtype=torch.int64, device=flat.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int64, device=flat.device)
    _align_kernel[(1,)](flat, pair_of_row, block_expert, num_pairs, num_experts, num_blocks * block_m, num_blocks,
                        BLOCK_M=block_m, BLOCK_P=max(16, triton.next_power_of_2(num_pairs)),
                        BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
                        BLOCK_R=triton.next_power_of_2(num_blocks * block_m),
                        BLOCK_B=max(16, triton.next_power_of_2(num_blocks)), **_chain_pdl(flat.device),
                        num_warps=4)
    return pair_of_row, block_expert


def block_m_for(num_pairs: int) -> int:
    """Rows per block: 16 for decode-sized batches (few rows per expert), 64 for prefill."""
    return 16 if num_pairs <= 1024 else 64


def align_to_blocks(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair index of each padded row, -1 for padding; expert of each row block, -1 past the groups).

    All on the device, no host read: the padded groups' ends come from a cumulative sum
    of the tokens per expert rounded up to ``block_m``, and each row finds its expert by
    a search over those ends.
    """
    flat = expert_ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    num_blocks = -(-num_pairs // block_m) + min(num_pairs, num_experts)
    rows = torch.arange(num_blocks * block_m, device=flat.device)
    expert_of_row = torch.searchsorted(padded_end, rows, right=True)
    in_groups = expert_of_row < num_experts
    expert = expert_of_row.clamp(max=num_experts - 1)
    local = rows - (padded_end - padded)[expert]
    real = in_groups & (local < counts[expert])
    sorted_position = (torch.cumsum(counts, 0) - counts)[expert] + local
    pair_of_row = torch.where(real, order[sorted_position.clamp(max=num_pairs - 1)], -1)
    block_expert = torch.where(in_groups[::block_m], expert_of_row[::block_m], -1)
    return pair_of_row, block_expert


def _grouped_gemm(a, weights, out, pair_of_row, block_expert, block_m, rows_per_a, router_weights=None,
                  config: GroupedGemmConfig | None = None):
    """out[pair] = a[pair // rows_per_a] @ weights[expert].T (times the pair's router weight).

    ``pair_of_row`` None: one pair a block, ``block_expert`` the pairs' experts (one token's, all distinct).
    ``config`` None: ``grouped_gemm_config``'s choice for the shape (the benchmark passes its candidates)."""
    n, k = weights.shape[1], weights.shape[2]
    config = config or grouped_gemm_config(n, k, out.shape[0], a.dtype)  # out: one row per pair
    grid = (block_expert.numel(), triton.cdiv(n, config.block_n))
    _grouped_gemm_kernel[grid](
        a, weights, out, pair_of_row if pair_of_row is not None else block_expert, block_expert,
        router_weights if router_weights is not None else out, n, k, weights.shape[0],
        a.stride(0), weights.stride(0), weights.stride(1), weights.stride(2), out.stride(0),
        ROWS_PER_A=rows_per_a, WEIGHTED=router_weights is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, ONE_PAIR=pair_of_row is None,
        **_chain_pdl(a.device), num_warps=config.num_warps, num_stages=config.num_stages)


def triton_grouped_expert_pairs(x: torch.Tensor, router_weights: torch.Tensor, expert_ids: torch.Tensor,
                                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, silu_and_mul) -> torch.Tensor:
    """Each (token, choice) pair's expert MLP output times its router weight: float32 [T·k, h].

    ``expert_ids`` index the first dimension of ``gate_up_proj [E, 2I, h]`` and ``down_proj
    [E, h, I]``: every expert when all are resident, the slots of an expert cache otherwise
    (mempath/model/moe_slots.py). A pair's row is computed the same way whichever group it
    sits in, so the two give the same bits.
    """
    tokens, top_k = expert_ids.shape
    num_pairs = tokens * top_k
    block_m = block_m_for(num_pairs)
    if tokens == 1 and ONE_TOKEN_UNALIGNED:
        # One token's top k are k distinct experts: each is a group of one pair, which is what a
        # block of one pair computes, so the pairs need no sorting (and no align launch).
        pair_of_row, block_expert = None, expert_ids.reshape(-1)
    else:
        align = align_fused if num_pairs <= FUSED_ALIGN_MAX_PAIRS else align_to_blocks
        pair_of_row, block_expert = align(expert_ids, gate_up_proj.shape[0], block_m)
    x = x.contiguous()
    gate_up = x.new_empty(num_pairs, gate_up_proj.shape[1])
    _grouped_gemm(x, gate_up_proj, gate_up, pair_of_row, block_expert, block_m, top_k)
    activated = silu_and_mul(gate_up).contiguous()
    del gate_up
    # Weighted outputs in float32 (the twin weights in the weights' dtype, float32 for Mixtral).
    out = torch.empty(num_pairs, down_proj.shape[1], dtype=torch.float32, device=x.device)
    _grouped_gemm(activated, down_proj, out, pair_of_row, block_expert, block_m, 1,
                  router_weights.reshape(-1).contiguous())
    return out


def sum_pairs(pairs: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """The pairs' outputs [T·k, h] summed over each token's k choices, in their order: [T, h] in ``dtype``.

    ``triton_sum_pairs``'s PyTorch twin (two launches, and a float32 [T, h] beside the result)."""
    return pairs.view(-1, top_k, pairs.shape[-1]).sum(dim=1).to(dtype)


SUM_PAIRS_BLOCK = 512  # columns per program: 4 warps of 4 float32 (one 16-byte load each)


def triton_sum_pairs(pairs: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """``sum_pairs`` in one launch: each token's k rows of the float32 pairs [T·k, h] added in float32
    in the order j = 0..k-1 (from 0.0), then cast to ``dtype``: [T, h], the only allocation.

    Not always torch's ``sum(dim=1)`` bit for bit (torch may add k > 2 terms in another order;
    for k <= 2 there is one rounding and they agree), but the same input always gives the same
    bits, whatever the batch or the experts: every path that sums with this function agrees.
    Nothing is read on the host, so a CUDA graph captures it.
    """
    hidden = pairs.shape[-1]
    out = torch.empty(pairs.shape[0] // top_k, hidden, dtype=dtype, device=pairs.device)
    if out.shape[0]:
        _launch_sum_pairs(pairs.contiguous(), out, top_k)
    return out


def _launch_sum_pairs(pairs: torch.Tensor, out: torch.Tensor, top_k: int) -> None:
    hidden = out.shape[1]
    grid = (out.shape[0], triton.cdiv(hidden, SUM_PAIRS_BLOCK))
    _sum_pairs_kernel[grid](pairs, out, hidden, pairs.stride(0), out.stride(0), TOP_K=top_k,
                            BLOCK_H=SUM_PAIRS_BLOCK, **pdl_options(pairs.device), num_warps=4)


def triton_grouped_experts(x: torch.Tensor, router_weights: torch.Tensor, expert_ids: torch.Tensor,
                           gate_up_proj: torch.Tensor, down_proj: torch.Tensor, silu_and_mul) -> torch.Tensor:
    """Every token's k experts' SiLU-gated MLPs, weighted and summed: [T, h] in x's dtype.

    ``gate_up_proj [E, 2I, h]``, ``down_proj [E, h, I]`` hold every expert (all resident);
    ``router_weights`` and ``expert_ids`` are the router's top k, [T, k].
    """
    pairs = triton_grouped_expert_pairs(x, router_weights, expert_ids, gate_up_proj, down_proj, silu_and_mul)
    return triton_sum_pairs(pairs, expert_ids.shape[1], x.dtype)
