"""The demo's headline: what PDD changes against the PD baselines, and whether it holds.

Four ratios, each against the bound the project holds PDD to (the PDD-mode issue's
targets): first-token tail against same-datacenter PD (at most 1.2x: PDD must not
pay for the line) and against cross-datacenter PD (at most 0.5x: it must hide the
line), the worst token gap against same-datacenter PD (at most 1.5x: a handoff must
not show), and the relay's share of output (under 15 %: the relay is a bridge, not a
second decode tier). The baselines are the modes with PDD's instance count where the
run has them (`pd-same-dc:main=2`: equal hardware), else the plain ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from pdd.names import Mode


@dataclass(frozen=True)
class Headline:
    name: str
    value: float | None
    bound: float
    at_most: bool  # True: value <= bound passes; False: value < bound passes
    basis: str  # what it divides
    percent: bool = False  # a share, printed as one

    @property
    def holds(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.bound if self.at_most else self.value < self.bound

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "bound": self.bound, "holds": self.holds, "basis": self.basis}


def _baseline(summaries: Mapping[str, Mapping[str, Any]], mode: str) -> str | None:
    """The run's mode for baseline `mode`: at PDD's instance count if present."""
    equal = [m for m in summaries if m.split(":")[0] == mode and m != mode]
    return equal[0] if equal else mode if mode in summaries else None


def _p99(summary: Mapping[str, Any], key: str) -> float | None:
    value = summary[key]["p99"]
    return None if value is None else float(value)


def _ratio(summaries: Mapping[str, Mapping[str, Any]], base: str | None, key: str) -> tuple[float | None, str]:
    pdd, other = summaries.get(Mode.PDD), summaries.get(base) if base else None
    if pdd is None or other is None:
        return None, f"{key} P99: {Mode.PDD} / {base or 'none'}"
    a, b = _p99(pdd, key), _p99(other, key)
    return (a / b if a is not None and b else None), f"{key} P99: {Mode.PDD} / {base}"


def headlines(summaries: Mapping[str, Mapping[str, Any]]) -> list[Headline]:
    """The four headline figures of a demo run (values None where a mode is missing)."""
    same, cross = _baseline(summaries, Mode.PD_SAME_DC), _baseline(summaries, Mode.PD_CROSS_DC)
    ttft_same, basis_same = _ratio(summaries, same, "ttft_ms")
    ttft_cross, basis_cross = _ratio(summaries, cross, "ttft_ms")
    itl, basis_itl = _ratio(summaries, same, "max_itl_ms")
    pdd = summaries.get(Mode.PDD)
    share = None
    if pdd is not None and pdd["output_tokens"]:
        share = pdd["relay_output_tokens"] / pdd["output_tokens"]
    return [
        Headline("PDD / same-dc PD, TTFT P99", ttft_same, 1.2, True, basis_same),
        Headline("PDD / cross-dc PD, TTFT P99", ttft_cross, 0.5, True, basis_cross),
        Headline("PDD / same-dc PD, max ITL P99", itl, 1.5, True, basis_itl),
        Headline("RLD share of output tokens", share, 0.15, False, "relay_output_tokens / output_tokens", percent=True),
    ]


def format_headlines(figures: list[Headline]) -> Table:
    table = Table(title="headline (bounds of the PDD-mode targets)")
    for col in ("figure", "value", "bound", "holds", "of"):
        table.add_column(col, justify="left" if col in ("figure", "of") else "right")
    for h in figures:
        number = "{:.1%}" if h.percent else "{:.2f}"
        value = "-" if h.value is None else number.format(h.value)
        bound = f"{'<=' if h.at_most else '<'} {number.format(h.bound)}"
        holds = "-" if h.holds is None else "yes" if h.holds else "NO"
        table.add_row(h.name, value, bound, holds, h.basis)
    return table
