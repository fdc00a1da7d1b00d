"""The periodic one-line stats log of a server, as vLLM writes it, plus the KV tiers.

Every ``--log-stats-interval`` seconds (vLLM's default, 10) while serving:

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.0 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, GPU KV cache usage: 12.5%, Prefix cache hit rate: 40.0%,
    CPU KV tier: 3.1% used, 12 blocks loaded, 40 written back

(one line). Every figure is a difference of the engine's own counters
(``engine.stats()``) over the interval, on the monotonic clock: prompt tokens are
those the engine computed (prefix-cache hits excluded: the prefill work done), the hit
rate is hits over queries of the interval, "loaded" counts blocks copied into the
device pool from the CPU tier, "written back" blocks copied out to it (for the disk
tier: to and from disk). An idle server writes nothing: the line after the last busy
interval (its throughput 0) is the last until work arrives again, as in vLLM.
``--disable-log-stats`` turns it off.
"""
import argparse
import logging

# The figures an operator reads: `mempath serve` shows this logger at INFO whatever
# --log-level says (the engine's start-up capacity line uses the same name).
STATS_LOGGER = "mempath.stats"
DEFAULT_LOG_STATS_INTERVAL = 10.0  # seconds, vLLM's

log = logging.getLogger(STATS_LOGGER)


def add_stats_log_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic stats line (throughput, running/waiting, KV use per tier)")
    parser.add_argument("--log-stats-interval", type=float, default=DEFAULT_LOG_STATS_INTERVAL,
                        help="seconds between stats lines while serving (default %(default)g)")


def enable_stats_logging(args) -> float | None:
    """Show the stats logger's lines; the interval of the periodic line, None when it is off."""
    if not 0 < args.log_stats_interval < float("inf"):
        raise ValueError(f"--log-stats-interval must be a number of seconds > 0, got {args.log_stats_interval} "
                         f"(--disable-log-stats turns the line off)")
    logging.getLogger(STATS_LOGGER).setLevel(logging.INFO)
    return None if args.disable_log_stats else args.log_stats_interval


class StatsLog:
    """Writes the line from two engine.stats() snapshots; the engine thread calls it."""

    def __init__(self, interval: float, device_label: str = "GPU"):
        self.interval = interval
        self.device_label = device_label  # vLLM's "GPU KV cache usage"; "CPU" on a CPU engine
        self.last_time: float | None = None
        self.last: dict | None = None
        self.last_was_busy = False
        self.busy_since_last = False  # a step ran since the previous line

    def start(self, stats: dict, now: float) -> None:
        self.last_time, self.last = now, stats

    def deadline(self) -> float | None:
        """When the next line is due; None while there is nothing to say (idle)."""
        if self.last_time is None or not (self.busy_since_last or self.last_was_busy):
            return None
        return self.last_time + self.interval

    def stepped(self) -> None:
        self.busy_since_last = True

    def maybe_log(self, stats_of, now: float) -> None:
        """Write the line if it is due; ``stats_of()`` gives the engine's stats."""
        deadline = self.deadline()
        if deadline is None or now < deadline:
            return
        stats = stats_of()
        line, busy = self.line(self.last, stats, now - self.last_time)
        log.info("%s", line)
        self.last_time, self.last = now, stats
        self.last_was_busy, self.busy_since_last = busy, False

    def line(self, before: dict, after: dict, seconds: float) -> tuple[str, bool]:
        """The line for the interval between two snapshots, and whether tokens were processed."""
        prompt = (after["prompt_tokens"] - before["prompt_tokens"]) / seconds
        generation = (after["generation_tokens"] - before["generation_tokens"]) / seconds
        queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        parts = [f"Avg prompt throughput: {prompt:.1f} tokens/s",
                 f"Avg generation throughput: {generation:.1f} tokens/s",
                 f"Running: {after['num_running']} reqs", f"Waiting: {after['num_waiting']} reqs"]
        if after["num_paused"]:
            parts.append(f"Paused: {after['num_paused']} reqs")
        parts += [f"{self.device_label} KV cache usage: {100 * after['kv_usage']:.1f}%",
                  f"Prefix cache hit rate: {100 * hits / queries if queries else 0:.1f}%"]
        parts += tier_parts(before.get("tiers", {}), after.get("tiers", {}))
        parts += spec_decode_parts(before.get("spec_decode"), after.get("spec_decode"))
        return ", ".join(parts), bool(prompt or generation)


def tier_parts(before: dict, after: dict) -> list[str]:
    if not after.get("enabled"):
        return []

    def moved(direction: str) -> int:
        return after["moved"][direction]["blocks"] - before["moved"][direction]["blocks"]

    parts = []
    for tier, name, loaded, written in (("cpu", "CPU", "cpu_to_gpu", "gpu_to_cpu"),
                                        ("disk", "Disk", "disk_to_cpu", "cpu_to_disk")):
        store = after.get(tier)
        if store is None:
            continue
        use = 100 * store["used_bytes"] / store["capacity_bytes"] if store["capacity_bytes"] else 0.0
        parts.append(f"{name} KV tier: {use:.1f}% used, {moved(loaded)} blocks loaded, "
                     f"{moved(written)} written back")
    return parts


def spec_decode_parts(before: dict | None, after: dict | None) -> list[str]:
    """vLLM's draft acceptance rate over the interval, once the engine reports spec_decode stats."""
    if not after:
        return []
    drafted = after["num_draft_tokens"] - (before or {}).get("num_draft_tokens", 0)
    accepted = after["num_accepted_tokens"] - (before or {}).get("num_accepted_tokens", 0)
    return [f"Draft acceptance rate: {100 * accepted / drafted if drafted else 0:.1f}%"]
