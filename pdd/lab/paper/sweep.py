"""`pdd sim sweep`: which assumption decides the comparison.

The published comparison rests on assumptions the spec does not state (its chips' figures,
their memory use, the weights' precision) and one it does (GPU B priced 20-30 % above
A). Each variant here changes one of them and searches every family's best layout
again (`pdd.lab.plan.planner`), so the answer to "PDD against same-datacenter PD" can be read
against each assumption. Prices change only the cost: the base search's simulated
layouts are re-ranked at each price without simulating again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pdd.lab.paper.compare import LINES_GBPS, MAX_GPUS, change
from pdd.lab.plan import paper
from pdd.lab.plan.planner import Probe, candidates
from pdd.lab.plan.search import search
from pdd.lab.plan.verdict import best_per_family
from pdd.lab.plan.workload import agentic
from pdd.perf.hardware import CHIPS
from pdd.perf.model import FP8

# (name, what changes): one assumption at a time, the rest as in `paper.SETTING`.
VARIANTS: tuple[tuple[str, Callable[[paper.Setting], paper.Setting]], ...] = (
    (
        "B compute as an H20 (148 TFLOPS BF16, 4.0 TB/s, 96 GB)",
        lambda s: replace(s, b=replace(CHIPS["H20"], price_per_hour=s.b.price_per_hour)),
    ),
    (
        "B compute / 3 (330 TFLOPS), bandwidth and memory as an H200",
        lambda s: replace(s, b=replace(s.b, bf16_tflops=s.b.bf16_tflops / 3, fp8_tflops=s.b.fp8_tflops / 3)),
    ),
    ("memory utilisation 85 %", lambda s: replace(s, memory_utilization=0.85)),
    ("memory utilisation 95 %", lambda s: replace(s, memory_utilization=0.95)),
    (
        "FP8 experts (1 byte a weight, FP8 matmuls)",
        lambda s: replace(s, model=s.model.with_expert_precision(FP8, True)),
    ),
)
PRICES = ((1.0, 1.2), (1.0, 1.3), (1.0, 1.0), (1.0, 1.5))  # (A, B) in GPU A hours


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    best = best_per_family(rows)
    same, pdd = best.get("pd-same-dc"), best.get("pdd")

    def of(key: str) -> tuple[float | None, float | None]:
        """(same-dc PD's, PDD's) figure, None for a family without a layout."""
        return None if same is None else same[key], None if pdd is None else pdd[key]

    return {
        "families": {
            f: {
                "layout": r["layout"],
                "goodput_rps": r["goodput_rps"],
                "cost": r["cost_per_hour"],
                "bcr": r["bcr"],
                "binding": r["binding"],
            }
            for f, r in best.items()
        },
        "pdd_vs_same_dc": {
            "goodput": change(*of("goodput_rps")),
            "cost": change(*of("cost_per_hour")),
            "bcr": change(*of("bcr")),
        },
    }


def reprice(rows: list[dict[str, Any]], setting: paper.Setting, a_price: float, b_price: float) -> list[dict]:
    """The simulated rows at other prices: the same goodputs over new costs."""
    priced = paper.with_prices(setting, a_price, b_price)
    out = []
    for r in rows:
        if not r["simulated"]:
            continue
        line = r["line_gbps"] * paper.LINE_PRICE_PER_GBPS_HOUR if r["line_gbps"] else 0.0
        cost = sum(n * priced.chip(hw).price_per_hour for hw, n in r["gpus"].items()) + line
        out.append(r | {"cost_per_hour": cost, "bcr": r["goodput_rps"] / cost})
    return out


def run_sweep(
    probe: Probe = Probe(steps=3), workers: int = 2, progress: Callable[[str], None] = lambda _msg: None
) -> dict[str, Any]:
    workload = agentic(paper.WORKLOAD)

    def searched(name: str, setting: paper.Setting) -> list[dict[str, Any]]:
        layouts = candidates(MAX_GPUS, LINES_GBPS, ("A", "B"), setting)
        return search(
            layouts,
            workload,
            probe,
            setting,
            workers,  # exact: prices re-rank every goodput
            lambda done, total, msg: progress(f"{name}: {done}/{total} {msg}"),
            exact=True,
        )

    base_rows = searched("as stated", paper.SETTING)
    result: dict[str, Any] = {"as stated": _summary(base_rows)}
    for a_price, b_price in PRICES:
        result[f"prices A {a_price:g}, B {b_price:g}"] = _summary(reprice(base_rows, paper.SETTING, a_price, b_price))
    for name, vary in VARIANTS:
        setting = vary(paper.SETTING)
        if setting.instance_gpus("A") is None or setting.instance_gpus("B") is None:
            result[name] = {"families": {}, "pdd_vs_same_dc": {}, "note": "the model does not fit"}
            continue
        result[name] = _summary(searched(name, setting)) | {
            "instance_gpus": {hw: setting.instance_gpus(hw) for hw in ("A", "B")}
        }
    return {"variants": result, "probe": {"judged_requests": probe.requests, "steps": probe.steps}}
