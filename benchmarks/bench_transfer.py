"""Bandwidth of moving KV blocks between the tiers, on one GPU.

Shape: Llama-3.1-8B KV blocks (32 layers, 8 KV heads, head_dim 128, bf16,
16 tokens: 2 MiB per block, scattered as 64 slices of 32 KiB over the cache).
``--kv-cache-dtype fp8`` moves the engine's fp8 blocks instead: the same shape in
one byte per element (the engine keeps an fp8 cache as uint8), 1 MiB per block.

Paths compared, both directions, for 256 and 2048 blocks at random device ids:
  * one copy: a single pinned copy of the same bytes, contiguous on both sides
    (the PCIe ceiling: ANCHORS.md reads ~53-55 GB/s);
  * per slice: one ``copy_`` per (block, layer, K/V), 32 KiB each: what a
    block table walk without batching does;
  * engine: ``TransferEngine``, gather/scatter on the device through the
    staging buffer, consecutive host ids (one copy per chunk);
  * engine, scattered host ids: the same with host ids in random order (one
    2 MiB copy per block).
Then the disk tier: ``DiskBlockStore`` writes (timed to fsync) and cold reads
(page cache dropped) of the same blocks.

``--compare-kv-dtypes`` runs only the engine path, both directions, for bf16 and
fp8 blocks side by side (the same block counts): bytes per block, GB/s, time per
block, and fp8's time over bf16's (issue #20: fp8 blocks move half the bytes).

Prints a table, then one JSON line. Usage:
    PYTHONPATH=. python3 benchmarks/bench_transfer.py [--quick] [--kv-cache-dtype {auto,fp8}]
        [--disk-path DIR] [--disk-blocks N]
    PYTHONPATH=. python3 benchmarks/bench_transfer.py --compare-kv-dtypes [--quick]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from mempath.kv.block_pool import hash_block
from mempath.kv.tiers.disk import DiskBlockStore
from mempath.kv.tiers.host import HostBlockStore
from mempath.kv.tiers.transfer import TransferEngine

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# What the device cache stores per --kv-cache-dtype: auto is the model dtype (bf16 here).
STORAGE_DTYPES = {"auto": torch.bfloat16, "fp8": torch.uint8}
SIZES = (256, 2048)
REPEATS = 3


def block_nbytes_of(dtype: torch.dtype) -> int:
    return 2 * NUM_LAYERS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize


def random_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Fill with random bytes, whatever the dtype (a copy does not care what they mean)."""
    tensor.view(torch.uint8).random_()
    return tensor


def timed(fn) -> float:
    """Median seconds of REPEATS runs after one warm-up; fn must leave nothing in flight."""
    fn()
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def engine_setup(num_blocks: int, staging_blocks: int, dtype: torch.dtype):
    """A device cache of num_blocks + 64 blocks, a host store of num_blocks, the engine between
    them, random device ids and consecutive host ids."""
    rng = np.random.default_rng(0)
    cache = random_bytes(torch.empty(NUM_LAYERS, 2, num_blocks + 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                                     dtype=dtype, device="cuda"))
    host = HostBlockStore.for_cache(cache, num_blocks * block_nbytes_of(dtype))
    engine = TransferEngine(cache, host, staging_blocks=staging_blocks)
    gpu_ids = [int(i) for i in rng.permutation(num_blocks + 64)[:num_blocks]]
    return cache, host, engine, gpu_ids, host.allocate(num_blocks)


def transfer_cases(num_blocks: int, staging_blocks: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Seconds per path and direction for num_blocks blocks."""
    cache, host, engine, gpu_ids, cpu_ids = engine_setup(num_blocks, staging_blocks, dtype)
    scattered = [int(i) for i in np.random.default_rng(1).permutation(cpu_ids)]
    flat_dev = torch.empty(host.storage.shape, dtype=dtype, device="cuda")
    flat_host = host.storage

    def per_slice(to_host: bool):
        for g, c in zip(gpu_ids, cpu_ids):
            for layer in range(NUM_LAYERS):
                for kv in range(2):
                    if to_host:
                        flat_host[c, layer, kv].copy_(cache[layer, kv, g], non_blocking=True)
                    else:
                        cache[layer, kv, g].copy_(flat_host[c, layer, kv], non_blocking=True)
        torch.cuda.synchronize()

    def one_copy(to_host: bool):
        (flat_host.copy_(flat_dev, non_blocking=True) if to_host
         else flat_dev.copy_(flat_host, non_blocking=True))
        torch.cuda.synchronize()

    seconds = {
        "one copy d2h": timed(lambda: one_copy(True)),
        "one copy h2d": timed(lambda: one_copy(False)),
        "per slice d2h": timed(lambda: per_slice(True)),
        "per slice h2d": timed(lambda: per_slice(False)),
        "engine d2h": timed(lambda: engine.device_to_host(gpu_ids, cpu_ids).wait()),
        "engine h2d": timed(lambda: engine.host_to_device(cpu_ids, gpu_ids).wait()),
        "engine scattered-host d2h": timed(lambda: engine.device_to_host(gpu_ids, scattered).wait()),
        "engine scattered-host h2d": timed(lambda: engine.host_to_device(scattered, gpu_ids).wait()),
    }
    # Host time to launch a batch while the GPU is busy: what the step loop pays.
    torch.cuda._sleep(int(2e8))
    start = time.perf_counter()
    transfer = engine.device_to_host(gpu_ids, cpu_ids)
    seconds["engine d2h launch (host time)"] = time.perf_counter() - start
    transfer.wait()
    del cache, flat_dev, engine
    torch.cuda.empty_cache()
    return seconds


def engine_cases(num_blocks: int, staging_blocks: int, dtype: torch.dtype) -> dict[str, float]:
    """Seconds of the engine path (TransferEngine), each direction, for num_blocks blocks."""
    cache, host, engine, gpu_ids, cpu_ids = engine_setup(num_blocks, staging_blocks, dtype)
    seconds = {"d2h": timed(lambda: engine.device_to_host(gpu_ids, cpu_ids).wait()),
               "h2d": timed(lambda: engine.host_to_device(cpu_ids, gpu_ids).wait())}
    del cache, engine
    torch.cuda.empty_cache()
    return seconds


def compare_rows(num_blocks: int, seconds: dict[str, dict[str, float]]) -> list[dict]:
    """Rows of the dtype comparison from {kv cache dtype: {direction: seconds}} for num_blocks
    blocks; fp8's time over auto's per direction when both ran."""
    rows = []
    for kv, by_direction in seconds.items():
        nbytes = block_nbytes_of(STORAGE_DTYPES[kv])
        for direction, s in by_direction.items():
            rows.append({"kv_cache_dtype": kv, "direction": direction, "blocks": num_blocks,
                         "bytes_per_block": nbytes, "seconds": s, "gb_per_s": num_blocks * nbytes / s / 1e9,
                         "us_per_block": s / num_blocks * 1e6})
    for direction in seconds.get("fp8", {}):
        if direction in seconds.get("auto", {}):
            rows.append({"kv_cache_dtype": "fp8/auto", "direction": direction, "blocks": num_blocks,
                         "time_ratio": seconds["fp8"][direction] / seconds["auto"][direction]})
    return rows


def print_comparison(rows: list[dict], staging_blocks: int) -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, engine path, staging {staging_blocks} blocks")
    print(f"{'kv dtype':<10}{'dir':<5}{'blocks':>8}{'bytes/block':>13}{'ms':>10}{'GB/s':>8}{'us/block':>10}")
    for r in rows:
        if "time_ratio" in r:
            print(f"{r['kv_cache_dtype']:<10}{r['direction']:<5}{r['blocks']:>8}   time fp8/bf16 {r['time_ratio']:.3f}")
        else:
            print(f"{r['kv_cache_dtype']:<10}{r['direction']:<5}{r['blocks']:>8}{r['bytes_per_block']:>13}"
                  f"{r['seconds'] * 1e3:>10.2f}{r['gb_per_s']:>8.1f}{r['us_per_block']:>10.2f}")
    print(json.dumps({"bench": "transfer_kv_dtypes", "device": torch.cuda.get_device_name(),
                      "staging_blocks": staging_blocks, "rows": rows}))


def disk_cases(path: str, num_blocks: int, workers: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    host = HostBlockStore(num_blocks, (NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype)
    random_bytes(host.storage)
    keys = [hash_block(None, [os.getpid(), i]) for i in range(num_blocks)]
    with DiskBlockStore(os.path.join(path, "mempath-bench-kv"), num_blocks * (host.block_nbytes + 4096),
                        host.block_nbytes, fingerprint="bench", block_shape=host.block_shape, dtype=dtype,
                        num_workers=workers) as disk:
        try:
            start = time.perf_counter()
            assert all(f.result() for f in [disk.write_async(h, host.storage[i]) for i, h in enumerate(keys)])
            disk.drop_page_cache(keys)  # fsync: the sustained rate, not the page cache's
            write = time.perf_counter() - start
            start = time.perf_counter()
            assert all(f.result() for f in [disk.read_async(h, host.storage[i]) for i, h in enumerate(keys)])
            read = time.perf_counter() - start
        finally:
            disk.remove(keys)
    return {"disk write (to fsync)": write, "disk read (cold)": read}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="256 blocks only")
    parser.add_argument("--kv-cache-dtype", choices=tuple(STORAGE_DTYPES), default="auto",
                        help="auto: bf16 blocks; fp8: the engine's one-byte blocks of the same shape")
    parser.add_argument("--compare-kv-dtypes", action="store_true",
                        help="only the engine path, both directions, for auto and fp8 blocks side by side")
    parser.add_argument("--staging-blocks", type=int, default=64)
    parser.add_argument("--disk-path", default=tempfile.gettempdir())
    parser.add_argument("--disk-blocks", type=int, default=256)
    parser.add_argument("--disk-workers", type=int, default=4)
    args = parser.parse_args(argv)
    if args.compare_kv_dtypes and args.kv_cache_dtype != "auto":
        parser.error("--compare-kv-dtypes runs both KV dtypes: drop --kv-cache-dtype")
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_transfer.py needs a CUDA device")
    sizes = SIZES[:1] if args.quick else SIZES
    if args.compare_kv_dtypes:
        rows = []
        for num_blocks in sizes:
            seconds = {kv: engine_cases(num_blocks, args.staging_blocks, dtype)
                       for kv, dtype in STORAGE_DTYPES.items()}
            rows += compare_rows(num_blocks, seconds)
        print_comparison(rows, args.staging_blocks)
        return
    dtype = STORAGE_DTYPES[args.kv_cache_dtype]
    block_nbytes = block_nbytes_of(dtype)
    rows = []
    for num_blocks in sizes:
        for case, s in transfer_cases(num_blocks, args.staging_blocks, dtype).items():
            rows.append({"case": case, "blocks": num_blocks, "seconds": s,
                         "gb_per_s": None if "launch" in case else num_blocks * block_nbytes / s / 1e9})
    for case, s in disk_cases(args.disk_path, args.disk_blocks, args.disk_workers, dtype).items():
        rows.append({"case": case, "blocks": args.disk_blocks, "seconds": s,
                     "gb_per_s": args.disk_blocks * block_nbytes / s / 1e9})

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, kv {args.kv_cache_dtype} ({dtype}), "
          f"block {block_nbytes >> 20} MiB, staging {args.staging_blocks} blocks")
    print(f"{'case':<32}{'blocks':>8}{'ms':>11}{'GB/s':>9}")
    for r in rows:
        rate = "" if r["gb_per_s"] is None else f"{r['gb_per_s']:.1f}"
        print(f"{r['case']:<32}{r['blocks']:>8}{r['seconds'] * 1e3:>11.2f}{rate:>9}")
    print(json.dumps({"bench": "transfer", "device": torch.cuda.get_device_name(),
                      "kv_cache_dtype": args.kv_cache_dtype, "block_nbytes": block_nbytes,
                      "staging_blocks": args.staging_blocks, "rows": rows}))


if __name__ == "__main__":
    main()
