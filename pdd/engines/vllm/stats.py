"""vLLM's own counters, as the engine port reports them (`load`, `stats`).

A stat logger (vLLM's plug-in point for metrics) that keeps, per instance: the KV
usage gauge (`vllm:kv_cache_usage_perc`), running requests and those waiting for a slot
(not those vLLM defers, waiting for their KV to land or for the connector: on a relay,
a request whose KV is still crossing, or the export of a finished one's output for MD's
fill, neither of which waits for a place in the batch), the prefix
cache's queries and hits (`vllm:prefix_cache_queries` / `_hits`), and prompt tokens by
where their KV came from (`vllm:prompt_tokens_by_source`: computed, local cache hit,
external transfer) and generated tokens, summed since start.

`VllmMetrics` serves vLLM's own series on the instance's /metrics: vLLM registers them
in prometheus_client's process-wide registry, and pdd's app serves a registry of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import Metric
from vllm.v1.metrics.loggers import StatLoggerBase


class VllmMetrics:
    """A collector of the process-wide registry's `vllm:*` families, as vLLM's
    `PrometheusStatLogger` keeps them (with `model_name` and `engine` labels)."""

    def collect(self) -> Iterator[Metric]:
        yield from (m for m in REGISTRY.collect() if m.name.startswith("vllm:"))


class StatsTap(StatLoggerBase):
    def __init__(self, into: dict[str, Any]) -> None:
        self.into = into

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        s = self.into
        if scheduler_stats is not None:
            s["kv_cache_usage"] = scheduler_stats.kv_cache_usage
            s["running"] = scheduler_stats.num_running_reqs
            s["waiting"] = scheduler_stats.num_waiting_reqs
            s["deferred"] = scheduler_stats.num_skipped_waiting_reqs
            s["prefix_cache_queries"] += scheduler_stats.prefix_cache_stats.queries
            s["prefix_cache_hits"] += scheduler_stats.prefix_cache_stats.hits
        if iteration_stats is not None:
            pts = iteration_stats.prompt_token_stats
            s["prompt_tokens_computed"] += pts.computed
            s["prompt_tokens_local_hit"] += pts.local_cache_hit
            s["prompt_tokens_external"] += pts.external_kv_transfer
            s["generation_tokens"] += iteration_stats.num_generation_tokens

    def log_engine_initialized(self) -> None:
        """Nothing to say: the instance logs its own start."""
