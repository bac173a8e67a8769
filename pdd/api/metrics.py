"""Prometheus metrics of an OpenAI-serving process (instance or router)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdd.api.backend import Load
from pdd.transfer.wire import REJECTS

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class ServingMetrics:
    def __init__(self, load: Callable[[], Load], registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdd_time_to_first_token_seconds", "Time to first token", registry=r, buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("pdd_time_per_output_token_seconds", "Mean time per output token after the first",
                              registry=r, buckets=_LATENCY_BUCKETS)
        self.requests = Counter("pdd_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("pdd_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("pdd_generation_tokens", "Tokens generated", registry=r)
        self.cache_hit_tokens = Counter("pdd_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r)
        Gauge("pdd_requests_running", "Requests being computed", registry=r).set_function(lambda: load().running)
        Gauge("pdd_requests_waiting", "Requests queued", registry=r).set_function(lambda: load().waiting)
        Gauge("pdd_kv_cache_usage", "Fraction of KV pages running requests hold (cached prefixes are evictable, "
              "not counted)", registry=r).set_function(lambda: load().kv_usage)
        Gauge("pdd_kv_free_pages", "KV pages free", registry=r).set_function(lambda: load().free_pages)
        Gauge("pdd_kv_used_pages", "KV pages running requests hold", registry=r).set_function(lambda: load().used_pages)
        Gauge("pdd_rejected_frames", "Inter-instance frames rejected (bad MAC, length, garbage)",
              registry=r).set_function(REJECTS.total)
        Gauge("pdd_prefix_cache_pages", "KV pages held by the prefix cache", registry=r).set_function(lambda: load().cached_pages)
