"""Summary math on hand-made records: the numbers `pdd bench` and `pdd demo` report."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from pdd.lab.bench.summary import format_table, summarize
from pdd.record import RequestRecord

CONTRACT_KEYS = {"requests", "completed", "failed", "ttft_ms", "tpot_ms", "e2e_ms", "max_itl_ms",
                 "prompt_tokens", "output_tokens", "p_hit_tokens", "d_hit_tokens", "line_bytes",
                 "relay_output_tokens", "main_output_tokens", "pipelines", "handoffs",
                 "slo_attainment", "d_hit_rate", "duration_s", "output_tokens_per_s"}


def _ok(i: int, ttft: float, tpot: float | None, *, pipeline: str | None = "P-MD",
        handoff: str | None = None, itl: float | None = 5.0) -> RequestRecord:
    output = 1 if tpot is None else 11
    e2e = ttft + (tpot or 0) * (output - 1)
    return RequestRecord(id=f"{i}-0", session=i, turn=0, start_s=i * 0.5, prompt_tokens=100,
                         output_tokens=output, ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e,
                         max_itl_ms=itl, cached_tokens=90, pipeline=pipeline, p_hit_tokens=90,
                         d_hit_tokens=80, line_bytes=1000, relay_output_tokens=1 if handoff else 0,
                         main_output_tokens=output - (1 if handoff else 0), handoff=handoff)


def _failed(i: int) -> RequestRecord:
    return RequestRecord(id=f"{i}-0", session=i, turn=0, start_s=0.25, prompt_tokens=100,
                         output_tokens=3, e2e_ms=100.0, line_bytes=500, error="HTTP 500: boom")


@pytest.fixture
def records() -> list[RequestRecord]:
    return [_ok(0, 10.0, 2.0),
            _ok(1, 20.0, 4.0, pipeline="P-RLD-MD", handoff="one_shot"),
            _ok(2, 30.0, None, pipeline="P-RLD"),
            _ok(3, 40.0, 8.0, pipeline="P-RLD-MD", handoff="catch_up", itl=None),
            _failed(4)]


def test_latency_percentiles_cover_completed_requests_only(records):
    summary = summarize(records, line_bytes=None, slo_ttft_ms=1e9, slo_tpot_ms=1e9)
    assert summary.keys() >= CONTRACT_KEYS
    quantiles = ("mean", "p50", "p90", "p99")
    assert {q: summary["ttft_ms"][q] for q in quantiles} == pytest.approx({"mean": 25.0, "p50": 25.0, "p90": 37.0,
                                                                          "p99": 39.7})
    # The one-token request has no TPOT and is skipped, not counted as zero.
    assert {q: summary["tpot_ms"][q] for q in quantiles} == pytest.approx({"mean": 14 / 3, "p50": 4.0, "p90": 7.2,
                                                                          "p99": 7.92})
    assert (summary["ttft_ms"]["n"], summary["tpot_ms"]["n"]) == (4, 3)
    assert summary["max_itl_ms"]["p99"] == 5.0


def test_counts_sums_and_shares(records):
    summary = summarize(records, line_bytes=None, slo_ttft_ms=1e9, slo_tpot_ms=1e9)
    assert (summary["requests"], summary["completed"], summary["failed"]) == (5, 4, 1)
    assert summary["prompt_tokens"] == 400 and summary["output_tokens"] == 34
    assert summary["p_hit_tokens"] == 360 and summary["d_hit_tokens"] == 320
    assert summary["d_hit_rate"] == pytest.approx(0.8)
    assert summary["relay_output_tokens"] == 2 and summary["main_output_tokens"] == 32
    assert summary["pipelines"] == {"P-MD": 1, "P-RLD-MD": 2, "P-RLD": 1}
    assert summary["handoffs"] == {"one_shot": 1, "catch_up": 1}
    # Without a server counter, line bytes are the per-request sum, failed ones included.
    assert summary["line_bytes"] == 4500
    assert summarize(records, line_bytes=123, slo_ttft_ms=1, slo_tpot_ms=1)["line_bytes"] == 123
    # From the first start (0 s) to the last end (1.5 s + 120 ms).
    assert summary["duration_s"] == pytest.approx(1.62)
    assert summary["output_tokens_per_s"] == pytest.approx(34 / 1.62)


def test_slo_attainment_counts_failures_against_it(records):
    summary = summarize(records, line_bytes=None, slo_ttft_ms=30.0, slo_tpot_ms=3.0)
    # Request 0 meets both; 1 misses TPOT; 2 has no TPOT and meets TTFT; 3 misses
    # TTFT; the failed one cannot count.
    assert summary["slo_attainment"] == pytest.approx(2 / 5)
    assert summary["slo_ttft_ms"] == 30.0


def test_colocated_and_plain_servers_are_counted_as_such():
    colocated = [_ok(0, 10.0, 1.0, pipeline="colocated"), _ok(1, 10.0, 1.0, pipeline=None)]
    summary = summarize(colocated, line_bytes=0, slo_ttft_ms=100, slo_tpot_ms=100)
    assert summary["pipelines"] == {"P-MD": 0, "P-RLD-MD": 0, "P-RLD": 0, "colocated": 1}
    assert "colocated" not in summarize([], line_bytes=None, slo_ttft_ms=1,
                                        slo_tpot_ms=1)["pipelines"]


def test_all_failed_gives_nulls_not_errors():
    summary = summarize([_failed(0), _failed(1)], line_bytes=None, slo_ttft_ms=1, slo_tpot_ms=1)
    assert summary["completed"] == 0 and summary["failed"] == 2
    assert summary["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None, "n": 0, "p90_ci": None,
                                  "p99_ci": None}
    assert summary["d_hit_rate"] is None and summary["slo_attainment"] == 0
    json.dumps(summary, allow_nan=False)  # still a valid report


def test_records_round_trip_through_json(records):
    loaded = [RequestRecord.from_dict(json.loads(json.dumps(r.to_dict()))) for r in records]
    assert loaded == records


def test_table_puts_summaries_side_by_side(records):
    by_mode = {"pd-cross-dc": summarize(records[:1], line_bytes=2 * 1024 ** 2, slo_ttft_ms=1,
                                        slo_tpot_ms=1),
               "pdd": summarize(records, line_bytes=None, slo_ttft_ms=1e9, slo_tpot_ms=1e9)}
    console = Console(record=True, width=120)
    console.print(format_table(by_mode))
    text = console.export_text()
    assert "pd-cross-dc" in text and "pdd" in text
    ttft_row = next(line for line in text.splitlines() if "TTFT p50" in line)
    assert "10.0" in ttft_row and "25.0" in ttft_row
    assert "2.00 MiB" in text and "4.39 KiB" in text
    assert "80.0 %" in text  # D hit


def test_tail_percentiles_carry_a_bootstrap_interval_that_narrows_with_more_requests():
    few = summarize([_ok(i, ttft=10.0 + i, tpot=2.0) for i in range(20)], line_bytes=None, slo_ttft_ms=1e9,
                    slo_tpot_ms=1e9)
    many = summarize([_ok(i, ttft=10.0 + i % 20, tpot=2.0) for i in range(400)], line_bytes=None, slo_ttft_ms=1e9,
                     slo_tpot_ms=1e9)
    lo, hi = few["ttft_ms"]["p99_ci"]
    assert lo <= few["ttft_ms"]["p99"] <= hi and lo < hi  # over 20 requests the P99 is uncertain
    lo2, hi2 = many["ttft_ms"]["p99_ci"]
    assert hi2 - lo2 < hi - lo
    assert few["ttft_ms"]["p90_ci"] == summarize([_ok(i, ttft=10.0 + i, tpot=2.0) for i in range(20)], line_bytes=None,
                                                 slo_ttft_ms=1e9, slo_tpot_ms=1e9)["ttft_ms"]["p90_ci"]  # seeded


def test_a_summary_without_intervals_differs_only_by_them():
    records = [_ok(i, ttft=10.0 + i, tpot=2.0) for i in range(20)]
    full = summarize(records, line_bytes=None, slo_ttft_ms=1e9, slo_tpot_ms=1e9)
    brief = summarize(records, line_bytes=None, slo_ttft_ms=1e9, slo_tpot_ms=1e9, intervals=False)
    assert brief["ttft_ms"]["p99_ci"] is None and full["ttft_ms"]["p99_ci"] is not None
    without = {k: {q: v for q, v in s.items() if not q.endswith("_ci")} if isinstance(s, dict) else s
               for k, s in full.items()}
    assert {k: {q: v for q, v in s.items() if not q.endswith("_ci")} if isinstance(s, dict) else s
            for k, s in brief.items()} == without


def test_the_headline_divides_pdd_by_the_baselines_at_equal_hardware_and_grades_each_bound():
    from pdd.lab.bench.headline import headlines

    def mode(ttft_p99: float, itl_p99: float, rld: int = 0) -> dict:
        return {"ttft_ms": {"p99": ttft_p99}, "max_itl_ms": {"p99": itl_p99}, "output_tokens": 1000,
                "relay_output_tokens": rld}

    run = {"pd-same-dc": mode(100.0, 10.0), "pd-same-dc:main=2": mode(500.0, 40.0), "pd-cross-dc": mode(1000.0, 50.0),
           "pdd": mode(550.0, 70.0, rld=150)}
    got = {h.name: h for h in headlines(run)}
    same = got["PDD / same-dc PD, TTFT P99"]
    assert same.value == pytest.approx(1.1) and same.holds and "pd-same-dc:main=2" in same.basis
    assert got["PDD / cross-dc PD, TTFT P99"].value == pytest.approx(0.55)
    assert got["PDD / cross-dc PD, TTFT P99"].holds is False
    assert got["PDD / same-dc PD, max ITL P99"].value == pytest.approx(1.75)
    assert got["RLD share of output tokens"].holds is False  # 15 % is not under 15 %
    assert all(h.value is None for h in headlines({"pdd": run["pdd"]}) if h.basis.startswith("ttft"))
