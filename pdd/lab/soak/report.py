"""What a soak found: totals, the chaos matrix, pages, peak RSS; as a table, Markdown and JSON.

The chaos matrix puts each fault kind against the outcomes of the requests that ran in
its window (in flight at any moment from the strike to the clear; a request that spans
several windows counts for the first), and the recovery:
from the clear until a request sent after it completes, so it includes that request's
own latency. A fault whose window no request shares still counts as injected.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from pdd.lab.soak.client import COMPLETED, FAILED, LOST, OUTCOMES, SoakOutcome
from pdd.lab.soak.faults import FaultEvent


def totals(outcomes: Sequence[SoakOutcome]) -> dict[str, int]:
    counts = Counter(o.outcome for o in outcomes)
    return {"sent": len(outcomes), **{k: counts[k] for k in OUTCOMES}}


def recovery_s(fault: FaultEvent, outcomes: Sequence[SoakOutcome]) -> float | None:
    """Seconds from the clear until the first request sent after it completed; None if none did."""
    ends = [o.end for o in outcomes if o.outcome == COMPLETED and o.start >= fault.clear]
    return min(ends) - fault.clear if ends else None


def first_fault(faults: Sequence[FaultEvent], outcomes: Sequence[SoakOutcome]) -> dict[int, FaultEvent]:
    """Request index -> the first fault whose window it shared. A request that hangs
    through several faults was hit by the first; the later ones found it broken."""
    first: dict[int, FaultEvent] = {}
    for fault in sorted(faults, key=lambda f: f.start):
        for o in outcomes:
            if o.index not in first and o.start <= fault.clear and o.end >= fault.start:
                first[o.index] = fault
    return first


def matrix(
    kinds: Sequence[str],
    faults: Sequence[FaultEvent],
    outcomes: Sequence[SoakOutcome],
    later: Sequence[SoakOutcome] = (),
    settled: dict[str, tuple[int, float]] | None = None,
) -> list[dict[str, Any]]:
    """One row per fault kind. `later` (probes sent after the load) counts for recovery
    only; `settled` (matrix runs): the pages each kind left held once its requests had
    ended and the pages had had their time to come back, and how long they took."""
    first = first_fault(faults, outcomes)
    rows = []
    for kind in kinds:
        hits = [f for f in faults if f.kind == kind]
        seen = [o for o in outcomes if first.get(o.index) in hits]
        counts = Counter(o.outcome for o in seen)
        rec = [recovery_s(f, [*outcomes, *later]) for f in hits]
        done = [r for r in rec if r is not None]
        row = {
            "fault": kind,
            "injections": len(hits),
            "requests": len(seen),
            **{k: counts[k] for k in OUTCOMES},
            "recovery_s_p50": statistics.median(done) if done else None,
            "recovery_s_max": max(done) if done else None,
            "not_recovered": len(rec) - len(done),
            "not_rejoined": sum(not f.ok for f in hits),
        }
        if settled is not None:
            row["leaked_pages"], row["settle_s"] = settled.get(kind, (None, None))
        rows.append(row)
    return rows


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _recovery(row: dict[str, Any]) -> str:
    text = f"{_seconds(row['recovery_s_p50'])} / {_seconds(row['recovery_s_max'])}"
    return text + (f" ({row['not_recovered']} never)" if row["not_recovered"] else "")


def matrix_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The matrix as a Markdown table, for the docs."""
    leak = rows and "leaked_pages" in rows[0]
    head = ["fault", "injections", "requests in window", "completed", "failed", "lost"]
    head += ["leaked pages", "pages back after (s)"] if leak else []
    head += ["recovery p50 / max (s)"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        cells = [r["fault"], r["injections"], r["requests"], r[COMPLETED], r[FAILED], r[LOST]]
        cells += [r["leaked_pages"], _seconds(r["settle_s"])] if leak else []
        cells += [_recovery(r)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def print_summary(console: Console, report: dict[str, Any]) -> None:
    """The table a person reads at the end of a run."""
    t = report["totals"]
    table = Table(title="pdd soak", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("requests sent", f"{t['sent']:,}")
    table.add_row("completed", f"{t[COMPLETED]:,}")
    table.add_row("failed with an error", f"{t[FAILED]:,}")
    table.add_row("lost", f"{t[LOST]:,}")
    table.add_row("faults injected", f"{len(report['faults'])}  ({_kind_counts(report['faults'])})")
    table.add_row("pages held when the load ended", str(report["held_pages_after_load"]))
    leaked = report["leaked_pages"]
    held = "still held" if leaked else "all back"
    table.add_row("leaked pages", f"{leaked}  ({held} after {report['settle_s']:.0f} s)")
    table.add_row("crashes", str(len(report["crashes"])))
    table.add_row("healthy at the end", "yes" if report["healthy_at_end"] else "NO")
    probes = report["probes"]
    table.add_row("probes after the run", f"{probes[COMPLETED]} / {probes['sent']} completed")
    table.add_row("wall time", f"{report['wall_s']:.0f} s")
    for name, mib in report["peak_rss_mib"].items():
        lives = report["lives"].get(name, 1)
        table.add_row(f"peak RSS {name}", f"{mib:,.0f} MiB" + (f" ({lives} lives)" if lives > 1 else ""))
    console.print(table)
    if report["failed_reasons"]:
        console.print("failed, by reason:", markup=False)
        for reason, n in report["failed_reasons"].items():
            console.print(f"  {n:6,} x {reason}", markup=False, highlight=False, soft_wrap=True)
    for o in report["lost_requests"][:10]:
        console.print(
            f"lost request {o['index']} ({o['kind']}, {o['start']:.1f}-{o['end']:.1f} s): {o['detail']}",
            markup=False,
            soft_wrap=True,
        )
    console.print(matrix_markdown(report["matrix"]), markup=False, highlight=False, soft_wrap=True)


def _kind_counts(faults: Sequence[dict[str, Any]]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(Counter(f["kind"] for f in faults).items()))


def counter(values: Iterable[str | None]) -> dict[str, int]:
    return dict(Counter(v for v in values if v).most_common())


def reasons(outcomes: Sequence[SoakOutcome], outcome: str) -> dict[str | None, int]:
    """How many requests ended with each reason (None: none was given), most common first."""
    return dict(Counter(o.detail for o in outcomes if o.outcome == outcome).most_common())
