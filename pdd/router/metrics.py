"""What the router counts: pipelines, handoffs, producers, fallbacks, mirror drift,
hits, the bytes sent across the line, and the instances it can reach.

Prometheus series on the router's `/metrics`, and the same totals as plain numbers for
`/pdd/stats` (tests and `pdd bench` read those).
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from pdd.names import Fallback, HandoffMode, Pipeline, RoleName
from pdd.record import RequestRecord
from pdd.router.client import InstanceClient
from pdd.router.request import RouterRequest
from pdd.transfer import messages as m

_STALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class _Instances:
    """Per instance, read at scrape time: whether the router's control connection to it
    is up (heartbeats drop a silent one), whether it drains, the work queued on it."""

    def __init__(self, clients: Callable[[], Iterable[InstanceClient]]) -> None:
        self._clients = clients

    def collect(self) -> Iterator[Metric]:
        # not instance, job or the scrape's target labels (name, role, site: deploy/prometheus),
        # which Prometheus would rename to exported_* on ingestion
        labels = ["member", "member_role", "dc"]
        up = GaugeMetricFamily(
            "pdd_router_instance_up", "1 while the router's connection to the instance is up", labels=labels
        )
        draining = GaugeMetricFamily("pdd_router_instance_draining", "1 while the instance drains", labels=labels)
        queued = GaugeMetricFamily(
            "pdd_router_instance_queued_tokens", "Tokens of work the router has queued on it", labels=labels
        )
        for c in list(self._clients()):
            key = [c.name, c.spec.role, c.spec.dc]
            up.add_metric(key, float(c.healthy))
            draining.add_metric(key, float(c.draining or c.refusing))
            queued.add_metric(key, float(c.queued_tokens))
        yield from (up, draining, queued)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, clients: Callable[[], Iterable[InstanceClient]] = tuple) -> None:
        r = registry
        r.register(_Instances(clients))
        self.pipelines = Counter(
            "pdd_router_pipeline_requests", "Finished requests by pipeline", ["pipeline"], registry=r
        )
        self.handoffs = Counter("pdd_router_handoffs", "Relay-to-main handoffs by mode", ["mode"], registry=r)
        self.handoff_tokens = Counter(
            "pdd_router_handoff_tokens", "Tokens handed from relays to main instances", registry=r
        )
        self.handoff_stall = Histogram(
            "pdd_router_handoff_stall_seconds",
            "Main instance's extend stall at a handoff",
            registry=r,
            buckets=_STALL_BUCKETS,
        )
        self.output_tokens = Counter(
            "pdd_router_output_tokens", "Output tokens by producing tier", ["producer"], registry=r
        )
        self.anomalies = Counter(
            "pdd_router_anomaly_filtered", "Requests the anomaly filter kept on the relay", registry=r
        )
        self.fallbacks = Counter(
            "pdd_router_fallbacks", "Requests that survived a lost or refusing instance", ["kind"], registry=r
        )
        self.drift = Histogram(
            "pdd_router_mirror_drift_tokens",
            "Predicted minus reserved decode-side hit tokens",
            registry=r,
            buckets=(-4096, -512, -64, -1, 0, 1, 64, 512, 4096),
        )
        # the drift's two sides as counters: a histogram with negative buckets has no _sum
        # (prometheus_client leaves it out, as OpenMetrics says), so its mean is these
        # counters' difference over its _count
        self.mirror_hits = Counter(
            "pdd_router_mirror_hit_tokens",
            "Decode-side hit tokens of planned requests: as the router's mirror predicted them "
            "(source=mirror) and as MD reserved them (source=reservation)",
            ["source"],
            registry=r,
        )
        self.kv_bytes = Counter(
            "pdd_router_kv_bytes",
            "KV bytes P sent, by path: across the line (line) or inside its datacenter (local)",
            ["path"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdd_router_finished_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.hit_tokens = Counter(
            "pdd_router_hit_tokens",
            "Prompt tokens of finished requests already cached, at P "
            "(side=prefill) and at the decode side (side=decode)",
            ["side"],
            registry=r,
        )
        # every label value from the start, at 0: a series exists before its first event, so
        # rate() and the alert rules (deploy/prometheus/alerts.yml) read 0, not nothing
        for counter, values in (
            (self.pipelines, Pipeline),
            (self.handoffs, HandoffMode),
            (self.output_tokens, (RoleName.RELAY, RoleName.MAIN)),
            (self.fallbacks, Fallback),
            (self.kv_bytes, ("line", "local")),
            (self.hit_tokens, ("prefill", "decode")),
            (self.mirror_hits, ("mirror", "reservation")),
        ):
            for value in values:
                counter.labels(value)
        self.failures = Counter(
            "pdd_router_failures", "Requests failed by an instance, a connection or a timeout", registry=r
        )
        self.conflicts = Counter(
            "pdd_router_stream_conflicts", "Output positions two producers disagreed on", registry=r
        )
        self.completed = 0
        self.drift_abs_total = 0
        self.totals: Tally[str] = Tally()  # the same counts as plain numbers, for /pdd/stats

    def observe_drift(self, predicted: int, reserved: int) -> None:
        self.drift.observe(predicted - reserved)
        self.mirror_hits.labels("mirror").inc(predicted)
        self.mirror_hits.labels("reservation").inc(reserved)
        self.drift_abs_total += abs(predicted - reserved)

    def fallback(self, kind: str) -> None:
        self.fallbacks.labels(kind).inc()
        self.totals[f"fallback:{kind}"] += 1

    def finished(self, request: RouterRequest, record: RequestRecord) -> None:
        self.completed += 1
        self.pipelines.labels(record.pipeline).inc()
        self.totals[f"pipeline:{record.pipeline}"] += 1
        for tier, tokens in ((RoleName.RELAY, record.relay_output_tokens), (RoleName.MAIN, record.main_output_tokens)):
            self.output_tokens.labels(tier).inc(tokens)
            self.totals[f"tokens:{tier}"] += tokens
        if record.handoff:
            self.handoffs.labels(record.handoff).inc()
            self.totals[f"handoff:{record.handoff}"] += 1
            self.handoff_tokens.inc(record.handoff_tokens)
            if record.handoff_stall_ms is not None:
                self.handoff_stall.observe(record.handoff_stall_ms / 1000)
        if record.anomalous:
            self.anomalies.inc()
            self.totals["anomaly_filtered"] += 1
        self.conflicts.inc(request.merger.conflicts)
        self.prompt_tokens.inc(len(request.req.prompt))
        self.hit_tokens.labels("prefill").inc(record.p_hit_tokens)
        self.hit_tokens.labels("decode").inc(record.d_hit_tokens)

    def kv_sent(self, result: m.Result) -> None:
        """P's KV transfers of a request are over: count what crossed, when it says so (after
        the request ended, too, when the relay finished it before MD's copy landed)."""
        self.kv_bytes.labels("line").inc(result.line_bytes)
        self.kv_bytes.labels("local").inc(result.kv_bytes - result.line_bytes)
        self.totals["kv_bytes:line"] += result.line_bytes

    def snapshot(self) -> dict:
        return {"requests": self.completed, "mirror_drift_abs_tokens": self.drift_abs_total, **dict(self.totals)}
