"""What a simulated run measured, in `pdd bench`'s own shape, and what it is worth.

Each simulated request becomes a `RequestRecord` and the run is summarised by
`pdd.bench.summary.summarize`, so a simulated column and a measured one have the same
keys. On top: throughput per hit-rate bucket (the spec's seven), goodput (the highest
rate at which 90 % of requests meet the SLA, by bisection) and BCR = goodput / cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from pdd.bench.summary import summarize
from pdd.names import Pipeline
from pdd.record import RequestRecord
from pdd.sim.outcome import Outcome

# The spec tracks requests in seven hit-rate buckets, 0-90 % up to 99-100 %.
HIT_BUCKETS = (0.0, 0.90, 0.95, 0.96, 0.97, 0.98, 0.99, 1.0001)
GOODPUT_ATTAINMENT = 0.90


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def record(o: Outcome) -> RequestRecord:
    return RequestRecord(
        id=f"{o.session}-{o.turn}", session=o.session, turn=o.turn, start_s=o.arrival_s,
        prompt_tokens=o.prompt_tokens, output_tokens=o.tokens, ttft_ms=_ms(o.ttft_s), tpot_ms=_ms(o.tpot_s),
        e2e_ms=_ms(None if o.end_s is None else o.end_s - o.arrival_s), max_itl_ms=_ms(o.max_itl_s),
        pipeline=o.pipeline, p_hit_tokens=o.p_hit, d_hit_tokens=o.d_hit, wan_bytes=int(o.wan_bytes),
        rld_output_tokens=o.rld_tokens, md_output_tokens=o.md_tokens, handoff=o.handoff,
        handoff_tokens=o.handoff_tokens, handoff_stall_ms=_ms(o.handoff_stall_s), fallback=o.fallback,
        planned_anomalous=o.anomalous, anomalous=o.anomalous and o.pipeline == Pipeline.P_RLD,
        error=o.failed if o.failed else (None if o.end_s is not None else "unfinished when the simulation stopped"))


def summary(outcomes: Sequence[Outcome], slo_ttft_ms: float, slo_tpot_ms: float) -> dict[str, Any]:
    result = summarize([record(o) for o in outcomes], wan_bytes=None, slo_ttft_ms=slo_ttft_ms,
                       slo_tpot_ms=slo_tpot_ms)
    result["hit_buckets"] = hit_buckets(outcomes, result.get("duration_s") or 0.0)
    return result


def hit_buckets(outcomes: Sequence[Outcome], duration_s: float) -> list[dict[str, Any]]:
    """Requests, median TTFT and output throughput per decode-side hit-rate bucket."""
    rows = []
    for low, high in zip(HIT_BUCKETS, HIT_BUCKETS[1:]):
        inside = [o for o in outcomes if low <= o.d_hit / o.prompt_tokens < high and o.ttft_s is not None]
        ttfts = sorted(o.ttft_s for o in inside)
        rows.append({"bucket": f"{100 * low:.0f}-{min(100.0, 100 * high):.0f} %", "requests": len(inside),
                     "ttft_p50_ms": _ms(ttfts[len(ttfts) // 2]) if ttfts else None,
                     "output_tokens_per_s": sum(o.tokens for o in inside) / duration_s if duration_s else None})
    return rows


def goodput(attainment_at: Callable[[float], float], low: float, high: float, steps: int = 7,
            attainment: float = GOODPUT_ATTAINMENT) -> float:
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
