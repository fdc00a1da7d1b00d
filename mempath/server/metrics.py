"""Prometheus metrics for one server, in a registry of its own.

Names and meanings follow vLLM's (``vllm:X`` here is ``mempath:X``, with the same
``model_name`` label), so existing dashboards translate by renaming the prefix.
Two kinds of figures:

* events (time to first token, inter-token latency, tokens in and out, finished
  requests) are observed by the engine thread as outputs arrive;
* state (running and waiting requests, KV blocks, prefix-cache counters,
  preemptions, the ledger's bytes per pathway) is read from one ``engine.stats()``
  snapshot per scrape, so the figures of one scrape agree with each other.

Ours, beyond vLLM's: ``mempath:memory_bytes{pathway,device}`` (the ledger) and
``mempath:kv_blocks{state}`` with state used (referenced by a request), free
(reusable) and cached (holding a prefix-cache entry, used or free).
"""
from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# `_created` series double the exposition and no vLLM dashboard reads them (process-wide switch).
disable_created_metrics()

# vLLM's buckets, so histogram quantiles compare like for like.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
DISCONNECT_STAGES = ("upload",)  # upload: while sending the request body


class ServerMetrics:
    def __init__(self, model_name: str, block_size: int):
        self.model_name = model_name
        self.block_size = block_size
        self.registry = CollectorRegistry()
        self._snapshot: dict | None = None
        labels = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("mempath:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("mempath:generation_tokens",
                                         "Number of generation tokens processed.")
        self.request_success = counter("mempath:request_success", "Count of finished requests.",
                                       ["finished_reason"])
        self.ttft = histogram("mempath:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("mempath:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("mempath:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", E2E_BUCKETS)
        self.client_disconnects = counter("mempath:client_disconnects",
                                          "Clients that hung up before their request was read, by stage.",
                                          ["stage"])
        # Zero series exist from the start, so rate() works before the first request ends.
        self.prompt_tokens.labels(model_name)
        self.generation_tokens.labels(model_name)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        for stage in DISCONNECT_STAGES:
            self.client_disconnects.labels(model_name, stage)
        self.num_disconnects: dict[str, int] = {}  # the counter's values, for the log line
        self.registry.register(_SnapshotCollector(self))

    # ----------------------------------------------------------------- events (engine thread)
    def record_first_token(self, ttft: float | None, num_prompt_tokens: int) -> None:
        if ttft is not None:
            self.ttft.labels(self.model_name).observe(ttft)
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def record_inter_token(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def record_generated(self, num_tokens: int) -> None:
        self.generation_tokens.labels(self.model_name).inc(num_tokens)

    def record_finish(self, reason: str | None, e2e: float | None) -> None:
        self.request_success.labels(self.model_name, reason or "abort").inc()
        if e2e is not None:
            self.e2e.labels(self.model_name).observe(e2e)

    def record_disconnect(self, stage: str) -> int:
        """Count a client hang-up; the count so far at that stage."""
        self.client_disconnects.labels(self.model_name, stage).inc()
        self.num_disconnects[stage] = self.num_disconnects.get(stage, 0) + 1
        return self.num_disconnects[stage]

    # ----------------------------------------------------------------- scrape
    def render(self, stats: dict) -> bytes:
        """The exposition text, with state read from this stats snapshot."""
        self._snapshot = stats
        return generate_latest(self.registry)


class _SnapshotCollector:
    """State metrics built from the latest engine.stats() snapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []  # no fixed description: the registry must not call collect() at registration

    def collect(self):
        stats = self.metrics._snapshot
        if stats is None:
            return
        name = self.metrics.model_name
        block = self.metrics.block_size

        def gauge(metric, doc, value):
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            return family

        def counter(metric, doc, value, extra_labels=None):
            extra_labels = extra_labels or {}
            family = CounterMetricFamily(metric, doc, labels=["model_name", *extra_labels])
            family.add_metric([name, *extra_labels.values()], value)
            return family

        yield gauge("mempath:num_requests_running", "Number of requests in model execution batches.",
                    stats["num_running"])
        yield gauge("mempath:num_requests_waiting", "Number of requests waiting to be processed.",
                    stats["num_waiting"])
        yield gauge("mempath:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    stats["kv_usage"])
        # vLLM counts prefix-cache queries and hits in tokens; the engine counts whole blocks.
        yield counter("mempath:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      stats["prefix_cache_queries"] * block)
        yield counter("mempath:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.",
                      stats["prefix_cache_hits"] * block)
        swaps = stats.get("tiers", {}).get("swaps", 0)
        preemptions = CounterMetricFamily("mempath:num_preemptions",
                                          "Cumulative number of preemptions from the engine, by kind.",
                                          labels=["model_name", "kind"])
        preemptions.add_metric([name, "recompute"], stats["num_preemptions"] - swaps)
        preemptions.add_metric([name, "swap"], swaps)
        yield preemptions

        yield from self._memory_families(stats, name, gauge)
        yield from spec_decode_families(stats.get("spec_decode"), name)

    def _memory_families(self, stats: dict, name: str, gauge):
        """KV blocks, every pathway's bytes, and the disk tier's failures."""
        blocks = GaugeMetricFamily("mempath:kv_blocks", "KV cache blocks by state.",
                                   labels=["model_name", "state"])
        for state in ("used", "free", "cached"):
            blocks.add_metric([name, state], stats[f"kv_blocks_{state}"])
        yield blocks
        yield gauge("mempath:kv_blocks_total", "KV cache blocks in the pool.", stats["kv_blocks_total"])

        memory = GaugeMetricFamily("mempath:memory_bytes",
                                   "Bytes held by each memory pathway, from the engine's ledger.",
                                   labels=["model_name", "pathway", "device", "source"])
        for pathway, entry in stats["ledger"].items():
            memory.add_metric([name, pathway, entry["device"], entry["source"]], entry["bytes"])
        yield memory

        # Every kind at zero from the start when there is a disk tier (kv.tiers: disk_failures).
        failures = stats.get("tiers", {}).get("disk_failures") or {}
        if failures:
            family = CounterMetricFamily("mempath:disk_kv_failures",
                                         "Disk KV tier failures by kind (each one recomputed, never served).",
                                         labels=["model_name", "kind"])
            for kind, count in sorted(failures.items()):
                family.add_metric([name, kind], count)
            yield family


def spec_decode_families(spec: dict | None, name: str):
    """Speculative decoding (docs/speculative.md): vLLM's spec_decode_* counters, and ours for
    the chosen draft length and the time spent drafting and verifying."""
    if spec is None:
        return
    for key, doc in (("num_drafts", "Number of spec decoding drafts."),
                     ("num_draft_tokens", "Number of draft tokens."),
                     ("num_accepted_tokens", "Number of accepted tokens."),
                     ("draft_seconds", "Seconds spent proposing draft tokens."),
                     ("verify_seconds", "Seconds spent in verify steps (target forward and rejection sampling).")):
        family = CounterMetricFamily(f"mempath:spec_decode_{key}", doc, labels=["model_name"])
        family.add_metric([name], spec[key])
        yield family
    per_pos = CounterMetricFamily("mempath:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.", labels=["model_name", "position"])
    for position, count in enumerate(spec["num_accepted_tokens_per_pos"]):
        per_pos.add_metric([name, str(position)], count)
    yield per_pos
    chosen = GaugeMetricFamily("mempath:spec_decode_chosen_k", "Draft length chosen for the last step.",
                               labels=["model_name"])
    chosen.add_metric([name], spec["chosen_k"])
    yield chosen
