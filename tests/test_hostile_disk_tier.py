"""The disk KV tier against a careless or hostile filesystem (issues 13, 22, 23).

It owns only what it wrote: a manifest at the root of ``--disk-kv-path``, one namespace
per layout, and inside its own namespace only the names it writes. Odd files (FIFOs,
directories, files of other users, unreadable ones) are never waited on and never
deleted; a read that fails or outlives its deadline falls back to recomputing. A
directory other users can write is refused. Failures are one line per kind and a
counter. Engine-level tests go through ``LLM`` with the tiny model, as
tests/test_kv_tiers_engine.py does, and compare token ids with a run without tiers.
"""
import errno
import logging
import math
import os
import re
import stat
import threading

import pytest
import torch

from mempath.config import EngineConfig
from mempath.kv.tiers import disk_dir
from mempath.kv.block_pool import hash_block
from mempath.kv.tiers.disk import DiskBlockStore
from tests import test_kv_tiers_engine as engine_tests
from tests.test_kv_tiers_engine import (assert_no_leak, conversations, gb, greedy, make_llm,  # noqa: F401
                                        reference, tier_stats, tiny)

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block size, KV heads, head dim
OTHER_BLOCK_SIZE = (2, 2, 8, 2, 4)  # same bytes per block, another block size
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a file to another user")
not_root = pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")


def store(path, shape=SHAPE, capacity=10**7, **kwargs) -> DiskBlockStore:
    return DiskBlockStore(path, capacity, math.prod(shape) * 4, fingerprint="tiny-llama",
                          block_shape=shape, dtype=torch.float32, **kwargs)


def keys(n, salt=0):
    return [hash_block(None, [salt, i]) for i in range(n)]


def write_blocks(disk, n, salt=0):
    data = torch.randn(n, *disk_shape(disk), generator=torch.Generator().manual_seed(salt))
    hashes = keys(n, salt)
    assert all(disk.write_async(h, data[i]).result() for i, h in enumerate(hashes))
    return hashes, data


def disk_shape(disk):
    return tuple(int(s) for s in disk.layout.rsplit("block=", 1)[1].split("x"))


def read(disk, block_hash) -> bool:
    return disk.read_async(block_hash, torch.empty(disk_shape(disk))).result(timeout=60)


def snapshot(root):
    """Every path below root with its bytes (files) or kind, to show nothing changed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.join(dirpath, name)] = "dir"
        for name in filenames:
            p = os.path.join(dirpath, name)
            out[p] = open(p, "rb").read() if stat.S_ISREG(os.lstat(p).st_mode) else "special"
    return out


def plant(root, files):
    for rel, content in files.items():
        p = os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(content)


USER_FILES = {"draft.tmp": "my draft", "project/build/obj.tmp": "object", "project/cache.kv": "mine",
              "ab/0123.kv": "not a block", "notes.txt": "hello"}


class FifoGuard:
    """Opens the write end of FIFOs after a long delay, so a reader stuck in open() on a
    regression returns (and the test fails on its assertions) instead of hanging the suite."""

    def __init__(self):
        self.paths, self.fired = [], False
        self._timer = threading.Timer(60.0, self.release)
        self._timer.daemon = True
        self._timer.start()

    def make(self, path):
        os.mkfifo(path, 0o600)
        self.paths.append(path)

    def release(self):
        self.fired = True
        for p in self.paths:
            try:
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass  # no reader waiting, or gone

    def cancel(self):
        self._timer.cancel()


@pytest.fixture
def fifos():
    guard = FifoGuard()
    yield guard
    guard.cancel()
    guard.release()


def block_files(root):
    return sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".kv")
                  and len(n) == 35)


# ---------------------------------------------------------------------------- what it owns
def test_start_up_deletes_nothing_it_did_not_write(tmp_path):
    root = tmp_path / "kv"
    disk = store(root)
    hashes, _ = write_blocks(disk, 3)
    disk.close()
    plant(root, USER_FILES)
    before = snapshot(root)
    again = store(root)
    assert snapshot(root) == before
    assert all(h in again for h in hashes)


def test_inside_its_namespace_only_its_own_names_are_touched(tmp_path):
    disk = store(tmp_path)
    hashes, _ = write_blocks(disk, 2)
    disk.close()
    own_leftover = disk.path_for(hashes[0]) + ".0123abcd.tmp"
    open(own_leftover, "wb").write(b"half a block")
    corrupt = disk.path_for(keys(1, salt=9)[0])
    os.makedirs(os.path.dirname(corrupt), exist_ok=True)
    open(corrupt, "wb").write(b"torn")  # our name, our namespace: a torn write of ours
    shard = os.path.dirname(disk.path_for(hashes[0]))
    plant(disk.namespace_path, {"README": "x", "zz/obj.tmp": "x", os.path.relpath(shard, disk.namespace_path)
                                + "/cache.kv": "x", os.path.relpath(shard, disk.namespace_path) + "/a.kv.tmp": "x"})
    before = snapshot(tmp_path)
    again = store(tmp_path)
    after = snapshot(tmp_path)
    assert set(before) - set(after) == {own_leftover, corrupt}
    assert all(after[p] == before[p] for p in after)
    assert len(again) == 2


def test_a_non_empty_directory_without_a_manifest_is_refused(tmp_path):
    home = tmp_path / "home"
    plant(home, USER_FILES)
    before = snapshot(home)
    with pytest.raises(disk_dir.DiskTierPathError, match=r"--disk-kv-path .*empty or new directory"):
        store(home)
    assert snapshot(home) == before


def test_an_empty_or_missing_directory_gets_an_owner_only_tier_with_a_manifest(tmp_path):
    import json
    (tmp_path / "empty").mkdir()
    for root in (tmp_path / "empty", tmp_path / "new" / "kv"):
        disk = store(root)
        write_blocks(disk, 1)
        manifest = json.loads((root / disk_dir.MANIFEST_NAME).read_text())
        assert manifest["format"] == "mempath-kv" and manifest["version"] == 1
        assert manifest["layouts"] == {os.path.basename(disk.namespace_path): disk.layout}
        assert stat.S_IMODE(os.stat(disk.namespace_path).st_mode) == 0o700
        (block,) = block_files(root)
        assert stat.S_IMODE(os.stat(block).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(block)).st_mode) == 0o700
        disk.close()
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "kv").st_mode) == 0o700


def test_other_block_sizes_and_dtypes_live_side_by_side(tmp_path):
    first = store(tmp_path)
    hashes, data = write_blocks(first, 20)
    first.close()
    second = store(tmp_path, shape=OTHER_BLOCK_SIZE)
    assert len(second) == 0
    write_blocks(second, 5, salt=1)
    second.close()
    third = DiskBlockStore(tmp_path, 10**7, math.prod(SHAPE) * 4, fingerprint="tiny-llama", block_shape=SHAPE,
                           dtype=torch.int32)  # same bytes, another meaning
    assert len(third) == 0
    third.close()
    again = store(tmp_path)
    assert len(again) == 20 and len(block_files(tmp_path)) == 25
    out = torch.empty(SHAPE)
    assert again.read_async(hashes[7], out).result() and torch.equal(out, data[7])
    assert len(store(tmp_path, shape=OTHER_BLOCK_SIZE)) == 5


def test_an_unusable_path_is_a_start_up_error_naming_the_flag(tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"--disk-kv-path .*not a directory"):
        store(a_file)
    with pytest.raises(ValueError, match=r"--disk-kv-path .*not a directory"):
        EngineConfig(model="m", cpu_kv_gb=1.0, disk_kv_path=str(a_file), disk_kv_gb=1.0)
    with pytest.raises(ValueError, match=r"--disk-kv-path .*not a directory"):
        EngineConfig(model="m", cpu_kv_gb=1.0, disk_kv_path=str(a_file / "below"), disk_kv_gb=1.0)
    assert a_file.read_text() == "x"
    real_mkdir = os.mkdir

    def read_only_parent(path, *args, **kwargs):
        if os.fspath(path).startswith(os.fspath(tmp_path / "ro")):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only_parent)
    with pytest.raises(ValueError, match=r"--disk-kv-path .*Permission denied"):
        store(tmp_path / "ro" / "kv")


def test_the_cli_names_the_flag_in_one_line(tiny, tmp_path, capsys):
    from mempath.cli import main as cli_main
    (tmp_path / "file").write_text("x")
    rc = cli_main(["generate", tiny, "hi", "--quiet", "--cpu-kv-gb", "1", "--disk-kv-path", str(tmp_path / "file"),
                   "--disk-kv-gb", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--disk-kv-path" in err and "Traceback" not in err


def test_a_tier_larger_than_its_disk_is_refused_by_the_config_and_counts_its_own_files(tmp_path, monkeypatch):
    """The disk's free space plus what the tier's files already take (it may evict them) is what it can hold."""
    import shutil
    from mempath.kv.tiers import disk_dir
    free = 3 << 30
    monkeypatch.setattr(disk_dir.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 7 << 30, free))
    with pytest.raises(ValueError, match=r"--disk-kv-path .*3 GiB free.*less than --disk-kv-gb 4; lower --disk-kv-gb"):
        EngineConfig(model="m", cpu_kv_gb=1.0, disk_kv_path=str(tmp_path / "new" / "kv"), disk_kv_gb=4.0)
    EngineConfig(model="m", cpu_kv_gb=1.0, disk_kv_path=str(tmp_path / "new" / "kv"), disk_kv_gb=3.0)
    assert not (tmp_path / "new").exists()  # nothing made: the config only checks
    kv = tmp_path / "kv"
    store(kv)  # the tier's manifest and namespace
    monkeypatch.setattr(disk_dir, "_bytes_under", lambda root: 2 << 30)  # its blocks on disk now
    EngineConfig(model="m", cpu_kv_gb=1.0, disk_kv_path=str(kv), disk_kv_gb=4.0)
    with pytest.raises(ValueError, match=r"2 GiB more in the files there now"):
        EngineConfig(model="m", cpu_kv_gb=1.0, disk_kv_path=str(kv), disk_kv_gb=6.0)


@not_root
def test_a_read_only_parent_is_refused_by_the_config(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o500)
    with pytest.raises(ValueError, match=r"--disk-kv-path .*not writable"):
        EngineConfig(model="m", cpu_kv_gb=1.0, disk_kv_path=str(parent / "kv"), disk_kv_gb=1.0)


# ---------------------------------------------------------------------------- one engine per namespace
def in_use_message(root):
    return (rf"--disk-kv-path {re.escape(str(root))} is in use by another engine \(pid {os.getpid()} on .*\).*"
            r"give each engine its own --disk-kv-path")


def test_a_second_store_on_one_namespace_is_refused_and_deletes_nothing(tmp_path):
    first = store(tmp_path)
    hashes, data = write_blocks(first, 3)
    in_flight = first.path_for(keys(1, salt=5)[0]) + ".0123abcd.tmp"  # the first engine's write in progress
    os.makedirs(os.path.dirname(in_flight), exist_ok=True)
    open(in_flight, "wb").write(b"half a block")
    before = snapshot(tmp_path)
    with pytest.raises(disk_dir.DiskTierPathError, match=in_use_message(tmp_path)) as refused:
        store(tmp_path)
    assert "\n" not in str(refused.value)
    assert snapshot(tmp_path) == before
    out = torch.empty(SHAPE)
    assert first.read_async(hashes[1], out).result() and torch.equal(out, data[1])
    first.close()  # releases the namespace: the same process may open it again
    again = store(tmp_path)
    assert all(h in again for h in hashes) and not os.path.exists(in_flight)  # now a leftover: removed
    again.close()


def test_engines_of_other_layouts_share_the_directory_at_once(tmp_path):
    first, second = store(tmp_path), store(tmp_path, shape=OTHER_BLOCK_SIZE)
    write_blocks(first, 2)
    write_blocks(second, 2, salt=1)
    assert len(block_files(tmp_path)) == 4
    first.close()
    second.close()


def test_a_lock_file_mempath_did_not_write_is_refused_not_overwritten(tmp_path):
    disk = store(tmp_path)
    lock = os.path.join(disk.namespace_path, disk_dir.LOCK_NAME)
    disk.close()
    with open(lock, "w") as f:
        f.write("my notes")
    with pytest.raises(disk_dir.DiskTierPathError, match=rf"{disk_dir.LOCK_NAME} mempath did not write"):
        store(tmp_path)
    assert open(lock).read() == "my notes"
    os.unlink(lock)
    os.mkdir(lock)
    with pytest.raises(disk_dir.DiskTierPathError, match=rf"{disk_dir.LOCK_NAME}"):
        store(tmp_path)
    assert os.path.isdir(lock)


# ---------------------------------------------------------------------------- who may write it
@pytest.mark.parametrize("mode", [0o770, 0o722, 0o777])
def test_a_tier_others_can_write_is_refused(tmp_path, mode):
    write_blocks(store(tmp_path / "kv"), 1)
    os.chmod(tmp_path / "kv", mode)
    with pytest.raises(disk_dir.DiskTierPathError, match=r"--disk-kv-path .*writable by .*chmod 700"):
        store(tmp_path / "kv")
    os.chmod(tmp_path / "kv", 0o755)  # readable by others is the user's choice; writable is not
    assert len(store(tmp_path / "kv")) == 1


@as_root
def test_a_tier_owned_by_another_user_is_refused(tmp_path):
    store(tmp_path / "kv").close()
    os.chown(tmp_path / "kv", 65534, 65534)
    with pytest.raises(disk_dir.DiskTierPathError, match=r"--disk-kv-path .*owned by uid 65534"):
        store(tmp_path / "kv")


@as_root
def test_a_block_file_of_another_user_is_neither_served_nor_deleted(tmp_path):
    disk = store(tmp_path)
    hashes, _ = write_blocks(disk, 2)
    os.chown(disk.path_for(hashes[0]), 65534, 65534)  # e.g. re-signed by someone else
    assert not read(disk, hashes[0]) and read(disk, hashes[1])
    assert os.path.exists(disk.path_for(hashes[0])) and hashes[0] not in disk
    assert disk.failures["read_foreign_file"] == 1
    disk.close()
    assert hashes[0] not in store(tmp_path)  # not indexed at start-up either


# ---------------------------------------------------------------------------- odd files
def test_a_fifo_is_never_opened_for_reading(tmp_path, fifos):
    disk = store(tmp_path)
    hashes, _ = write_blocks(disk, 3)
    disk.close()
    os.unlink(disk.path_for(hashes[0]))
    fifos.make(disk.path_for(hashes[0]))  # there at start-up
    again = store(tmp_path)
    assert hashes[0] not in again and len(again) == 2
    os.unlink(again.path_for(hashes[1]))
    fifos.make(again.path_for(hashes[1]))  # swapped in after start-up
    assert not read(again, hashes[1]) and read(again, hashes[2])
    assert not fifos.fired
    assert all(stat.S_ISFIFO(os.lstat(p).st_mode) for p in fifos.paths)  # left alone
    assert again.failures["read_foreign_file"] == 1


def test_a_directory_in_place_of_a_block_is_a_failed_read(tmp_path):
    disk = store(tmp_path)
    hashes, _ = write_blocks(disk, 2)
    os.unlink(disk.path_for(hashes[0]))
    os.mkdir(disk.path_for(hashes[0]))
    assert not read(disk, hashes[0]) and read(disk, hashes[1])
    assert os.path.isdir(disk.path_for(hashes[0])) and hashes[0] not in disk
    # Its write is refused rather than replacing what is in the way.
    assert not disk.write_async(hashes[0], torch.zeros(SHAPE)).result()
    assert os.path.isdir(disk.path_for(hashes[0]))
    disk.close()
    assert len(store(tmp_path)) == 1


def test_files_it_cannot_remove_do_not_stop_the_start_up(tmp_path, monkeypatch):
    """A read-only directory holding a leftover temporary and a corrupt block."""
    disk = store(tmp_path)
    hashes, _ = write_blocks(disk, 2)
    disk.close()
    leftover = disk.path_for(hashes[0]) + ".0123abcd.tmp"
    open(leftover, "wb").write(b"half")
    with open(disk.path_for(hashes[1]), "r+b") as f:
        f.write(b"XXXX")  # bad magic
    real_unlink = os.unlink

    def read_only(path, *args, **kwargs):
        if os.fspath(path).startswith(os.fspath(tmp_path)):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", read_only)
    again = store(tmp_path)
    assert set(again._index) == {hashes[0]}
    assert again.failures["cleanup_error"] == 2
    assert read(again, hashes[0])


def test_an_unreadable_block_is_a_failed_read(tmp_path, monkeypatch):
    disk = store(tmp_path)
    hashes, _ = write_blocks(disk, 2)
    real_open = os.open

    def denied(path, flags, *args, **kwargs):
        if os.fspath(path) == disk.path_for(hashes[0]):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    assert not read(disk, hashes[0]) and read(disk, hashes[1])
    assert disk.failures["read_permission"] == 1


# ---------------------------------------------------------------------------- failed writes
@pytest.mark.parametrize("code, kind", [(errno.ENOSPC, "write_no_space"), (errno.EACCES, "write_permission"),
                                        (errno.EIO, "write_error")])
def test_a_failed_write_is_one_line_and_a_counter(tmp_path, monkeypatch, caplog, code, kind):
    disk = store(tmp_path)
    real_replace = os.replace

    def failing(src, dst, *args, **kwargs):
        if os.fspath(dst).endswith(".kv"):
            raise OSError(code, os.strerror(code), os.fspath(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", failing)
    caplog.set_level(logging.DEBUG, logger="mempath.kv.tiers.disk")
    data = torch.randn(4, *SHAPE)
    assert not any(disk.write_async(h, data[i]).result() for i, h in enumerate(keys(4)))
    assert len(disk) == 0 and disk.used_bytes == 0
    assert disk.failures[kind] == 4
    records = [r for r in caplog.records if r.name.startswith("mempath.kv")]
    warnings = [r for r in records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and kind in warnings[0].getMessage() and warnings[0].exc_info is None
    assert all(r.exc_info is None for r in records if r.levelno > logging.DEBUG)
    assert not [n for _, _, names in os.walk(tmp_path) for n in names if n.endswith(".tmp")]
    monkeypatch.setattr(os, "replace", real_replace)
    assert disk.write_async(keys(1)[0], data[0]).result() and len(disk) == 1  # it recovers


# ---------------------------------------------------------------------------- the engine
def first_run_on_disk(tiny, path):
    """Every conversation's first turn on disk, the writes finished; returns the block files."""
    engine_tests.first_run_on_disk(tiny, path)
    return block_files(path)


def engine_on(tiny, path):
    return make_llm(tiny, cpu_kv_gb=gb(4), disk_kv_path=str(path), disk_kv_gb=gb(64))


def test_the_engine_refuses_a_users_directory_and_changes_nothing(tiny, tmp_path):
    plant(tmp_path, USER_FILES)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match="--disk-kv-path"):
        engine_on(tiny, tmp_path)
    assert snapshot(tmp_path) == before


def test_a_second_engine_on_one_disk_tier_is_refused_until_the_first_closes(tiny, reference, tmp_path):
    first = engine_on(tiny, tmp_path)
    with pytest.raises(ValueError, match=in_use_message(tmp_path)):
        engine_on(tiny, tmp_path)
    assert first.generate(conversations()[0], greedy(), use_tqdm=False)[0].token_ids == reference[0][0]
    first.engine.close()
    second = engine_on(tiny, tmp_path)
    assert second.engine.kv.tiers.disk.num_blocks == first.engine.kv.tiers.disk.num_blocks
    second.engine.close()


@pytest.mark.parametrize("odd", ["fifo", "directory", "unreadable"])
def test_odd_block_files_fall_back_to_recompute(tiny, reference, tmp_path, monkeypatch, fifos, odd):
    files = first_run_on_disk(tiny, tmp_path)
    llm = engine_on(tiny, tmp_path)
    assert llm.engine.kv.tiers.disk.num_blocks == len(files)
    real_open = os.open
    for path in files:  # after start-up: the index lists them, the reads must cope
        if odd == "fifo":
            os.unlink(path)
            fifos.make(path)
        elif odd == "directory":
            os.unlink(path)
            os.mkdir(path)

    def denied(path, *args, **kwargs):
        if os.fspath(path) in files:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_open(path, *args, **kwargs)

    if odd == "unreadable":
        monkeypatch.setattr(os, "open", denied)
    out = llm.generate(conversations()[0], greedy(), use_tqdm=False)[0]
    assert out.token_ids == reference[0][0] and out.finish_reason == "length"
    stats = tier_stats(llm)
    assert stats["disk_read_failures"] >= 1 and stats["hits_blocks"]["disk"] == 0
    assert sum(stats["disk_failures"].values()) >= 1
    if odd != "unreadable":
        assert all(os.path.lexists(p) and not os.path.isfile(p) for p in files)  # left alone
    assert not fifos.fired
    assert_no_leak(llm)


def test_a_read_that_hangs_is_abandoned_at_its_deadline(tiny, reference, tmp_path):
    first_run_on_disk(tiny, tmp_path)
    llm = engine_on(tiny, tmp_path)
    tiers = llm.engine.kv.tiers
    tiers.read_deadline_s = 0.0
    gate = threading.Event()
    read_file = tiers.disk._read_file
    tiers.disk._read_file = lambda *a: (gate.wait(120), read_file(*a))[1]  # a disk that stopped answering
    try:
        first = llm.generate(conversations()[0], greedy(), use_tqdm=False)[0]
        # While that read is still out, the disk is not asked again: no second wait.
        second = llm.generate(conversations()[1], greedy(), use_tqdm=False)[0]
        assert not gate.is_set()
    finally:
        gate.set()
        tiers.close()
    assert first.token_ids == reference[0][0]
    stats = tier_stats(llm)
    assert stats["disk_failures"]["read_timeout"] == 1 and stats["hits_blocks"]["disk"] == 0
    assert second.token_ids == reference[0][1]
    assert_no_leak(llm)


def test_failed_disk_writes_do_not_flood_the_log(tiny, reference, tmp_path, monkeypatch, caplog):
    llm = make_llm(tiny, cpu_kv_gb=gb(2), disk_kv_path=str(tmp_path), disk_kv_gb=gb(64),
                   disk_write_policy="write-through")
    real_replace = os.replace

    def disk_full(src, dst, *args, **kwargs):
        if os.fspath(dst).endswith(".kv"):
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", disk_full)
    caplog.set_level(logging.INFO)
    tokens, _ = engine_tests.run_turns(llm, conversations(), idle=llm.engine.kv.tiers.disk.flush)
    assert tokens == reference[0]
    failures = tier_stats(llm)["disk_failures"]
    assert failures["write_no_space"] > 1
    lines = [r for r in caplog.records if r.name.startswith("mempath.kv") and r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "write_no_space" in lines[0].getMessage() and lines[0].exc_info is None
    assert not block_files(tmp_path)
    assert_no_leak(llm)
    pytest.importorskip("prometheus_client")
    from mempath.server.metrics import ServerMetrics
    text = ServerMetrics("tiny", llm.engine.config.block_size).render(llm.engine.stats()).decode()
    line = next(x for x in text.splitlines() if x.startswith("mempath:disk_kv_failures_total") and "write_no_space" in x)
    assert float(line.split()[-1]) == failures["write_no_space"]  # the counter is in /metrics


# ---------------------------------------------------------------------------- paths and manifests no check caught
DEEP_JSON = "[" * 100_000 + "]" * 100_000  # deeper than Python's parser recurses


def test_a_manifest_nested_too_deep_is_one_line_not_a_recursion_error(tmp_path):
    (tmp_path / disk_dir.MANIFEST_NAME).write_text(DEEP_JSON)
    with pytest.raises(disk_dir.DiskTierPathError, match=r"holds a mempath-kv.json mempath cannot use.*nested"):
        EngineConfig(model="m", cpu_kv_gb=1.0, disk_kv_path=str(tmp_path), disk_kv_gb=1.0)


@pytest.mark.parametrize("path", ["", "   "])
@pytest.mark.parametrize("size", [{}, {"disk_kv_gb": 1.0}])
def test_an_empty_disk_kv_path_is_refused_not_ignored(path, size):
    with pytest.raises(ValueError, match=r"--disk-kv-path is empty; name a directory"):
        EngineConfig(model="m", cpu_kv_gb=1.0, disk_kv_path=path, **size)


def test_a_nul_byte_in_the_path_names_the_flag():
    with pytest.raises(disk_dir.DiskTierPathError, match=r"--disk-kv-path .* contains a NUL byte"):
        EngineConfig(model="m", cpu_kv_gb=1.0, disk_kv_path="/tmp/a\0b", disk_kv_gb=1.0)


def test_a_dangling_link_is_refused_before_anything_loads(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(disk_dir.DiskTierPathError, match=r"--disk-kv-path .*link.* is a link to .*nowhere, which "
                       r"does not exist"):
        EngineConfig(model="m", cpu_kv_gb=1.0, disk_kv_path=str(tmp_path / "link"), disk_kv_gb=1.0)
    assert not (tmp_path / "nowhere").exists()


def test_a_tier_on_a_read_only_file_system_says_so(tmp_path, monkeypatch):
    """chmod cannot fix a read-only mount: the line names the mount, not the permissions."""
    store(tmp_path)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: not mode & os.W_OK and real_access(path, mode, **kw))
    real_statvfs = os.statvfs

    class ReadOnly:
        def __init__(self, st):
            self.st = st

        def __getattr__(self, name):
            value = getattr(self.st, name)
            return value | os.ST_RDONLY if name == "f_flag" else value

    monkeypatch.setattr(os, "statvfs", lambda path: ReadOnly(real_statvfs(path)))
    with pytest.raises(disk_dir.DiskTierPathError, match=r"is on a read-only file system; point --disk-kv-path at "
                       r"a directory on a writable one"):
        EngineConfig(model="m", cpu_kv_gb=1.0, disk_kv_path=str(tmp_path), disk_kv_gb=1.0)


# ---------------------------------------------------------------------------- what the stats say moved
def test_blocks_moved_to_disk_count_the_writes_that_landed(tiny, reference, tmp_path, monkeypatch):
    llm = make_llm(tiny, cpu_kv_gb=gb(2), disk_kv_path=str(tmp_path), disk_kv_gb=gb(64),
                   disk_write_policy="write-through")
    real_replace = os.replace
    failing = {"on": True}

    def half_full(src, dst, *args, **kwargs):
        if os.fspath(dst).endswith(".kv") and failing["on"]:
            failing["on"] = False  # every other write fails
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(dst))
        failing["on"] = True
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", half_full)
    tokens, _ = engine_tests.run_turns(llm, conversations(), idle=llm.engine.kv.tiers.disk.flush)
    assert tokens == reference[0]
    stats = tier_stats(llm)
    assert stats["disk_failures"]["write_no_space"] > 0
    assert stats["moved"]["cpu_to_disk"]["blocks"] == len(block_files(tmp_path)) > 0
    assert stats["moved"]["cpu_to_disk"]["bytes"] == stats["moved"]["cpu_to_disk"]["blocks"] * stats["block_nbytes"]


def test_mempath_generate_leaves_its_kv_on_disk_for_the_next_run(tiny, tmp_path, capsys):
    """One-shot generate and chat never closed the engine, and nothing reached disk."""
    from mempath.cli import main as cli_main
    prompt = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n" * 2
    flags = ["--quiet", "--max-tokens", "4", "--cpu-kv-gb", "0.01", "--disk-kv-path", str(tmp_path / "kv"),
             "--disk-kv-gb", "0.05"]
    assert cli_main(["generate", tiny, prompt, *flags]) == 0
    assert block_files(tmp_path / "kv")
    capsys.readouterr()
