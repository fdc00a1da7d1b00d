"""Prometheus metrics for one server, in a registry of its own.

Names, meanings and buckets follow vLLM's (``vllm:X`` here is ``mempath:X``, with
the same ``model_name`` label), so existing dashboards translate by renaming the
prefix; ``deploy/grafana/mempath.json`` is one that reads them (docs/server.md,
"Metrics", lists every family and where its figure comes from). Three kinds:

* per token and per step (time to first token, inter-token latency, tokens in and
  out, tokens per step) are observed by the engine thread as outputs arrive;
* per request (queue, prefill, decode, inference and end-to-end time, prompt and
  generation tokens, max_tokens) from the engine's own timestamps
  (``engine/request.py``) when the request finishes;
* state (running, waiting, paused and loading requests, KV blocks, prefix-cache
  counters, preemptions, the ledger's bytes per pathway, the KV tiers) is read from
  one ``engine.stats()`` snapshot per scrape, so the figures of one scrape agree.

Ours, beyond vLLM's: ``mempath:memory_bytes{pathway,device}`` (the ledger; the draft's
rows of speculative decoding add ``tenant="draft"``),
``mempath:memory_budget_bytes`` and ``mempath:device_memory_used_bytes`` (CUDA),
``mempath:kv_blocks{state}`` with state used (referenced by a request), free
(reusable) and cached (holding a prefix-cache entry, used or free), and the tier
families ``mempath:kv_tier_*`` / ``mempath:kv_blocks_moved``.
"""
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.samples import Sample

# `_created` series double the exposition and no vLLM dashboard reads them (process-wide switch).
disable_created_metrics()

# vLLM's buckets, so histogram quantiles compare like for like.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
# vLLM's request_latency_buckets: e2e, queue, prefill, decode and inference time.
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort", "error")
DISCONNECT_STAGES = ("upload",)  # upload: while sending the request body
TIER_MOVES = ("gpu_to_cpu", "cpu_to_gpu", "cpu_to_disk", "disk_to_cpu")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def cache_config_info(engine) -> dict[str, str]:
    """The labels of ``mempath:cache_config_info``: vLLM's CacheConfig fields, and the tiers'."""
    config, kv = engine.config, engine.kv
    host = kv.tiers.host if kv.tiers is not None else None
    disk = kv.tiers.disk if kv.tiers is not None else None
    return {
        "block_size": str(config.block_size),
        "num_gpu_blocks": str(kv.num_blocks),
        "cache_dtype": str(config.kv_torch_dtype(engine.dtype)).removeprefix("torch."),
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "swap_space": str(config.cpu_kv_gb),  # GiB of the CPU tier, vLLM's name for it
        "num_cpu_blocks": str(host.num_blocks if host is not None else 0),
        "disk_kv_gb": str(config.disk_kv_gb),
        "num_disk_blocks": str(disk.capacity_bytes // kv.tiers.block_nbytes if disk is not None else 0),
        "disk_write_policy": config.disk_write_policy if disk is not None else "",
        "preemption_mode": config.preemption_mode,
    }


class ServerMetrics:
    def __init__(self, model_name: str, block_size: int, max_model_len: int = 131072,
                 cache_info: dict[str, str] | dict[str, dict[str, str]] | None = None,
                 memory_budget: tuple[str, int] | None = None, block_sizes: dict[str, int] | None = None):
        """``max_model_len`` bounds the token-count buckets; ``cache_info``: cache_config_info's
        labels (several models: each model's, by name, as a series with its ``model_name``);
        ``memory_budget``: (device, bytes) of the device budget, None on the CPU.
        ``block_sizes``: several models (mempath/multi), each model's name and block size: every
        model's requests and state are series of its own ``model_name`` (the events' ``model=``),
        and ``model_name`` names the process-wide series (the names joined)."""
        self.model_name = model_name
        self.block_size = block_size
        self.block_sizes = block_sizes or {model_name: block_size}
        self.model_names = list(self.block_sizes)
        self.memory_budget = memory_budget
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
        self._request_histograms(max_model_len)
        self.client_disconnects = counter("mempath:client_disconnects",
                                          "Clients that hung up before their request was read, by stage.",
                                          ["stage"])
        if cache_info is not None:
            # An info metric as vLLM writes it: a gauge at 1 whose labels carry the settings.
            by_model = cache_info if block_sizes is not None else None
            fields = list(next(iter(by_model.values())) if by_model else cache_info)
            info = Gauge("mempath:cache_config_info", "Information of the LLMEngine CacheConfig",
                         (["model_name"] if by_model else []) + fields, registry=self.registry)
            for name, labels in (by_model or {None: cache_info}).items():
                info.labels(**labels, **({"model_name": name} if by_model else {})).set(1)
        # Zero series exist from the start, so rate() works before the first request ends.
        for name in self.model_names:
            self._zero_series(name)
        self.num_disconnects: dict[str, int] = {}  # the counter's values, for the log line
        # vLLM serves the default registry, which holds these: process_* (CPU, memory, files), python_*.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(_SnapshotCollector(self))

    def _zero_series(self, name: str) -> None:
        for family in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
                       *self.request_histograms):
            family.labels(name)
        for reason in FINISH_REASONS:
            self.request_success.labels(name, reason)
        for stage in DISCONNECT_STAGES:
            self.client_disconnects.labels(name, stage)

    def _request_histograms(self, max_model_len: int) -> None:
        """vLLM's per-request and per-step histograms."""
        self.request_histograms = []

        def request_histogram(name, doc, buckets):
            family = Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)
            self.request_histograms.append(family)
            return family

        self.queue_time = request_histogram("mempath:request_queue_time_seconds",
                                            "Histogram of time spent in WAITING phase for request.", E2E_BUCKETS)
        self.prefill_time = request_histogram("mempath:request_prefill_time_seconds",
                                              "Histogram of time spent in PREFILL phase for request.", E2E_BUCKETS)
        self.decode_time = request_histogram("mempath:request_decode_time_seconds",
                                             "Histogram of time spent in DECODE phase for request.", E2E_BUCKETS)
        self.inference_time = request_histogram("mempath:request_inference_time_seconds",
                                                "Histogram of time spent in RUNNING phase for request.", E2E_BUCKETS)
        self.request_tpot = request_histogram("mempath:request_time_per_output_token_seconds",
                                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = request_histogram("mempath:request_prompt_tokens",
                                                       "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = request_histogram("mempath:request_generation_tokens",
                                                           "Number of generation tokens processed.", token_buckets)
        self.request_max_tokens = request_histogram("mempath:request_params_max_tokens",
                                                    "Histogram of the max_tokens request parameter.", token_buckets)
        self.iteration_tokens = request_histogram("mempath:iteration_tokens_total",
                                                  "Histogram of number of tokens per engine_step.",
                                                  ITERATION_TOKEN_BUCKETS)

    @classmethod
    def for_engine(cls, model_name: str, engine) -> "ServerMetrics":
        """Metrics for a server over this engine: its buckets, cache settings and budget."""
        budget = engine.budget
        return cls(model_name, engine.config.block_size, engine.max_model_len, cache_config_info(engine),
                   None if budget.limit is None else (budget.device, budget.limit))

    @classmethod
    def for_models(cls, engines: dict) -> "ServerMetrics":
        """Metrics for a server over several models (name -> LLMEngine, mempath/multi): each
        model's cache settings, the longest max_model_len's buckets, one budget."""
        first = next(iter(engines.values()))
        budget = first.budget
        return cls(",".join(engines), first.config.block_size, max(e.max_model_len for e in engines.values()),
                   {name: cache_config_info(e) for name, e in engines.items()},
                   None if budget.limit is None else (budget.device, budget.limit),
                   block_sizes={name: e.config.block_size for name, e in engines.items()})

    # ----------------------------------------------------------------- events (engine thread)
    # ``model``: the served model the event belongs to (several models); None: the only one.
    def record_first_token(self, ttft: float | None, num_prompt_tokens: int, model: str | None = None) -> None:
        if ttft is not None:
            self.ttft.labels(model or self.model_name).observe(ttft)
        self.prompt_tokens.labels(model or self.model_name).inc(num_prompt_tokens)

    def record_inter_token(self, seconds: float, model: str | None = None) -> None:
        self.itl.labels(model or self.model_name).observe(seconds)

    def record_generated(self, num_tokens: int, model: str | None = None) -> None:
        self.generation_tokens.labels(model or self.model_name).inc(num_tokens)

    def record_iteration(self, num_tokens: int, model: str | None = None) -> None:
        """Prompt and generated tokens of one engine step."""
        self.iteration_tokens.labels(model or self.model_name).observe(num_tokens)

    def record_finish(self, reason: str | None, e2e: float | None, model: str | None = None) -> None:
        self.request_success.labels(model or self.model_name, reason or "abort").inc()
        if e2e is not None:
            self.e2e.labels(model or self.model_name).observe(e2e)

    def record_request(self, request, model: str | None = None) -> None:
        """A finished request's phases, from its own timestamps (engine/request.py), as vLLM
        defines them: queue = first scheduled - arrival, prefill = first token - first
        scheduled, decode = last token - first token, inference = last token - first
        scheduled. A phase the request never reached (aborted while waiting) is not observed."""
        scheduled, first, last = request.scheduled_time, request.first_token_time, request.last_token_time
        name = model or self.model_name
        if scheduled is not None:
            self.queue_time.labels(name).observe(scheduled - request.arrival_time)
            if first is not None:
                self.prefill_time.labels(name).observe(first - scheduled)
                self.inference_time.labels(name).observe(last - scheduled)
        if first is not None:
            self.decode_time.labels(name).observe(last - first)
            if request.num_output_tokens > 1:
                self.request_tpot.labels(name).observe((last - first) / (request.num_output_tokens - 1))
        self.request_prompt_tokens.labels(name).observe(request.num_prompt_tokens)
        self.request_generation_tokens.labels(name).observe(request.num_output_tokens)
        self.request_max_tokens.labels(name).observe(request.params.max_tokens)

    def record_disconnect(self, stage: str, model: str | None = None) -> int:
        """Count a client hang-up; the count so far at that stage."""
        self.client_disconnects.labels(model or self.model_name, stage).inc()
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
        if "models" not in stats:
            yield from self._model_families(stats, self.metrics.model_name, self.metrics.block_size)
            yield from self._device_families(stats, self.metrics.model_name)
            return
        # Several models: each one's series from its own stats, merged into one family per metric.
        families = [family for name, block in self.metrics.block_sizes.items()
                    for family in self._model_families(stats["models"][name], name, block)]
        families += self._device_families(stats, self.metrics.model_name)
        families += multi_model_families(stats, self.metrics.model_name)
        yield from merge_families(families)

    def _model_families(self, stats: dict, name: str, block: int):
        """One model's state: requests, KV blocks, prefix cache, preemptions, its ledger, tiers."""
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
        # Ours: requests whose client is not reading (not scheduled, keeping their blocks), and
        # requests admitted whose KV blocks are still coming from the CPU or disk tier.
        yield gauge("mempath:num_requests_paused", "Number of requests paused because their client reads nothing.",
                    stats["num_paused"])
        yield gauge("mempath:num_requests_loading",
                    "Number of requests admitted whose KV blocks are being loaded from a tier.",
                    stats["num_loading"])
        yield gauge("mempath:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    stats["kv_usage"])
        yield counter("mempath:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", stats["prefix_cache_queries"])
        yield counter("mempath:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.", stats["prefix_cache_hits"])
        swaps = stats.get("tiers", {}).get("swaps", 0)
        preemptions = CounterMetricFamily("mempath:num_preemptions",
                                          "Cumulative number of preemptions from the engine, by kind.",
                                          labels=["model_name", "kind"])
        preemptions.add_metric([name, "recompute"], stats["num_preemptions"] - swaps)
        preemptions.add_metric([name, "swap"], swaps)
        yield preemptions

        yield from self._memory_families(stats, name, gauge)
        if stats.get("tiers", {}).get("enabled"):
            yield from _tier_families(stats["tiers"], name)
        yield from spec_decode_families(stats.get("spec_decode"), name)
        yield from expert_cache_families(stats.get("expert_cache"), name)

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
        # The draft of speculative decoding, a tenant of the same budget: its rows carry tenant="draft",
        # and the target's keep their labels (their series), so sum by (pathway) adds the two.
        for pathway, entry in (stats.get("draft_ledger") or {}).items():
            memory.samples.append(Sample("mempath:memory_bytes", {
                "model_name": name, "pathway": pathway, "device": entry["device"], "source": entry["source"],
                "tenant": "draft"}, entry["bytes"]))
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

    def _device_families(self, stats: dict, name: str) -> list:
        """The process's device: the budget and the driver's figure of memory in use."""
        families = []
        device_labels = ["model_name", "device"]
        if self.metrics.memory_budget is not None:
            device, limit = self.metrics.memory_budget
            budget = GaugeMetricFamily("mempath:memory_budget_bytes",
                                       "The device budget: gpu_memory_utilization x total device memory.",
                                       labels=device_labels)
            budget.add_metric([name, device], limit)
            families.append(budget)
        if stats.get("device_memory_used_bytes") is not None:
            used = GaugeMetricFamily("mempath:device_memory_used_bytes",
                                     "Device memory in use as the driver reports it (total - free), "
                                     "every process included.", labels=device_labels)
            used.add_metric([name, stats["device"]], stats["device_memory_used_bytes"])
            families.append(used)
        return families


def merge_families(families):
    """One family per metric name, holding the samples of every family of that name."""
    merged = {}
    for family in families:
        if family.name in merged:
            merged[family.name].samples.extend(family.samples)
        else:
            merged[family.name] = family
    return list(merged.values())


def multi_model_families(stats: dict, process_name: str) -> list:
    """Several models (docs/multi_model.md): the shared page pool's split, per model, and the pool's
    own figures, which belong to no one model, under ``process_name`` (the served names joined)."""
    pages = stats["kv_pages"]
    per_model = (("mempath:kv_pages_used", "KV pages of the shared pool this model's requests reference.",
                  pages["used_by_model"]),
                 ("mempath:kv_pages_guaranteed", "KV pages this model may always have (--kv-min-share).",
                  pages["guaranteed_by_model"]))
    families = []
    for metric, doc, values in per_model:
        family = GaugeMetricFamily(metric, doc, labels=["model_name"])
        for model, value in values.items():
            family.add_metric([model], value)
        families.append(family)
    preempted = CounterMetricFamily("mempath:num_cross_model_preemptions",
                                    "Requests of this model preempted to give KV pages to another model.",
                                    labels=["model_name"])
    for model, value in stats["cross_model_preemptions_by_model"].items():
        preempted.add_metric([model], value)
    families.append(preempted)
    sleep = stats["sleep"]  # --sleep-after (mempath/multi/sleep.py)
    asleep = GaugeMetricFamily("mempath:model_asleep", "1 while the model is asleep (idle past --sleep-after: "
                               "no guaranteed KV pages), else 0.", labels=["model_name"])
    for model in sleep["sleeps_by_model"]:
        asleep.add_metric([model], int(model in sleep["asleep"]))
    families.append(asleep)
    for key, metric, doc in (("sleeps_by_model", "mempath:model_sleeps", "Times the model fell asleep."),
                             ("wakes_by_model", "mempath:model_wakes", "Times a request woke the model.")):
        family = CounterMetricFamily(metric, doc, labels=["model_name"])
        for model, value in sleep[key].items():
            family.add_metric([model], value)
        families.append(family)
    if sleep["offload_weights"]:  # --sleep-offload-weights
        offloaded = GaugeMetricFamily("mempath:model_weights_offloaded", "1 while the model's weights wait in "
                                      "host memory (asleep with --sleep-offload-weights), else 0.", labels=["model_name"])
        wake = GaugeMetricFamily("mempath:model_wake_seconds", "Seconds the model's last wake took to copy its "
                                 "weights back to the device.", labels=["model_name"])
        for model in sleep["sleeps_by_model"]:
            offloaded.add_metric([model], int(model in sleep["weights_offloaded"]))
            if sleep["last_wake_seconds_by_model"][model] is not None:
                wake.add_metric([model], sleep["last_wake_seconds_by_model"][model])
        woken = CounterMetricFamily("mempath:model_wake_bytes", "Weight bytes copied back to the device by wakes.",
                                    labels=["model_name"])
        for model, value in sleep["wake_bytes_by_model"].items():
            woken.add_metric([model], value)
        families += [offloaded, wake, woken]
    for metric, doc, value in (("mempath:kv_pages_free", "Free KV pages of the shared pool.", pages["free"]),
                               ("mempath:kv_pages_total", "KV pages in the shared pool.", pages["total"]),
                               ("mempath:kv_page_bytes", "Bytes of one KV page.", pages["page_bytes"])):
        family = GaugeMetricFamily(metric, doc, labels=["model_name"])
        family.add_metric([process_name], value)
        families.append(family)
    memory = GaugeMetricFamily("mempath:memory_bytes", "Bytes held by each memory pathway, from the engine's ledger.",
                               labels=["model_name", "pathway", "device", "source"])
    for pathway, entry in stats["pool_ledger"].items():
        memory.add_metric([process_name, pathway, entry["device"], entry["source"]], entry["bytes"])
    families.append(memory)
    return families


def _tier_families(tiers: dict, name: str):
    """The CPU and disk KV tiers: capacity and use, hits per tier, blocks and bytes moved."""
    capacity = GaugeMetricFamily("mempath:kv_tier_capacity_bytes", "Bytes a KV tier can hold.",
                                 labels=["model_name", "tier"])
    used = GaugeMetricFamily("mempath:kv_tier_used_bytes", "Bytes of KV blocks a KV tier holds.",
                             labels=["model_name", "tier"])
    for tier in ("cpu", "disk"):
        if tiers.get(tier) is not None:
            capacity.add_metric([name, tier], tiers[tier]["capacity_bytes"])
            used.add_metric([name, tier], tiers[tier]["used_bytes"])
    yield capacity
    yield used
    hits = CounterMetricFamily("mempath:kv_tier_hit_blocks",
                               "KV blocks a new request found in each tier (gpu: the device prefix cache).",
                               labels=["model_name", "tier"])
    for tier, count in tiers["hits_blocks"].items():
        hits.add_metric([name, tier], count)
    yield hits
    blocks = CounterMetricFamily("mempath:kv_blocks_moved",
                                 "KV blocks copied between tiers: gpu_to_cpu (offload, swap-out), "
                                 "cpu_to_gpu (loads, swap-in), cpu_to_disk (write-back), disk_to_cpu.",
                                 labels=["model_name", "direction"])
    nbytes = CounterMetricFamily("mempath:kv_bytes_moved", "Bytes of KV blocks copied between tiers.",
                                 labels=["model_name", "direction"])
    for direction in TIER_MOVES:
        blocks.add_metric([name, direction], tiers["moved"][direction]["blocks"])
        nbytes.add_metric([name, direction], tiers["moved"][direction]["bytes"])
    yield blocks
    yield nbytes
    evictions = CounterMetricFamily("mempath:kv_tier_evictions",
                                    "Blocks the CPU tier dropped to make room.", labels=["model_name", "tier"])
    evictions.add_metric([name, "cpu"], tiers["host_evictions"])
    yield evictions


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


def expert_cache_families(cache: dict | None, name: str):
    """A MoE model's expert cache (docs/moe.md), summed over its layers: lookups that found the
    expert in a device slot or missed it (copied in, or run on the host), the bytes copied, the experts
    resident now."""
    if not cache or not cache.get("enabled"):
        return
    for key, metric, doc in (("hits", "hits", "Routed experts found in a device slot (one per layer and step)."),
                             ("misses", "misses", "Routed experts not found in a device slot: copied in from host "
                                                  "memory, or run on the host (host_experts)."),
                             ("evictions", "evictions", "Experts a copy displaced from their slot."),
                             ("bytes_loaded", "bytes_copied", "Bytes of experts copied from host memory to the device."),
                             ("prefetched", "prefetched", "Experts copied ahead on the next layer's router's prediction."),
                             ("prefetch_used", "prefetch_used", "Prefetched experts the forward they were copied for used."),
                             ("host_experts", "host_experts", "Missed experts run on the host instead of copied "
                                                              "(--moe-cpu-experts)."),
                             ("host_tokens", "host_tokens", "Tokens of the missed experts run on the host.")):
        family = CounterMetricFamily(f"mempath:moe_expert_cache_{metric}", doc, labels=["model_name"])
        family.add_metric([name], cache[key])
        yield family
    resident = GaugeMetricFamily("mempath:moe_expert_cache_resident_experts",
                                 "Experts held in device slots, summed over the MoE layers.", labels=["model_name"])
    resident.add_metric([name], cache["resident_experts"])
    yield resident
