"""`pdd plan`'s search: which deployment of each family gives the most goodput per unit
of hardware cost (BCR), under one GPU budget and one SLO.

A comparison between two hand-picked layouts says more about the picking than about the
architectures, so every family is given its own best layout before any two are compared
(`pdd.lab.plan.verdict.best_per_family`): same-datacenter PD on A, on B, cross-datacenter PD, and PDD, with
their P:D (and relay) counts, at each line bandwidth. Every layout that spends the
budget is a candidate. Each one's analytic capacity (`pdd.lab.plan.bounds`), the screen,
orders the search and seeds its goodput bisection; only each family's first few by it
are contenders, and a contender whose capacity per cost cannot reach the best goodput
per cost its family has already shown is not simulated. The rest are simulated in
steady state (`pdd.lab.sim.runner`), several at a time in worker processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdd.lab.plan import paper
from pdd.lab.plan.bounds import Shape, capacity_rps
from pdd.lab.plan.workload import Workload
from pdd.lab.sim.fleet import DeploymentSpec
from pdd.lab.sim.metrics import GOODPUT_ATTAINMENT
from pdd.lab.sim.runner import Window, find_goodput, run_window, tail_s
from pdd.names import CHIPS, Mode

MIN_PREFILL_SHARE, MAX_PREFILL_SHARE = 0.15, 0.8  # of the layout's GPUs: outside, one side idles
RELAYS = (1, 2)
HEADROOM = 1.5  # how far above its analytic capacity a layout's goodput is searched, and may be before pruning
# the deployments compared, named as the modes are (`pdd.names.Mode`); pd-same-dc-b: same-site PD on B
FAMILIES = (Mode.PD_SAME_DC.value, f"{Mode.PD_SAME_DC}-b", Mode.PD_CROSS_DC.value, Mode.PDD.value)


@dataclass(frozen=True)
class Layout:
    """A deployment to price: P (and relays) in datacenter A, MD in A when there is no
    line, else across the line in B.

    `cells`: the deployment is that many identical cells, each these instances under a
    router of its own, sessions split among the cells by a hash of the session (a
    session-affine balancer in front of `cells` pdd deployments, not part of pdd); the
    line is shared in equal parts. One cell is simulated at its share of the rate, which
    is exact for that deployment, so a large fleet's probe costs what its cell's does."""

    prefill: int
    main: int
    relays: int = 0
    prefill_hw: str = "A"  # P and the relays
    main_hw: str = "A"
    line_gbps: float = 0.0  # 0: one datacenter, no line; with cells, the whole line
    cells: int = 1

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.main < 1 or self.relays < 0:
            raise ValueError("a layout needs at least one prefill and one main instance")
        if self.cells < 1:
            raise ValueError("a layout is at least one cell")
        if self.relays and not self.line_gbps:
            raise ValueError("relays only make sense when MD is across a line")

    @property
    def family(self) -> str:
        if self.relays:
            return "pdd"
        if self.line_gbps:
            return "pd-cross-dc"
        chips = self.prefill_hw if self.main_hw == self.prefill_hw else self.prefill_hw + self.main_hw
        return "pd-same-dc" if chips == "A" else f"pd-same-dc-{chips.lower()}"

    @property
    def name(self) -> str:
        return f"{self.cells} x {self._cell_name}" if self.cells > 1 else self._cell_name

    @property
    def _cell_name(self) -> str:
        if not self.line_gbps and self.main_hw != self.prefill_hw:
            return f"same-dc {self.prefill}P {self.prefill_hw} + {self.main}D {self.main_hw}"
        if not self.line_gbps:
            return f"same-dc {self.prefill}P+{self.main}D {self.prefill_hw}"
        near = f"{self.prefill}P" + (f"+{self.relays}R" if self.relays else "")
        return (
            f"{'pdd' if self.relays else 'cross-dc'} {near} {self.prefill_hw} | {self.main}MD {self.main_hw} "
            f"{self.line_gbps:g}G"
        )

    def spec(self, setting: paper.Setting = paper.SETTING) -> DeploymentSpec:
        """One cell's deployment (the whole one when it is one cell), on its share of the line."""
        far = "B" if self.line_gbps else "A"
        roles = [setting.role("prefill", "A", self.prefill, self.prefill_hw)]
        if self.relays:
            roles.append(setting.role("relay", "A", self.relays, self.prefill_hw))
        roles.append(setting.role("main", far, self.main, self.main_hw))
        return setting.deployment(self.family, tuple(roles), self.line_gbps / self.cells)

    def gpus(self, setting: paper.Setting = paper.SETTING) -> int:
        p, r, d = _sizes(setting, self.prefill_hw, self.main_hw)
        return self.cells * (self.prefill * p + self.relays * r + self.main * d)

    def bill(self, setting: paper.Setting = paper.SETTING, b_price: float | None = None) -> paper.Bill:
        """What all its cells cost an hour (the line's price is linear in its bandwidth:
        the cells' shares add up to the whole line's)."""
        cell = paper.bill(self.spec(setting), setting, b_price)
        return paper.Bill({hw: self.cells * n for hw, n in cell.gpus.items()}, self.cells * cell.per_hour)


def cells_for(max_gpus: int, cell_gpus: int) -> int:
    """Cells a budget of `max_gpus` is planned in: as few as keep each within `cell_gpus`
    (0: one, whatever the budget)."""
    return max(1, math.ceil(max_gpus / cell_gpus)) if cell_gpus > 0 else 1


def _sizes(setting: paper.Setting, near: str, far: str) -> tuple[int, int, int]:
    """GPUs of a P, a relay (beside P) and an MD instance (0: the model fits none)."""
    return (
        setting.instance_gpus(near, "prefill") or 0,
        setting.instance_gpus(near, "relay") or 0,
        setting.instance_gpus(far, "decode") or 0,
    )


def candidates(
    max_gpus: int,
    line_gbps: Sequence[float],
    hardware: Sequence[str],
    setting: paper.Setting = paper.SETTING,
    spend: bool = True,
    cells: int = 1,
) -> list[Layout]:
    """Layouts within the budget: same-dc PD on each hardware, and for each line P (and
    relays) on `hardware[0]` with MD on `hardware[-1]`, within a sensible share of prefill
    GPUs. `spend`: only those that spend it (no instance of either kind would still fit).
    `cells`: layouts of that many identical cells, each within its share of the budget."""
    unknown = [h for h in hardware if h not in CHIPS]
    if unknown or not hardware:
        raise ValueError(f"chips must be {' or '.join(CHIPS)}, got {list(hardware)}")
    layouts: list[Layout] = []
    for hw in hardware:
        layouts += _family(max_gpus // cells, hw, hw, 0, 0.0, setting, spend)
    for gbps in line_gbps:
        for relays in (0, *RELAYS):
            layouts += _family(max_gpus // cells, hardware[0], hardware[-1], relays, gbps, setting, spend)
    return [replace(lay, cells=cells) for lay in layouts] if cells > 1 else layouts


def _family(
    max_gpus: int, near: str, far: str, relays: int, gbps: float, setting: paper.Setting, spend: bool
) -> list[Layout]:
    """The layouts of P on `near` (and `relays` beside it) with MD on `far`."""
    p_size, r_size, d_size = _sizes(setting, near, far)
    if not (p_size and d_size and (r_size or not relays)):
        return []
    smallest = min(p_size, d_size, r_size if relays else d_size)
    out = []
    for p in range(1, max_gpus // p_size + 1):
        most = (max_gpus - p * p_size - relays * r_size) // d_size  # MD instances the rest holds
        for main in range(most if spend else 1, most + 1):
            if main < 1:
                continue
            used = p * p_size + relays * r_size + main * d_size
            share = p * p_size / (p * p_size + main * d_size)
            if (max_gpus < used + smallest or not spend) and MIN_PREFILL_SHARE <= share <= MAX_PREFILL_SHARE:
                out.append(Layout(p, main, relays, near, far, gbps))
    return out


@dataclass(frozen=True)
class Probe:
    """One steady-state run: arrivals for `warmup_s` unjudged (after a warm start), then
    until about `requests` requests are judged and at least `min_window_s` have passed;
    the goodput bisection's `steps`. The window's length, not its count of requests,
    is what sees an overload: at 10 % over capacity a queue takes about TTFT target /
    10 % to grow past the TTFT target, and agentic arrivals come in bursts of sessions'
    long first turns, which a window of a few seconds samples by luck."""

    requests: int = 300
    warmup_s: float = 20.0
    slo: tuple[float, float] = (paper.SLO_TTFT_MS, paper.SLO_TPOT_MS)
    attainment: float = GOODPUT_ATTAINMENT
    steps: int = 4
    min_window_s: float = 60.0

    def window(self, rps: float, workload: Workload) -> Window:
        judged = max(self.requests / rps, self.min_window_s)
        return Window(self.warmup_s, self.warmup_s + judged, tail_s(workload.longest_output, self.slo))


def spec_of(layout: Layout, setting: paper.Setting, workload: Workload) -> DeploymentSpec:
    """The layout's deployment, its cache in the workload's blocks."""
    return replace(layout.spec(setting), block_tokens=workload.block_tokens)


def capacity_of(layout: Layout, setting: paper.Setting, workload: Workload, shape: Shape, probe: Probe) -> float:
    """The layout's analytic capacity in requests a second (`bounds.capacity_rps`), all
    its cells'; `shape`: the workload's."""
    return layout.cells * capacity_rps(spec_of(layout, setting, workload), shape, probe.slo[1] / 1000)["rps"]


def probe_at(spec: DeploymentSpec, workload: Workload, probe: Probe, rps: float) -> dict[str, Any]:
    """One probe at `rps` requests a second, stopped as soon as it cannot meet the SLO."""
    return run_window(
        spec,
        workload.sessions(),
        rps / workload.turns,
        probe.window(rps, workload),
        probe.slo,
        stop_early=True,
        attainment=probe.attainment,
        intervals=False,
    )


def goodput_of(
    layout: Layout,
    setting: paper.Setting,
    workload: Workload,
    probe: Probe,
    capacity: float,
    beat_rps: float | None = None,
) -> dict[str, Any]:
    """The layout's goodput, searched around its analytic capacity: the bracket
    [capacity / 3, `HEADROOM` x capacity] (the capacity is an estimate: relays decode
    too, and requests vary around the means it takes), widened downwards while even its
    bottom misses.

    With `beat_rps` (the rate, probed, at which it would beat the best BCR its family has
    shown), one probe at that rate comes first: a layout that misses the SLO there
    cannot win, and its row says only that (`goodput_rps` None, `missed_rps`: the rate); one that
    meets it is searched upwards from there. `probed_rps`: the rate its goodput was
    probed at (session rate x turns), which is its goodput (`_row`) and what `beat_rps`
    is made of."""
    spec = spec_of(layout, setting, workload)
    sessions, turns = workload.sessions(), workload.turns
    per_session = layout.cells * turns  # the layout's requests a second, a session a second of one cell
    runs: dict[float, dict[str, Any]] = {}  # by one cell's session rate: a rate is never probed twice

    def searched(low: float, high: float, steps: int) -> dict[str, Any] | None:
        return find_goodput(
            spec,
            sessions,
            probe.slo,
            lambda rate: probe.window(rate * turns, workload),
            low / per_session,
            high / per_session,
            steps=steps,
            attainment=probe.attainment,
            runs=runs,
        )

    if beat_rps is not None:
        run = runs[beat_rps / per_session] = probe_at(spec, workload, probe, beat_rps / layout.cells)
        if (run["slo_attainment"] or 0.0) < probe.attainment:
            return row_of(layout, setting, run, capacity, beat_rps) | {
                "goodput_rps": None,
                "bcr": None,
                "probes": 1,
                "missed_rps": beat_rps,
            }
        high = max(HEADROOM * capacity, (1 + search_resolution(probe)) * beat_rps)
        best = searched(beat_rps, high, steps_for(high / beat_rps, probe))
    else:
        high, low, best, tried = HEADROOM * capacity, capacity / 3, None, 0
        while best is None and tried < 3:
            best = searched(low, high, probe.steps)
            high, low, tried = low, low / 4, tried + 1
    probed = best["session_rate"] * per_session if best else None
    return row_of(layout, setting, best, capacity, probed) | {"probes": len(runs), "probed_rps": probed}


def steps_for(ratio: float, probe: Probe) -> int:
    """Bisection steps that resolve a bracket of `ratio` as finely as the full one."""
    return max(1, math.ceil(math.log2(math.log(ratio) / math.log(1 + search_resolution(probe)))))


def row_of(
    layout: Layout, setting: paper.Setting, run: dict[str, Any] | None, capacity: float, probed_rps: float | None
) -> dict[str, Any]:
    """A layout's row. Its goodput is the steady rate the probe that met the SLO offered
    (`probed_rps`: sessions a second x turns a session), not the requests its window
    happened to judge (`judged_rps`): closed-loop sessions arrive as their turns end,
    which the warm start's nominal turn lengths do not know, so the count moved with how
    fast a layout decodes (-8 % to +19 % of the probed rate over the default search's top
    layouts, BENCHMARKS.md). Rates are the whole layout's; `run` is its one cell's."""
    bill = layout.bill(setting)
    rps = probed_rps if run and probed_rps else 0.0
    ttft = run["ttft_ms"] if run else {}
    return {
        "layout": layout.name,
        "family": layout.family,
        "prefill": layout.prefill,
        "relays": layout.relays,
        "main": layout.main,
        "prefill_hw": layout.prefill_hw,
        "main_hw": layout.main_hw,
        "line_gbps": layout.line_gbps,
        "cells": layout.cells,
        "gpus": bill.gpus,
        "cost_per_hour": bill.per_hour,
        "capacity_rps": capacity,
        "goodput_rps": rps,
        "judged_rps": layout.cells * run["offered_rps"] if run else None,
        "bcr": rps / bill.per_hour,
        "simulated": True,
        "ttft_p50_ms": ttft.get("p50"),
        "ttft_p99_ms": ttft.get("p99"),
        "slo_attainment": run["slo_attainment"] if run else None,
        "utilisation": run["utilisation"] if run else {},
        "binding": run["binding"] if run else "-",
        "missed_rps": None,
        "screened_out": False,
        "probed_rps": None,
        "probes": 0,
        "run": run,
    }


OnProgress = Callable[[int, int, str], None]  # (layouts done, layouts to simulate so far, what finished)


def search_resolution(probe: Probe) -> float:
    """The goodput bisection's step, as a fraction: from capacity / 4 to 1.1 capacity."""
    return math.exp(math.log(4.4) / 2**probe.steps) - 1


def tie(change: float | None, probe: Probe) -> bool:
    """Whether a change of goodput, or of BCR (goodput over an exact cost), is inside the
    search's resolution, where a verdict must call it a tie: each goodput is known only
    to within one bisection step of the rate that met the SLO."""
    return change is not None and abs(math.log1p(change)) < math.log1p(search_resolution(probe))
