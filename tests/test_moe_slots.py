"""The expert cache on the grouped kernel (mempath/model/moe_slots.py) and decode graphs cut at
its MoE layers (mempath/engine/piecewise.py).

On the CPU the grouped kernel is replaced by its twin (``expert_pairs_torch``), so the
bookkeeping — waves over the slots, slot ids per pair, the slot table, the counters — runs
for real; the graphs themselves need CUDA (the tests at the end)."""
import dataclasses

import pytest
import torch

from mempath import LLM, SamplingParams
from mempath.model import moe_slots
from mempath.model.moe import (SyntheticRouterBias, expert_cache_stats, set_expert_cache_size,
                               synthetic_router_bias, synthetic_uniform_router)
from mempath.model.moe_slots import SlotTable, book_one_wave, expert_pairs_torch, graph_rows_limit
from tests.conftest import release_cuda
from tests.test_moe import GREEDY, PROMPTS, check_caches, generate, references  # noqa: F401 (fixture)


def slot_kernel_llm(path, size, **options) -> LLM:
    """A CPU engine whose offloaded MoE layers run the slot path with the kernel's twin."""
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, enable_prefix_caching=False,
              moe_expert_cache_size=size, **options)
    for block in llm.engine.model.moe_blocks():
        block.experts.kernels = dataclasses.replace(block.experts.kernels, grouped_expert_pairs=expert_pairs_torch)
    return llm


def test_the_twin_is_each_pair_of_the_reference_block():
    torch.manual_seed(0)
    tokens, k, experts, h, inter = 5, 2, 4, 8, 6
    x = torch.randn(tokens, h)
    ids = torch.randint(0, experts, (tokens, k))
    weights = torch.rand(tokens, k)
    gate_up, down = torch.randn(experts, 2 * inter, h), torch.randn(experts, h, inter)

    def silu_and_mul(t):
        gate, up = t.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    pairs = expert_pairs_torch(x, weights, ids, gate_up, down, silu_and_mul)
    for p in range(tokens * k):
        t, e = p // k, int(ids.view(-1)[p])
        expected = (silu_and_mul(x[t] @ gate_up[e].T) @ down[e].T) * weights.view(-1)[p]
        torch.testing.assert_close(pairs[p], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("size", [2, 3, 5])
def test_the_slot_path_gives_the_transformers_tokens_at_every_cache_size(arch, size, model_factory, references):
    path, _ = model_factory(arch)
    llm = slot_kernel_llm(path, size)
    assert all(moe_slots.uses_slot_kernel(b) for b in llm.engine.model.moe_blocks())
    assert generate(llm) == references[arch]
    check_caches(llm.engine.model)
    stats = expert_cache_stats(llm.engine.model)
    assert stats["hits"] > 0 and stats["misses"] > 0  # several waves per prefill at 2 of 8
    for block in llm.engine.model.moe_blocks():
        table = block.experts.__dict__["slot_table"]
        assert table.device_table.tolist() == [max(s, 0) for s in block.experts.cache.slot_of]


def test_the_slot_path_logits_are_bit_identical_across_cache_sizes(model_factory):
    path, _ = model_factory("mixtral")
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(3))
    outputs = []
    for size in (2, 3, 5, 7):
        llm = slot_kernel_llm(path, size)
        block = llm.engine.model.moe_blocks()[0]
        outputs.append(block(x.to(block.gate.weight.dtype)))
        block.experts.cache.check()
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])


def test_a_captured_batch_is_booked_in_one_wave_or_refused(model_factory):
    path, _ = model_factory("mixtral")
    llm = slot_kernel_llm(path, 3)
    block = llm.engine.model.moe_blocks()[0]
    cache = block.experts.cache
    book_one_wave(block, [4, 6, 4, 1])
    assert sorted(cache.resident_experts()) == [1, 4, 6] and cache.misses == 3 and not cache.in_use
    table = block.experts.__dict__["slot_table"].device_table.tolist()
    assert [table[e] for e in (1, 4, 6)] == [cache.slot_of[e] for e in (1, 4, 6)]
    book_one_wave(block, [6, 1])
    assert cache.hits == 2 and cache.misses == 3
    with pytest.raises(RuntimeError, match="more experts than the 3 slots"):
        book_one_wave(block, [0, 2, 3, 5])
    assert not cache.in_use


def test_the_slot_table_is_written_only_when_the_bookings_change():
    table = SlotTable(4, torch.device("cpu"))
    table.write([-1, 0, -1, 1])
    assert table.device_table.tolist() == [0, 0, 0, 1]
    table.device_table.fill_(7)  # a stale device copy would show if the same bookings were rewritten
    table.write([-1, 0, -1, 1])
    assert table.device_table.tolist() == [7, 7, 7, 7]
    table.write([1, 0, -1, -1])
    assert table.device_table.tolist() == [1, 0, 0, 0]


def test_graph_batches_fit_one_wave_of_every_offloaded_layer(model_factory):
    path, _ = model_factory("mixtral")  # k = 2
    model = slot_kernel_llm(path, 5).engine.model
    assert graph_rows_limit(model) == 2
    set_expert_cache_size(model, None)
    assert graph_rows_limit(model) is None  # every expert resident: the whole step is one graph
    host_misses = LLM(path, dtype="float32", device="cpu", show_progress=False, moe_expert_cache_size=4,
                      moe_cpu_experts="always").engine.model
    assert graph_rows_limit(host_misses) == 0  # a miss on the host cannot sit inside a graph


def test_the_synthetic_bias_drifts_in_place(model_factory):
    bias = SyntheticRouterBias(8, skew=1.0, hot=2, drift_every=2, seed=0)
    logits = torch.zeros(1, 8)
    first = bias(logits).clone()
    held = bias.bias
    second = bias(logits)  # the second call drifts
    assert bias.bias is held  # a CUDA graph keeps reading the same tensor
    assert not torch.equal(first, second)
    torch.testing.assert_close(second[0], bias._host_bias())


def test_the_uniform_router_ignores_the_model_and_misses_as_often_as_the_cache_is_small(model_factory):
    path, _ = model_factory("mixtral")
    llm = slot_kernel_llm(path, 2)
    synthetic_uniform_router(llm.engine.model, seed=1)
    generate(llm)
    stats = expert_cache_stats(llm.engine.model)
    assert stats["router"] == "synthetic uniform"
    assert stats["hit_rate"] < 0.4  # 2 of 8 resident: about a quarter
    synthetic_router_bias(llm.engine.model, skew=None)
    assert expert_cache_stats(llm.engine.model)["router"] == "model"


# ---------------------------------------------------------------- CUDA: decode graphs cut at the MoE layers


def cuda_tokens(path, prompts, params, **options):
    llm = LLM(path, device="cuda", show_progress=False, enable_prefix_caching=False, **options)
    out = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.engine.runner
    info = {"graphs": dict(runner.graphs), "stats": expert_cache_stats(llm.engine.model)}
    del llm, runner
    release_cuda()
    return out, info


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cut_graphs_give_the_all_resident_tokens(dtype, model_factory):
    from mempath.engine.piecewise import PiecewiseGraph
    path, _ = model_factory("qwen3_moe")  # 3 layers, 2 of them MoE (8 experts, k = 2)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 33, 7], list(range(10, 47))]
    resident, _ = cuda_tokens(path, prompts, params, dtype=dtype)
    for size in (2, 5):
        for batch in ([prompts[0]], prompts):
            want = resident[:len(batch)] if len(batch) == 2 else [resident[0]]
            tokens, info = cuda_tokens(path, batch, params, dtype=dtype, moe_expert_cache_size=size, max_num_seqs=2)
            graphs = info["graphs"]
            assert sorted(graphs) == [1, 2][:size // 2]
            assert all(isinstance(g, PiecewiseGraph) and len(g.pieces) == 3 for g in graphs.values())
            assert tokens == want, (size, len(batch))
            assert info["stats"]["misses"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cut_graphs_count_every_lookup_and_leak_no_slot(model_factory):
    path, _ = model_factory("mixtral")
    llm = LLM(path, dtype="bfloat16", device="cuda", show_progress=False, moe_expert_cache_size=2, max_num_seqs=1)
    assert sorted(llm.engine.runner.graphs) == [1]
    before = expert_cache_stats(llm.engine.model)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True), use_tqdm=False)
    after = expert_cache_stats(llm.engine.model)
    layers = len(llm.engine.model.moe_blocks())
    lookups = after["hits"] + after["misses"] - before["hits"] - before["misses"]
    # The prompt's step (eager) routes 3 tokens; each of the 16 graph steps 1 token to 2 experts per layer.
    assert lookups >= 16 * 2 * layers
    check_caches(llm.engine.model)
    del llm
    release_cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cut_graphs_split_misses_between_the_host_and_the_copies(model_factory, monkeypatch):
    """auto on cut graphs: with a host a little faster than the link forced on, graph steps' misses are split;
    the host-run pairs' rows enter the piece after the cut, and float32 tokens stay the all-resident ones
    (tiny model: the host's and the device's float32 products agree to the token)."""
    from mempath.engine.piecewise import PiecewiseGraph
    from mempath.model.moe_host import HostExpertCost
    path, _ = model_factory("mixtral")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 33, 7], list(range(10, 47))]
    resident, _ = cuda_tokens(path, prompts, params, dtype="float32")
    llm = LLM(path, dtype="float32", device="cuda", show_progress=False, enable_prefix_caching=False,
              moe_expert_cache_size=4, max_num_seqs=2, moe_cpu_experts="auto")
    assert all(isinstance(g, PiecewiseGraph) for g in llm.engine.runner.graphs.values()) and llm.engine.runner.graphs
    blocks = llm.engine.model.moe_blocks()
    experts = blocks[0].experts
    copy = HostExpertCost(1.0, 1.0, 0.0).copy_seconds(experts.gate_up_proj.shape[2], experts.intermediate_size,
                                                      experts.gate_up_proj.element_size())
    for block in blocks:  # one miss: the host; two: one each side; three: two on the host
        block.experts.host_cost = HostExpertCost(1.0, 1e30, 0.0, host_row_seconds=0.6 * copy)
    split = []  # (host-run, copied or hit) experts of each graph step's layer
    book = moe_slots.book_one_wave

    def counted(block, ids):
        on_host = book(block, ids)
        split.append((len(on_host), len(set(ids)) - len(on_host)))
        return on_host
    monkeypatch.setattr(moe_slots, "book_one_wave", counted)
    for batch in ([prompts[0]], prompts):
        tokens = [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        assert tokens == resident[:len(batch)]
    assert len(split) >= 2 * 23 * len(blocks)  # every decode step ran on the cut graphs
    assert sum(h for h, _ in split) > 23 and any(h and rest for h, rest in split)
    check_caches(llm.engine.model)
    del llm
    release_cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cut_graphs_time_their_host_rows_for_the_split(model_factory):
    """The host steps between graph pieces time their host-run rows for the cost model: a per-row time set far
    below the real one rises toward it."""
    from mempath.model.moe_host import HostExpertCost
    path, _ = model_factory("mixtral")
    llm = LLM(path, dtype="float32", device="cuda", show_progress=False, enable_prefix_caching=False,
              moe_expert_cache_size=4, max_num_seqs=1, moe_cpu_experts="auto")
    assert llm.engine.runner.graphs
    cost = HostExpertCost(1e9, 1e30, 0.0, host_row_seconds=1e-9, row_weight=0.5)
    for block in llm.engine.model.moe_blocks():
        block.experts.host_cost = cost
    llm.generate([[1, 5, 9, 33, 7]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert expert_cache_stats(llm.engine.model)["host_experts"] > 0
    assert cost.host_row_seconds > 1e-7
    check_caches(llm.engine.model)
    del llm
    release_cuda()
