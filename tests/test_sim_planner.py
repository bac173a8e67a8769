"""`pdd plan`: the layouts it tries spend the budget and cover every family, each family
is ranked by the best layout it simulated, pruning spares the simulation, more decode
capacity never loses goodput, and the command prints and writes what it found. Tiny
searches only; no timing is asserted."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from pdd.lab.plan import paper, planner
from pdd.lab.plan.args import add_plan_arguments
from pdd.lab.plan.command import _prepare, plan_main
from pdd.lab.plan.planner import (
    FAMILIES,
    Layout,
    Probe,
    candidates,
    search_resolution,
    tie,
)
from pdd.lab.plan.published import published
from pdd.lab.plan.report import assumption_line
from pdd.lab.plan.search import search
from pdd.lab.plan.verdict import best_per_family
from pdd.lab.plan.workload import agentic, mooncake
from pdd.lab.sim.metrics import goodput
from pdd.lab.workload.agentic import AgenticConfig
from pdd.lab.workload.mooncake import TraceRecord
from pdd.perf.hardware import CATALOG, LINE_PRICE_PER_GBPS_HOUR

# Short prompts and long answers: quick to simulate, and decode is what runs out first.
SMALL = AgenticConfig(
    system_prompt_tokens=256,
    task_tokens=(512, 1024),
    turns=(2, 4),
    tool_output_tokens=(16, 64),
    large_tool_output_tokens=(256, 512),
    output_tokens=(128, 256),
    max_context=8192,
    anomalous_fraction=0.0,
)
# `pdd plan`'s options for a search small enough for a test: 24 GPUs of B, the paper
# setting's layout (its rho is the one the tests know), one-step bisections of 20 requests.
TINY_PLAN = ["--max-gpus", "24", "--chips", "B", "--attention", "tp-dcp", "--line-gbps", "100", "--requests", "20"]
TINY_PLAN += ["--warmup-s", "5", "--min-window-s", "0", "--steps", "1", "--workers", "1"]
# A tight TPOT target: the decode side's capacity, a few requests a second, decides.
TINY_PROBE = Probe(requests=40, warmup_s=5.0, slo=(paper.SLO_TTFT_MS, 15.0), steps=2, min_window_s=0.0)


@pytest.mark.parametrize("max_gpus", [32, 48, 88, 130])
def test_candidates_spend_the_budget_and_cover_every_family(max_gpus: int) -> None:
    lines = [10.0, 100.0]
    layouts = candidates(max_gpus, lines, ["A", "B"])
    size = {hw: paper.SETTING.instance_gpus(hw) for hw in "AB"}
    for layout in layouts:
        used = layout.gpus()
        smallest = min(size[layout.prefill_hw], size[layout.main_hw])
        assert used <= max_gpus < used + smallest, layout  # no further instance of its kinds would fit
        assert (layout.line_gbps in lines) == (layout.family not in ("pd-same-dc", "pd-same-dc-b"))
    families = {layout.family for layout in layouts}
    assert {"pd-same-dc", "pd-same-dc-b", "pd-cross-dc"} <= families
    assert ("pdd" in families) == (max_gpus >= 2 * size["A"] + size["B"])  # a relay is a third instance
    assert len(set(layouts)) == len(layouts)


def test_candidates_at_the_spec_scale_include_its_layouts() -> None:
    layouts = candidates(88, [25.0], ["A", "B"])
    assert Layout(2, 3) in layouts  # 80 GPU A: 5 instances of 16
    assert Layout(2, 5, 1, "A", "B", 25.0) in layouts and Layout(3, 5, 0, "A", "B", 25.0) in layouts
    with pytest.raises(ValueError, match="A or B"):
        candidates(88, [25.0], ["A", "H100"])


def test_a_layout_places_roles_and_bills_the_line_only_across_sites() -> None:
    pdd = Layout(2, 4, 1, "A", "B", 25.0).spec()
    assert [(r.role, r.dc, r.count, r.hardware, r.gpus) for r in pdd.roles] == [
        ("prefill", "A", 2, "A", 16),
        ("relay", "A", 1, "A", 16),
        ("main", "B", 4, "B", 8),
    ]
    assert paper.bill(pdd).per_hour == pytest.approx(
        48 * CATALOG["A"].price_per_hour + 32 * CATALOG["B"].price_per_hour + 25 * LINE_PRICE_PER_GBPS_HOUR
    )
    same = Layout(2, 3).spec()
    assert {r.dc for r in same.roles} == {"A"} and paper.bill(same).per_hour == 80 * CATALOG["A"].price_per_hour
    with pytest.raises(ValueError):
        Layout(4, 7, relays=1)


def test_a_layout_of_cells_is_its_cells_together_each_on_its_share_of_the_line() -> None:
    cell, cells = Layout(2, 4, 1, "A", "B", 25.0), Layout(2, 4, 1, "A", "B", 75.0, cells=3)
    assert cells.spec() == cell.spec()  # one cell, on a third of the line
    assert cells.gpus() == 3 * cell.gpus() and cells.name == f"3 x {Layout(2, 4, 1, 'A', 'B', 75.0).name}"
    assert cells.bill().per_hour == pytest.approx(3 * cell.bill().per_hour)
    assert cells.bill().gpus == {hw: 3 * n for hw, n in cell.bill().gpus.items()}
    shape = agentic(SMALL).shape()
    assert planner.capacity_of(cells, paper.SETTING, agentic(SMALL), shape, TINY_PROBE) == pytest.approx(
        3 * planner.capacity_of(cell, paper.SETTING, agentic(SMALL), shape, TINY_PROBE)
    )
    with pytest.raises(ValueError, match="one cell"):
        Layout(2, 4, cells=0)


def test_a_budget_past_the_cell_size_is_planned_in_cells_within_it() -> None:
    assert [planner.cells_for(gpus, 128) for gpus in (88, 128, 129, 1000)] == [1, 1, 2, 8]
    assert planner.cells_for(1000, 0) == 1
    layouts = candidates(1000, [100.0], ["A", "B"], cells=8)
    assert layouts and {lay.cells for lay in layouts} == {8}
    assert max(lay.gpus() for lay in layouts) <= 1000
    assert {replace(lay, cells=1, line_gbps=lay.line_gbps / 8) for lay in layouts} == set(
        candidates(125, [12.5], ["A", "B"])
    )


def test_a_layout_of_cells_simulates_one_cell_at_its_share_of_the_rate() -> None:
    """Exact for the deployment it names: each cell its own router and sessions."""
    workload, cell = agentic(SMALL), Layout(1, 1, 1, "A", "B", 25.0)
    capacity = planner.capacity_of(cell, paper.SETTING, workload, workload.shape(), TINY_PROBE)
    one = planner.goodput_of(cell, paper.SETTING, workload, TINY_PROBE, capacity)
    two = planner.goodput_of(replace(cell, line_gbps=50.0, cells=2), paper.SETTING, workload, TINY_PROBE, 2 * capacity)
    assert one["goodput_rps"] and two["goodput_rps"] == pytest.approx(2 * one["goodput_rps"])
    assert two["run"] == one["run"] and two["probes"] == one["probes"]
    assert two["judged_rps"] == pytest.approx(2 * one["judged_rps"])
    assert two["bcr"] == pytest.approx(one["bcr"])


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
    assert goodput(lambda r: 0.95 if r < 10 else 0.5, 1.0, 64.0, 6, attainment=0.99) == 0.0


def _layouts() -> list[Layout]:
    return [lay for lay in candidates(48, [100.0], ["A", "B"]) if lay.family in ("pd-same-dc-b", "pd-cross-dc")]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    """Every simulated layout's goodput (`exact`)."""
    return search(_layouts(), agentic(SMALL), TINY_PROBE, workers=1, exact=True)


@pytest.fixture(scope="module")
def decided() -> list[dict]:
    """The default search: a layout is probed first at the rate that would beat its family's best."""
    return search(_layouts(), agentic(SMALL), TINY_PROBE, workers=1)


def test_each_family_is_ranked_by_the_best_layout_it_simulated(rows: list[dict]) -> None:
    """The fair comparison: no family is represented by a layout worse than another of
    its own that was simulated, and the ranking is by goodput per cost."""
    import random

    shuffled = random.Random(0).sample(rows, len(rows))  # whatever order the rows come in
    best = best_per_family(shuffled)
    assert best == best_per_family(rows[::-1])
    assert set(best) == {"pd-same-dc-b", "pd-cross-dc"}
    for family, chosen in best.items():
        simulated = [r for r in rows if r["family"] == family and r["simulated"]]
        assert len(simulated) >= 2 or any(not r["simulated"] for r in rows if r["family"] == family)
        assert chosen["bcr"] == max(r["bcr"] for r in simulated)
    assert [r["bcr"] for r in rows] == sorted((r["bcr"] for r in rows), reverse=True)
    for r in rows:
        assert r["bcr"] == pytest.approx(r["goodput_rps"] / r["cost_per_hour"])
        if r["simulated"]:
            assert r["goodput_rps"] > 0 and r["binding"] != "-" and r["utilisation"]


def test_pruned_layouts_could_not_have_won(rows: list[dict]) -> None:
    from pdd.lab.plan.planner import HEADROOM

    best = best_per_family(rows)
    for r in rows:
        if not r["simulated"]:
            assert HEADROOM * r["capacity_rps"] / r["cost_per_hour"] < best[r["family"]]["bcr"], r


def test_a_layout_shown_not_to_win_could_not_have_won(rows: list[dict], decided: list[dict]) -> None:
    """The default search finds each family's best as the exact one does (to the
    bisection's resolution); a layout it left with a bound only has, searched exactly,
    no better BCR than that best, and was probed at its family's best's probed rate per cost."""
    resolution = search_resolution(TINY_PROBE)
    exact_best, best = best_per_family(rows), best_per_family(decided)
    assert set(best) == set(exact_best)
    exact = {r["layout"]: r for r in rows}
    bounded = [r for r in decided if r["simulated"] and r["goodput_rps"] is None]
    assert bounded, "no layout was decided by one probe: the test would not exercise it"
    for family, chosen in best.items():
        assert chosen["bcr"] == pytest.approx(exact_best[family]["bcr"], rel=resolution)
    for r in bounded:
        assert r["missed_rps"] == pytest.approx(
            best[r["family"]]["probed_rps"] * r["cost_per_hour"] / best[r["family"]]["cost_per_hour"], rel=resolution
        ), r
        assert exact[r["layout"]]["bcr"] <= best[r["family"]]["bcr"] * (1 + resolution), (r, exact[r["layout"]])


def _rising(layout: Layout, setting, workload, probe, capacity: float, beat_rps: float | None) -> dict:
    """A stand-in for `goodput_of`: each layout later in its family's queue (lower
    capacity per cost) beats the one before, by little (none is pruned); the row keeps the
    rate it was probed at first."""
    import time

    time.sleep(0.2)  # long enough for the other worker to be free meanwhile
    cost = paper.bill(layout.spec(setting), setting).per_hour
    rps = (0.1 - 0.01 * capacity / cost) * cost
    return {
        "layout": layout.name,
        "family": layout.family,
        "cost_per_hour": cost,
        "goodput_rps": rps,
        "bcr": rps / cost,
        "probed_rps": rps,
        "simulated": True,
        "missed_rps": None,
        "beat_rps": beat_rps,
        "probes": 1,
    }


def test_the_search_is_the_same_whatever_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a layout is probed at depends on its family's earlier layouts only, not on
    which process finished first: two workers give the rows one gives."""
    from pdd.lab.plan import search as plan_search

    monkeypatch.setattr(plan_search, "goodput_of", _rising)
    layouts = [lay for lay in candidates(88, [100.0], ["A", "B"]) if lay.family == "pd-same-dc-b"][:4]
    one, two = (search(layouts, agentic(SMALL), TINY_PROBE, workers=n) for n in (1, 2))
    assert [r["beat_rps"] for r in one].count(None) == 1  # every layout after the first was probed to beat one
    assert one == two


def test_searches_on_one_pool_give_each_its_own_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's search and the publication's layouts share the workers (`run`): each
    search's rows are those it gives alone, whatever the other's layouts finish first."""
    from pdd.lab.plan import search as plan_search

    monkeypatch.setattr(plan_search, "goodput_of", _rising)
    layouts = candidates(88, [100.0], ["A", "B"])
    mine = [lay for lay in layouts if lay.family == "pd-same-dc-b"][:3]
    theirs = [lay for lay in layouts if lay.family == "pd-same-dc"][:3]
    alone = [search(mine, agentic(SMALL), TINY_PROBE, workers=1), search(theirs, agentic(SMALL), TINY_PROBE, workers=1)]
    shared = plan_search.run(
        [plan_search.Search(mine, agentic(SMALL), TINY_PROBE), plan_search.Search(theirs, agentic(SMALL), TINY_PROBE)],
        workers=2,
    )
    assert shared == alone
    assert {r["family"] for r in shared[0]} == {"pd-same-dc-b"} and [r["beat_rps"] for r in shared[0]].count(None) == 1


def test_only_each_familys_contenders_by_the_screen_are_simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """`contenders=K`: each family's first K layouts by the analytic screen (capacity per
    cost) are simulated, every family keeps at least one, and the rest are rows marked
    screened out, with their capacity and no goodput."""
    from pdd.lab.plan import planner
    from pdd.lab.plan import search as plan_search

    monkeypatch.setattr(plan_search, "goodput_of", _rising)
    monkeypatch.setattr("time.sleep", lambda _s: None)
    layouts = candidates(88, [25.0, 100.0], ["A", "B"])
    shape, cost = agentic(SMALL).shape(), {}
    screen = {}
    for lay in layouts:
        cost[lay.name] = lay.bill().per_hour
        screen[lay.name] = planner.capacity_of(lay, paper.SETTING, agentic(SMALL), shape, TINY_PROBE)
    for k in (1, 2):
        rows = search(layouts, agentic(SMALL), TINY_PROBE, workers=1, contenders=k)
        assert len(rows) == len(layouts)
        for family in {lay.family for lay in layouts}:
            mine = sorted((lay.name for lay in layouts if lay.family == family), key=lambda n: -screen[n] / cost[n])
            simulated = {r["layout"] for r in rows if r["family"] == family and r["simulated"]}
            assert simulated == set(mine[:k]), (family, k)
            cut = [r for r in rows if r["family"] == family and r["layout"] not in simulated]
            assert all(r["screened_out"] and r["goodput_rps"] == 0.0 and r["capacity_rps"] > 0 for r in cut)
            assert len(cut) == len(mine) - k
    everything = search(layouts, agentic(SMALL), TINY_PROBE, workers=1)
    assert all(r["simulated"] for r in everything)


def test_a_rate_is_probed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bisection that comes back to a rate (the ends, a bracket widened downwards)
    reuses its run: the simulation is deterministic."""
    from pdd.lab.sim import runner

    probed: list[float] = []

    def run_window(spec, sessions, rate, *args, **kwargs):
        probed.append(rate)
        return {"slo_attainment": 1.0 if rate <= 3.0 else 0.0, "offered_rps": rate}

    monkeypatch.setattr(runner, "run_window", run_window)
    runs: dict = {}
    first = runner.find_goodput(None, None, (0, 0), runner.Window(0, 1, 0), 1.0, 64.0, steps=4, runs=runs)
    again = runner.find_goodput(None, None, (0, 0), runner.Window(0, 1, 0), 1.0, 64.0, steps=4, runs=runs)
    assert first == again and first["offered_rps"] <= 3.0
    assert len(probed) == len(set(probed)) == len(runs)


@pytest.mark.parametrize("threshold_x", [0.5, 1.6])
def test_the_probe_at_the_beating_rate_decides(monkeypatch: pytest.MonkeyPatch, threshold_x: float) -> None:
    """A layout that misses the SLO at the rate that would beat its family's best gets a
    bound from that one probe; one that meets it is searched upwards and gets its goodput,
    at least that rate and within the bisection's resolution of its threshold. The goodput
    is the rate probed, not what the window judged (here a tenth more: closed-loop
    sessions whose turns end sooner than nominal)."""
    from pdd.lab.plan import planner
    from pdd.lab.sim import runner

    workload, beat_rps = agentic(SMALL), 6.0
    threshold_rps = threshold_x * beat_rps

    def run_window(spec, sessions, rate, *args, **kwargs):
        rps = rate * workload.turns
        return {
            "slo_attainment": 1.0 if rps <= threshold_rps else 0.0,
            "offered_rps": 1.1 * rps,
            "ttft_ms": {},
            "utilisation": {},
            "binding": "-",
            "session_rate": rate,
        }

    monkeypatch.setattr(runner, "run_window", run_window)
    monkeypatch.setattr(planner, "run_window", run_window)
    row = planner.goodput_of(Layout(1, 1, 0, "B", "B"), paper.SETTING, workload, TINY_PROBE, 8.0, beat_rps)
    if threshold_rps < beat_rps:
        assert row["goodput_rps"] is None and row["missed_rps"] == beat_rps and row["probes"] == 1
    else:
        assert beat_rps <= row["goodput_rps"] <= threshold_rps
        assert row["goodput_rps"] >= threshold_rps / (1 + search_resolution(TINY_PROBE))
        assert row["missed_rps"] is None and row["probed_rps"] == pytest.approx(row["goodput_rps"])
        assert row["judged_rps"] == pytest.approx(1.1 * row["goodput_rps"])


def test_a_probe_lost_in_its_tail_stops_there() -> None:
    """A window too short for the early stop inside it (two checks) is judged in its
    tail: once the certain misses exceed what the attainment allows, the verdict cannot
    change, and the run stops with the one it would have reached."""
    from dataclasses import replace

    from pdd.lab.sim.runner import CHECK_S, Window, run_window, tail_s

    workload, slo = agentic(SMALL), TINY_PROBE.slo
    spec = replace(Layout(1, 1, 0, "B", "B").spec(), block_tokens=workload.block_tokens)
    window = Window(5.0, 5.0 + 1.5 * CHECK_S, tail_s(workload.longest_output, slo))
    stopped, whole = (
        run_window(spec, workload.sessions(), 30.0 / workload.turns, window, slo, stop_early=stop)
        for stop in (True, False)
    )
    assert whole["slo_attainment"] < TINY_PROBE.attainment and not whole["stopped_early"]
    assert stopped["stopped_early"] and stopped["slo_attainment"] < TINY_PROBE.attainment
    assert stopped["events"] < whole["events"]
    assert stopped["offered_rps"] == pytest.approx(whole["offered_rps"])


def test_more_decode_instances_never_lose_goodput() -> None:
    probe = Probe(requests=60, warmup_s=5.0, slo=(paper.SLO_TTFT_MS, 12.0), steps=3, min_window_s=0.0)
    rows = search([Layout(1, 1, 0, "B", "B"), Layout(1, 2, 0, "B", "B")], agentic(SMALL), probe, workers=1, exact=True)
    one, two = (next(r for r in rows if r["main"] == n) for n in (1, 2))
    assert one["goodput_rps"] > 0
    assert two["goodput_rps"] >= one["goodput_rps"]


def test_each_probe_replays_the_head_of_one_draw() -> None:
    """Sessions are drawn once, at a unit rate, as far as the largest probe needs (and on
    from there when a later one needs more): each probe's sessions are
    `plan_session_shapes`' at its rate, those that start before its end."""
    from pdd.lab.sim import runner
    from pdd.lab.workload.agentic import plan_session_shapes

    config = replace(SMALL, seed=SMALL.seed + 1)  # a config no other test has drawn
    runner.draw_ahead(config, 2.0, 100.0)
    held = len(runner._DRAWN[config].sessions)
    for rate, until_s in ((2.0, 50.0), (0.5, 300.0), (4.0, 3 * runner.history_s(config))):
        drawn = runner._drawn(config, rate, until_s)
        planned = plan_session_shapes(config, 4 * sum(len(s.turns) for s in drawn), rate)
        assert drawn == [s for s in planned if s.start_s < until_s]
    assert len(runner._DRAWN[config].sessions) > held  # the last drew on past the first draw


def test_a_trace_is_replayed_at_the_probed_rate() -> None:
    records = [TraceRecord(1000 * i, 1024, 16, (i, i + 1)) for i in range(10)]
    workload = mooncake(records)
    sessions = workload.sessions()(4.0, 100.0)
    assert workload.turns == 1.0 and workload.block_tokens == 512 and workload.longest_output == 16
    assert len(sessions) / sessions[-1].start_s == pytest.approx(4.0)
    assert len(workload.sessions()(4.0, 1.0)) == 4  # those arriving in the first second
    with pytest.raises(ValueError, match="timestamps"):
        mooncake(records[:1])


def test_plan_main_prints_the_best_and_writes_every_layout(tmp_path: Path, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    out = tmp_path / "plan.json"
    args = parser.parse_args([*TINY_PLAN, "--top", "2", "--no-published", "--out", str(out), "--quiet"])
    assert plan_main(args) == 0
    printed = capsys.readouterr().out
    assert "pdd plan" in printed and "each family's best" in printed and "Assumptions" in printed
    assert "Head to head" not in printed and "the publication's" not in printed  # (--no-published)
    rho = paper.rho(_prepare(parser.parse_args(["--attention", "tp-dcp"])).setting)
    assert (
        f"What the verdict rests on: rho = {rho.rho:.2f}" in printed
        and f"below {rho.break_even_b_price:.2f} a" in printed
    )
    report = json.loads(out.read_text())
    assert report["rho"]["break_even_b_price"] == pytest.approx(1.25 * report["rho"]["rho"])
    assert {r["family"] for r in report["layouts"]} <= set(FAMILIES)
    assert report["assumptions"]["line_price_per_gbps_hour"] == LINE_PRICE_PER_GBPS_HOUR
    assert plan_main(parser.parse_args(["--attainment", "1.5"])) == 2


def test_plan_shapes_the_agentic_workload_by_its_options_and_refuses_them_for_a_trace(capsys) -> None:

    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    workload = _prepare(parser.parse_args(["--tool-time-s", "5,30", "--task-tokens", "56000,60000"])).workload
    assert workload.config is not None and workload.config.tool_time_s == (5.0, 30.0)
    assert workload.config.task_tokens == (56000, 60000)
    assert workload.name == "agentic, tasks of 56,000-60,000 tokens, 5-30 s of tool time between turns"
    args = parser.parse_args(["--workload", "mooncake:trace.jsonl", "--tool-time-s", "1,2"])
    assert plan_main(args) == 2
    assert "shape the agentic workload, not a trace" in capsys.readouterr().err
    assert plan_main(parser.parse_args(["--task-tokens", "70000,80000"])) == 2
    assert "cannot hold a first turn" in capsys.readouterr().err


def test_rho_is_bs_decode_for_its_price_against_as_and_moves_with_bs_price_and_memory() -> None:
    """ρ (`pdd.perf.decode`): the catalog's pair decodes alike for its price (ρ = 0.98, both
    bound by KV memory, so B's 25 % dearer GPU buys 25 % less); B at A's price decodes
    cheaper (ρ x 1.25); with twice the memory, too, until the TPOT target binds (ρ 1.07);
    the batch never breaks the TPOT target."""
    base = paper.rho()
    assert base is not None and 0.95 < base.rho < 1.0 and base.a.bound == base.b.bound == "kv"
    assert base.b.step_s <= 0.050 and base.a.step_s <= 0.050
    cheap = paper.rho(replace(paper.SETTING, b=replace(paper.SETTING.b, price_per_hour=1.0)))
    assert cheap is not None and cheap.rho == pytest.approx(base.rho * 1.25)
    roomy = paper.rho(replace(paper.SETTING, b=replace(paper.SETTING.b, mem_gb=2 * paper.SETTING.b.mem_gb)))
    assert roomy is not None and roomy.rho > 1.0 and roomy.b.bound == "tpot"  # (then the TPOT target binds)
    tight = paper.rho(tpot_ms=10.0)
    assert tight is None or tight.b.bound == "tpot"


def test_each_attention_layout_holds_what_serving_holds_and_moves_rho() -> None:
    """The three layouts serving names (`AttentionLayout`): under `dp-ep` every GPU holds
    the dense weights (23 GB of the spec's model), so an instance keeps (GPUs - 1) copies'
    less room for KV and each GPU reads its whole copy in a step; under `tp` every rank
    keeps the whole MLA latent (16 copies on A's 16 GPUs) and reads it; `tp-dcp` (the
    paper setting's) splits it, one copy. ρ: 0.98 split, 1.66 under dp-ep, 2.43 under tp."""
    from pdd.names import AttentionLayout as L
    from pdd.perf.physics import kv_capacity_tokens
    from pdd.perf.steps import StepLoad

    m, split = paper.SETTING.model, paper.SETTING
    dp, tp = replace(split, attention=L.DP_EP), replace(split, attention=L.TP)
    assert split.attention == L.TP_DCP
    dense = (m.dense_params + m.embedding_params) * m.dense_bytes_per_param
    assert 23e9 < dense < 23.2e9
    for hw in ("A", "B"):
        gpus = split.instance_gpus(hw)
        assert dp.instance_gpus(hw) == gpus
        lost = split.kv_capacity_tokens(hw, gpus) - dp.kv_capacity_tokens(hw, gpus)
        assert lost == pytest.approx((gpus - 1) * dense / m.kv_bytes_per_token, abs=1)
        assert dp.kv_capacity_tokens(hw, gpus) == kv_capacity_tokens(dp.chip(hw), m, gpus, 0.9, L.DP_EP)
        assert tp.kv_capacity_tokens(hw, gpus) == pytest.approx(split.kv_capacity_tokens(hw, gpus) / gpus, abs=1)
        one = StepLoad(seqs=1, new_tokens=1, attn_pairs=1, kv_read_tokens=1)
        tp_s, dp_s = split.physics(hw, gpus).parts(one)["dense"], dp.physics(hw, gpus).parts(one)["dense"]
        assert dp_s == pytest.approx(gpus * tp_s)  # a small batch is bound by reading them
        long = StepLoad(seqs=1, new_tokens=1, attn_pairs=1, kv_read_tokens=60000)
        read = tp.physics(hw, gpus).parts(long)["attention"] / split.physics(hw, gpus).parts(long)["attention"]
        assert read == pytest.approx(gpus)  # each rank reads its own copy of the latent
    rhos = [paper.rho(setting) for setting in (split, dp, tp)]
    assert [round(r.rho, 2) for r in rhos if r] == [0.98, 1.66, 2.43]
    assert all(r is not None and r.a.bound == r.b.bound == "kv" for r in rhos)


def test_the_plan_offers_only_layouts_serving_runs_and_names_each_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pdd plan` searches each side's layout and instance size among those serving runs
    (all three; one serving could not run only when named, and marked), and says which it took."""
    from pdd.lab.plan.layouts import SERVED
    from pdd.names import AttentionLayout as L

    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    plan = _prepare(parser.parse_args([]))
    served = {str(a) for a in L if SERVED[a] is None}
    assert {o["attention"] for o in plan.sides} == served == {"tp", "tp-dcp", "dp-ep"}
    assert {(r.side, r.hw) for r in plan.setting.roles} == {
        (s, hw) for s in ("prefill", "decode", "relay") for hw in "AB"
    }
    for r in plan.setting.roles:
        assert str(r.attention) in served
        options = [o for o in plan.sides if (o["side"], o["hw"]) == (r.side.replace("relay", "decode"), r.hw)]
        assert max(o["gpus"] for o in options) > min(o["gpus"] for o in options)  # sizes searched
        if r.side == "decode":
            picked = next(o for o in options if r.side in o["chosen"])
            assert picked["per_price"] >= 0.95 * max(o["per_price"] for o in options)
    line = assumption_line(Probe(), agentic(), plan.setting)
    for r in plan.setting.roles:
        if r.side != "relay":
            assert f"{r.side} {r.gpus} GPUs {r.attention}" in line, line
    prefill = [o for o in plan.sides if (o["side"], o["hw"]) == ("prefill", "A")]
    picked = next(o for o in prefill if o["chosen"])  # (its rate ties: the most room for its prefix cache)
    assert picked["kv_tokens"] == max(o["kv_tokens"] for o in prefill if o["gpus"] == picked["gpus"])
    from rich.console import Console

    from pdd.lab.plan.report import sides_table

    console = Console(width=160, record=True)
    console.print(sides_table(plan.sides))
    text = console.export_text()  # the prefill layouts' rates tie: the table says so
    assert text.count("chosen: prefill") == 2 and "tie" in text and "chosen: relay" in text
    monkeypatch.setitem(SERVED, L.TP_DCP, "not in this build")
    assert "tp-dcp" not in {o["attention"] for o in _prepare(parser.parse_args([])).sides}
    named = _prepare(parser.parse_args(["--attention", "tp-dcp"]))
    assert {str(r.attention) for r in named.setting.roles} == {"tp-dcp"}
    assert all(not o["served"] and o["why_not_served"] == "not in this build" for o in named.sides)


def test_a_change_inside_the_searchs_resolution_is_a_tie() -> None:
    """Each goodput is known to one bisection step (9.7 % at the default four steps), so a
    verdict calls a smaller change of goodput or BCR, either way, a tie, and says so."""
    from pdd.lab.plan.report import judged
    from pdd.lab.plan.report import versus_line as _versus_line

    probe = Probe()
    step = search_resolution(probe)
    assert 0.09 < step < 0.1
    assert tie(0.05, probe) and tie(step * 0.99, probe) and tie(-step / (1 + step) * 0.99, probe)
    assert not tie(step * 1.01, probe) and not tie(-step / (1 + step) * 1.01, probe) and not tie(None, probe)
    assert judged(-0.035, probe) == "-3.5% (a tie: inside the search's 10%)"
    assert judged(-0.132, probe) == "-13.2%" and judged(0.05, probe, short=True) == "+5.0% (tie)"
    assert tie(0.05, Probe(steps=1)) and not tie(0.05, Probe(steps=8))  # (finer searches tell more apart)
    versus = {
        "goodput_change": -0.035,
        "cost_change": 0.113,
        "their_cost_change": -0.057,
        "bcr_change": -0.132,
        "bcr_change_their_costs": 0.023,
        "flip_goodput_rps": 24.9,
        "flip_b_price": 0.88,
        "b_price": 1.25,
        "published": {"goodput_change": 0.278, "cost_change": [-0.071, -0.035], "bcr_change": 0.375},
    }
    line = _versus_line(versus, probe)
    assert "goodput -3.5% (tie)" in line and "BCR -13.2% (+2.3% (tie) at" in line, line
    assert line.endswith("(A tie: inside the search's 10%.)")
    assert not _versus_line(versus | {"goodput_change": 0.2, "bcr_change_their_costs": 0.5}, probe).endswith(".)")


def test_the_published_layouts_are_evaluated_as_given_head_to_head(tmp_path: Path, capsys) -> None:
    """`pdd plan` (by default): the publication's layouts, as near as whole instances come
    (same-dc PD on 80 GPU A; PDD on 48 A + 32 B with one relay; cross-dc PD on the same;
    between them, that P and D in one site), each evaluated as given; PDD against same-dc
    PD by our accounting and by the publication's (its GPU counts at their prices); and
    the step from one to the other a change at a time, each against the step before."""
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    out = tmp_path / "plan.json"
    args = parser.parse_args([*TINY_PLAN, "--out", str(out), "--quiet"])
    assert plan_main(args) == 0
    printed = capsys.readouterr().out
    assert "the publication's layouts, as given" in printed and "Head to head" in printed
    assert [lay.gpus() for lay in published(100.0)] == [80, 80, 80, 80]
    assert [lay.family for lay in published(100.0)] == ["pd-same-dc", "pd-same-dc-ab", "pd-cross-dc", "pdd"]
    assert "one change at a time" in printed
    report = json.loads(out.read_text())
    steps = {s["step"]: s for s in report["breakdown"]}
    assert list(steps) == ["D on B, same site", "D across the line", "a relay beside P"]
    costs = {r["family"]: r["cost_per_hour"] for r in report["published_layouts"]}
    assert steps["D on B, same site"]["cost_change"] == pytest.approx(costs["pd-same-dc-ab"] / costs["pd-same-dc"] - 1)
    assert steps["a relay beside P"]["cost_change"] == pytest.approx(costs["pdd"] / costs["pd-cross-dc"] - 1)
    versus = report["published"]
    if versus is not None:  # (a layout may miss the SLO at every rate so short a probe tries)
        assert versus["their_cost_change"] == pytest.approx((43 + 32 * 1.25) / 88 - 1)
        assert versus["bcr_change"] == pytest.approx((1 + versus["goodput_change"]) / (1 + versus["cost_change"]) - 1)
        # what would flip it: at that goodput, or at that price of B, the two BCRs are equal
        rows = {r["family"]: r for r in report["published_layouts"]}
        pd, pdd = rows["pd-same-dc"], rows["pdd"]
        assert versus["flip_goodput_rps"] / pdd["cost_per_hour"] == pytest.approx(pd["bcr"])
        b = pdd["gpus"]["B"]
        at_flip = pdd["cost_per_hour"] + b * (versus["flip_b_price"] - versus["b_price"])
        assert pdd["goodput_rps"] / at_flip == pytest.approx(pd["bcr"])
        assert "The BCRs would be equal at a PDD goodput of" in " ".join(printed.split())  # (as rich wraps it)


def test_each_familys_cheapest_layout_at_a_target_load(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`pdd plan --target-rps`: within the budget, layouts of every size (not only those
    that spend it), each family's in order of cost, the first that meets the SLO at the
    target is its answer; its goodput is the target. Here a probe meets it on 32 GPUs or
    more: the answer is the cheapest such layout of each family."""
    from pdd.lab.plan import planner
    from pdd.lab.plan import published as plan_published

    probed: list[int] = []

    def run_window(spec, sessions, rate, *args, **kwargs):
        gpus = sum(r.count * r.gpus for r in spec.roles)
        probed.append(gpus)
        return {
            "slo_attainment": 1.0 if gpus >= 32 else 0.0,
            "offered_rps": 0.5,
            "ttft_ms": {},
            "utilisation": {},
            "binding": "-",
            "session_rate": rate,
        }

    monkeypatch.setattr(planner, "run_window", run_window)
    everything = candidates(48, [100.0], ["A", "B"], spend=False)
    assert set(candidates(48, [100.0], ["A", "B"])) < set(everything)  # the budget-spending ones, and smaller
    found = plan_published.cheapest_at(everything, 0.2, agentic(SMALL), TINY_PROBE)
    for family in {lay.family for lay in everything}:
        able = [lay for lay in everything if lay.family == family and lay.gpus() >= 32]
        cost = {lay: paper.bill(lay.spec()).per_hour for lay in able}
        if not able:
            assert family not in found
            continue
        cheapest = min(cost.values())
        assert found[family]["cost_per_hour"] == pytest.approx(cheapest), family
        assert found[family]["goodput_rps"] == 0.2 and found[family]["judged_rps"] == 0.5
    assert probed and min(probed) < 32  # smaller layouts were probed first, and missed

    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    assert plan_main(parser.parse_args(["--target-rps", "0"])) == 2
    assert "--target-rps must be > 0" in capsys.readouterr().err


def test_the_screen_prices_a_prefill_instances_own_hits() -> None:
    """P caches the prompts it computed, never the answer MD decoded: a later turn's hit at
    P is the previous turn's prompt, so P recomputes the previous answer, and a P instance
    takes fewer requests a second than the decode side's hits would let it (a colocated
    instance, which decodes too, keeps them)."""
    from pdd.lab.plan.bounds import prefill_rps, shape_of

    shape = shape_of(SMALL)
    assert shape.prefilled is not None and len(shape.prefilled) == len(shape.requests)
    later = [k for k in range(1, len(shape.requests)) if shape.requests[k][1] > shape.requests[k - 1][0]]
    assert later  # turns that hit more than the previous prompt at the decode side
    for k in later:
        assert shape.prefilled[k] == (shape.requests[k][0], shape.requests[k - 1][0])
    p = next(r for r in Layout(1, 1, 0, "B", "B").spec().roles if r.role == "prefill")
    assert prefill_rps(p, shape) < prefill_rps(replace(p, role="standalone"), shape)


def test_the_screen_counts_what_a_relay_decodes_and_what_it_keeps_off_the_line() -> None:
    """A relay decodes each request's first tokens, and a request it finishes alone sends
    no KV over the line: a PDD layout's decode and line ceilings hold its relays' decode
    (counted as MD only, the screen put PDD's best below layouts that lost to it)."""
    from pdd.lab.plan.bounds import capacity_rps, decode_rps, shape_of

    shape, tpot_s = shape_of(SMALL), 0.2
    pdd = Layout(2, 1, 1, "A", "B", 25.0).spec()
    cross = Layout(2, 1, 0, "A", "B", 25.0).spec()
    relay = next(r for r in pdd.roles if r.role == "relay")
    with_relay, without = capacity_rps(pdd, shape, tpot_s), capacity_rps(cross, shape, tpot_s)
    assert with_relay["decode"] == pytest.approx(without["decode"] + decode_rps(relay, shape, tpot_s))
    assert with_relay["line"] == pytest.approx(without["line"] + decode_rps(relay, shape, tpot_s))
