"""`pdd bench overhead`'s arithmetic: ratios pair by pair, spreads, the 10 % verdict."""

from __future__ import annotations

import pytest

from pdd.lab.bench.overhead import compare, metrics_of


def _pair(vllm: dict, pdd: dict) -> dict:
    base = {"ttft_p50_ms": 10.0, "ttft_p90_ms": 20.0, "tpot_p50_ms": 3.0, "output_tok_s": 100.0}
    return {"vllm": base | vllm, "pdd": base | pdd}


def test_ratios_are_taken_pair_by_pair_and_spread_over_the_pairs():
    pairs = [
        _pair({"ttft_p50_ms": 10.0}, {"ttft_p50_ms": 11.0}),  # 1.1
        _pair({"ttft_p50_ms": 20.0}, {"ttft_p50_ms": 20.0}),  # 1.0: a slow pair for both
        _pair({"ttft_p50_ms": 10.0}, {"ttft_p50_ms": 10.4}),  # 1.04
    ]
    ttft = compare(pairs)["ttft_p50_ms"]
    assert ttft["ratio"] == pytest.approx({"median": 1.04, "min": 1.0, "max": 1.1})
    # not the ratio of the medians (11 / 10): the pair cancels what the machine did meanwhile
    assert ttft["vllm"] == {"median": 10.0, "min": 10.0, "max": 20.0}
    assert ttft["pdd"] == {"median": 11.0, "min": 10.4, "max": 20.0}
    assert ttft["within_target"] is True


def test_the_verdict_knows_which_side_is_better():
    slower = compare([_pair({}, {"ttft_p90_ms": 21.4, "output_tok_s": 94.0})])
    assert slower["ttft_p90_ms"]["within_target"] is False  # 7 % more latency: past the 5 % bound
    assert slower["output_tok_s"]["within_target"] is False  # 6 % less throughput
    faster = compare([_pair({}, {"ttft_p90_ms": 10.0, "output_tok_s": 150.0})])
    assert faster["ttft_p90_ms"]["within_target"] is True and faster["output_tok_s"]["within_target"] is True


def test_a_missing_number_is_left_out_not_zero():
    pairs = [_pair({"tpot_p50_ms": None}, {}), _pair({}, {"tpot_p50_ms": 6.0})]
    tpot = compare(pairs)["tpot_p50_ms"]
    assert tpot["ratio"] == {"median": 2.0, "min": 2.0, "max": 2.0}
    assert tpot["vllm"]["median"] == 3.0
    none = compare([_pair({"tpot_p50_ms": None}, {"tpot_p50_ms": None})])["tpot_p50_ms"]
    assert none["ratio"] is None and none["within_target"] is None


def test_metrics_come_from_a_bench_summary():
    summary = {
        "ttft_ms": {"p50": 1.0, "p90": 2.0},
        "tpot_ms": {"p50": 3.0},
        "output_tokens_per_s": 4.0,
    }
    assert metrics_of(summary) == {"ttft_p50_ms": 1.0, "ttft_p90_ms": 2.0, "tpot_p50_ms": 3.0, "output_tok_s": 4.0}


def test_the_control_runs_plain_vllm_in_pdds_place(tiny_model_dir):
    import argparse

    from pdd.lab.bench.overhead import _commands

    args = argparse.Namespace(vllm_layout="in-process", kv_cache_gib=1, threads=1, control=False)
    measured = _commands(tiny_model_dir, args)
    assert measured["pdd"][:3] == ["-m", "pdd.cli", "serve"] and "--engine" in measured["pdd"]
    assert measured["vllm"][:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "uni" in measured["vllm"]  # in-process: plain vLLM's worker in its engine core, as pdd runs it
    control = _commands(tiny_model_dir, argparse.Namespace(**{**vars(args), "control": True}))
    assert control["pdd"] == control["vllm"] == measured["vllm"]
