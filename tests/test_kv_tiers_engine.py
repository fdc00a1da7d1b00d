"""The KV tiers inside the engine: demotion, promotion, swap, restart, corruption, leaks.

The device tier is the CPU here, so every path runs for real (transfers complete
at once). A device pool of a few blocks forces finished conversations down the
tiers; outputs must equal a run without tiers, token for token.
"""
import math
import os
import random
import re
from types import SimpleNamespace

import pytest

from mempath import LLM, SamplingParams
from mempath.config import EngineConfig
from mempath.kv.block_pool import hash_block

BLOCK = 16
DEVICE_BLOCKS = 8
BLOCK_NBYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # layers, K/V, tokens, kv heads, head_dim, float32
GIB = 1 << 30


def gb(blocks: int) -> float:
    """cpu_kv_gb / disk_kv_gb holding about this many blocks (disk files carry ~130 bytes of header)."""
    return blocks * (BLOCK_NBYTES + 256) / GIB


def greedy(n=6):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def make_llm(path, **kw):
    llm = LLM(path, dtype="float32", show_progress=False, num_gpu_blocks_override=DEVICE_BLOCKS, **kw)
    tiers = llm.engine.kv.tiers
    if tiers is not None:
        # Deterministic choices: loading always beats recomputing unless a test says otherwise.
        tiers.rates["prefill_tokens_per_s"] = 1.0
    return llm


def conversations(n=4, length=40):
    return [[10 + (7 * c + i) % 200 for i in range(length)] for c in range(n)]


def run_turns(llm, prompts, turns=2, idle=None):
    """Each conversation alone, turn after turn; returns outputs and num_cached_tokens per turn.

    ``idle`` runs between requests (a user's think time)."""
    history = [list(p) for p in prompts]
    tokens, cached = [], []
    for turn in range(turns):
        for c in range(len(history)):
            out = llm.generate(history[c], greedy(), use_tqdm=False)[0]
            tokens.append(out.token_ids)
            cached.append(out.num_cached_tokens)
            history[c] = history[c] + out.token_ids + [250 + turn, 251, 252]
            if idle is not None:
                idle()
    return tokens, cached


@pytest.fixture(scope="module")
def tiny(model_factory):
    return model_factory("llama")[0]


@pytest.fixture(scope="module")
def reference(tiny):
    return run_turns(make_llm(tiny), conversations())


def tier_stats(llm):
    return llm.stats()["tiers"]


def assert_no_leak(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.kv.pool.check_invariants()
    assert engine.kv.pool.num_used == 0
    tiers = engine.kv.tiers
    if tiers is not None:
        tiers.reap()
        if tiers.disk is not None:
            tiers.disk.flush()
        host = tiers.host
        host.check_invariants()
        owned = host.num_blocks - host.num_free - len(host._index)
        assert owned == 0, f"{owned} host blocks owned by nobody"
        if tiers.disk is not None:
            assert tiers.disk.used_bytes <= tiers.disk.capacity_bytes


def test_multi_turn_reuses_the_cpu_tier(tiny, reference):
    llm = make_llm(tiny, cpu_kv_gb=gb(32))
    tokens, cached = run_turns(llm, conversations())
    assert tokens == reference[0]
    stats = tier_stats(llm)
    assert stats["hits_blocks"]["cpu"] > 0 and stats["demoted_blocks"] > 0
    assert all(c > 0 for c in cached[4:])  # every second turn found its first turn's KV
    assert stats["moved"]["cpu_to_gpu"]["bytes"] == stats["moved"]["cpu_to_gpu"]["blocks"] * BLOCK_NBYTES
    assert_no_leak(llm)


def test_a_prefix_being_loaded_is_loaded_once(tiny):
    """Two requests arrive together whose shared prefix sits in the host tier: the second
    waits for the first's load and takes the blocks from the device, not a second copy."""
    shared = conversations(1, 40)[0]
    others = conversations(4, 40)[1:]
    prompts = [shared + [201, 202, 203], shared + [204, 205]]
    expected = [o.token_ids for o in make_llm(tiny).generate(prompts, greedy(), use_tqdm=False)]
    llm = make_llm(tiny, cpu_kv_gb=gb(32))
    llm.generate(shared, greedy(), use_tqdm=False)
    for other in others:  # the pool's 8 blocks turn over: the shared prefix goes to the host tier
        llm.generate(other, greedy(), use_tqdm=False)
    before = tier_stats(llm)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    after = tier_stats(llm)
    assert [o.token_ids for o in outs] == expected
    full_blocks = len(shared) // BLOCK
    assert after["hits_blocks"]["cpu"] - before["hits_blocks"]["cpu"] == full_blocks
    assert after["moved"]["cpu_to_gpu"]["blocks"] - before["moved"]["cpu_to_gpu"]["blocks"] == full_blocks
    assert [o.num_cached_tokens for o in outs] == [full_blocks * BLOCK] * 2
    assert_no_leak(llm)


def test_a_request_waiting_for_room_is_weighed_once(tiny):
    """A request whose prefix is in the host tier waits at the head of the queue while a
    long one holds the device pool: its load-or-recompute choice is counted (and logged)
    once, when it is admitted, not at every step it waits."""
    shared = conversations(1, 40)[0]
    long_prompt = conversations(6, 112)[5]  # 7 of the pool's 8 blocks, 8 by its last token
    prompts = [long_prompt, shared + [201, 202, 203]]  # its 2 host blocks cannot land until then
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), greedy()]
    expected = [o.token_ids for o in make_llm(tiny).generate(prompts, params, use_tqdm=False)]
    llm = make_llm(tiny, cpu_kv_gb=gb(32))
    llm.generate(shared, greedy(), use_tqdm=False)
    for other in conversations(4, 40)[1:]:  # the shared prefix goes to the host tier
        llm.generate(other, greedy(), use_tqdm=False)
    before = tier_stats(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = tier_stats(llm)
    assert [o.token_ids for o in outs] == expected
    assert outs[1].num_cached_tokens == 2 * BLOCK  # it waited, then loaded its prefix
    assert llm.engine.scheduler.num_preemptions == 0
    assert after["decisions"]["load"] - before["decisions"]["load"] == 1  # was 17: once per step waited
    assert after["decisions"]["recompute"] == before["decisions"]["recompute"]
    assert_no_leak(llm)


def test_a_paused_request_gives_its_blocks_to_a_head_whose_prefix_is_in_the_host_tier(tiny):
    """A paused request (a stream whose reader fell behind) is the first preempted for room. A head that would
    load its prefix from the host tier but found no room waited instead, the paused request kept its blocks,
    and the engine stepped on with nothing to run until the stream was read or timed out."""
    llm = make_llm(tiny, cpu_kv_gb=gb(32), max_model_len=128)
    engine = llm.engine
    shared = conversations(1)[0]
    llm.generate(shared, greedy(4), use_tqdm=False)
    for other in conversations(4)[1:]:  # turn the pool over: the shared prefix moves to the host tier
        llm.generate(other, greedy(4), use_tqdm=False)
    engine.add_request(list(range(20, 120)), greedy(20), "paused")  # 100 tokens: 7 of the 8 blocks
    while engine.outputs.requests["paused"].num_computed_tokens < 100:
        engine.step()
    engine.pause_request("paused")
    engine.add_request(shared + [201, 202, 203], greedy(4), "head")
    done = {}
    for _ in range(20):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if "head" in done:
            break
    assert "head" in done and done["head"].outputs[0].token_ids == make_llm(tiny).generate(
        shared + [201, 202, 203], greedy(4), use_tqdm=False)[0].token_ids
    assert engine.outputs.requests["paused"].num_computed_tokens == 0  # preempted: recomputes when read
    engine.resume_request("paused")
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(llm)


def _finished(future):
    future.result()
    return future


@pytest.mark.parametrize("policy", ["write-back", "write-through"])
def test_disk_tier_never_stalls_the_step_loop(tiny, reference, tmp_path, policy):
    """With the host tier full of blocks whose disk writes are running, steps go on without
    waiting for the disk (they used to flush it: on the H200 each turn then waited on 0.8 GB/s)."""
    llm = make_llm(tiny, cpu_kv_gb=gb(2), disk_kv_path=str(tmp_path), disk_kv_gb=gb(64),
                   disk_write_policy=policy)
    disk = llm.engine.kv.tiers.disk
    flush = disk.flush

    def no_waiting():
        raise AssertionError("the step loop waited for the disk")

    disk.flush = no_waiting
    tokens, _ = run_turns(llm, conversations(), idle=flush)  # between turns, writes may finish
    disk.flush = flush
    assert tokens == reference[0]
    assert_no_leak(llm)


@pytest.mark.parametrize("policy", ["write-back", "write-through"])
def test_multi_turn_through_the_disk_tier(tiny, reference, tmp_path, policy):
    llm = make_llm(tiny, cpu_kv_gb=gb(2), disk_kv_path=str(tmp_path), disk_kv_gb=gb(64),
                   disk_write_policy=policy)
    # The step loop never waits for a disk write (see the test below): with writes still
    # running, a demotion that finds the host tier full is dropped, so how many blocks
    # reach the disk would depend on timing. Writes that finish at once make it exact.
    disk = llm.engine.kv.tiers.disk
    write_async = disk.write_async
    disk.write_async = lambda *a, **k: _finished(write_async(*a, **k))
    tokens, cached = run_turns(llm, conversations())
    assert tokens == reference[0]
    stats = tier_stats(llm)
    assert stats["hits_blocks"]["disk"] > 0 and stats["moved"]["cpu_to_disk"]["blocks"] > 0
    assert stats["disk"]["write_policy"] == policy
    assert_no_leak(llm)


def first_run_on_disk(tiny, path):
    """Fill the disk tier with the first turns, then let the writes finish (a clean shutdown)."""
    llm = make_llm(tiny, cpu_kv_gb=gb(8), disk_kv_path=str(path), disk_kv_gb=gb(64),
                   disk_write_policy="write-through")
    run_turns(llm, conversations(), turns=1)
    llm.engine.kv.tiers.close()
    assert any(name.endswith(".kv") for _, _, names in os.walk(path) for name in names)


def test_disk_index_survives_a_restart(tiny, reference, tmp_path):
    first_run_on_disk(tiny, tmp_path)
    llm = make_llm(tiny, cpu_kv_gb=gb(4), disk_kv_path=str(tmp_path), disk_kv_gb=gb(64))
    assert llm.engine.kv.tiers.disk.num_blocks > 0
    prompt = conversations()[0]
    out = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    assert out.token_ids == reference[0][0]
    assert out.num_cached_tokens == 32 and tier_stats(llm)["hits_blocks"]["disk"] == 2
    assert_no_leak(llm)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_disk_block_is_recomputed_with_identical_output(tiny, reference, tmp_path, damage):
    first_run_on_disk(tiny, tmp_path)
    llm = make_llm(tiny, cpu_kv_gb=gb(4), disk_kv_path=str(tmp_path), disk_kv_gb=gb(64))
    # Damage every file after start-up, so the index still lists them and the reads must notice.
    for root, _, names in os.walk(tmp_path):
        for name in (n for n in names if n.endswith(".kv")):  # block files, not the manifest
            file_path = os.path.join(root, name)
            size = os.path.getsize(file_path)
            with open(file_path, "r+b") as f:
                if damage == "truncate":
                    f.truncate(size - 100)
                else:
                    f.seek(size // 2)
                    byte = f.read(1)
                    f.seek(size // 2)
                    f.write(bytes([byte[0] ^ 0xFF]))
    out = llm.generate(conversations()[0], greedy(), use_tqdm=False)[0]
    assert out.token_ids == reference[0][0]
    stats = tier_stats(llm)
    assert stats["disk_read_failures"] >= 1 and stats["hits_blocks"]["disk"] == 0
    assert out.num_cached_tokens == 0
    assert_no_leak(llm)


def test_cost_model_recomputes_when_that_is_faster(tiny, reference):
    llm = make_llm(tiny, cpu_kv_gb=gb(32))
    llm.engine.kv.tiers.rates["prefill_tokens_per_s"] = 1e15
    tokens, _ = run_turns(llm, conversations())
    assert tokens == reference[0]
    stats = tier_stats(llm)
    assert stats["hits_blocks"]["cpu"] == 0 and stats["decisions"]["recompute"] > 0
    assert stats["decisions"]["load"] == 0
    assert_no_leak(llm)


def batch_under_pressure(llm):
    """Eight requests growing at once in a pool of eight blocks: preemption is certain."""
    prompts = [[20 + (5 * r + i) % 150 for i in range(18 + r)] for r in range(8)]
    return [o.token_ids for o in llm.generate(prompts, greedy(30), use_tqdm=False)]


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_preemption_gives_the_outputs_of_recompute(tiny, mode):
    reference = batch_under_pressure(make_llm(tiny))
    llm = make_llm(tiny, cpu_kv_gb=gb(32), preemption_mode=mode)
    if mode == "auto":
        llm.engine.kv.tiers.rates["transfer_latency_s"] = 0.0  # long or short, swapping wins
    assert batch_under_pressure(llm) == reference
    stats = tier_stats(llm)
    assert stats["swaps"] > 0 and stats["swap_ins"] == stats["swaps"]
    assert stats["recompute_preemptions"] == 0
    assert_no_leak(llm)


def test_cost_model_recomputes_short_requests_and_swaps_long_ones(tiny):
    llm = make_llm(tiny, cpu_kv_gb=gb(32))
    tiers = llm.engine.kv.tiers
    tiers.rates.update(prefill_tokens_per_s=1000.0, transfer_latency_s=0.01,
                       d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9)

    class Victim:
        request_id = "v"

    short, long = Victim(), Victim()
    short.num_computed_tokens, long.num_computed_tokens = 16, 4096
    assert not tiers.should_swap(short, 1)  # 16 ms to recompute < 20 ms of latency
    assert tiers.should_swap(long, 4096 // BLOCK)


def test_random_workload_with_aborts_leaks_nothing(tiny, tmp_path):
    llm = make_llm(tiny, cpu_kv_gb=gb(4), disk_kv_path=str(tmp_path), disk_kv_gb=gb(12))
    engine, tiers = llm.engine, llm.engine.kv.tiers
    rng = random.Random(1234)
    shared = [[30 + (11 * s + i) % 180 for i in range(rng.randrange(16, 48))] for s in range(4)]
    live = []
    for step in range(300):
        if rng.random() < 0.3:
            prompt = rng.choice(shared) + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 20))]
            live.append(engine.add_request(prompt, greedy(rng.randrange(1, 24))))
        if live and rng.random() < 0.1:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        engine.step()
        assert tiers.host.used_bytes <= tiers.host.capacity_bytes
        assert tiers.disk.used_bytes <= tiers.disk.capacity_bytes
        assert engine.kv.pool.num_used <= engine.kv.pool.num_blocks
    while engine.has_unfinished_requests():
        engine.step()
    stats = tier_stats(llm)
    assert stats["demoted_blocks"] > 0 and stats["hits_blocks"]["cpu"] + stats["hits_blocks"]["disk"] > 0
    assert_no_leak(llm)


def test_tiers_off_allocate_nothing(tiny):
    llm = make_llm(tiny)
    stats = llm.stats()
    assert stats["tiers"] == {"enabled": False}
    assert not {"kv_cpu", "kv_disk", "kv_transfer_staging"} & set(stats["ledger"])
    assert llm.engine.kv.tiers is None


def test_ledger_and_stats_show_the_tiers(tiny, tmp_path):
    llm = make_llm(tiny, cpu_kv_gb=gb(4), disk_kv_path=str(tmp_path), disk_kv_gb=gb(8))
    ledger, tiers = llm.stats()["ledger"], tier_stats(llm)
    assert ledger["kv_cpu"]["bytes"] == tiers["cpu"]["capacity_bytes"] == 4 * BLOCK_NBYTES
    assert ledger["kv_disk"]["bytes"] == tiers["disk"]["capacity_bytes"]
    assert ledger["kv_disk"]["device"] == "disk"
    for key in ("h2d_bytes_per_s", "d2h_bytes_per_s", "disk_read_bytes_per_s", "prefill_tokens_per_s"):
        assert tiers["rates"][key] > 0


@pytest.mark.parametrize("kw, message", [
    (dict(disk_kv_path="/tmp/x", disk_kv_gb=1.0), "host tier"),
    (dict(cpu_kv_gb=1.0, disk_kv_gb=1.0), "disk_kv_path"),
    (dict(preemption_mode="swap"), "cpu_kv_gb"),
    (dict(preemption_mode="sometimes"), "preemption_mode"),
    (dict(cpu_kv_gb=1.0, disk_kv_path="/tmp/x", disk_kv_gb=1.0, disk_write_policy="never"), "write-back"),
    (dict(cpu_kv_gb=-1.0), ">= 0"),
    (dict(cpu_kv_gb=1.0, disk_kv_path="/tmp/x", disk_kv_gb=1.0, enable_prefix_caching=False),
     "enable_prefix_caching"),
    (dict(cpu_kv_gb=1.0, enable_prefix_caching=False, preemption_mode="recompute"), "never be used"),
])
def test_bad_tier_options_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **kw)


def test_a_host_tier_smaller_than_one_block_names_the_flag(tiny):
    with pytest.raises(ValueError, match=r"--cpu-kv-gb .* holds no KV block: one block is \d+ bytes"):
        make_llm(tiny, cpu_kv_gb=BLOCK_NBYTES / 2 / GIB)


@pytest.mark.parametrize("flag, value", [("cpu", math.inf), ("cpu", math.nan), ("disk", math.inf),
                                         ("disk", math.nan)])
def test_non_finite_tier_sizes_are_refused_before_anything_loads(tmp_path, flag, value):
    kw = dict(cpu_kv_gb=1.0, disk_kv_path=str(tmp_path), disk_kv_gb=1.0)
    kw[f"{flag}_kv_gb"] = value
    with pytest.raises(ValueError, match=rf"^--{flag}-kv-gb {value:g} is not a finite size") as refused:
        EngineConfig(model="m", **kw)
    assert "\n" not in str(refused.value)


def test_a_host_tier_larger_than_the_available_memory_is_refused(monkeypatch):
    import psutil
    available = 3 * GIB
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=available, total=8 * GIB))
    with pytest.raises(ValueError, match=r"^--cpu-kv-gb 4 asks for a host KV tier of 4.00 GiB, more than the 3.00 GiB of host memory available "
                                         r".*lower --cpu-kv-gb") as refused:
        EngineConfig(model="m", cpu_kv_gb=4.0)
    assert "\n" not in str(refused.value)
    EngineConfig(model="m", cpu_kv_gb=2.5)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="more than the"):
        EngineConfig(model="m", cpu_kv_gb=100000)  # the audit's: it crashed allocating host memory


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_tier_smaller_than_one_block_is_refused_before_the_weights_load(tiny, tmp_path, monkeypatch, tier):
    """From config.json's shape, not after minutes of loading a large model's weights."""
    import mempath.engine.startup as startup

    def never_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the tier's size was checked")

    monkeypatch.setattr(startup, "load_model", never_load)
    kw = dict(cpu_kv_gb=BLOCK_NBYTES / 2 / GIB)
    if tier == "disk":
        kw = dict(cpu_kv_gb=gb(2), disk_kv_path=str(tmp_path), disk_kv_gb=BLOCK_NBYTES / 2 / GIB)
    expected = {"cpu": rf"^--cpu-kv-gb .* holds no KV block: one block is {BLOCK_NBYTES} bytes",
                "disk": rf"^--disk-kv-gb .* holds no KV block: one block file is more than {BLOCK_NBYTES} bytes"}
    with pytest.raises(ValueError, match=expected[tier]) as refused:
        make_llm(tiny, **kw)
    assert "\n" not in str(refused.value)
    assert not os.listdir(tmp_path)


def test_a_host_tier_below_one_byte_is_named_as_given(tiny):
    with pytest.raises(ValueError, match=r"^--cpu-kv-gb 1e-12 holds no KV block"):
        make_llm(tiny, cpu_kv_gb=1e-12)


def test_a_disk_tier_smaller_than_one_block_file_names_the_flag(tiny, tmp_path):
    # Room for the block's K and V (start-up's check passes) but not for its file's header too.
    with pytest.raises(ValueError, match=r"^--disk-kv-gb \S+ holds no KV block: one block file is (\d+) bytes") \
            as refused:
        make_llm(tiny, cpu_kv_gb=gb(2), disk_kv_path=str(tmp_path), disk_kv_gb=(BLOCK_NBYTES + 1) / GIB)
    assert "\n" not in str(refused.value)
    assert not os.listdir(tmp_path)  # refused before the tier touched the directory
    file_nbytes = int(re.search(r"is (\d+) bytes", str(refused.value))[1])
    llm = make_llm(tiny, cpu_kv_gb=gb(2), disk_kv_path=str(tmp_path), disk_kv_gb=file_nbytes / GIB)
    disk = llm.engine.kv.tiers.disk
    assert disk.capacity_bytes == file_nbytes == disk.file_nbytes(hash_block(None, [0]))
    llm.engine.close()


def test_cli_passes_the_tier_flags():
    import argparse

    from mempath.engine_flags import add_engine_arguments, engine_options
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--cpu-kv-gb", "4", "--disk-kv-path", "/d", "--disk-kv-gb", "100",
                              "--disk-write-policy", "write-through", "--preemption-mode", "swap"])
    options = engine_options(args)
    assert options["cpu_kv_gb"] == 4 and options["disk_kv_path"] == "/d" and options["disk_kv_gb"] == 100
    assert options["disk_write_policy"] == "write-through" and options["preemption_mode"] == "swap"


@pytest.mark.parametrize("policy", ["write-back", "write-through"])
def test_closing_writes_what_the_device_and_host_cache_so_a_restart_finds_it(tiny, tmp_path, policy):
    """The disk tier got only what the device pool and the host tier evicted: a run that never filled them left
    nothing on disk at close, and the next engine on the path recomputed everything."""
    prompts = conversations(3)
    first = make_llm(tiny, cpu_kv_gb=gb(2), disk_kv_path=str(tmp_path), disk_kv_gb=gb(64),
                     disk_write_policy=policy)
    expected = [first.generate(p, greedy(), use_tqdm=False)[0].token_ids for p in prompts]
    assert tier_stats(first)["disk"]["blocks"] == 0  # nothing was evicted: the disk holds nothing yet
    first.engine.close()
    again = make_llm(tiny, cpu_kv_gb=gb(2), disk_kv_path=str(tmp_path), disk_kv_gb=gb(64),
                     disk_write_policy=policy)
    outs = [again.generate(p, greedy(), use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in outs] == expected
    block = again.engine.config.block_size
    assert [o.num_cached_tokens for o in outs] == [len(p) // block * block for p in prompts]
    assert tier_stats(again)["hits_blocks"]["disk"] > 0
    assert_no_leak(again)


def test_closing_onto_a_smaller_disk_writes_only_blocks_a_restart_can_reach(tiny, tmp_path):
    """A restart finds a prompt's blocks only from its first one on. The close wrote the newest blocks first,
    a long prompt's tail, which no restart reaches without its head; and the host tier's blocks, written first,
    were then evicted by the device pool's."""
    prompt = conversations(1, 100)[0]  # six full blocks
    llm = make_llm(tiny, cpu_kv_gb=gb(4), disk_kv_path=str(tmp_path), disk_kv_gb=gb(3))
    expected = llm.generate(prompt, greedy(), use_tqdm=False)[0].token_ids
    llm.engine.close()
    again = make_llm(tiny, cpu_kv_gb=gb(4), disk_kv_path=str(tmp_path), disk_kv_gb=gb(3))
    assert tier_stats(again)["disk"]["blocks"] == 3
    out = again.generate(prompt, greedy(), use_tqdm=False)[0]
    assert out.token_ids == expected and out.num_cached_tokens == 3 * BLOCK
    assert tier_stats(again)["hits_blocks"]["disk"] == 3
    assert_no_leak(again)


def test_closing_writes_the_host_tiers_heads_before_the_device_pools_tails(tiny, tmp_path):
    llm = make_llm(tiny, cpu_kv_gb=gb(4), disk_kv_path=str(tmp_path), disk_kv_gb=gb(7))
    for prompt in conversations(4):
        llm.generate(prompt, greedy(), use_tqdm=False)
    tiers = llm.engine.kv.tiers
    device, host = list(tiers.pool.cached), [h for _, h in tiers.host.cached_blocks()]
    assert len(device) < 7 < len(device) + len(host)  # the disk holds the host's blocks and part of the device's
    assert tiers.persist() == 7
    assert all(h in tiers.disk for h in host) and [h in tiers.disk for h in device] == [True] * 5 + [False]
    assert tier_stats(llm)["disk"]["blocks"] == 7
    llm.engine.close()


def test_closing_releases_the_tier_even_when_writing_at_close_fails_and_twice_is_harmless(tiny, tmp_path,
                                                                                          monkeypatch, caplog):
    """A failure while persisting skipped the flush and the close: the directory stayed locked for the process."""
    llm = make_llm(tiny, cpu_kv_gb=gb(2), disk_kv_path=str(tmp_path), disk_kv_gb=gb(64))
    llm.generate(conversations(1)[0], greedy(), use_tqdm=False)
    tiers = llm.engine.kv.tiers

    def broken(*args, **kwargs):
        raise RuntimeError("a copy failed")

    monkeypatch.setattr(tiers.transfer, "device_to_host", broken)
    llm.engine.close()
    llm.engine.close()
    assert any("writing the cached blocks at close failed" in r.getMessage() for r in caplog.records)
    again = make_llm(tiny, cpu_kv_gb=gb(2), disk_kv_path=str(tmp_path), disk_kv_gb=gb(64))  # not "in use"
    again.engine.close()


def test_writing_at_close_stops_at_its_deadline(tiny, tmp_path, monkeypatch, caplog):
    from mempath.kv.tiers import coordinator
    llm = make_llm(tiny, cpu_kv_gb=gb(2), disk_kv_path=str(tmp_path), disk_kv_gb=gb(64))
    for prompt in conversations(3):
        llm.generate(prompt, greedy(), use_tqdm=False)
    tiers = llm.engine.kv.tiers
    newest = list(tiers.pool.cached)[-1]
    monkeypatch.setattr(coordinator, "PERSIST_DEADLINE_S", 0.0)
    assert tiers.persist() == 0 and newest not in tiers.disk
    assert any("not written at close" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(coordinator, "PERSIST_DEADLINE_S", 30.0)
    assert tiers.persist() > 0 and newest in tiers.disk
    llm.engine.close()


def test_device_hits_are_counted_in_blocks_as_the_other_tiers_hits(tiny):
    """The pool's hit counter went over to tokens (vLLM's prefix-cache counters): the device tier's hits came out
    block_size times too many beside the host's and the disk's."""
    llm = make_llm(tiny, cpu_kv_gb=gb(4))
    prompt = conversations(1, 50)[0]
    llm.generate(prompt, greedy(), use_tqdm=False)
    assert llm.generate(prompt, greedy(), use_tqdm=False)[0].num_cached_tokens == 3 * BLOCK
    assert tier_stats(llm)["hits_blocks"]["gpu"] == 3
