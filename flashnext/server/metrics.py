"""Prometheus metrics under vLLM's names, so existing dashboards and autoscalers read them unchanged.

Per-request histograms are filled once, when a request finishes, from its RequestMetrics; the engine's
gauges and cumulative counters are read from `engine.stats()` when Prometheus scrapes — never in the
generation loop.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)


def model_label(served_model_name: str) -> str:
    """The model_name label's value: the exposition is UTF-8, and a name from non-UTF-8 command-line bytes holds lone
    surrogates (surrogateescape), which made every scrape a 500; those go out as backslash escapes."""
    return served_model_name.encode("utf-8", "backslashreplace").decode("utf-8")


class _EngineCollector:
    """Reads the engine's own counters at scrape time."""

    def __init__(self, label: str, engine_provider):
        self.label, self.engine_provider = label, engine_provider

    def collect(self):
        engine = self.engine_provider()
        if engine is None:
            return
        s = engine.stats()
        labels = [self.label]
        for name, doc, value in (("num_requests_running", "Requests in the running batch.", s.num_running),
                                 ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
                                 ("kv_cache_usage_perc", "KV-cache usage, 0 to 1.", s.kv_cache_usage)):
            for prefix in ("vllm:", "flashnext_"):
                g = GaugeMetricFamily(prefix + name, doc, labels=["model_name"])
                g.add_metric(labels, value)
                yield g
        for name, doc, value in (("prompt_tokens", "Prompt tokens processed.", s.prompt_tokens_total),
                                 ("generation_tokens", "Tokens generated.", s.generation_tokens_total),
                                 ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  s.prefix_queries),
                                 ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hits),
                                 ("num_preemptions", "Requests preempted to free memory.",
                                  getattr(s, "num_preemptions", 0))):
            for prefix in ("vllm:", "flashnext_"):
                c = CounterMetricFamily(prefix + name, doc, labels=["model_name"])
                c.add_metric(labels, value)
                yield c
        prefix = prefix_cache_of(engine)
        if prefix is not None:
            yield from _prefix_cache_metrics(prefix, labels)
        cache = expert_cache_of(engine)
        if cache is not None:  # --expert-vram-gb (docs/expert_cache.md); the bench reads these exact names
            st = cache.stats
            for name, doc, value in (
                    ("hits", "Routed expert reads found in the device slot pool.", st.hits),
                    ("misses", "Routed expert reads of experts not in the device pool (copied in first; in a "
                               "captured decode step read from host memory over PCIe).", st.misses),
                    ("bytes_copied", "Bytes of expert weights copied host to device.", st.bytes_copied),
                    ("stall_seconds", "Time the forward waited for experts to be copied in (on a GPU the copies' "
                                       "time on the compute stream).", st.stall_seconds),
                    ("prefetched", "Experts copied in ahead of their layer (a guess through its router).",
                     st.prefetched),
                    ("prefetch_used", "Prefetched experts their layer then read.", st.prefetch_used),
                    ("admitted", "Missed experts admitted into a pool slot inside the decode step, written there as "
                                 "they were read (no copy).", st.admitted)):
                c = CounterMetricFamily(f"flashnext_expert_cache_{name}", doc, labels=["model_name"])
                c.add_metric(labels, value)
                yield c


def _prefix_cache_metrics(cache, labels: list[str]):
    """Per tier (device: state snapshots; host, disk: KV blocks and snapshots): bytes held, their budget,
    entries, and the prefix hits served from a lower tier (tokens, host seconds of copying them in)."""
    tiers = [("device", cache.snapshot_bytes, cache.snapshot_budget, cache.num_snapshots)]
    tiers += [(t.name, t.bytes, t.capacity, len(t.snaps)) for t in cache.tiers()]
    for name, doc, column in (("bytes", "Bytes the prefix cache holds, by tier.", 1),
                              ("capacity_bytes", "Bytes the prefix cache may hold, by tier.", 2),
                              ("entries", "Conversation states (snapshots) held, by tier.", 3)):
        g = GaugeMetricFamily(f"flashnext_prefix_cache_{name}", doc, labels=["model_name", "tier"])
        for tier in tiers:
            g.add_metric(labels + [tier[0]], tier[column])
        yield g
    for name, doc, counts in (
            ("restored_tokens", "Prompt tokens of prefix hits copied in from a lower tier.", cache.restored_tokens),
            ("restore_seconds", "Host time spent copying prefix hits in from a lower tier (disk hits read in the "
                                "background: from the read's start to the install).", cache.restore_seconds)):
        c = CounterMetricFamily(f"flashnext_prefix_cache_{name}", doc, labels=["model_name", "tier"])
        for tier in tiers[1:]:
            c.add_metric(labels + [tier[0]], counts[tier[0]])
        yield c
    g = GaugeMetricFamily("flashnext_prefix_cache_background_reads",
                          "Disk-tier hits being read in the background, or read and waiting for KV room to install.",
                          labels=["model_name"])
    g.add_metric(labels, cache.num_background_reads)
    yield g


def prefix_cache_of(engine):
    """The PrefixCache behind an AsyncLLM or LLMEngine, or None (prefix caching off)."""
    inner = getattr(engine, "engine", engine)
    return getattr(inner, "prefix_cache", None)


def expert_cache_of(engine):
    """The ExpertCache behind an AsyncLLM or LLMEngine, or None (no --expert-vram-gb, or a parallel engine)."""
    inner = getattr(engine, "engine", engine)
    return getattr(getattr(inner, "loaded", None), "expert_cache", None)


class ServerMetrics:
    """Histograms of finished requests, plus the engine's numbers read at scrape time."""

    def __init__(self, settings, engine_provider):
        self.registry = CollectorRegistry()
        self.label = model_label(settings.served_model_name)
        self.registry.register(_EngineCollector(self.label, engine_provider))
        common = dict(labelnames=["model_name"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", buckets=_TTFT_BUCKETS,
                              **common)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens.", buckets=_ITL_BUCKETS,
                             **common)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", buckets=_E2E_BUCKETS,
                             **common)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduling.",
                               buckets=_E2E_BUCKETS, **common)
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.",
                                    buckets=_TOKEN_BUCKETS, **common)
        self.gen_len = Histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                                 buckets=_TOKEN_BUCKETS, **common)
        self.success = Counter("vllm:request_success", "Finished requests by reason.",
                               labelnames=["model_name", "finished_reason"], registry=self.registry)
        for histogram in (self.ttft, self.itl, self.e2e, self.queue, self.prompt_len, self.gen_len):
            histogram.labels(self.label)  # series exist (at zero) before the first request

    def observe_finished(self, out) -> None:
        name = self.label
        self.success.labels(name, out.finish_reason).inc()
        self.prompt_len.labels(name).observe(out.prompt_tokens)
        self.gen_len.labels(name).observe(out.completion_tokens)
        m = out.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.labels(name).observe(m.ttft)
        if m.queue_time is not None:
            self.queue.labels(name).observe(m.queue_time)
        itl = self.itl.labels(name)
        for gap in m.inter_token_times:
            itl.observe(gap)
        if m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
