"""The bathtub sweep: its workload hits what it is asked to, in several prefix groups;
a tail that cannot ride with another request's chunk costs P throughput; valleys are
found where they are; the plot is written. Small sizes; no timing is asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdd.lab.paper.bathtub import SCHEDULERS, deployment, group_sessions, plot, point, shared_blocks, sweep, valleys
from pdd.lab.plan import paper
from pdd.lab.sim.runner import Window, simulate

PROMPT, OUTPUT, BLOCK = 4096, 16, paper.SETTING.block_tokens


def _cross_dc_pd():
    return paper.deployment("small-pd", (paper.role("prefill", "A", 1, "A"), paper.role("main", "B", 1, "B")))


@pytest.mark.parametrize("hit", [0.0, 0.3, 0.9])
def test_every_request_hits_its_groups_share(hit: float) -> None:
    sessions = group_sessions(hit, 0.01, 12, PROMPT, OUTPUT, BLOCK, groups=3)
    groups = {s.trace_keys[0][1] for s in sessions if hit > 0}
    assert hit == 0 or len(groups) > 1  # not one prefix for all
    records, _ = simulate(_cross_dc_pd(), sessions)
    seen: set[int] = set()
    for o in sorted(records, key=lambda o: o.session):
        assert o.error is None
        group = sessions[o.session].trace_keys[0][1] if hit > 0 else None
        if hit > 0 and group in seen:  # its group's prefix was left in both caches by an earlier request
            assert o.p_hit_tokens == o.d_hit_tokens == shared_blocks(hit, PROMPT, BLOCK) * BLOCK
        seen.add(group)


def test_a_tail_that_runs_alone_costs_throughput() -> None:
    """At a high hit every request is one small tail after a long cached prefix: when a
    step may hold only one request's chunk, each tail pays a whole step (every expert's
    weights, the all-to-all, the fixed costs) alone."""
    window = Window(2.0, 6.0, 0.0)
    batched = point(deployment(SCHEDULERS["engine (tails batch)"]), 0.98, 0, window)
    alone = point(deployment(SCHEDULERS["one chunk a step (tails alone)"]), 0.98, 0, window)
    assert alone["throughput_rps"] < 0.9 * batched["throughput_rps"]
    assert batched["p_hit_rate"] == pytest.approx(0.98, abs=0.01)


def test_the_sweep_reports_a_spread_over_seeds() -> None:
    rows = sweep([0.9], [0, 1], Window(2.0, 5.0, 0.0))
    assert {r["scheduler"] for r in rows} == set(SCHEDULERS)
    assert all(r["seeds"] == 2 and r["std_rps"] >= 0 and r["throughput_rps"] > 0 for r in rows)


def test_valleys_are_where_throughput_dips_beyond_its_spread() -> None:
    def row(hit: float, rps: float, std: float = 0.1) -> dict:
        return {"scheduler": next(iter(SCHEDULERS)), "hit": hit, "throughput_rps": rps, "std_rps": std}

    rows = [row(0.18, 2.0), row(0.20, 1.5), row(0.22, 2.1), row(0.24, 2.2), row(0.26, 2.15, 0.2), row(0.28, 2.3)]
    assert [v["hit"] for v in valleys(rows)] == [0.20]  # 0.26 dips, but within its spread


def test_the_plot_is_written(tmp_path: Path) -> None:
    rows = [{"scheduler": name, "hit": h, "throughput_rps": 1 + h, "std_rps": 0.1} for name in SCHEDULERS
            for h in (0.0, 0.5)]
    plot(rows, tmp_path / "bathtub.png")
    assert (tmp_path / "bathtub.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
