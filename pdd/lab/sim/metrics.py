"""What a simulated run measured, in `pdd bench`'s own shape, and what it is worth.

Each simulated request is a `RequestRecord`, and the run is summarised by
`pdd.lab.bench.summary.summarize`, so a simulated column and a measured one have the same
keys. On top: throughput per hit-rate bucket (the spec's seven), goodput (the highest
rate at which 90 % of requests meet the SLA, by bisection) and BCR = goodput / cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

from pdd.lab.bench.summary import summarize
from pdd.lab.sim.stream import ended
from pdd.record import RequestRecord

# The spec tracks requests in seven hit-rate buckets, 0-90 % up to 99-100 %.
HIT_BUCKETS = (0.0, 0.90, 0.95, 0.96, 0.97, 0.98, 0.99, 1.0001)
GOODPUT_ATTAINMENT = 0.90


def summary(
    records: Sequence[RequestRecord], slo_ttft_ms: float, slo_tpot_ms: float, intervals: bool = True
) -> dict[str, Any]:
    records = ended(records)
    result = summarize(records, line_bytes=None, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, intervals=intervals)
    result["hit_buckets"] = hit_buckets(records, result.get("duration_s") or 0.0)
    return result


def hit_buckets(records: Sequence[RequestRecord], duration_s: float) -> list[dict[str, Any]]:
    """Requests, median TTFT and output throughput per decode-side hit-rate bucket (served ones)."""
    rows = []
    for low, high in pairwise(HIT_BUCKETS):
        inside = [r for r in records if r.completed and low <= r.d_hit_tokens / r.prompt_tokens < high]
        ttfts = sorted(r.ttft_ms for r in inside if r.ttft_ms is not None)  # (a served one has it)
        rows.append(
            {
                "bucket": f"{100 * low:.0f}-{min(100.0, 100 * high):.0f} %",
                "requests": len(inside),
                "ttft_p50_ms": ttfts[len(ttfts) // 2] if ttfts else None,
                "output_tokens_per_s": sum(r.output_tokens for r in inside) / duration_s if duration_s else None,
            }
        )
    return rows


def goodput(
    attainment_at: Callable[[float], float],
    low: float,
    high: float,
    steps: int = 7,
    attainment: float = GOODPUT_ATTAINMENT,
) -> float:
    """The highest rate in [low, high] at which `attainment_at(rate)` >= `attainment` (it
    falls as the rate rises); 0.0 when even `low` misses it. Geometric midpoints, since
    rates span decades; the ends are tried only when every midpoint fell on their side,
    because a steady-state run costs about its rate times its length, and the top is the
    dearest."""

    def passes(rate: float) -> bool:
        return attainment_at(rate) >= attainment

    lo, hi = low, high
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    if hi == high and passes(high):
        return high
    return 0.0 if lo == low and not passes(low) else lo
