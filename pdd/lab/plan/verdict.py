"""What a `pdd plan` search's rows say to the buyer: each family's best, whether B pays at
its price, and the price at which it would stop (or start) paying.

A row's goodput does not depend on what its GPUs cost, so the rows a search simulated are
re-priced exactly at any price of B: its B GPUs at the new price, the rest (A, the line)
as they are. The break-even price is found on those re-priced rows, every family's at
each price, not from ρ alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from pdd.lab.plan import paper
from pdd.lab.plan.planner import Layout, Probe, goodput_of, tie
from pdd.lab.plan.workload import Workload

Row = dict[str, Any]
PRICE_SPAN = 8.0  # break-even prices are searched from 0 to this many times B's price
PRICE_STEPS = 400


def best_per_family(rows: Sequence[Row]) -> dict[str, Row]:
    """Each family's layout of the highest BCR among those whose goodput was found."""
    best: dict[str, Row] = {}
    for r in rows:
        if r["simulated"] and r["bcr"] is not None and (r["family"] not in best or r["bcr"] > best[r["family"]]["bcr"]):
            best[r["family"]] = r
    return best


def iso_goodput(family_rows: Sequence[Row], target_rps: float) -> Row | None:
    """The cheapest simulated layout of a family that reaches `target_rps` (None: none does)."""
    able = [r for r in family_rows if r["simulated"] and (r["goodput_rps"] or 0.0) >= target_rps]
    return min(able, key=lambda r: r["cost_per_hour"]) if able else None


def screen_error(rows: Sequence[Row]) -> dict[str, Any] | None:
    """The analytic screen (each layout's capacity, `pdd.lab.plan.bounds`, which orders and
    prunes the search) against the simulation: capacity over goodput - 1 over the layouts
    whose goodput was found (None: none was)."""
    errors = sorted(r["capacity_rps"] / r["goodput_rps"] - 1 for r in _found(rows))
    if not errors:
        return None
    return {"layouts": len(errors), "median": errors[len(errors) // 2], "low": errors[0], "high": errors[-1]}


def repriced_bcr(row: Row, b_price: float, b_price_now: float) -> float:
    """The row's BCR were B's GPUs priced `b_price` an hour rather than `b_price_now`."""
    cost = row["cost_per_hour"] + row["gpus"].get("B", 0) * (b_price - b_price_now)
    return row["goodput_rps"] / cost if cost > 0 else float("inf")


def _found(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r["simulated"] and r["goodput_rps"]]


def break_even(side: Sequence[Row], rivals: Sequence[Row], b_price_now: float) -> dict[str, Any]:
    """B's prices at which the best of `side` and the best of `rivals`, both re-priced, have
    equal BCR (`prices`, each found to 1e-9), and the ranges of B's price in [0, `PRICE_SPAN`
    x its price] where `side` wins (`wins`, [low, high] each): a side with more B GPUs than
    its rival wins below a price, but the rival that wins at the lowest prices may be all-B."""

    def gap(price: float) -> float:
        best = max(repriced_bcr(r, price, b_price_now) for r in side)
        return best / max(repriced_bcr(r, price, b_price_now) for r in rivals) - 1

    top = PRICE_SPAN * b_price_now
    prices = [top * i / PRICE_STEPS for i in range(PRICE_STEPS + 1)]
    gaps = [gap(p) for p in prices]
    crossings = [
        _bisect(gap, prices[i], prices[i + 1]) for i in range(PRICE_STEPS) if (gaps[i] > 0) != (gaps[i + 1] > 0)
    ]
    edges = [0.0, *crossings, top]
    wins = [[low, high] for low, high in zip(edges, edges[1:], strict=False) if gap((low + high) / 2) > 0]
    return {"prices": crossings, "wins": wins, "span": top}


def _bisect(f: Callable[[float], float], low: float, high: float) -> float:
    """The root of `f` between `low` and `high`, where its sign changes, to 1e-9 relative."""
    f_low = f(low) > 0
    while high - low > 1e-9 * max(high, 1e-9):
        mid = (low + high) / 2
        if (f(mid) > 0) == f_low:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def verdict(rows: Sequence[Row], b_price: float, probe: Probe) -> dict[str, Any] | None:
    """Does PDD with B pay at `b_price`: its best layout against the best of every other
    family (all-A and all-B included), the BCR change and whether it is a tie (inside the
    search's resolution); B's break-even prices, re-pricing the rows: PDD's best against
    the best alternative, and the best layout with any B GPU against the best all-A one.
    None when PDD or every alternative met the SLO at no rate searched."""
    found = _found(rows)
    pdd = [r for r in found if r["family"] == "pdd"]
    others = [r for r in found if r["family"] != "pdd"]
    if not pdd or not others:
        return None
    best, rival = max(pdd, key=lambda r: r["bcr"]), max(others, key=lambda r: r["bcr"])
    change = best["bcr"] / rival["bcr"] - 1
    answer = "tie" if tie(change, probe) else ("yes" if change > 0 else "no")
    with_b = [r for r in found if r["gpus"].get("B", 0)]
    all_a = [r for r in found if not r["gpus"].get("B", 0)]
    return {
        "answer": answer,
        "bcr_change": change,
        "b_price": b_price,
        "pdd": best["layout"],
        "rival": rival["layout"],
        "rival_family": rival["family"],
        "pdd_break_even": break_even(pdd, others, b_price),
        "b_break_even": break_even(with_b, all_a, b_price) if with_b and all_a else None,
        "binding": {"pdd": best["binding"], "rival": rival["binding"]},
    }


def layout_of(row: dict[str, Any]) -> Layout:
    """The layout a row (`pdd.lab.plan.planner.row_of`) is of."""
    return Layout(
        row["prefill"], row["main"], row["relays"], row["prefill_hw"], row["main_hw"], row["line_gbps"], row["cells"]
    )


def seed_spread(
    seeds: int, found: dict[str, Any], rows: Sequence[Row], workload: Workload, setting: paper.Setting, probe: Probe
) -> list[dict[str, Any]]:
    """The verdict's two layouts probed again with each seed (the first: the search's own
    rows), their goodputs and the BCR change between them. A trace has no seed: none."""
    config = workload.config
    if config is None:
        return []
    by_name = {r["layout"]: r for r in rows}
    pair = [by_name[found["pdd"]], by_name[found["rival"]]]
    spread = [{"seed": config.seed, "pdd_rps": pair[0]["goodput_rps"], "rival_rps": pair[1]["goodput_rps"]}]
    for seed in range(config.seed + 1, config.seed + seeds):
        again_workload = replace(workload, config=replace(config, seed=seed))
        again = [
            goodput_of(layout_of(r), setting, again_workload, probe, r["capacity_rps"])["goodput_rps"] for r in pair
        ]
        spread.append({"seed": seed, "pdd_rps": again[0], "rival_rps": again[1]})
    for s in spread:
        costs = [r["cost_per_hour"] for r in pair]
        s["bcr_change"] = (s["pdd_rps"] / costs[0]) / (s["rival_rps"] / costs[1]) - 1 if s["rival_rps"] else 0.0
    return spread
