"""`pdd sim --paper`: the three deployments of the published comparison, side by side.

For each: goodput (the highest request rate at which 90 % of requests meet the SLO, in
steady state: see `pdd.sim.runner`), then one longer steady-state run of all three at
the same reference load (80 % of the same-datacenter baseline's goodput) for latencies,
the relay's share and the line's use; cost and BCR from the catalog. Printed next to
the spec's numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from pdd.sim import paper
from pdd.sim.hardware import CATALOG, LINE_PRICE_PER_GBPS_HOUR
from pdd.sim.runner import Window, find_goodput, run_window, steady_sessions, tail_s, turns_per_session

REFERENCE_LOAD = 0.8  # of the same-datacenter baseline's goodput
B_PRICES = (1.2, 1.25, 1.3)  # GPU B in GPU A hours: the spec's "20-30 % above A"


def assumptions() -> dict[str, Any]:
    return {
        "model": paper.MODEL.to_dict(),
        "hardware": {k: v.to_dict() for k, v in CATALOG.items()},
        "gpus_per_instance": paper.GPUS_PER_INSTANCE,
        "memory_utilization": paper.MEMORY_UTILIZATION,
        "line": {"gbps": paper.LINE_GBPS, "price_per_gbps_hour": LINE_PRICE_PER_GBPS_HOUR,
                 "one_way_ms": paper.line(paper.LINE_GBPS).one_way_ms},
        "workload": {"system_prompt_tokens": paper.WORKLOAD.system_prompt_tokens,
                     "task_tokens": paper.WORKLOAD.task_tokens, "turns": paper.WORKLOAD.turns,
                     "tool_output_tokens": paper.WORKLOAD.tool_output_tokens,
                     "large_tool_output": [paper.WORKLOAD.large_tool_output_prob,
                                           paper.WORKLOAD.large_tool_output_tokens],
                     "output_tokens": paper.WORKLOAD.output_tokens, "max_context": paper.WORKLOAD.max_context,
                     "anomalous_fraction": paper.WORKLOAD.anomalous_fraction},
        "slo": {"ttft_ms": paper.SLO_TTFT_MS, "tpot_ms": paper.SLO_TPOT_MS, "attainment": 0.9},
        "policy": {"ttft_budget_ms": paper.POLICY.ttft_budget_ms, "handoff_threshold": paper.POLICY.handoff_threshold,
                   "catch_up_chunk": paper.POLICY.catch_up_chunk, "affinity_weight": paper.POLICY.affinity_weight},
        "block_tokens": paper.BLOCK_TOKENS,
        "reference_load": REFERENCE_LOAD,
    }


def run_paper(requests: int, low: float, high: float, warmup_s: float = 120.0, probe_s: float = 120.0,
              progress: Callable[[str], None] = lambda _msg: None) -> dict[str, Any]:
    """Goodput of each deployment from steady-state probes (sessions arriving for
    `warmup_s + probe_s`, the last `probe_s` judged), then one steady-state run of each at
    the same reference load, judged over about `requests` requests."""
    specs = paper.paper_deployments()
    slo = (paper.SLO_TTFT_MS, paper.SLO_TPOT_MS)
    tail = tail_s(paper.WORKLOAD.output_tokens[1], slo)
    sessions = steady_sessions(paper.WORKLOAD)
    probe = Window(warmup_s, warmup_s + probe_s, tail)
    best: dict[str, dict[str, Any] | None] = {}
    for name, spec in specs.items():
        best[name] = find_goodput(spec, sessions, slo, probe, low, high,
                                  lambda r, run, n=name: progress(f"{n}: {run['offered_rps']:.1f} req/s -> "
                                                                  f"{run['slo_attainment']:.1%} within the SLO"))
    if best["same-dc-pd"] is None:
        raise RuntimeError(f"same-dc-pd misses the SLO even at {low} sessions/s: lower --low")
    reference = REFERENCE_LOAD * best["same-dc-pd"]["session_rate"]
    turns = turns_per_session(paper.WORKLOAD)
    window = Window(warmup_s, warmup_s + requests / (reference * turns), tail)
    configs = {}
    for name, spec in specs.items():
        progress(f"{name}: about {requests:,} judged requests at {reference * turns:.1f} req/s")
        started = time.perf_counter()
        result = run_window(spec, sessions, reference, window, slo)
        configs[name] = _config(spec, result, best[name], time.perf_counter() - started)
    return {"configs": configs, "reference_rps": configs["same-dc-pd"]["offered_rps"], "assumptions": assumptions(),
            "paper": paper.PAPER}


def _config(spec: paper.DeploymentSpec, result: dict[str, Any], best: dict[str, Any] | None,
            wall_s: float) -> dict[str, Any]:
    bills = {price: paper.bill(spec, price) for price in B_PRICES}
    goodput_rps = best["offered_rps"] if best else 0.0
    cost = bills[1.25].per_hour
    return {
        "ttft_ms": result["ttft_ms"], "tpot_ms": result["tpot_ms"], "max_itl_ms": result["max_itl_ms"],
        "goodput_rps": goodput_rps, "cost": cost, "cost_range": {str(p): b.per_hour for p, b in bills.items()},
        "bcr": goodput_rps / cost, "gpus": {"A": 0, "B": 0} | bills[1.25].gpus,
        "wan_gbps": spec.wan.gbps if len({r.dc for r in spec.roles}) > 1 else 0.0,
        "wan_used_gbps": result["wan_bytes"] * 8 / 1e9 / result["duration_s"] if result["duration_s"] else 0.0,
        "slo_attainment": result["slo_attainment"], "offered_rps": result["offered_rps"],
        "rld_share": result["rld_output_tokens"] / result["output_tokens"] if result["output_tokens"] else 0.0,
        "d_hit_rate": result["d_hit_rate"], "pipelines": result["pipelines"], "handoffs": result["handoffs"],
        "hit_buckets": result["hit_buckets"], "requests": result["requests"], "failed": result["failed"],
        "simulated_requests": result["simulated_requests"], "events": result["events"], "wall_s": wall_s,
        "events_per_s": result["events"] / wall_s,
        "at_goodput": None if best is None else {"ttft_ms": best["ttft_ms"], "slo_attainment": best["slo_attainment"],
                                                 "rld_share": best["rld_output_tokens"] / best["output_tokens"]},
    }


def _change(a: float | None, b: float | None) -> str:
    return "-" if not a or b is None else f"{(b - a) / a:+.1%}"


def print_paper(result: dict[str, Any], console: Console) -> None:
    c = result["configs"]
    same, cross, pdd = c["same-dc-pd"], c["cross-dc-pd"], c["pdd"]
    table = Table(title=f"pdd sim --paper: three deployments at {result['reference_rps']:.1f} req/s "
                        "(80 % of same-dc-pd's goodput)")
    table.add_column("metric")
    for name in c:
        table.add_column(name, justify="right")
    rows = [
        ("GPUs", lambda r: " + ".join(f"{n} {k}" for k, n in r["gpus"].items() if n)),
        ("line (Gbit/s)", lambda r: f"{r['wan_gbps']:g}" if r["wan_gbps"] else "-"),
        ("cost (GPU A hours / h)", lambda r: f"{r['cost']:.1f}"),
        ("TTFT p50 / p90 / p99 (ms)", lambda r: " / ".join(f"{r['ttft_ms'][q]:,.0f}" for q in ("p50", "p90", "p99"))),
        ("TTFT mean (ms)", lambda r: f"{r['ttft_ms']['mean']:,.0f}"),
        ("TPOT p50 / p99 (ms)", lambda r: f"{r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p99']:.1f}"),
        ("SLO attainment", lambda r: f"{r['slo_attainment']:.1%}"),
        ("goodput (req/s)", lambda r: f"{r['goodput_rps']:.2f}"),
        ("BCR (req/s per GPU A hour/h)", lambda r: f"{r['bcr']:.4f}"),
        ("decode-side hit", lambda r: f"{r['d_hit_rate']:.1%}"),
        ("RLD share of output", lambda r: f"{r['rld_share']:.1%}"),
        ("line used (Gbit/s)", lambda r: f"{r['wan_used_gbps']:.2f}"),
        ("simulated requests, events / s (wall s)",
         lambda r: f"{r['simulated_requests']:,}, {r['events_per_s']:,.0f} ({r['wall_s']:.1f})"),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(r) for r in c.values()))
    console.print(table)
    p = result["paper"]
    versus = Table(title="against the spec's numbers")
    for col in ("", "simulated", "spec"):
        versus.add_column(col, justify="right" if col else "left")
    cost_range = [_change(same["cost"], v) for v in pdd["cost_range"].values()]
    versus.add_row("TTFT mean, PDD vs cross-dc PD", _change(cross["ttft_ms"]["mean"], pdd["ttft_ms"]["mean"]),
                   f"{p['ttft_change']:+.1%}")
    versus.add_row("TTFT p99, PDD vs cross-dc PD", _change(cross["ttft_ms"]["p99"], pdd["ttft_ms"]["p99"]), "")
    versus.add_row("goodput, PDD vs cross-dc PD", _change(cross["goodput_rps"], pdd["goodput_rps"]),
                   f"{p['goodput_change']:+.1%}")
    versus.add_row("goodput, PDD vs same-dc PD", _change(same["goodput_rps"], pdd["goodput_rps"]), "")
    versus.add_row("cost, PDD vs same-dc PD (B at +20 / 25 / 30 %)", " / ".join(cost_range),
                   f"{p['cost_change'][0]:+.1%} .. {p['cost_change'][1]:+.1%}")
    versus.add_row("BCR, PDD vs same-dc PD", _change(same["bcr"], pdd["bcr"]), f"up to {p['bcr_change']:+.1%}")
    versus.add_row("RLD share of output tokens", f"{pdd['rld_share']:.1%}", f"{p['rld_share']:.1%}")
    console.print(versus)
