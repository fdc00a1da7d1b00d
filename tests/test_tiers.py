"""KV tiers: host and disk stores, the transfer engine, and their limits.

The CPU tests run the real code with a CPU tensor as the "device" cache; the
CUDA tests (skipped without a GPU) check the stream/event path and print the
bandwidth of batched vs one-copy-per-slice transfers.
"""
import math
import os
import random
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mempath.kv.block_pool import hash_block
from mempath.kv.tiers.cost import measure_transfer_rates
from mempath.kv.tiers.disk import DiskBlockStore, spill_to_disk, write_through_block
from mempath.kv.tiers.host import HostBlockStore, block_shape_of, contiguous_runs
from mempath.kv.tiers.transfer import TransferEngine

# (num_layers, block_size, num_kv_heads, head_dim)
LAYOUTS = [(2, 4, 2, 8), (3, 2, 1, 16)]
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_cache(num_blocks, layout=LAYOUTS[0], dtype=torch.float32, device="cpu", seed=0):
    num_layers, block_size, num_kv_heads, head_dim = layout
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    return cache.to(dtype).to(device)


def block_of(cache, block_id):
    """Block-major bytes of one device block, for exact comparison."""
    return cache[:, :, block_id].contiguous().view(-1).view(torch.uint8).cpu()


def same_bytes(a, b) -> bool:
    return torch.equal(a.contiguous().view(-1).view(torch.uint8).cpu(), b.contiguous().view(-1).view(torch.uint8).cpu())


def hashes(n, salt=0):
    return [hash_block(None, [salt, i]) for i in range(n)]


def disk_for(path, host, capacity_blocks=1000, fingerprint="tiny-llama", **kwargs):
    nbytes = host.block_nbytes
    capacity = capacity_blocks * (nbytes + 256)  # 256: room for a file's header and checksum
    return DiskBlockStore(path, capacity, nbytes, fingerprint=fingerprint,
                          block_shape=host.block_shape, dtype=host.dtype, **kwargs)


def file_bytes_on_disk(path) -> int:
    """Bytes of the block files under path now (a worker may rename or delete one as we look)."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            if not name.endswith(".kv"):
                continue  # the manifest, temporaries
            try:
                total += os.path.getsize(os.path.join(root, name))
            except FileNotFoundError:
                pass
    return total


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_device_host_disk_host_device(tmp_path, dtype, layout):
    cache = make_cache(24, layout, dtype)
    original = cache.clone()
    host = HostBlockStore.for_cache(cache, capacity_bytes=16 * block_of(cache, 0).numel())
    engine = TransferEngine(cache, host, staging_blocks=4)
    disk = disk_for(tmp_path, host)
    gpu_ids = [5, 1, 17, 3, 9, 10, 11, 22, 0]
    keys = hashes(len(gpu_ids))

    cpu_ids = host.allocate(len(gpu_ids))
    engine.device_to_host(gpu_ids, cpu_ids).wait()
    for g, c, h in zip(gpu_ids, cpu_ids, keys):
        assert same_bytes(host.storage[c], block_of(original, g))
        host.insert(h, c)
    # All cached, untouched: by age; write-back, so each goes to disk.
    assert spill_to_disk(host, disk, len(gpu_ids)) == sorted(cpu_ids)
    host.reap()
    disk.flush()
    assert host.num_free == host.num_blocks and all(h in disk for h in keys)

    back = host.allocate(len(keys))
    assert all(disk.read_async(h, host.storage[c]).result() for h, c in zip(keys, back))
    targets = [23, 2, 4, 6, 7, 8, 12, 13, 14]
    cache.zero_()
    engine.host_to_device(back, targets).wait()
    for g, t in zip(gpu_ids, targets):
        assert same_bytes(cache[:, :, t], original[:, :, g])
    untouched = [i for i in range(24) if i not in targets]
    assert not cache[:, :, untouched].any()


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_chunks_larger_than_staging_and_scattered_host_ids(direction):
    cache = make_cache(40, dtype=torch.bfloat16, seed=1)
    host = HostBlockStore.for_cache(cache, capacity_bytes=40 * block_of(cache, 0).numel())
    engine = TransferEngine(cache, host, staging_blocks=3)
    rng = random.Random(0)
    gpu_ids = rng.sample(range(40), 17)
    # Runs of consecutive host ids, some crossing a chunk boundary, and singletons.
    cpu_ids = [0, 1, 2, 3, 4, 20, 7, 8, 30, 31, 32, 33, 11, 39, 12, 13, 14]
    host.allocate(40)
    if direction == "d2h":
        engine.device_to_host(gpu_ids, cpu_ids).wait()
        for g, c in zip(gpu_ids, cpu_ids):
            assert same_bytes(host.storage[c], cache[:, :, g])
    else:
        host.storage.copy_(torch.randn(host.storage.shape).to(host.dtype))
        before = cache.clone()
        engine.host_to_device(cpu_ids, gpu_ids).wait()
        for g, c in zip(gpu_ids, cpu_ids):
            assert same_bytes(cache[:, :, g], host.storage[c])
        rest = [i for i in range(40) if i not in gpu_ids]
        assert same_bytes(cache[:, :, rest], before[:, :, rest])
    stats = engine.stats()
    assert stats[f"{direction}_blocks"] == 17 and stats[f"{direction}_bytes"] == 17 * host.block_nbytes
    assert stats["in_flight"] == 0 and not any(host.is_pinned(c) for c in cpu_ids)


def test_contiguous_runs():
    assert contiguous_runs([]) == []
    assert contiguous_runs([4, 5, 6, 9, 1, 2]) == [(0, 4, 3), (3, 9, 1), (4, 1, 2)]


def test_mismatched_host_layout_is_refused():
    cache = make_cache(4)
    host = HostBlockStore(4, (2, 2, 4, 2, 4), torch.float32, pin_memory=False)
    with pytest.raises(ValueError, match="do not match"):
        TransferEngine(cache, host)


# ---------------------------------------------------------------------------- disk integrity
def written_store(tmp_path, n=3, **kwargs):
    host = HostBlockStore(n, (2, 2, 4, 2, 8), torch.float32, pin_memory=False)
    host.storage.copy_(torch.randn(host.storage.shape))
    disk = disk_for(tmp_path, host, **kwargs)
    keys = hashes(n)
    assert all(disk.write_async(h, host.storage[i]).result() for i, h in enumerate(keys))
    return host, disk, keys


def test_disk_read_returns_the_written_bytes(tmp_path):
    host, disk, keys = written_store(tmp_path)
    out = torch.empty_like(host.storage[0])
    for i, h in enumerate(keys):
        assert disk.read_async(h, out).result()
        assert same_bytes(out, host.storage[i])
    assert not disk.read_async(hash_block(None, [99]), out).result()


@pytest.mark.parametrize("where", ["payload", "header", "checksum"])
def test_corrupted_file_is_detected_and_removed(tmp_path, where):
    host, disk, keys = written_store(tmp_path)
    path = disk.path_for(keys[1])
    data = bytearray(open(path, "rb").read())
    offset = {"payload": len(data) // 2, "header": 6, "checksum": len(data) - 2}[where]
    data[offset] ^= 0x40
    open(path, "wb").write(bytes(data))
    used = disk.used_bytes
    assert not disk.read_async(keys[1], torch.empty_like(host.storage[0])).result()
    assert not os.path.exists(path) and keys[1] not in disk
    assert disk.used_bytes == used - len(data)
    assert disk.read_async(keys[0], torch.empty_like(host.storage[0])).result()


@pytest.mark.parametrize("cut", [1, 4, 1000])
def test_truncated_file_is_detected_and_removed(tmp_path, cut):
    host, disk, keys = written_store(tmp_path)
    path = disk.path_for(keys[0])
    os.truncate(path, os.path.getsize(path) - cut)
    assert not disk.read_async(keys[0], torch.empty_like(host.storage[0])).result()
    assert not os.path.exists(path) and keys[0] not in disk


def test_file_grown_past_its_checksum_is_rejected(tmp_path):
    host, disk, keys = written_store(tmp_path)
    with open(disk.path_for(keys[2]), "ab") as f:
        f.write(b"x")
    assert not disk.read_async(keys[2], torch.empty_like(host.storage[0])).result()


# ---------------------------------------------------------------------------- restart
def test_index_survives_a_restart_with_its_lru_order(tmp_path):
    host, disk, keys = written_store(tmp_path, n=4)
    used = disk.used_bytes
    disk.close()
    # Access order older first: 2, 0, 3, 1.
    for age, i in enumerate([2, 0, 3, 1]):
        os.utime(disk.path_for(keys[i]), ns=(10**18 + age * 10**9,) * 2)
    stray = disk.path_for(keys[0]) + ".abcd1234.tmp"
    open(stray, "wb").write(b"half a block")
    other = tmp_path / "README.txt"
    other.write_text("not a block")

    again = disk_for(tmp_path, host)
    assert again.used_bytes == used and all(h in again for h in keys)
    assert not os.path.exists(stray) and other.exists()
    out = torch.empty_like(host.storage[0])
    assert again.read_async(keys[3], out).result() and same_bytes(out, host.storage[3])
    assert again.evict(2) == [keys[2], keys[0]]  # 3 was just read: now most recent
    again.close()
    third = disk_for(tmp_path, host)
    assert set(third._index) == {keys[1], keys[3]}
    assert list(third._index)[-1] == keys[3]  # the read refreshed its mtime


def test_restart_with_a_smaller_capacity_evicts_the_oldest(tmp_path):
    host, disk, keys = written_store(tmp_path, n=3)
    file_size = disk.file_nbytes(keys[0])
    disk.close()
    for age, h in enumerate(keys):
        os.utime(disk.path_for(h), ns=(10**18 + age * 10**9,) * 2)
    small = DiskBlockStore(tmp_path, 2 * file_size, host.block_nbytes, fingerprint="tiny-llama",
                           block_shape=host.block_shape, dtype=host.dtype)
    assert set(small._index) == set(keys[1:]) and file_bytes_on_disk(tmp_path) == 2 * file_size


@pytest.mark.parametrize("change", ["fingerprint", "dtype", "shape"])
def test_blocks_of_another_layout_are_neither_used_nor_touched(tmp_path, change):
    host, disk, keys = written_store(tmp_path)
    disk.close()
    on_disk = file_bytes_on_disk(tmp_path)
    kwargs = dict(fingerprint="tiny-llama", block_shape=host.block_shape, dtype=host.dtype)
    if change == "fingerprint":
        kwargs["fingerprint"] = "other-model"
    elif change == "dtype":
        kwargs["dtype"] = torch.int32  # same bytes per element, other meaning
    else:
        kwargs["block_shape"] = (2, 2, 8, 2, 4)  # same bytes, other block size
    other = DiskBlockStore(tmp_path, 10**9, host.block_nbytes, **kwargs)
    assert len(other) == 0 and other.used_bytes == 0
    assert not other.read_async(keys[0], torch.empty_like(host.storage[0])).result()
    other.close()
    # Each layout has its own namespace: the first engine's blocks are still there (they were deleted).
    assert file_bytes_on_disk(tmp_path) == on_disk and set(disk_for(tmp_path, host)._index) == set(keys)


def test_inconsistent_block_nbytes_is_refused(tmp_path):
    with pytest.raises(ValueError, match="block_nbytes"):
        DiskBlockStore(tmp_path, 10**6, 100, block_shape=(2, 2), dtype=torch.float32)


# ---------------------------------------------------------------------------- eviction rules
def test_host_eviction_follows_the_documented_score():
    host = HostBlockStore(6, (1, 2, 1, 1, 4), torch.float32, pin_memory=False, hit_weight=2.0)
    ids = host.allocate(6)
    for i, h in zip(ids, hashes(6)):
        host.insert(h, i)  # clock 1..6
    host.touch(ids[0])  # clock 7, hits 1: score 7 + 2*1 = 9
    for _ in range(3):
        host.touch(ids[1])  # clock 10, hits 3: score 10 + 2*2 = 14
    # ids[2..5] were inserted at 3..6 with no hits.
    expected = sorted(ids, key=lambda i: (host._last_access[i] + 2.0 * math.log2(1 + host._hits[i]), i))
    assert host.evict_candidates(6) == expected == [ids[2], ids[3], ids[4], ids[5], ids[0], ids[1]]
    # Popularity outweighs a little recency: hits buy 2*log2(1+h) ticks.
    host.touch(ids[2])  # clock 11, hits 1: score 13 < 14
    assert host.evict_candidates(6)[-2:] == [ids[2], ids[1]]
    host.pin([ids[3]])
    assert ids[3] not in host.evict_candidates(6)


def test_owned_and_pinned_blocks_are_never_evicted():
    host = HostBlockStore(4, (1, 2, 1, 1, 4), torch.float32, pin_memory=False)
    a, b, c, d = host.allocate(4)
    host.insert(b"x" * 16, b)
    host.insert(b"y" * 16, c)
    host.pin([c])
    assert host.evict_candidates(4) == [b]
    with pytest.raises(RuntimeError, match="pinned"):
        host.free([c])
    assert host.allocate(1) is None
    host.unpin([c])
    host.free([a, b])
    assert host.lookup(b"x" * 16) is None and host.num_free == 2
    with pytest.raises(RuntimeError, match="twice"):
        host.free([a])
    host.check_invariants()


def test_host_allocation_prefers_consecutive_ids():
    host = HostBlockStore(10, (1, 2, 1, 1, 2), torch.float32, pin_memory=False)
    ids = host.allocate(10)
    host.free([ids[i] for i in (1, 2, 5, 6, 7, 9)])
    assert host.allocate(3) == [5, 6, 7]
    assert host.allocate(3) == [1, 2, 9]


def test_disk_lru_evicts_least_recently_read_first(tmp_path):
    host = HostBlockStore(5, (2, 2, 4, 2, 8), torch.float32, pin_memory=False)
    keys = hashes(5)
    probe = DiskBlockStore(tmp_path / "probe", 10**9, host.block_nbytes, fingerprint="tiny-llama",
                           block_shape=host.block_shape, dtype=host.dtype)
    file_size = probe.file_nbytes(keys[0])
    disk = DiskBlockStore(tmp_path / "cold", 3 * file_size, host.block_nbytes, fingerprint="tiny-llama",
                          block_shape=host.block_shape, dtype=host.dtype)
    for i in range(3):
        assert disk.write_async(keys[i], host.storage[i]).result()
    assert disk.read_async(keys[0], host.storage[4]).result()  # 0 becomes most recent
    assert disk.write_async(keys[3], host.storage[3]).result()  # evicts 1
    assert set(disk._index) == {keys[0], keys[2], keys[3]}
    assert disk.used_bytes == 3 * file_size == file_bytes_on_disk(tmp_path / "cold")
    tiny = DiskBlockStore(tmp_path / "tiny", file_size - 1, host.block_nbytes, fingerprint="tiny-llama",
                          block_shape=host.block_shape, dtype=host.dtype)
    assert not tiny.write_async(keys[0], host.storage[0]).result() and tiny.used_bytes == 0


# ---------------------------------------------------------------------------- policies
def test_write_through_writes_on_insert_and_frees_on_eviction(tmp_path):
    host = HostBlockStore(4, (2, 2, 4, 2, 8), torch.float32, pin_memory=False)
    host.storage.copy_(torch.randn(host.storage.shape))
    disk = disk_for(tmp_path, host, write_through=True)
    ids = host.allocate(2)
    keys = hashes(2)
    for i, h in zip(ids, keys):
        host.insert(h, i)
        future = write_through_block(host, disk, i)
        assert future.result() and h in disk
    assert write_through_block(host, disk, ids[0]) is None  # already there
    host.reap()
    assert spill_to_disk(host, disk, 2) == ids and host.num_free == 4  # freed at once
    out = torch.empty_like(host.storage[0])
    assert disk.read_async(keys[1], out).result() and same_bytes(out, host.storage[ids[1]])


def test_a_read_queued_behind_its_write_sees_the_block(tmp_path):
    host = HostBlockStore(8, (4, 2, 16, 4, 32), torch.float32, pin_memory=False)
    host.storage.copy_(torch.randn(host.storage.shape))
    disk = disk_for(tmp_path, host, num_workers=3)
    keys = hashes(4)
    for i, h in enumerate(keys):
        disk.write_async(h, host.storage[i])
    reads = [disk.read_async(h, host.storage[4 + i]) for i, h in enumerate(keys)]
    assert all(r.result() for r in reads)
    for i in range(4):
        assert same_bytes(host.storage[4 + i], host.storage[i])


# ---------------------------------------------------------------------------- random workload
def _finished(future):
    future.result()
    return future


def run_workload(tmp_path, seed: int, steps: int, host_blocks: int, disk_blocks: int, write_through: bool):
    rng = random.Random(seed)
    cache = make_cache(16, LAYOUTS[1], torch.bfloat16, seed=seed)
    host = HostBlockStore.for_cache(cache, host_blocks * block_of(cache, 0).numel())
    engine = TransferEngine(cache, host, staging_blocks=3)
    probe = DiskBlockStore(tmp_path / "probe", 10**9, host.block_nbytes)
    disk = DiskBlockStore(tmp_path / "cold", disk_blocks * probe.file_nbytes(hashes(1)[0]) + 7,
                          host.block_nbytes, write_through=write_through, num_workers=2)
    # Every write is over before the next operation. Otherwise what reaches the disk depends on
    # the writer threads: a block still being written cannot be evicted to make room, so the
    # next write is skipped; on a busy machine write-through then had 7 cold hits, not 12.
    write_async = disk.write_async
    disk.write_async = lambda *args: _finished(write_async(*args))
    # The device cache never changes here, so a block's hash can name its device block.
    keys = {g: hash_block(None, [seed, g]) for g in range(16)}
    truth = {keys[g]: block_of(cache, g) for g in range(16)}
    counts = {"cold_hits": 0, "spilled": 0}
    for _ in range(steps):
        op = rng.random()
        if op < 0.4:  # swap some device blocks out
            gpu_ids = [g for g in rng.sample(range(16), rng.randint(1, 4)) if keys[g] not in host]
            if host.num_free < len(gpu_ids):
                counts["spilled"] += len(spill_to_disk(host, disk, len(gpu_ids) - host.num_free))
            cpu_ids = host.allocate(len(gpu_ids))
            if not cpu_ids:
                continue
            engine.device_to_host(gpu_ids, cpu_ids).wait()
            for g, c in zip(gpu_ids, cpu_ids):
                assert host.insert(keys[g], c)
                write_through_block(host, disk, c)
        elif op < 0.6 and host._index:  # hit in the warm tier
            h = rng.choice(list(host._index))
            host.touch(host.lookup(h))
            assert same_bytes(host.storage[host.lookup(h)], truth[h])
        elif op < 0.8:  # load from the cold tier
            candidates = [h for h in truth if h in disk and h not in host]
            if not candidates:
                continue
            ids = host.allocate(1)
            if ids is None:
                continue
            h = rng.choice(candidates)
            host.pin(ids)
            ok = disk.read_async(h, host.storage[ids[0]]).result()
            host.unpin(ids)
            if ok:
                assert same_bytes(host.storage[ids[0]], truth[h])
                host.insert(h, ids[0])
                counts["cold_hits"] += 1
            else:
                host.free(ids)
        elif op < 0.9:
            counts["spilled"] += len(spill_to_disk(host, disk, rng.randint(1, 3)))
        else:
            disk.evict(rng.randint(0, 2))
        host.check_invariants()
        assert host.used_bytes <= host.capacity_bytes
        assert disk.used_bytes <= disk.capacity_bytes
        assert file_bytes_on_disk(tmp_path / "cold") <= disk.capacity_bytes
    disk.close()
    host.reap()
    assert file_bytes_on_disk(tmp_path / "cold") == disk.used_bytes <= disk.capacity_bytes
    assert host.num_free + len(host._index) == host.num_blocks
    return disk, counts


@pytest.mark.parametrize("write_through", [False, True])
def test_capacity_is_never_exceeded_under_a_random_workload(tmp_path, write_through):
    disk, counts = run_workload(tmp_path, seed=7 + write_through, steps=400, host_blocks=6, disk_blocks=9,
                                write_through=write_through)
    assert len(disk) > 0 and counts["cold_hits"] > 10 and counts["spilled"] > 10, counts


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "insert", "touch", "pin", "unpin", "free", "evict"]),
                          st.integers(0, 7)), max_size=60))
def test_host_store_bookkeeping_stays_consistent(ops):
    host = HostBlockStore(8, (1, 2, 1, 1, 2), torch.float32, pin_memory=False)
    owned, pinned = set(), []
    for op, x in ops:
        if op == "alloc":
            ids = host.allocate(x % 4)
            assert ids is None or len(set(ids) & owned) == 0
            owned.update(ids or [])
        elif op == "insert" and owned:
            host.insert(hashes(8)[x], sorted(owned)[x % len(owned)])
        elif op == "touch" and host._index:
            host.touch(list(host._index.values())[x % len(host._index)])
        elif op == "pin" and owned:
            b = sorted(owned)[x % len(owned)]
            host.pin([b])
            pinned.append(b)
        elif op == "unpin" and pinned:
            host.unpin([pinned.pop(x % len(pinned))])
        elif op == "free" and owned:
            b = sorted(owned)[x % len(owned)]
            if b not in pinned:
                host.free([b])
                owned.discard(b)
        elif op == "evict":
            victims = host.evict_candidates(x)
            assert not set(victims) & set(pinned)
            scores = host.scores(victims)
            assert list(scores) == sorted(scores)
        host.check_invariants()
        assert host.num_free == 8 - len(owned)


# ---------------------------------------------------------------------------- calibration
def test_calibrate_reports_rates_and_leaves_everything_as_it_was(tmp_path):
    cache = make_cache(8, dtype=torch.bfloat16)
    original = cache.clone()
    host = HostBlockStore.for_cache(cache, 8 * block_of(cache, 0).numel())
    disk = disk_for(tmp_path, host)
    result = measure_transfer_rates(TransferEngine(cache, host, staging_blocks=4), disk, probe_blocks=8,
                                    disk_probe_blocks=3)
    for key in ("d2h_bytes_per_s", "h2d_bytes_per_s", "disk_write_bytes_per_s", "disk_read_bytes_per_s"):
        assert result[key] > 0
    assert same_bytes(cache, original)
    assert host.num_free == 8 and len(disk) == 0 and file_bytes_on_disk(tmp_path) == 0


# ---------------------------------------------------------------------------- CUDA
LLAMA8B = (32, 16, 8, 128)  # layers, block size, KV heads, head dim: 2 MiB per bf16 block


@cuda_only
def test_cuda_transfers_follow_the_compute_stream_and_round_trip():
    cache = make_cache(64, LAYOUTS[0], torch.bfloat16, device="cuda")
    host = HostBlockStore.for_cache(cache, 32 * block_of(cache, 0).numel())
    assert host.storage.is_pinned()
    engine = TransferEngine(cache, host, staging_blocks=5)
    gpu_ids = list(range(40, 52))
    expected = cache[:, :, gpu_ids].clone()
    # A slow kernel writes the blocks on the compute stream; the D2H must see its result.
    torch.cuda._sleep(50_000_000)
    cache[:, :, gpu_ids] += 1
    expected += 1
    cpu_ids = host.allocate(len(gpu_ids))
    out = engine.device_to_host(gpu_ids, cpu_ids)
    out.make_current_stream_wait()
    cache[:, :, gpu_ids] = 0  # safe: ordered after the gather
    out.wait()
    for j, c in enumerate(cpu_ids):
        assert same_bytes(host.storage[c], expected[:, :, j])
    back = engine.host_to_device(cpu_ids, list(range(12)))
    back.make_current_stream_wait()
    assert same_bytes(cache[:, :, :12], expected)  # read on the compute stream after the wait
    while not back.done():
        time.sleep(1e-4)
    stats = engine.stats()
    assert stats["d2h_blocks"] == stats["h2d_blocks"] == 12 and stats["in_flight"] == 0


@cuda_only
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_cuda_back_to_back_transfers_do_not_share_a_staging_half(direction):
    """Transfer B is launched while A still uses the staging buffer: a stalled stream of
    the direction (the copy stream for D2H, the scatter stream for H2D) keeps A's one
    chunk in staging half 0 while B's first chunk could run at once. B must take the
    other half first and wait for A before refilling half 0 (when each transfer started
    at half 0, B's first chunk overwrote A's staged blocks)."""
    cache = make_cache(80, LAYOUTS[0], torch.bfloat16, device="cuda")
    host = HostBlockStore.for_cache(cache, 64 * block_of(cache, 0).numel())
    engine = TransferEngine(cache, host, staging_blocks=8)  # halves of 4 blocks
    original = cache.clone()
    copy_stream, kernel_stream = engine._streams[direction]
    a_gpu, b_gpu = list(range(0, 4)), list(range(40, 46))  # A: one chunk; B: two
    a_cpu, b_cpu = host.allocate(4), host.allocate(6)
    if direction == "h2d":
        for c, g in zip(a_cpu + b_cpu, a_gpu + b_gpu):
            host.storage[c].copy_(cache[:, :, g + 20].contiguous().view(host.storage[c].shape))
        with torch.cuda.stream(kernel_stream):
            torch.cuda._sleep(100_000_000)  # A's scatter waits; B's first copy could run
        first = engine.host_to_device(a_cpu, a_gpu)
        second = engine.host_to_device(b_cpu, b_gpu)
        first.wait(), second.wait()
        for g in a_gpu + b_gpu:
            assert same_bytes(cache[:, :, g], original[:, :, g + 20])
    else:
        with torch.cuda.stream(copy_stream):
            torch.cuda._sleep(100_000_000)  # A's copy waits; B's first gather could run
        first = engine.device_to_host(a_gpu, a_cpu)
        second = engine.device_to_host(b_gpu, b_cpu)
        first.wait(), second.wait()
        for c, g in zip(a_cpu + b_cpu, a_gpu + b_gpu):
            assert same_bytes(host.storage[c], block_of(original, g))


@cuda_only
def test_cuda_launch_does_not_block_the_host():
    """A D2H launched behind a busy compute stream returns while that stream is still busy
    (an order of events, not a wall-clock bound) and makes no synchronising CUDA call (torch's
    sync debug mode raises on one)."""
    cache = make_cache(128, LLAMA8B, torch.bfloat16, device="cuda")
    host = HostBlockStore.for_cache(cache, 128 * host_block_bytes(cache))
    engine = TransferEngine(cache, host, staging_blocks=64)
    ids = host.allocate(128)
    engine.device_to_host([0], ids[:1]).wait()  # first-call set-up outside the check
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # keep the compute stream busy, far longer than a launch
    busy = torch.cuda.Event()
    busy.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        transfer = engine.device_to_host(list(range(128)), ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not busy.query(), "the launch returned only after the compute stream's work ended"
    assert not transfer.done()
    transfer.wait()
    assert engine.stats()["d2h_blocks"] == 129


def host_block_bytes(cache) -> int:
    return math.prod(block_shape_of(cache)) * cache.element_size()


class _HostCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts copy_ calls that write into (or read from) the host store's storage."""

    def __init__(self, host_storage: torch.Tensor):
        super().__init__()
        self.host_ptr = host_storage.untyped_storage().data_ptr()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.count += self.host_ptr in (args[0].untyped_storage().data_ptr(),
                                            args[1].untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_batched_transfer_makes_one_host_copy_per_chunk(device, direction):
    """256 scattered device blocks to or from consecutive host blocks: at most one host copy
    per half-staging-buffer chunk (one per block, layer and K/V would be 256 x 4 here), and
    every block arrives intact. How much faster that is than one copy per slice is measured
    by benchmarks/bench_transfer.py ("per slice" against "engine"), not asserted here."""
    num_blocks = 256
    cache = make_cache(num_blocks + 8, LAYOUTS[0], device=device)
    host = HostBlockStore.for_cache(cache, num_blocks * block_of(cache, 0).numel())
    engine = TransferEngine(cache, host, staging_blocks=64)
    gpu_ids = [int(g) for g in np.random.default_rng(0).permutation(num_blocks + 8)[:num_blocks]]
    cpu_ids = host.allocate(num_blocks)
    assert len(contiguous_runs(cpu_ids)) == 1
    original = cache.clone()
    if direction == "h2d":
        for c, g in zip(cpu_ids, gpu_ids):
            host.storage[c].copy_(original[:, :, (g + 1) % (num_blocks + 8)].contiguous()
                                  .view(host.storage[c].shape))
    counter = _HostCopies(host.storage)
    with counter:
        if direction == "d2h":
            engine.device_to_host(gpu_ids, cpu_ids).wait()
        else:
            engine.host_to_device(cpu_ids, gpu_ids).wait()
    assert 0 < counter.count <= -(-num_blocks // (engine.staging_blocks // 2))
    for c, g in zip(cpu_ids, gpu_ids):
        if direction == "d2h":
            assert same_bytes(host.storage[c], block_of(original, g))
        else:
            assert same_bytes(block_of(cache, g), block_of(original, (g + 1) % (num_blocks + 8)))


def test_host_tier_short_of_room_spills_once_while_writes_are_pending(tmp_path):
    """With the host tier full and its spilled blocks still being written, asking again for
    the same room must not evict more warm blocks (each ask used to evict another batch)."""
    import threading

    from mempath.kv.block_pool import BlockPool
    from mempath.kv.tiers.coordinator import TierConfig, TierCoordinator
    kv = torch.zeros(1, 2, 8, 4, 1, 8)
    block_nbytes = 2 * 4 * 8 * 4
    tiers = TierCoordinator(BlockPool(8), 4, TierConfig(kv, 6 * block_nbytes, str(tmp_path), 1 << 20, False))
    gate = threading.Event()
    write_file = tiers.disk._write_file
    tiers.disk._write_file = lambda *a: (gate.wait(), write_file(*a))[1]
    for i, block in enumerate(tiers.host.allocate(6)):
        tiers.host.insert(bytes([i]) * 16, block)
    try:
        for _ in range(3):
            assert tiers._allocate_host(2) == []  # the writes are held: nothing is free yet
            assert tiers.counters["host_evictions"] == 2
    finally:
        gate.set()
        tiers.disk.flush()
    assert tiers.host.num_free == 2 and len(tiers.host._index) == 4
    tiers.close()
