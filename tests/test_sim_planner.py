"""`pdd plan`: the layouts it tries stay within the budget and cover every family, its
ranking is by goodput per cost, more decode capacity never loses goodput, and the
command prints and writes what it found. Tiny searches only; no timing is asserted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdd.sim import paper
from pdd.sim.hardware import CATALOG, LINE_PRICE_PER_GBPS_HOUR
from pdd.sim.metrics import goodput
from pdd.sim.planner import (Layout, add_plan_arguments, agentic, candidates, mooncake, plan,
                             plan_main)
from pdd.sim.steps import chunk_load
from pdd.workload.agentic import AgenticConfig
from pdd.workload.mooncake import TraceRecord

SLO = (paper.SLO_TTFT_MS, paper.SLO_TPOT_MS)
# Short prompts and long answers: decode is what runs out first.
DECODE_BOUND = AgenticConfig(system_prompt_tokens=256, task_tokens=(512, 1024), turns=(2, 4),
                             tool_output_tokens=(16, 64), large_tool_output_tokens=(256, 512),
                             output_tokens=(256, 512), max_context=8192, anomalous_fraction=0.0)


@pytest.mark.parametrize("max_gpus", [16, 40, 88, 130])
def test_candidates_stay_within_the_budget_and_cover_every_family(max_gpus: int) -> None:
    lines = [10.0, 100.0]
    layouts = candidates(max_gpus, 8, lines, ["A", "B"])
    assert all(layout.instances * 8 <= max_gpus for layout in layouts)
    families = {layout.family for layout in layouts}
    assert {"same-dc-pd", "cross-dc-pd"} <= families
    assert ("pdd" in families) == (max_gpus >= 24)  # a relay needs a third instance
    for layout in layouts:
        assert 0.25 <= layout.prefill / layout.main <= 2.0
        assert (layout.line_gbps in lines) == (layout.family != "same-dc-pd")
    assert len(set(layouts)) == len(layouts)


def test_candidates_at_the_spec_scale_include_its_layouts() -> None:
    layouts = candidates(88, 8, [25.0], ["A", "B"])
    assert Layout(4, 7) in layouts
    assert Layout(4, 6, 1, "A", "B", 25.0) in layouts and Layout(5, 6, 0, "A", "B", 25.0) in layouts


def test_candidates_skip_hardware_the_model_does_not_fit() -> None:
    # 6 x 80 GB at 90 % cannot hold the 1T model's 520 GB of weights; 6 x 141 GB can.
    layouts = candidates(40, 6, [25.0], ["A", "B"])
    assert layouts and all(layout.prefill_hw == layout.main_hw == "B" for layout in layouts)
    with pytest.raises(ValueError, match="catalog"):
        candidates(88, 8, [25.0], ["A", "H100"])


def test_a_layout_places_roles_and_bills_the_line_only_across_sites() -> None:
    pdd = Layout(4, 4, 1, "A", "B", 25.0).spec()
    assert [(r.role, r.dc, r.count, r.hardware) for r in pdd.roles] == [
        ("prefill", "A", 4, "A"), ("relay", "A", 1, "A"), ("main", "B", 4, "B")]
    assert paper.bill(pdd).per_hour == pytest.approx(40 * CATALOG["A"].price_per_hour
                                                     + 32 * CATALOG["B"].price_per_hour
                                                     + 25 * LINE_PRICE_PER_GBPS_HOUR)
    same = Layout(4, 7).spec()
    assert {r.dc for r in same.roles} == {"A"} and paper.bill(same).per_hour == 88 * CATALOG["A"].price_per_hour
    with pytest.raises(ValueError):
        Layout(4, 7, relays=1)


def test_goodput_search_finds_the_threshold_on_a_log_scale() -> None:
    tried: list[float] = []

    def under(limit: float):
        def attainment(rate: float) -> float:
            tried.append(rate)
            return 1.0 if rate <= limit else 0.0
        return attainment

    found = goodput(under(10.0), 1.0, 64.0, 6)
    assert 10.0 / 64 ** (1 / 64) <= found <= 10.0 and len(tried) == 6  # the ends are not run
    assert 1.0 not in tried and 64.0 not in tried
    assert goodput(under(100.0), 1.0, 64.0, 4) == 64.0
    assert goodput(under(0.5), 1.0, 64.0, 4) == 0.0
    assert goodput(under(1.0), 1.0, 64.0, 4) == 1.0


def test_plan_ranks_by_goodput_per_cost() -> None:
    layouts = [Layout(1, 1), Layout(1, 2), Layout(1, 1, 0, "A", "B", 100.0)]
    rows = plan(agentic(DECODE_BOUND), SLO, layouts, 120, 1.0, 64.0, steps=2, warmup_s=10.0)
    assert len(rows) == 3
    assert [r["bcr"] for r in rows] == sorted((r["bcr"] for r in rows), reverse=True)
    for r in rows:
        assert r["bcr"] == pytest.approx(r["goodput_rps"] / r["cost_per_hour"])
        assert r["goodput_rps"] > 0 and r["ttft_p50_ms"] is not None
    cross = next(r for r in rows if r["family"] == "cross-dc-pd")
    assert cross["cost_per_hour"] == pytest.approx(8 + 8 * CATALOG["B"].price_per_hour
                                                   + 100 * LINE_PRICE_PER_GBPS_HOUR)


def test_more_decode_instances_never_lose_goodput() -> None:
    # A TPOT budget of 1.2 lone decode steps: a batch of more than a few dozen misses it.
    tpot_ms = 1.2 * 1000 * Layout(1, 1).spec().roles[1].steps.step_s(chunk_load(4096, 1))
    seen = []
    rows = plan(agentic(DECODE_BOUND), (paper.SLO_TTFT_MS, tpot_ms), [Layout(1, 1), Layout(1, 2)], 150, 1.0,
                64.0, progress=lambda done, msg: seen.append(done), steps=3, warmup_s=15.0)
    one, two = (next(r for r in rows if r["main"] == n) for n in (1, 2))
    assert not one["at_ceiling"]  # else the check below says nothing
    assert two["goodput_rps"] >= one["goodput_rps"]
    assert seen[-1] == 2 and seen == sorted(seen)


def test_a_trace_is_replayed_at_the_probed_rate() -> None:
    records = [TraceRecord(1000 * i, 1024, 16, (i, i + 1)) for i in range(10)]
    workload = mooncake(records)
    sessions = workload.sessions(4.0, 100.0)
    assert workload.turns == 1.0 and workload.block_tokens == 512 and workload.longest_output == 16
    assert len(sessions) / sessions[-1].start_s == pytest.approx(4.0)
    assert len(workload.sessions(4.0, 1.0)) == 4  # those arriving in the first second
    with pytest.raises(ValueError, match="timestamps"):
        mooncake(records[:1])


def test_plan_main_prints_the_best_and_writes_every_layout(tmp_path: Path, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    out = tmp_path / "plan.json"
    args = parser.parse_args(["--max-gpus", "16", "--line-gbps", "100", "--hardware", "A", "--requests", "20",
                              "--warmup-s", "5", "--rps", "0.5,2", "--steps", "1", "--top", "1", "--out", str(out),
                              "--quiet"])
    assert plan_main(args) == 0
    printed = capsys.readouterr().out
    assert "pdd plan" in printed and "Assumptions" in printed and "paper-1t" in printed
    report = json.loads(out.read_text())
    assert {r["family"] for r in report["layouts"]} == {"same-dc-pd", "cross-dc-pd"}
    assert report["assumptions"]["line"]["price_per_gbps_hour"] == LINE_PRICE_PER_GBPS_HOUR
    assert plan_main(parser.parse_args(["--rps", "5,1"])) == 2
