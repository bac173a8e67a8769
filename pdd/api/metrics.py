"""Prometheus metrics of an OpenAI-serving process (instance or router)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from pdd.api.source import Load
from pdd.policy.transfer import LineEstimate
from pdd.transfer.wire import REJECTS

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
# a token's gap: tens of ms normally, seconds where a handoff or a stalled line holds a stream
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ServingMetrics:
    def __init__(self, load: Callable[[], Load], registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry

        def seconds(name: str, what: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"pdd_{name}_seconds", what, registry=r, buckets=buckets)

        self.ttft = seconds(
            "time_to_first_token", "Time to first token, from the request's arrival (its wait for admission included)"
        )
        self.queue = seconds(
            "request_queue_time", "Time a request waited for admission (the router's line, or an instance's)"
        )
        self.e2e = seconds("e2e_request_latency", "Time from a request's arrival to its last token")
        self.itl = seconds(
            "inter_token_latency",
            "Time between consecutive output tokens as the client gets them (one observation a token "
            "after the first; tokens that arrive together count 0 after the first of them)",
            _ITL_BUCKETS,
        )
        self.tpot = seconds("time_per_output_token", "Mean time per output token after the first")
        self.requests = Counter("pdd_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("pdd_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("pdd_generation_tokens", "Tokens generated", registry=r)
        self.cache_hit_tokens = Counter(
            "pdd_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        Gauge("pdd_requests_running", "Requests being computed", registry=r).set_function(lambda: load().running)
        Gauge("pdd_requests_waiting", "Requests queued", registry=r).set_function(lambda: load().waiting)
        Gauge(
            "pdd_kv_cache_usage",
            "Fraction of KV pages running requests hold (cached prefixes are evictable, not counted)",
            registry=r,
        ).set_function(lambda: load().kv_usage)
        Gauge("pdd_kv_free_pages", "KV pages free", registry=r).set_function(lambda: load().free_pages)
        Gauge("pdd_kv_used_pages", "KV pages running requests hold", registry=r).set_function(lambda: load().used_pages)
        r.register(REJECTS.counter)  # process-wide: one counter, in the registry of every app of the process
        Gauge("pdd_prefix_cache_pages", "KV pages held by the prefix cache", registry=r).set_function(
            lambda: load().cached_pages
        )


class LineMetrics:
    """What a prefill instance has measured of the path to each datacenter it sends KV
    to (`pdd.policy.transfer`), read at scrape time: the rate its pipeline choice
    assumes, to set beside the line's nominal rate and the KV bytes crossing it."""

    def __init__(self, lines: Callable[[], Mapping[str, LineEstimate]]) -> None:
        self._lines = lines

    def collect(self) -> Iterator[Metric]:
        rate = GaugeMetricFamily(
            "pdd_line_bandwidth_bytes_per_second", "Measured rate of the path to a datacenter", labels=["dc"]
        )
        delay = GaugeMetricFamily(
            "pdd_line_one_way_delay_seconds", "Measured one-way delay to a datacenter", labels=["dc"]
        )
        for dc, est in dict(self._lines()).items():
            rate.add_metric([dc], est.bytes_per_s)
            delay.add_metric([dc], est.one_way_s)
        yield from (rate, delay)
