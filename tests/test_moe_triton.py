"""The grouped-GEMM MoE kernel (kernels/moe_triton.py) against its PyTorch twin (model/moe.py).

On the CPU through Triton's interpreter (TRITON_INTERPRET=1, in a child process: the
variable must be set before Triton compiles anything); on CUDA directly.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mempath.kernels.common import HAS_TRITON
from tests.conftest import release_cuda

COMPARE = textwrap.dedent("""
    import torch
    from mempath.kernels.dispatch import torch_kernels
    from mempath.kernels.moe_triton import align_to_blocks, triton_grouped_experts
    from mempath.model.moe import Experts, combine, dispatch

    def twin(x, weights, ids, gate_up, down):
        experts = Experts(gate_up.shape[0], x.shape[1], down.shape[2], torch_kernels())
        experts.gate_up_proj.data, experts.down_proj.data = gate_up, down
        order, counts = dispatch(ids, gate_up.shape[0])
        return combine(experts(x[order // ids.shape[1]], counts), weights, order, ids.shape[1], x.dtype)

    def check(tokens, experts, top_k, hidden, inter, dtype, device, skip_expert=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
        gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(device, dtype)
        down = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(device, dtype)
        scores = torch.rand(tokens, experts, generator=g)
        if skip_expert is not None:
            scores[:, skip_expert] = -1  # an expert no token routes to
        weights, ids = torch.topk(torch.softmax(scores, -1), top_k, dim=-1)
        weights, ids = weights.to(device), ids.to(device)
        pair_of_row, block_expert = align_to_blocks(ids, experts, 16)
        real = pair_of_row[pair_of_row >= 0].sort().values
        assert torch.equal(real.cpu(), torch.arange(tokens * top_k)), "every pair once"
        rows_expert = block_expert.repeat_interleave(16)
        flat = ids.reshape(-1)
        assert torch.equal(rows_expert[pair_of_row >= 0], flat[pair_of_row[pair_of_row >= 0]]), "a block is one expert's"
        ours = triton_grouped_experts(x, weights, ids, gate_up, down, torch_kernels().silu_and_mul)
        expected = twin(x, weights, ids, gate_up, down)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert ours.dtype == expected.dtype and ours.shape == expected.shape
        err = (ours.float() - expected.float()).abs().max().item()
        assert err <= tol * max(1.0, expected.float().abs().max().item()), (tokens, experts, top_k, dtype, err)

    def check_align(tokens, experts, top_k, block_m, device, seed=0):
        from mempath.kernels.moe_triton import align_fused
        g = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(device)
        if tokens > 2:
            ids[: tokens // 2] = ids[0]  # crowded experts: groups longer than a block
        want = align_to_blocks(ids, experts, block_m)
        got = align_fused(ids, experts, block_m)
        assert all(torch.equal(w.cpu(), g_.cpu()) for w, g_ in zip(want, got)), (tokens, experts, top_k, want, got)

    def check_route(tokens, experts, top_k, norm, dtype, weights_dtype, device, seed=0):
        from mempath.kernels.moe_triton import triton_route
        from mempath.model.moe import route_torch
        logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
        want_w, want_i = route_torch(logits, top_k, norm, weights_dtype)
        got_w, got_i = triton_route(logits, top_k, norm, weights_dtype)
        assert got_w.dtype == want_w.dtype and torch.equal(got_i.sort(-1).values, want_i.sort(-1).values)
        order_w = want_w.gather(-1, want_i.argsort(-1)).float()
        order_g = got_w.gather(-1, got_i.argsort(-1)).float()
        tol = 1e-6 if weights_dtype == torch.float32 else 1e-2
        assert (order_w - order_g).abs().max().item() <= tol, (tokens, experts, top_k, dtype)

    def with_config(config, fn, *args, **kwargs):
        # fn run with every grouped GEMM launched under config (the chooser replaced).
        from mempath.kernels import moe_triton
        chooser = moe_triton.grouped_gemm_config
        moe_triton.grouped_gemm_config = lambda n, k, pairs, dtype, table=None: config
        try:
            return fn(*args, **kwargs)
        finally:
            moe_triton.grouped_gemm_config = chooser

    def check_slots(tokens, experts, top_k, hidden, inter, dtype, device, seed=0):
        # The kernel over a cache's slots (the routed experts and an idle one, in another order)
        # gives the all-resident run's outputs bit for bit.
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
        gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(device, dtype)
        down = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(device, dtype)
        weights, ids = torch.topk(torch.softmax(torch.rand(tokens, experts, generator=g), -1), top_k, dim=-1)
        weights, ids = weights.to(device, dtype), ids.to(device)
        silu = torch_kernels().silu_and_mul
        full = triton_grouped_experts(x, weights, ids, gate_up, down, silu)
        used = ids.unique().flip(0)
        idle = next(e for e in range(experts) if e not in used.tolist())
        resident = torch.cat([used, torch.tensor([idle], device=device)])
        slot_of = torch.full((experts,), -1, dtype=torch.int64, device=device)
        slot_of[resident] = torch.arange(resident.numel(), device=device)
        cached = triton_grouped_experts(x, weights, slot_of[ids], gate_up[resident], down[resident], silu)
        assert torch.equal(full, cached), (tokens, experts, top_k, (full - cached).abs().max().item())

    def check_one_token(experts, top_k, hidden, inter, dtype, device, seed=0):
        # One token's pairs run one a block with no align launch, and give the aligned launch's bits.
        from mempath.kernels import moe_triton
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(1, hidden, generator=g).to(device, dtype)
        gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(device, dtype)
        down = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(device, dtype)
        weights, ids = torch.topk(torch.softmax(torch.rand(1, experts, generator=g), -1), top_k, dim=-1)
        weights, ids = weights.to(device, dtype), ids.to(device)
        silu = torch_kernels().silu_and_mul
        aligners = moe_triton.align_fused, moe_triton.align_to_blocks
        def no_align(*args):
            raise AssertionError("one token's pairs were aligned")
        moe_triton.align_fused = moe_triton.align_to_blocks = no_align
        try:
            unaligned = moe_triton.triton_grouped_expert_pairs(x, weights, ids, gate_up, down, silu)
        finally:
            moe_triton.align_fused, moe_triton.align_to_blocks = aligners
        moe_triton.ONE_TOKEN_UNALIGNED = False
        try:
            aligned = moe_triton.triton_grouped_expert_pairs(x, weights, ids, gate_up, down, silu)
        finally:
            moe_triton.ONE_TOKEN_UNALIGNED = True
        assert torch.equal(unaligned, aligned), (experts, top_k, dtype, (unaligned - aligned).abs().max().item())

    def run_configs(device, dtype):
        from mempath.kernels.moe_triton import GroupedGemmConfig
        configs = [GroupedGemmConfig(block_n=16, block_k=32, num_warps=2, num_stages=2),
                   GroupedGemmConfig(block_n=16, block_k=128, num_warps=2, num_stages=4),  # wider than K (48, 64)
                   GroupedGemmConfig(block_n=128, block_k=16, num_warps=8, num_stages=5),
                   GroupedGemmConfig(block_n=32, block_k=256, num_warps=4, num_stages=3)]
        for i, config in enumerate(configs):
            with_config(config, check, 3, 8, 2, 64, 48, dtype, device, seed=10 + i)       # gate_up 96x64, down 64x48
            with_config(config, check, 5, 16, 4, 32, 40, dtype, device, seed=20 + i)      # tails in N and K
        with_config(configs[0], check, 600, 8, 2, 64, 48, dtype, device, seed=30)         # 64-row blocks
        check_slots(4, 16, 4, 64, 48, dtype, device)
        with_config(configs[1], check_slots, 3, 8, 2, 32, 40, dtype, device, seed=1)
        with_config(configs[2], check_one_token, 16, 4, 32, 40, dtype, device, seed=2)  # tails in N and K

    def run_all(device, dtypes):
        check_align(1, 128, 8, 16, device)                                # Qwen3-30B-A3B decode, batch 1
        check_align(16, 128, 8, 16, device, seed=1)                        # 128 pairs: the fused bound
        check_align(3, 8, 2, 16, device, seed=2)                           # Mixtral-like, few experts
        check_align(7, 60, 4, 16, device, seed=3)                          # experts not a power of two
        for dtype in dtypes:
            check_route(5, 128, 8, True, dtype, dtype, device)             # Qwen3-MoE: renormalised
            check_route(4, 8, 2, True, dtype, torch.float32, device)       # Mixtral: float32 weights
            check_route(3, 60, 4, False, dtype, dtype, device, seed=1)     # not renormalised
        for dtype in dtypes:
            check(1, 8, 2, 64, 48, dtype, device)                      # decode, batch 1
            check_one_token(128, 8, 64, 48, dtype, device)             # Qwen3-30B-A3B's routing, batch 1
            check(37, 8, 2, 64, 48, dtype, device, skip_expert=3)       # an empty group, ragged groups
            check(5, 16, 4, 32, 40, dtype, device, seed=1)              # K, N not multiples of the tiles
            check(600, 8, 2, 64, 48, dtype, device, seed=2)             # prefill-sized: 64-row blocks
    """)


SUM_COMPARE = textwrap.dedent("""
    import torch
    from mempath.kernels.moe_triton import SUM_PAIRS_BLOCK, sum_pairs, triton_sum_pairs

    def in_order(pairs, top_k, dtype):
        # The kernel's documented arithmetic: float32 adds in the order j = 0..k-1, then the cast.
        rows = pairs.view(-1, top_k, pairs.shape[-1])
        acc = torch.zeros_like(rows[:, 0])
        for j in range(top_k):
            acc = acc + rows[:, j]
        if dtype == torch.bfloat16 and pairs.device.type == "cpu":
            # Triton's interpreter casts float32 to bfloat16 by truncation (CUDA rounds to nearest even).
            return (acc.view(torch.int32) & -65536).view(torch.float32).to(dtype)
        return acc.to(dtype)

    def check_sum(device):
        g = torch.Generator().manual_seed(0)
        for hidden in (SUM_PAIRS_BLOCK + 37, 40):  # a tail past a block; one narrower than a block
            for top_k in (1, 2, 8):
                for dtype in (torch.float32, torch.bfloat16):
                    tokens = 3
                    pairs = (torch.randn(tokens * top_k, hidden, generator=g) * 10 ** torch.randn(1, generator=g)).to(device)
                    got = triton_sum_pairs(pairs, top_k, dtype)
                    assert got.dtype == dtype and got.shape == (tokens, hidden), (got.dtype, got.shape)
                    assert torch.equal(got, in_order(pairs, top_k, dtype)), (hidden, top_k, dtype)
                    assert torch.equal(got, triton_sum_pairs(pairs, top_k, dtype)), "the same input, the same bits"
                    twin = sum_pairs(pairs, top_k, dtype)
                    if top_k <= 2 and (dtype == torch.float32 or device != "cpu"):  # one rounding either way
                        assert torch.equal(got, twin), (hidden, top_k, dtype)
                    else:
                        tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the interpreter's truncation
                        scale = twin.float().abs().max().item()
                        assert (got.float() - twin.float()).abs().max().item() <= tol * scale, (hidden, top_k, dtype)
        empty = triton_sum_pairs(torch.empty(0, 64, device=device), 8, torch.bfloat16)
        assert empty.shape == (0, 64) and empty.dtype == torch.bfloat16
    """)


@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(), reason="needs Triton, and no CUDA (checked compiled there)")
def test_sum_over_k_matches_the_twin_in_the_interpreter():
    interpret(SUM_COMPARE + "\ncheck_sum('cpu')\nprint('ok')\n")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sum_over_k_matches_the_twin_on_cuda_and_is_captured_in_a_graph():
    namespace = {}
    exec(SUM_COMPARE, namespace)
    namespace["check_sum"]("cuda")
    from mempath.kernels.moe_triton import triton_sum_pairs
    pairs = torch.randn(4 * 8, 2048, device="cuda")
    eager = triton_sum_pairs(pairs, 8, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_sum_pairs(pairs, 8, torch.bfloat16)
    pairs.mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, triton_sum_pairs(pairs, 8, torch.bfloat16)) and not torch.equal(captured, eager)


# Where CUDA is present the compiled kernel is checked instead (as tests/test_triton_interpret.py
# does): Triton 3.6's interpreter, on the H200, could not take this kernel's loop bound
# (2026-12-01: "only 0-dimensional arrays can be converted to Python scalars").
@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(), reason="needs Triton, and no CUDA (checked compiled there)")
def test_kernel_matches_the_twin_in_the_interpreter():
    interpret(COMPARE + "\nrun_all('cpu', [torch.float32])\nprint('ok')\n")


def interpret(script: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(), reason="needs Triton, and no CUDA (checked compiled there)")
def test_launch_configurations_match_the_twin_in_the_interpreter():
    """Other tile shapes (block_n 16, block_k wider than K's tail) and a cache's slots: the same results."""
    interpret(COMPARE + "\nrun_configs('cpu', torch.float32)\nprint('ok')\n")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_launch_configurations_match_the_twin_on_cuda():
    namespace = {}
    exec(COMPARE, namespace)
    for dtype in (torch.float32, torch.bfloat16):
        namespace["run_configs"]("cuda", dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_the_twin_on_cuda():
    namespace = {}
    exec(COMPARE, namespace)
    namespace["run_all"]("cuda", [torch.float32, torch.bfloat16])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_grouped_kernel_is_captured_in_a_cuda_graph(model_factory):
    """All experts resident: decode graphs capture the MoE layers and give the eager tokens."""
    from mempath import LLM, SamplingParams
    path, _ = model_factory("qwen3_moe")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 33, 7], list(range(10, 47))]
    # One engine at a time: each one's budget is the device's, less what the others hold.
    graphs = LLM(path, dtype="float32", device="cuda", show_progress=False)
    assert graphs.engine.runner.graphs, "a MoE model with every expert resident gets decode graphs"
    tokens = [o.token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    del graphs
    release_cuda()
    eager = LLM(path, dtype="float32", device="cuda", show_progress=False, enforce_eager=True)
    assert tokens == [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    release_cuda()
    partial = LLM(path, dtype="float32", device="cuda", show_progress=False, moe_expert_cache_size=2)
    # Misses are host decisions: the batch-1 graph is cut at every MoE layer (engine/piecewise.py).
    assert sorted(partial.engine.runner.graphs) == [1]
    assert [o.token_ids for o in partial.generate(prompts, params, use_tqdm=False)] == tokens


# ------------------------------------------------------------------ the router's logits at decode batches

ROUTER_COMPARE = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from mempath.kernels.moe_triton import ROUTER_KERNEL_MAX_ROWS, router_blocks, triton_router_logits

    def check_router(device, dtype, shapes):
        g = torch.Generator().manual_seed(0)
        for tokens, experts, k in shapes:
            x = torch.randn(tokens, k, generator=g).to(device, dtype)
            w = (torch.randn(experts, k, generator=g) / k ** 0.5).to(device, dtype)
            got = triton_router_logits(x, w)
            want = F.linear(x.float(), w.float())  # float32 products and sums, one rounding at the end
            assert got.dtype == dtype and got.shape == (tokens, experts), (got.dtype, got.shape)
            tol = 1e-5 if dtype == torch.float32 else 2 ** -7  # one rounding to 16 bits
            err = ((got.float() - want).abs() / want.abs().clamp_min(1.0)).max().item()
            assert err <= tol, (tokens, experts, k, dtype, err, router_blocks(experts, k))
        try:
            too_many = torch.zeros(ROUTER_KERNEL_MAX_ROWS + 1, 8, device=device)
            triton_router_logits(too_many, torch.zeros(4, 8, device=device))
        except ValueError as error:
            assert "at most 16 rows" in str(error), error
        else:
            raise AssertionError("17 rows were not refused")
""")
# Experts and K that are and are not powers of two, one and 16 tokens, K over three steps with a tail
# (128 experts: 1,024 of K a step); on CUDA the Qwen3-30B-A3B (128 x 2048), Mixtral (8 x 4096) and
# OLMoE (64 x 2048) routers.
ROUTER_SHAPES_CPU = [(1, 8, 64), (3, 128, 96), (16, 6, 40), (5, 64, 1000), (2, 128, 2100)]
ROUTER_SHAPES_CUDA = ROUTER_SHAPES_CPU + [(1, 128, 2048), (16, 128, 2048), (1, 8, 4096), (8, 8, 4096), (2, 64, 2048)]


@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(), reason="needs Triton, and no CUDA (checked compiled there)")
def test_router_logits_match_the_matmul_in_the_interpreter():
    interpret(ROUTER_COMPARE + f"\ncheck_router('cpu', torch.float32, {ROUTER_SHAPES_CPU})\nprint('ok')\n")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_logits_match_the_matmul_on_cuda_and_are_captured_in_a_graph():
    namespace = {}
    exec(ROUTER_COMPARE, namespace)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        namespace["check_router"]("cuda", dtype, ROUTER_SHAPES_CUDA)
    from mempath.kernels.moe_triton import triton_router_logits
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16)
    eager = triton_router_logits(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_router_logits(x, w)
    x.mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, triton_router_logits(x, w)) and not torch.equal(captured, eager)


def test_moe_block_takes_the_router_kernel_at_decode_batches_in_16_bits():
    """The kernel for at most ROUTER_KERNEL_MAX_ROWS tokens in bf16/fp16; F.linear above that and in float32
    (the parity tests' arithmetic), and wherever the model's kernels have none (the PyTorch twins)."""
    from dataclasses import replace

    from mempath.kernels.dispatch import torch_kernels
    from mempath.kernels.moe_triton import ROUTER_KERNEL_MAX_ROWS
    from mempath.model.moe import MoEBlock

    calls = []

    def kernel(x, weight):
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, weight)

    class Spec:
        num_experts, num_experts_per_tok, norm_topk_prob, routing_weights_float32 = 8, 2, True, False
        hidden_size, moe_intermediate_size = 16, 8

    block = MoEBlock(Spec(), replace(torch_kernels(), router_logits=kernel))
    for rows, dtype, used in ((1, torch.bfloat16, True), (ROUTER_KERNEL_MAX_ROWS, torch.float16, True),
                              (ROUTER_KERNEL_MAX_ROWS + 1, torch.bfloat16, False), (1, torch.float32, False)):
        calls.clear()
        block.to(dtype)
        weights, ids = block.route(torch.randn(rows, 16, dtype=dtype))
        assert calls == ([rows] if used else []) and ids.shape == (rows, 2), (rows, dtype, calls)
    plain = MoEBlock(Spec(), torch_kernels())
    assert plain.experts.kernels.router_logits is None
    plain.route(torch.randn(1, 16, dtype=torch.float32))
