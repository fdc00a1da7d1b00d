"""A batch-1 decode step's decoder layers as one persistent Triton kernel: the prototype #17 measures.

The engine runs a layer at batch 1 as about a dozen launches; BENCHMARKS.md (thirty-first session) found
the time outside the weight stream, not the stream, keeps batch-1 decode below 90% of the read limit. Here
every program of one launch runs every phase of every layer, and grid-wide barriers (one atomic counter)
separate the phases:

  1. RMSNorm of the residual, then the q/k/v rows                    (row tiles, round robin)
  2. rotary on q and the new k, the new K/V written, attention over the context in (KV head, split) items;
     a head's last split to finish merges its splits (an atomic count a head, no barrier)
  3. the o rows, the residual added                                 (row tiles)
  4. RMSNorm, the gate and up rows, SiLU(gate) * up                   (row tiles)
  5. the down rows, the residual added                              (row tiles)

The residual and every hand-off between phases are float32; weights and the paged KV cache are the model's
dtype. With one bit of ``PHASES`` set and no ``SYNC`` the kernel runs one phase of one layer and waits on no
barrier. Launched phase by phase, that is the form the interpreter checks on the CPU (its programs run one
after another, so a barrier would never open) and the launch-per-phase form the persistent one is timed
against. ``layer_stack_torch`` is the plain PyTorch twin.

Not the engine: Llama-family layers only (no q/k/v bias, no q/k norm, query heads a power-of-two multiple
of the KV heads), one sequence, no PDL; the embedding, final norm and LM head stay outside.
"""
import math
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # the twin still runs
    HAS_TRITON = False

PHASES = 5
ATTENTION_POSITIONS = 16  # context positions an attention item takes at a time


@dataclass
class LayerStack:
    """Every layer's weights stacked on a leading layer axis, as the kernel indexes them."""
    qkv: torch.Tensor  # [L, (q_heads + 2 kv_heads) * head_dim, hidden]
    o: torch.Tensor  # [L, hidden, q_heads * head_dim]
    gate_up: torch.Tensor  # [L, 2 intermediate, hidden]: the gate rows, then the up rows
    down: torch.Tensor  # [L, hidden, intermediate]
    input_norm: torch.Tensor  # [L, hidden]
    post_norm: torch.Tensor  # [L, hidden]
    q_heads: int
    kv_heads: int
    head_dim: int
    eps: float

    @property
    def layers(self) -> int:
        return self.qkv.shape[0]

    @property
    def hidden(self) -> int:
        return self.qkv.shape[2]

    @property
    def intermediate(self) -> int:
        return self.down.shape[2]

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qkv, self.o, self.gate_up, self.down,
                                                          self.input_norm, self.post_norm))


def random_stack(layers: int, hidden: int, intermediate: int, q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, eps: float = 1e-5, seed: int = 0) -> LayerStack:
    """Random weights scaled as 1/sqrt(fan-in), so the residual stays of order one through the layers."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def weight(*shape):
        w = torch.empty(*shape, dtype=dtype, device=device)
        for layer in w:  # a layer at a time: a float32 draw of every layer would double the peak
            layer.copy_(torch.empty(shape[1:], device=device).normal_(generator=gen) / math.sqrt(shape[-1]))
        return w

    def norm():
        return (1 + 0.1 * torch.empty(layers, hidden, device=device).normal_(generator=gen)).to(dtype)

    qkv_rows = (q_heads + 2 * kv_heads) * head_dim
    return LayerStack(weight(layers, qkv_rows, hidden), weight(layers, hidden, q_heads * head_dim),
                      weight(layers, 2 * intermediate, hidden), weight(layers, hidden, intermediate),
                      norm(), norm(), q_heads, kv_heads, head_dim, eps)


def rope_tables(max_positions: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, head_dim / 2], float32, for rotate-half rotary."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float().to(device), angles.sin().float().to(device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean() + eps) * weight.float()


def layer_stack_torch(x: torch.Tensor, stack: LayerStack, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_table: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int) -> torch.Tensor:
    """The twin: ``x`` [hidden] float32 through every layer at position ``pos``; the new K/V written into the
    caches [L, blocks, block_size, kv_heads, head_dim] as the kernel writes them. Returns the new residual."""
    s = stack
    nq, nkv, d = s.q_heads, s.kv_heads, s.head_dim
    group, block_size, inter = nq // nkv, k_cache.shape[2], s.intermediate
    x = x.float().clone()
    positions = torch.arange(pos + 1, device=x.device)
    slots = block_table.long()[positions // block_size], positions % block_size
    for layer in range(s.layers):
        qkv = s.qkv[layer].float() @ _rms(x, s.input_norm[layer], s.eps)
        q = _rotate(qkv[:nq * d].view(nq, d), cos[pos], sin[pos])
        k = _rotate(qkv[nq * d:(nq + nkv) * d].view(nkv, d), cos[pos], sin[pos])
        block, offset = slots[0][pos], slots[1][pos]
        k_cache[layer, block, offset] = k.to(k_cache.dtype)
        v_cache[layer, block, offset] = qkv[(nq + nkv) * d:].view(nkv, d).to(v_cache.dtype)
        keys = k_cache[layer][slots].float().repeat_interleave(group, dim=1)  # [ctx, nq, d]
        values = v_cache[layer][slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q, keys) / math.sqrt(d)
        attn = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), values)
        x = x + s.o[layer].float() @ attn.reshape(-1)
        xn = _rms(x, s.post_norm[layer], s.eps)
        gate, up = s.gate_up[layer, :inter].float() @ xn, s.gate_up[layer, inter:].float() @ xn
        x = x + s.down[layer].float() @ (torch.nn.functional.silu(gate) * up)
    return x


@dataclass
class StepBuffers:
    """The float32 hand-offs between phases and the barrier counter, made once (no allocation per step)."""
    x: torch.Tensor  # [hidden] the residual, read and updated in place
    qkv: torch.Tensor
    part_max: torch.Tensor  # [q_heads, splits]
    part_sum: torch.Tensor
    part_acc: torch.Tensor  # [q_heads, splits, head_dim]
    attn: torch.Tensor  # [q_heads * head_dim] the attention output, its splits merged
    act: torch.Tensor  # [intermediate]
    counters: torch.Tensor  # int32: the barrier's, then one a layer and KV head (its splits done); zeroed a step

    @classmethod
    def make(cls, stack: LayerStack, splits: int, device) -> "StepBuffers":
        f = dict(dtype=torch.float32, device=device)
        nq, d = stack.q_heads, stack.head_dim
        return cls(torch.zeros(stack.hidden, **f), torch.zeros((nq + 2 * stack.kv_heads) * d, **f),
                   torch.zeros(nq, splits, **f), torch.zeros(nq, splits, **f), torch.zeros(nq, splits, d, **f),
                   torch.zeros(nq * d, **f), torch.zeros(stack.intermediate, **f),
                   torch.zeros(1 + stack.layers * stack.kv_heads, dtype=torch.int32, device=device))


if HAS_TRITON:
    @triton.jit
    def _arrive(counter_ptr):
        """A grid barrier's first half: this program's stores so far are released to every program."""
        tl.debug_barrier()
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")

    @triton.jit
    def _wait(counter_ptr, target):
        """Its second half: none leaves before ``target`` arrivals, and then sees every arrival's stores.
        Polled with acquire loads, not atomics: the spinning programs leave L2's atomic unit to the arrivals."""
        while tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [counter_ptr],
                                        dtype=tl.int32, is_pure=False, pack=1) < target:
            pass
        tl.debug_barrier()

    @triton.jit
    def _grid_sync(counter_ptr, target):
        _arrive(counter_ptr)
        _wait(counter_ptr, target)

    @triton.jit
    def _preload(w_ptr, rows, row_ok, K, BK: tl.constexpr, PRELOAD: tl.constexpr):
        """The first K tile of rows ``rows``, loaded between a barrier's halves (weights never wait on one);
        0.0 when not PRELOAD."""
        if PRELOAD:
            offs = tl.arange(0, BK)
            return tl.load(w_ptr + rows[:, None] * K + offs[None, :], mask=row_ok[:, None] & (offs[None, :] < K),
                           other=0.0)
        else:
            return 0.0

    @triton.jit
    def _prefetch_rows(w_ptr, row0, N, K, BN: tl.constexpr, BYTES: tl.constexpr):
        """Ask L2 for the first BYTES of rows row0.. of ``w`` [N, K] (a hint: nothing waits for it)."""
        PER_LINE: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements in 128 bytes
        rows = tl.minimum(row0 + tl.arange(0, BN), N - 1)
        cols = tl.minimum(tl.arange(0, BYTES // 128) * PER_LINE, K - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [w_ptr + rows[:, None] * K + cols[None, :]], dtype=tl.int32, is_pure=False,
                                  pack=1)

    @triton.jit
    def _prefetch_first_tile(w_ptr, N, K, pid, BN: tl.constexpr, BYTES: tl.constexpr):
        if BYTES > 0:
            if pid * BN < N:
                _prefetch_rows(w_ptr, pid * BN, N, K, BN, BYTES)

    @triton.jit
    def _inv_rms(x_ptr, H, eps, H_PAD: tl.constexpr):
        """1 / RMS(x), x read in one load (a loop of loads would wait on L2 once a tile)."""
        offs = tl.arange(0, H_PAD)
        xs = tl.load(x_ptr + offs, mask=offs < H, other=0.0, cache_modifier=".cg")
        return 1.0 / tl.sqrt(tl.sum(xs * xs, 0) / H + eps)

    @triton.jit
    def _vector_tile(v_ptr, norm_ptr, inv_rms, k, K, NORMED: tl.constexpr):
        vk = tl.load(v_ptr + k, mask=k < K, other=0.0, cache_modifier=".cg")
        if NORMED:
            vk = vk * inv_rms * tl.load(norm_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        return vk

    @triton.jit
    def _rows(w_ptr, rows, row_ok, v_ptr, norm_ptr, inv_rms, K, w_first, R: tl.constexpr, BK: tl.constexpr,
              NORMED: tl.constexpr, PIPELINE: tl.constexpr, HAVE_FIRST: tl.constexpr):
        """Rows ``rows`` [R] of ``w`` [., K] times the float32 vector ``v`` another program wrote (NORMED: its
        RMSNorm, v * inv_rms * norm): [R] float32. PIPELINE: each K tile's loads (weights and vector) are
        issued before the tile before it is multiplied, so a program keeps two tiles in flight. HAVE_FIRST
        (with PIPELINE): ``w_first`` is the first weight tile, loaded by the caller."""
        offs = tl.arange(0, BK)
        w_rows = w_ptr + rows[:, None] * K
        acc = tl.zeros([R, BK], tl.float32)
        if PIPELINE:
            if HAVE_FIRST:
                w_next = w_first
            else:
                w_next = tl.load(w_rows + offs[None, :], mask=row_ok[:, None] & (offs[None, :] < K), other=0.0)
            v_next = _vector_tile(v_ptr, norm_ptr, inv_rms, offs, K, NORMED)
        for k0 in range(0, K, BK):
            k = k0 + offs
            if PIPELINE:
                w, vk = w_next, v_next
                w_next = tl.load(w_rows + (k + BK)[None, :], mask=row_ok[:, None] & ((k + BK)[None, :] < K),
                                 other=0.0)
                v_next = _vector_tile(v_ptr, norm_ptr, inv_rms, k + BK, K, NORMED)
            else:
                w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & (k[None, :] < K), other=0.0)
                vk = _vector_tile(v_ptr, norm_ptr, inv_rms, k, K, NORMED)
            acc += w.to(tl.float32) * vk[None, :]
        return tl.sum(acc, 1)

    @triton.jit
    def _qkv_phase(x_ptr, qkv_ptr, w_ptr, norm_ptr, H, NQKV, eps, pid, P, w_first, BN: tl.constexpr,
                   BK: tl.constexpr, PIPELINE: tl.constexpr, H_PAD: tl.constexpr, HAVE_FIRST: tl.constexpr):
        inv_rms = _inv_rms(x_ptr, H, eps, H_PAD)
        for t in range(pid, tl.cdiv(NQKV, BN), P):
            rows = t * BN + tl.arange(0, BN)
            if t == pid:
                out = _rows(w_ptr, rows, rows < NQKV, x_ptr, norm_ptr, inv_rms, H, w_first, BN, BK, True, PIPELINE,
                            HAVE_FIRST)
            else:
                out = _rows(w_ptr, rows, rows < NQKV, x_ptr, norm_ptr, inv_rms, H, 0.0, BN, BK, True, PIPELINE, False)
            tl.store(qkv_ptr + rows, out, mask=rows < NQKV)

    @triton.jit
    def _attention_phase(qkv_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, cos_ptr, sin_ptr,
                         part_max_ptr, part_sum_ptr, part_acc_ptr, attn_ptr, head_counters_ptr, layer_base, pos,
                         split_len, scale, pid, P,
                         NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         SPLITS: tl.constexpr, BT: tl.constexpr):
        G: tl.constexpr = NQ // NKV
        HALF: tl.constexpr = D // 2
        heads = tl.arange(0, G)
        dh = tl.arange(0, HALF)
        dv = tl.arange(0, D)
        cos = tl.load(cos_ptr + pos * HALF + dh)
        sin = tl.load(sin_ptr + pos * HALF + dh)
        for item in range(pid, NKV * SPLITS, P):
            kvh = item // SPLITS
            split = item % SPLITS
            start = split * split_len
            end = tl.minimum(start + split_len, pos + 1)
            q_rows = qkv_ptr + (kvh * G + heads)[:, None] * D
            q1 = tl.load(q_rows + dh[None, :], cache_modifier=".cg")
            q2 = tl.load(q_rows + HALF + dh[None, :], cache_modifier=".cg")
            q1, q2 = (q1 * cos[None, :] - q2 * sin[None, :]) * scale, (q2 * cos[None, :] + q1 * sin[None, :]) * scale
            if (start <= pos) & (pos < end):  # this item holds the new token: it writes the token's K and V
                k_new = qkv_ptr + NQ * D + kvh * D
                k1 = tl.load(k_new + dh, cache_modifier=".cg")
                k2 = tl.load(k_new + HALF + dh, cache_modifier=".cg")
                v = tl.load(qkv_ptr + (NQ + NKV) * D + kvh * D + dv, cache_modifier=".cg")
                block = tl.load(block_table_ptr + pos // BLOCK_SIZE).to(tl.int64)
                slot = ((layer_base + block) * BLOCK_SIZE + pos % BLOCK_SIZE) * (NKV * D) + kvh * D
                tl.store(k_cache_ptr + slot + dh, (k1 * cos - k2 * sin).to(k_cache_ptr.dtype.element_ty))
                tl.store(k_cache_ptr + slot + HALF + dh, (k2 * cos + k1 * sin).to(k_cache_ptr.dtype.element_ty))
                tl.store(v_cache_ptr + slot + dv, v.to(v_cache_ptr.dtype.element_ty))
                tl.debug_barrier()  # the program's own reads below see the token
            m = tl.full([G], float("-inf"), tl.float32)
            denom = tl.zeros([G], tl.float32)
            acc = tl.zeros([G, D], tl.float32)
            for t0 in range(start, end, BT):
                t = t0 + tl.arange(0, BT)
                valid = t < end
                block = tl.load(block_table_ptr + t // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
                slot = ((layer_base + block) * BLOCK_SIZE + t % BLOCK_SIZE) * (NKV * D) + kvh * D
                k1 = tl.load(k_cache_ptr + slot[:, None] + dh[None, :], mask=valid[:, None], other=0.0)
                k2 = tl.load(k_cache_ptr + slot[:, None] + HALF + dh[None, :], mask=valid[:, None], other=0.0)
                v = tl.load(v_cache_ptr + slot[:, None] + dv[None, :], mask=valid[:, None], other=0.0)
                scores = (tl.sum(q1[:, None, :] * k1.to(tl.float32)[None, :, :], 2)
                          + tl.sum(q2[:, None, :] * k2.to(tl.float32)[None, :, :], 2))
                scores = tl.where(valid[None, :], scores, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, 1))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(scores - m_new[:, None])
                denom = denom * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
                m = m_new
            q_heads = kvh * G + heads
            if SPLITS == 1:
                tl.store(attn_ptr + q_heads[:, None] * D + dv[None, :], acc / denom[:, None])
            else:
                part = q_heads * SPLITS + split
                tl.store(part_max_ptr + part, m)
                tl.store(part_sum_ptr + part, denom)
                tl.store(part_acc_ptr + part[:, None] * D + dv[None, :], acc)
                # The head's last split to finish merges them all: no barrier, and no other program waits.
                tl.debug_barrier()
                done = tl.atomic_add(head_counters_ptr + kvh, 1, sem="acq_rel", scope="gpu")
                if done == SPLITS - 1:
                    parts = q_heads[:, None] * SPLITS + tl.arange(0, SPLITS)[None, :]
                    m_all = tl.load(part_max_ptr + parts, cache_modifier=".cg")
                    weight = tl.exp2(m_all - tl.max(m_all, 1)[:, None])  # an empty split's -inf weighs 0
                    total = tl.sum(weight * tl.load(part_sum_ptr + parts, cache_modifier=".cg"), 1)
                    accs = tl.load(part_acc_ptr + parts[:, :, None] * D + dv[None, None, :], cache_modifier=".cg")
                    merged = tl.sum(weight[:, :, None] * accs, 1) / total[:, None]
                    tl.store(attn_ptr + q_heads[:, None] * D + dv[None, :], merged)

    @triton.jit
    def _residual_phase(x_ptr, v_ptr, w_ptr, H, K, pid, P, w_first, BN: tl.constexpr, BK: tl.constexpr,
                        PIPELINE: tl.constexpr, HAVE_FIRST: tl.constexpr):
        """The rows of ``w`` [H, K] over a float32 vector (o: the attention output; down: SiLU(gate) * up), the
        residual added."""
        for t in range(pid, tl.cdiv(H, BN), P):
            rows = t * BN + tl.arange(0, BN)
            if t == pid:
                out = _rows(w_ptr, rows, rows < H, v_ptr, v_ptr, 0.0, K, w_first, BN, BK, False, PIPELINE, HAVE_FIRST)
            else:
                out = _rows(w_ptr, rows, rows < H, v_ptr, v_ptr, 0.0, K, 0.0, BN, BK, False, PIPELINE, False)
            out += tl.load(x_ptr + rows, mask=rows < H, other=0.0, cache_modifier=".cg")
            tl.store(x_ptr + rows, out, mask=rows < H)

    @triton.jit
    def _gate_up_rows(t, I, BN: tl.constexpr):
        """Tile t's weight rows: its BN gate rows, then the same outputs' up rows."""
        pair = tl.arange(0, 2 * BN)
        outputs = t * BN + pair % BN
        return outputs + tl.where(pair >= BN, I, 0), outputs < I

    @triton.jit
    def _gate_up_phase(x_ptr, act_ptr, w_ptr, norm_ptr, H, I, eps, pid, P, w_first, BN: tl.constexpr,
                       BK: tl.constexpr, PIPELINE: tl.constexpr, H_PAD: tl.constexpr, HAVE_FIRST: tl.constexpr):
        """A tile is BN gate rows and the BN up rows of the same outputs, in one pass over K."""
        inv_rms = _inv_rms(x_ptr, H, eps, H_PAD)
        for t in range(pid, tl.cdiv(I, BN), P):
            rows, ok = _gate_up_rows(t, I, BN)
            if t == pid:
                both = _rows(w_ptr, rows, ok, x_ptr, norm_ptr, inv_rms, H, w_first, 2 * BN, BK, True, PIPELINE,
                             HAVE_FIRST)
            else:
                both = _rows(w_ptr, rows, ok, x_ptr, norm_ptr, inv_rms, H, 0.0, 2 * BN, BK, True, PIPELINE, False)
            both = tl.reshape(both, [2, BN])
            up_half = (tl.arange(0, 2) == 1)[:, None]
            gate, up = tl.sum(tl.where(up_half, 0.0, both), 0), tl.sum(tl.where(up_half, both, 0.0), 0)
            rows = t * BN + tl.arange(0, BN)
            tl.store(act_ptr + rows, gate / (1.0 + tl.exp(-gate)) * up, mask=rows < I)

    @triton.jit
    def _layer_stack_kernel(x_ptr, qkv_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, attn_ptr, act_ptr, counter_ptr,
                            w_qkv_ptr, w_o_ptr, w_gate_up_ptr, w_down_ptr, norm1_ptr, norm2_ptr,
                            k_cache_ptr, v_cache_ptr, block_table_ptr, cos_ptr, sin_ptr,
                            layer_first, layer_last, pos, split_len, scale, eps, H, I, blocks_per_layer,
                            NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            SPLITS: tl.constexpr, PHASES: tl.constexpr, SYNC: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, BT: tl.constexpr, PREFETCH: tl.constexpr,
                            PREFETCH_O: tl.constexpr, PIPELINE: tl.constexpr, H_PAD: tl.constexpr,
                            PRELOAD: tl.constexpr):
        """PHASES: a bit a phase to run; SYNC: grid barriers (and the L2 prefetches before them) between phases;
        PRELOAD (with SYNC and PIPELINE): each program loads its first weight tile of the next phase between a
        barrier's arrival and its wait, so the weight stream does not stop for the barrier."""
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        NQKV: tl.constexpr = (NQ + 2 * NKV) * D
        syncs = 0
        tile = pid * BN + tl.arange(0, BN)  # a program's first row tile of each phase
        gate_up_tile, gate_up_ok = _gate_up_rows(pid, I, BN)
        FIRST: tl.constexpr = PRELOAD and SYNC and PIPELINE
        qkv_first = _preload(w_qkv_ptr + (layer_first + tl.zeros([], tl.int64)) * NQKV * H, tile, tile < NQKV, H, BK,
                             FIRST)
        for layer in range(layer_first, layer_last):
            big = layer + tl.zeros([], tl.int64)  # 64-bit offsets: the stacked weights pass 2^31 elements
            w_qkv, w_o = w_qkv_ptr + big * NQKV * H, w_o_ptr + big * H * NQ * D
            w_gate_up, w_down = w_gate_up_ptr + big * 2 * I * H, w_down_ptr + big * H * I
            if PHASES & 1:
                _qkv_phase(x_ptr, qkv_ptr, w_qkv, norm1_ptr + big * H, H, NQKV, eps, pid, P, qkv_first, BN, BK,
                           PIPELINE, H_PAD, FIRST)
            if SYNC:
                if PREFETCH_O:  # the whole of the program's o rows, while the attention runs
                    for t in range(pid, tl.cdiv(H, BN), P):
                        _prefetch_rows(w_o, t * BN, H, NQ * D, BN, NQ * D * 2)
                else:
                    _prefetch_first_tile(w_o, H, NQ * D, pid, BN, PREFETCH)
                syncs += 1
                _grid_sync(counter_ptr, syncs * P)
            if PHASES & 2:
                _attention_phase(qkv_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, cos_ptr, sin_ptr,
                                 part_max_ptr, part_sum_ptr, part_acc_ptr, attn_ptr, counter_ptr + 1 + layer * NKV,
                                 big * blocks_per_layer, pos, split_len, scale, pid, P, NQ, NKV, D, BLOCK_SIZE, SPLITS,
                                 BT)
            if SYNC:
                syncs += 1
                _arrive(counter_ptr)
            o_first = _preload(w_o, tile, tile < H, NQ * D, BK, FIRST)
            if SYNC:
                _wait(counter_ptr, syncs * P)
            if PHASES & 4:
                _residual_phase(x_ptr, attn_ptr, w_o, H, NQ * D, pid, P, o_first, BN, BK, PIPELINE, FIRST)
            if SYNC:
                _prefetch_first_tile(w_gate_up, I, H, pid, BN, PREFETCH)
                syncs += 1
                _arrive(counter_ptr)
            gate_up_first = _preload(w_gate_up, gate_up_tile, gate_up_ok, H, BK, FIRST)
            if SYNC:
                _wait(counter_ptr, syncs * P)
            if PHASES & 8:
                _gate_up_phase(x_ptr, act_ptr, w_gate_up, norm2_ptr + big * H, H, I, eps, pid, P, gate_up_first, BN,
                               BK, PIPELINE, H_PAD, FIRST)
            if SYNC:
                _prefetch_first_tile(w_down, H, I, pid, BN, PREFETCH)
                syncs += 1
                _arrive(counter_ptr)
            down_first = _preload(w_down, tile, tile < H, I, BK, FIRST)
            if SYNC:
                _wait(counter_ptr, syncs * P)
            if PHASES & 16:
                _residual_phase(x_ptr, act_ptr, w_down, H, I, pid, P, down_first, BN, BK, PIPELINE, FIRST)
            if SYNC:
                if layer + 1 < layer_last:
                    _prefetch_first_tile(w_qkv + NQKV * H, NQKV, H, pid, BN, PREFETCH)
                syncs += 1
                _arrive(counter_ptr)
            qkv_first = _preload(w_qkv + NQKV * H, tile, (tile < NQKV) & (layer + 1 < layer_last), H, BK, FIRST)
            if SYNC:
                _wait(counter_ptr, syncs * P)


def split_length(pos: int, splits: int, positions: int = ATTENTION_POSITIONS) -> int:
    """Context positions an attention split covers: the context over ``splits``, in whole chunks."""
    chunk = -(-(pos + 1) // splits)
    return positions * -(-chunk // positions)


def launch_layer_stack(stack: LayerStack, bufs: StepBuffers, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_table: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int, *,
                       programs: int, persistent: bool = True, row_tile: int = 16, k_tile: int = 512,
                       positions: int = ATTENTION_POSITIONS, num_warps: int = 8,
                       cooperative: bool = False, prefetch: int = 0, prefetch_o: bool = False,
                       pipeline: bool = False, preload: bool = False, diagnostic: str = ""):
    """One decode step of every layer on ``bufs.x`` (float32, in place). ``persistent``: one launch of
    ``programs`` programs with barriers between phases; every program must be resident at once, or the
    first barrier never opens: ``cooperative`` has the driver refuse a grid
    it cannot hold at once rather than hang. Otherwise a launch a phase and layer. Returns the (last)
    compiled kernel. ``prefetch``: bytes of each row of its next phase's first row tile a program asks L2
    for before a barrier; ``prefetch_o``: a program asks for all of its o rows before the attention
    (persistent only: L2 prefetch is inline PTX, which the interpreter does not run). ``preload`` (persistent,
    with ``pipeline``): each program loads its first weight tile of the next phase between a barrier's arrival
    and its wait (measured without gain: BENCHMARKS.md). ``diagnostic``
    (persistent, wrong results, for timing only): "barriers" runs the barriers and no phase, "no-barriers"
    every phase and no barrier."""
    s = stack
    splits = bufs.part_max.shape[1]
    d = s.head_dim
    args = (bufs.x, bufs.qkv, bufs.part_max, bufs.part_sum, bufs.part_acc, bufs.attn, bufs.act, bufs.counters,
            s.qkv, s.o, s.gate_up, s.down, s.input_norm, s.post_norm, k_cache, v_cache, block_table, cos, sin)
    scalars = (pos, split_length(pos, splits, positions), math.log2(math.e) / math.sqrt(d), s.eps, s.hidden,
               s.intermediate, k_cache.shape[1])
    meta = dict(H_PAD=triton.next_power_of_2(s.hidden), NQ=s.q_heads, NKV=s.kv_heads, D=d,
                BLOCK_SIZE=k_cache.shape[2], SPLITS=splits, BN=row_tile,
                BK=k_tile, BT=positions, PREFETCH=prefetch if persistent else 0,
                PREFETCH_O=prefetch_o and persistent, PIPELINE=pipeline, PRELOAD=preload, num_warps=num_warps)
    bufs.counters.zero_()
    if persistent:
        if cooperative:
            meta["launch_cooperative_grid"] = True
        return _layer_stack_kernel[(programs,)](*args, 0, s.layers, *scalars, PHASES=0 if diagnostic == "barriers"
                                                else (1 << PHASES) - 1, SYNC=diagnostic != "no-barriers", **meta)
    for layer in range(s.layers):
        for phase in range(PHASES):
            compiled = _layer_stack_kernel[(programs,)](*args, layer, layer + 1, *scalars, PHASES=1 << phase,
                                                        SYNC=False, **meta)
    return compiled

