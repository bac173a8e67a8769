"""Evaluations beside `pdd plan`'s search: the publication's layouts as given, head to
head and one change at a time, and each family's cheapest layout at a target load."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdd.lab.plan import paper
from pdd.lab.plan.planner import HEADROOM, Layout, OnProgress, Probe, capacity_of, probe_at, row_of, spec_of
from pdd.lab.plan.workload import Workload


def published(line_gbps: float, setting: paper.Setting = paper.SETTING) -> list[Layout]:
    """The publication's layouts as near as whole instances come (`paper.paper_deployments`):
    its 88 GPU A in one site as 2 P + 3 D of 16, its 43 A + 32 B as 2 P + 1 relay of 16 on A
    and 4 MD of 8 on B, and cross-site PD on the same GPUs without the relay; between the
    first and those, the same P and D in one site (the `BREAKDOWN`'s middle step)."""
    return [
        Layout(2, 3, 0, "A", "A"),
        Layout(3, 4, 0, "A", "B"),
        Layout(3, 4, 0, "A", "B", line_gbps),
        Layout(2, 4, 1, "A", "B", line_gbps),
    ]


# From same-dc PD on A to PDD, one change at a time: (the family after the step, what the step changes)
BREAKDOWN = (
    ("pd-same-dc-ab", "D on B, same site"),
    ("pd-cross-dc", "D across the line"),
    ("pdd", "a relay beside P"),
)


def breakdown(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """What each step from same-dc PD on A to PDD changes, on the published layouts
    (`published`): B decoding in the same site, then the line between P and D, then a relay
    (in place of one P's GPUs). Each step's goodput, cost, BCR and TTFT p99 against the step
    before; a step whose either end met the SLO at no rate searched has None there."""
    by = {r["family"]: r for r in rows}

    def change(before: dict[str, Any] | None, after: dict[str, Any] | None, key: str) -> float | None:
        if before is None or after is None or not before[key] or after[key] is None:
            return None
        if key != "cost_per_hour" and not (before["goodput_rps"] and after["goodput_rps"]):
            return None  # (what a layout that met the SLO at no rate searched did is no figure)
        return after[key] / before[key] - 1

    out, before = [], by.get("pd-same-dc")
    for family, step in BREAKDOWN:
        after = by.get(family)
        out.append(
            {
                "step": step,
                "layout": after["layout"] if after else None,
                "goodput_change": change(before, after, "goodput_rps"),
                "cost_change": change(before, after, "cost_per_hour"),
                "bcr_change": change(before, after, "bcr"),
                "ttft_p99_change": change(before, after, "ttft_p99_ms"),
            }
        )
        before = after
    return out


def head_to_head(rows: Sequence[dict[str, Any]], setting: paper.Setting = paper.SETTING) -> dict[str, Any] | None:
    """PDD's published layout against same-dc PD's, each evaluated as given: goodput, cost
    and BCR, by our accounting (the instances as built, the line priced) and by the
    publication's (its GPU counts at their prices, no line); and what would make their BCRs
    equal, one figure at a time: PDD's goodput, or B's price (negative: not even free B
    GPUs would). None where either missed."""
    by = {r["family"]: r for r in rows if r["simulated"] and r["goodput_rps"]}
    pd, pdd = by.get("pd-same-dc"), by.get("pdd")
    if pd is None or pdd is None:
        return None
    counts = paper.PAPER["gpus"]
    theirs = {
        family: sum(n * setting.chip(hw).price_per_hour for hw, n in counts[family].items())
        for family in ("pd-same-dc", "pdd")
    }
    goodput = pdd["goodput_rps"] / pd["goodput_rps"] - 1
    # What would flip the verdict, one figure at a time, the others as they are: BCR is goodput
    # over cost, and PDD's cost is linear in B's price (its B GPUs at it, the rest fixed)
    b_gpus = pdd["gpus"].get("B", 0)
    b_price = setting.chip("B").price_per_hour
    pd_pace = pd["goodput_rps"] / pd["cost_per_hour"]
    flip_b_price = (
        (pdd["goodput_rps"] / pd_pace - (pdd["cost_per_hour"] - b_gpus * b_price)) / b_gpus if b_gpus else None
    )
    return {
        "flip_goodput_rps": pd_pace * pdd["cost_per_hour"],
        "flip_b_price": flip_b_price,
        "b_price": b_price,
        "goodput_change": goodput,
        "cost_change": pdd["cost_per_hour"] / pd["cost_per_hour"] - 1,
        "bcr_change": pdd["bcr"] / pd["bcr"] - 1,
        "their_cost_change": theirs["pdd"] / theirs["pd-same-dc"] - 1,
        "bcr_change_their_costs": (1 + goodput) * theirs["pd-same-dc"] / theirs["pdd"] - 1,
        "published": {k: paper.PAPER[k] for k in ("goodput_change", "cost_change", "bcr_change")},
    }


def cheapest_at(
    layouts: Sequence[Layout],
    target_rps: float,
    workload: Workload,
    probe: Probe = Probe(),
    setting: paper.Setting = paper.SETTING,
    progress: OnProgress | None = None,
) -> dict[str, dict[str, Any]]:
    """Each family's cheapest layout that meets the SLO at `target_rps`: its layouts in
    order of cost, one probe each at that rate, past those whose analytic capacity could
    not carry it even with `HEADROOM`; the first that meets it is the answer (a family
    none of whose layouts does is left out). Its row: the probe's figures at the target."""
    shape = workload.shape()
    found: dict[str, dict[str, Any]] = {}
    families = sorted({lay.family for lay in layouts})
    probed = 0
    for family in families:
        for lay in sorted(
            (x for x in layouts if x.family == family),
            key=lambda x: (x.bill(setting).per_hour, x.name),
        ):
            capacity = capacity_of(lay, setting, workload, shape, probe)
            if HEADROOM * capacity < target_rps:
                continue
            run = probe_at(spec_of(lay, setting, workload), workload, probe, target_rps / lay.cells)
            probed += 1
            if progress is not None:
                progress(probed, probed, f"{lay.name} at {target_rps:g} req/s")
            if (run["slo_attainment"] or 0.0) >= probe.attainment:
                found[family] = row_of(lay, setting, run, capacity, target_rps) | {
                    "probes": 1,
                    "probed_rps": target_rps,
                }
                break
    return found
