"""The bathtub sweep: its workload hits what it is asked to, more cache never lowers
goodput, the line's demand follows the uncached share, and the plots are written.
Small prompts and few requests keep it fast; no timing is asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdd.sim import paper
from pdd.sim.bathtub import bathtub, fixed_hit_sessions, plot_bathtub, plot_wan, shared_blocks
from pdd.sim.runner import Window, simulate

PROMPT, OUTPUT, BLOCK = 4096, 16, paper.BLOCK_TOKENS
REFERENCE_RPS = 2.0


def _cross_dc_pd():
    """One P on GPU A, one MD on GPU B across the line: the decode side's hit decides
    what crosses it."""
    return paper.deployment("small-pd", (paper.role("prefill", "A", 1, "A"), paper.role("main", "B", 1, "B")))


def test_same_draws_at_every_rate() -> None:
    slow = fixed_hit_sessions(0.5, 1.0, 20, PROMPT, OUTPUT, BLOCK)
    fast = fixed_hit_sessions(0.5, 4.0, 20, PROMPT, OUTPUT, BLOCK)
    assert [s.start_s / 4 for s in slow] == pytest.approx([s.start_s for s in fast])
    assert all(a.start_s < b.start_s for a, b in zip(slow, slow[1:]))


@pytest.mark.parametrize("hit", [0.0, 0.3, 0.9])
def test_every_request_after_the_first_hits_the_requested_share(hit: float) -> None:
    # Far apart (0.01 / s), so each request has left its prefix in both caches before the next.
    outcomes, _ = simulate(_cross_dc_pd(), fixed_hit_sessions(hit, 0.01, 6, PROMPT, OUTPUT, BLOCK))
    outcomes.sort(key=lambda o: o.session)
    assert [o.failed for o in outcomes] == [None] * 6
    assert outcomes[0].d_hit == 0
    for o in outcomes[1:]:
        assert o.d_hit / PROMPT == pytest.approx(hit, abs=BLOCK / (2 * PROMPT))
        assert o.p_hit == o.d_hit == shared_blocks(hit, PROMPT, BLOCK) * BLOCK


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return bathtub(_cross_dc_pd(), [0.0, 0.95], (1000.0, paper.SLO_TPOT_MS), Window(5.0, 25.0, 3.0), PROMPT, OUTPUT,
                   low=0.5, high=200.0, reference_rate=REFERENCE_RPS)


def test_more_cache_never_lowers_goodput(rows: list[dict]) -> None:
    cold, warm = rows
    assert 0 < cold["goodput_rps"] <= warm["goodput_rps"]
    assert warm["d_hit_rate"] == pytest.approx(0.95, abs=BLOCK / (2 * PROMPT))


def test_the_line_must_carry_what_the_decode_side_lacks(rows: list[dict]) -> None:
    """The caches start warm, so every request, the first included, sends only its tail."""
    kv = _cross_dc_pd().kv_bytes_per_token
    for row in rows:
        tail = PROMPT - shared_blocks(row["hit"], PROMPT, BLOCK) * BLOCK
        assert row["wan_gbps_needed"] == pytest.approx(REFERENCE_RPS * tail * kv * 8 / 1e9)
        assert row["line_gbps"] == paper.LINE_GBPS


@pytest.mark.parametrize("plot", [plot_bathtub, plot_wan])
def test_plots_are_written(rows: list[dict], plot, tmp_path: Path) -> None:
    path = tmp_path / "plot.png"
    plot(rows, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
