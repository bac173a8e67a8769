"""Per-request records and the run summary of `pdd bench`.

The summary is a contract (DESIGN.md, "Contracts"): `pdd demo`, the reports and the
comparison against the paper read these exact keys, so a run on a plain OpenAI server
and one through PDD produce the same shape and can sit side by side in one table.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from rich.table import Table

from pdd.names import PDD_PIPELINES, HandoffMode
from pdd.record import RequestRecord

PIPELINES = PDD_PIPELINES
HANDOFFS = tuple(HandoffMode)
LATENCIES = ("ttft_ms", "tpot_ms", "e2e_ms", "max_itl_ms")


BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0  # the same data always gives the same interval


def _stats(values: list[float | None], intervals: bool = True) -> dict[str, Any]:
    """Mean and percentiles, how many values they rest on (`n`), and a 95 % bootstrap
    interval for P90 and P99: over a few dozen requests a P99 is one request or two,
    and the interval says how far another run's could fall. `intervals` False: no
    intervals (None), for a caller that reads none and summarises often (the bootstrap is
    most of a summary's time)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "n": 0, "p90_ci": None, "p99_ci": None}
    data = np.asarray(present, dtype=float)
    p50, p90, p99 = np.percentile(data, [50, 90, 99]).tolist()
    stats = {"mean": float(data.mean()), "p50": p50, "p90": p90, "p99": p99, "n": len(data)}
    if not intervals:
        return stats | {"p90_ci": None, "p99_ci": None}
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    resampled = np.percentile(rng.choice(data, size=(BOOTSTRAP_RESAMPLES, len(data))), [90, 99], axis=1)
    (lo90, hi90), (lo99, hi99) = np.percentile(resampled, [2.5, 97.5], axis=1).T.tolist()
    return stats | {"p90_ci": [lo90, hi90], "p99_ci": [lo99, hi99]}


def _within_slo(record: RequestRecord, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    # A one-token answer has no TPOT; it meets the TPOT SLO trivially.
    return (
        record.completed
        and record.ttft_ms is not None
        and record.ttft_ms <= slo_ttft_ms
        and (record.tpot_ms is None or record.tpot_ms <= slo_tpot_ms)
    )


def _duration_s(records: list[RequestRecord]) -> float | None:
    spans = [
        (r.start_s, r.start_s + r.e2e_ms / 1000.0) for r in records if r.start_s is not None and r.e2e_ms is not None
    ]
    if not spans:
        return None
    return max(end for _, end in spans) - min(start for start, _ in spans)


def summarize(
    records: Iterable[RequestRecord],
    *,
    line_bytes: int | None,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    intervals: bool = True,
) -> dict[str, Any]:
    """The DESIGN summary of a run (`intervals` False: no bootstrap intervals, see `_stats`).

    Latency statistics, token sums and hit counts cover completed requests only (a
    failed request's partial counts would mix in noise); `requests`, `failed` and
    `slo_attainment` cover all, so failures lower attainment. `line_bytes` is the
    server-side counter delta when known, else the sum of per-request `line_bytes`.
    """
    records = list(records)
    done = [r for r in records if r.completed]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    p_hit = sum(r.p_hit_tokens for r in done)
    d_hit = sum(r.d_hit_tokens for r in done)
    pipelines = dict.fromkeys(PIPELINES, 0) | Counter(r.pipeline for r in done if r.pipeline)
    handoffs = dict.fromkeys(HANDOFFS, 0) | Counter(r.handoff for r in done if r.handoff)
    fallbacks = Counter(kind for r in done for kind in r.fallbacks)
    duration = _duration_s(records)
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
    }
    summary |= {name: _stats([getattr(r, name) for r in done], intervals) for name in LATENCIES}
    summary |= {
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "p_hit_tokens": p_hit,
        "d_hit_tokens": d_hit,
        "p_hit_rate": p_hit / prompt_tokens if prompt_tokens else None,
        "d_hit_rate": d_hit / prompt_tokens if prompt_tokens else None,
        "line_bytes": line_bytes if line_bytes is not None else sum(r.line_bytes for r in records),
        "relay_output_tokens": sum(r.relay_output_tokens for r in done),
        "main_output_tokens": sum(r.main_output_tokens for r in done),
        "pipelines": pipelines,
        "handoffs": handoffs,
        "handoff_tokens": sum(r.handoff_tokens for r in done),
        "handoff_stall_ms": _stats([r.handoff_stall_ms for r in done], intervals),
        "anomaly_filtered": sum(r.anomalous for r in done),
        "fallbacks": dict(sorted(fallbacks.items())),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "slo_attainment": (sum(_within_slo(r, slo_ttft_ms, slo_tpot_ms) for r in records) / len(records))
        if records
        else None,
        "duration_s": duration,
        "output_tokens_per_s": output_tokens / duration if duration else None,
    }
    return summary


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _bytes(value: int) -> str:
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _share(part: int, whole: int) -> str:
    return f"{part:,}" + (f" ({100 * part / whole:.1f} %)" if whole else "")


def _counts(counts: Mapping[str, int]) -> str:
    return "  ".join(f"{name} {n}" for name, n in counts.items()) or "-"


def _tail(stats: Mapping[str, Any], q: str) -> str:
    """A tail percentile with its 95 % interval: `p99 (lo-hi)`."""
    ci = stats.get(f"{q}_ci")
    return _num(stats[q]) + (f" ({ci[0]:,.0f}-{ci[1]:,.0f})" if ci else "")


_ROWS: list[tuple[str, Callable[[Mapping[str, Any]], str]]] = [
    ("requests (ok / failed)", lambda s: f"{s['completed']} / {s['failed']}"),
    *[
        (
            f"{label} {q} (ms){' [95% CI]' if q != 'p50' else ''}",
            lambda s, k=key, q=q: _num(s[k][q]) if q == "p50" else _tail(s[k], q),
        )
        for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E"))
        for q in ("p50", "p90", "p99")
    ],
    ("max ITL p99 (ms) [95% CI]", lambda s: _tail(s["max_itl_ms"], "p99")),
    ("percentiles rest on", lambda s: f"{s['ttft_ms'].get('n', s['completed'])} requests"),
    ("prompt tokens", lambda s: f"{s['prompt_tokens']:,}"),
    ("output tokens", lambda s: f"{s['output_tokens']:,}"),
    ("P hit", lambda s: _pct(s["p_hit_rate"])),
    ("D hit", lambda s: _pct(s["d_hit_rate"])),
    ("line bytes", lambda s: _bytes(s["line_bytes"])),
    ("RLD output tokens", lambda s: _share(s["relay_output_tokens"], s["output_tokens"])),
    ("MD output tokens", lambda s: _share(s["main_output_tokens"], s["output_tokens"])),
    ("pipelines", lambda s: _counts({k: n for k, n in s["pipelines"].items() if n})),
    ("handoffs", lambda s: _counts(s["handoffs"])),
    (
        "handoff stall p50 / p99 (ms)",
        lambda s: f"{_num(s['handoff_stall_ms']['p50'])} / {_num(s['handoff_stall_ms']['p99'])}",
    ),
    ("anomaly-filtered", lambda s: f"{s['anomaly_filtered']:,}"),
    ("fallbacks", lambda s: _counts(s["fallbacks"])),
    ("SLO attainment", lambda s: _pct(s["slo_attainment"])),
    ("output tokens/s", lambda s: _num(s["output_tokens_per_s"])),
    ("duration (s)", lambda s: _num(s["duration_s"])),
]


def format_table(summary_by_name: Mapping[str, Mapping[str, Any]]) -> Table:
    """One column per summary, one row per metric, so modes compare at a glance."""
    table = Table(title="pdd bench")
    table.add_column("metric", style="bold")
    for name in summary_by_name:
        table.add_column(name, justify="right")
    for label, cell in _ROWS:
        table.add_row(label, *(cell(s) for s in summary_by_name.values()))
    return table


def format_hardware_table(summary_by_name: Mapping[str, Mapping[str, Any]]) -> Table | None:
    """Each mode's instances: the chip each ran on, its prefill and decode step times
    (emulated), and how many steps overran their emulated time (then the CPU, not the
    chip, set the pace). None when no summary carries instances."""
    rows = [
        (mode, name, inst) for mode, s in summary_by_name.items() for name, inst in (s.get("instances") or {}).items()
    ]
    if not rows:
        return None
    table = Table(title="hardware: each instance's accelerator and step times")
    for column in ("mode", "instance", "chip", "prefill step (ms)", "decode step (ms)", "overrun steps"):
        table.add_column(column, justify="left" if column in ("mode", "instance", "chip") else "right")
    for mode, name, inst in rows:
        if inst.get("hardware", "native") == "native":
            chip = "native (this CPU)"
        else:
            chip = f"{inst['hardware']}: {inst.get('chip')} x{inst.get('gpus')}, time x{inst.get('dilation', 1):g}"
        overruns = "-" if not inst.get("steps") else f"{inst['overruns']:,} of {inst['steps']:,}"
        table.add_row(mode, name, chip, _num(inst.get("prefill_step_ms")), _num(inst.get("decode_step_ms")), overruns)
    return table
