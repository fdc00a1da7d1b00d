"""Prefetch of the next MoE layer's predicted experts (model/moe.py: MoEBlock.predict_experts,
Experts.prefetch): the counters, the slots, and the same tokens. On the CPU the copies run at
once (the path stays synchronous); on CUDA on a copy stream, each slot's first reader waits."""
import pytest
import torch

from mempath.kernels.dispatch import torch_kernels
from mempath.model.moe import Experts, expert_cache_stats, set_expert_cache_size, set_expert_prefetch
from mempath import SamplingParams
from tests.test_moe import PROMPTS, check_caches, generate, references  # noqa: F401 (fixture)
from tests.test_moe_engine import moe_llm

SHORT = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def generate_short(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS[1:3], SHORT, use_tqdm=False)]


def test_a_prefetch_fills_slots_from_the_host_store_and_counts_what_the_next_forward_used():
    experts = Experts(8, 16, 12, torch_kernels())
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    full = experts.gate_up_proj.detach().clone()
    experts.set_resident(3)
    cache = experts.cache
    experts.prefetch([5, 2, 7, 1])  # more than the slots: the three most wanted
    assert sorted(cache.resident_experts()) == [2, 5, 7] and cache.prefetched == 3
    for expert in (2, 5, 7):
        assert torch.equal(experts.gate_up_proj[cache.slot_of[expert]], full[expert])
    assert cache.bytes_loaded == 3 * experts.expert_bytes() and cache.misses == 0
    cache.record_routing([0, 0, 4, 0, 0, 1, 0, 0])  # the forward it was for used 2 and 5, not 7
    assert cache.prefetch_used == 2 and cache.stats()["prefetch_accuracy"] == pytest.approx(2 / 3)
    experts.prefetch([2, 5])  # both resident: nothing copied, nothing counted
    assert cache.prefetched == 3 and cache.bytes_loaded == 3 * experts.expert_bytes()
    cache.check()


@pytest.mark.parametrize("used_per_prefetch,stops", [(1, True), (2, False)])
def test_prefetch_stops_where_the_forward_seldom_uses_what_it_copied(used_per_prefetch, stops):
    """Three experts copied ahead per forward, one or two of them used: 1/3 is under
    PREFETCH_MIN_ACCURACY, so prefetch turns itself off once PREFETCH_JUDGED_AFTER are judged;
    2/3 keeps it on. Turning it on again starts a new judgement."""
    from mempath.model.moe import PREFETCH_JUDGED_AFTER, PREFETCH_MIN_ACCURACY
    experts = Experts(8, 16, 12, torch_kernels())
    experts.set_resident(3)
    cache = experts.cache
    cache.prefetch = True
    assert 1 / 3 < PREFETCH_MIN_ACCURACY <= 2 / 3
    forwards = 0
    while cache.prefetch and forwards < 2 * PREFETCH_JUDGED_AFTER:
        wanted = [(3 * forwards + i) % 8 for i in range(3)]  # none resident: all three copied
        experts.prefetch(wanted)
        routed = [0] * 8
        for expert in wanted[:used_per_prefetch]:
            routed[expert] = 1
        cache.record_routing(routed)
        forwards += 1
    assert cache.prefetch is not stops and cache.stats()["prefetch_stopped"] is stops
    if stops:
        assert cache.judged_prefetched >= PREFETCH_JUDGED_AFTER
        assert forwards == -(-PREFETCH_JUDGED_AFTER // 3)  # judged as soon as enough were copied
    cache.check()


@pytest.mark.parametrize("size", [2, 4])
def test_prefetch_keeps_the_tokens_and_the_lookups(size, model_factory):
    path, _ = model_factory("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[])
    plain = moe_llm(path, moe_expert_cache_size=size)
    expected = generate_short(plain)
    without = expert_cache_stats(plain.engine.model)
    assert without["prefetched"] == 0  # off by default on the CPU
    llm = moe_llm(path, moe_expert_cache_size=size)
    set_expert_prefetch(llm.engine.model, True)
    assert generate_short(llm) == expected
    check_caches(llm.engine.model)
    stats = expert_cache_stats(llm.engine.model)
    assert stats["hits"] + stats["misses"] == without["hits"] + without["misses"]  # the same routing
    assert stats["prefetched"] > 0 and 0 <= stats["prefetch_used"] <= stats["prefetched"]
    assert stats["layers"][0]["prefetched"] == 0  # nothing before the first MoE layer predicts it
    block = llm.engine.model.moe_blocks()[0]
    assert stats["bytes_loaded"] == (stats["misses"] + stats["prefetched"]) * block.experts.expert_bytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefetch_on_a_copy_stream_gives_the_cpu_tokens(model_factory, references):
    from mempath import LLM
    path, _ = model_factory("mixtral")
    llm = LLM(path, dtype="float32", device="cuda", show_progress=False, enable_prefix_caching=False,
              moe_expert_cache_size=2, max_num_seqs=8, max_num_batched_tokens=64)
    assert all(block.experts.cache.prefetch for block in llm.engine.model.moe_blocks())
    assert generate(llm) == references["mixtral"]
    check_caches(llm.engine.model)
    stats = expert_cache_stats(llm.engine.model)
    assert stats["prefetched"] > 0 and not any(block.experts.cache.pending for block in llm.engine.model.moe_blocks()[:1])
    set_expert_cache_size(llm.engine.model, 3)  # a loaded model: prefetch stays on by default on CUDA
    assert all(block.experts.cache.prefetch for block in llm.engine.model.moe_blocks())


def test_start_ups_routing_is_forgotten_when_start_up_is_done():
    """Start-up's forwards (on CUDA the profile step, the decode graphs' warm-ups and captures, the kernel
    probes) route dummy tokens. Their lookups showed in stats() and /metrics as serving's, their routing
    history steered eviction, and their prefetches, judged, could turn prefetch off before serving began."""
    from mempath.model.moe import PREFETCH_JUDGED_AFTER, forget_start_up_routing

    class Model:
        def moe_blocks(self):
            return [type("Block", (), {"experts": experts})()]
    experts = Experts(8, 16, 12, torch_kernels())
    experts.set_resident(3)
    cache = experts.cache
    cache.prefetch = True
    for _ in range(PREFETCH_JUDGED_AFTER):  # every prefetch unused: judged, and stopped
        missing = [e for e in range(8) if cache.slot_of[e] < 0]
        experts.prefetch(missing[:1])
        cache.record_routing({missing[1]: 2})
        [wave] = cache.waves([missing[1]])
        cache.release(cache.acquire(wave, experts.load_into_slot))
    assert cache.prefetch_stopped and cache.hits + cache.misses > 0 and max(cache.scores) > 0
    resident = cache.resident_experts()
    forget_start_up_routing(Model())
    stats = cache.stats()
    assert {k: stats[k] for k in ("hits", "misses", "evictions", "bytes_loaded", "prefetched", "prefetch_used",
                                  "host_experts", "host_tokens")} == dict.fromkeys(
        ("hits", "misses", "evictions", "bytes_loaded", "prefetched", "prefetch_used", "host_experts",
         "host_tokens"), 0)
    assert cache.prefetch and not stats["prefetch_stopped"] and cache.judged_prefetched == 0
    assert cache.clock == 0 and not any(cache.routed_tokens) and not any(cache.scores)
    assert cache.resident_experts() == resident  # the slots keep their experts: serving needs no copy for them
    cache.check()


def test_the_engine_forgets_start_ups_routing_once_started(model_factory, monkeypatch):
    from mempath.engine import startup
    path, _ = model_factory("mixtral")
    forgotten = []
    monkeypatch.setattr(startup, "forget_start_up_routing", forgotten.append)
    llm = moe_llm(path, moe_expert_cache_size=3)
    assert forgotten == [llm.engine.model]
