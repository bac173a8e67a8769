"""The tables `pdd sim --paper` prints: each family's best, the spec's figures graded
against what they were published against, the anchors, and the SLO sensitivity."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from pdd.lab.paper.compare import change
from pdd.lab.plan import paper
from pdd.lab.plan.planner import Probe
from pdd.lab.plan.report import assumption_line, judged
from pdd.lab.plan.workload import agentic


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _util(u: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0%}" for k, v in sorted(u.items(), key=lambda kv: -kv[1])[:3])


def graded(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(figure, against, simulated, published) for each figure the spec gives."""
    c, p = result["configs"], result["paper"]
    probe = Probe(steps=result["assumptions"]["probe"]["steps"])  # (what the goodputs are known to)
    pdd = c.get("pdd")
    rows: list[tuple[str, str, str, str]] = []
    if pdd is None:
        return rows
    vs = {
        name: c.get(p[f"{key}_against"])
        for key, name in (("ttft", "ttft"), ("goodput", "goodput"), ("cost", "cost"), ("bcr", "bcr"))
    }
    if vs["ttft"]:
        rows.append(
            (
                "TTFT mean, PDD",
                p["ttft_against"],
                _pct(change(vs["ttft"]["ttft_ms"]["mean"], pdd["ttft_ms"]["mean"])),
                f"{p['ttft_change']:+.1%}",
            )
        )
    if vs["goodput"]:
        rows.append(
            (
                "goodput, PDD",
                p["goodput_against"],
                judged(change(vs["goodput"]["goodput_rps"], pdd["goodput_rps"]), probe),
                f"{p['goodput_change']:+.1%}",
            )
        )
    if vs["cost"]:
        cost = " / ".join(_pct(change(vs["cost"]["cost"], v)) for v in pdd["cost_range"].values())
        rows.append(
            (
                "cost, PDD (B at +20 / 25 / 30 %)",
                p["cost_against"],
                cost,
                f"{p['cost_change'][0]:+.1%} .. {p['cost_change'][1]:+.1%}",
            )
        )
    if vs["bcr"]:
        rows.append(
            (
                "BCR, PDD",
                p["bcr_against"],
                judged(change(vs["bcr"]["bcr"], pdd["bcr"]), probe),
                f"up to {p['bcr_change']:+.1%}",
            )
        )
    if c.get("pd-cross-dc"):
        rows.append(
            (
                "goodput, PDD",
                "pd-cross-dc",
                judged(change(c["pd-cross-dc"]["goodput_rps"], pdd["goodput_rps"]), probe),
                "(not published)",
            )
        )
        rows.append(
            (
                "TTFT p99, PDD",
                "pd-cross-dc",
                _pct(change(c["pd-cross-dc"]["ttft_ms"]["p99"], pdd["ttft_ms"]["p99"])),
                "(not published)",
            )
        )
    rows.append(("RLD share of output tokens", "-", f"{pdd['rld_share']:.1%}", f"{p['rld_share']:.1%}"))
    return rows


def print_paper(result: dict[str, Any], console: Console) -> None:
    c = result["configs"]
    table = Table(
        title=f"pdd sim --paper: each family's best layout within {result['assumptions']['budget_gpus']} "
        f"GPUs; latencies at {result['reference_rps']:.1f} req/s (80 % of pd-same-dc's goodput)"
    )
    table.add_column("metric")
    for name in c:
        table.add_column(name, justify="right")
    rows = [
        ("layout", lambda r: r["layout"]),
        ("GPUs", lambda r: " + ".join(f"{n} {k}" for k, n in r["gpus"].items() if n)),
        ("cost (GPU A hours / h)", lambda r: f"{r['cost']:.1f}"),
        ("goodput (req/s)", lambda r: f"{r['goodput_rps']:.1f}"),
        ("BCR (req/s per GPU A hour/h)", lambda r: f"{r['bcr']:.3f}"),
        ("binding at goodput", lambda r: f"{r['binding_at_goodput']} ({_util(r['utilisation_at_goodput'])})"),
        (
            "GPUs for pd-same-dc's goodput",
            lambda r: "-" if r["iso_goodput_gpus_linear"] is None else f"{r['iso_goodput_gpus_linear']:.0f} (scaled)",
        ),
        ("TTFT p50 / p90 / p99 (ms)", lambda r: " / ".join(f"{r['ttft_ms'][q]:,.0f}" for q in ("p50", "p90", "p99"))),
        ("TTFT mean (ms)", lambda r: f"{r['ttft_ms']['mean']:,.0f}"),
        ("TPOT p50 / p99 (ms)", lambda r: f"{r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p99']:.1f}"),
        ("SLO attainment", lambda r: f"{r['slo_attainment']:.1%}"),
        ("P hit / decode-side hit", lambda r: f"{r['p_hit_rate']:.1%} / {r['d_hit_rate']:.1%}"),
        ("RLD share of output", lambda r: f"{r['rld_share']:.1%}"),
        (
            "line (Gbit/s): size / used",
            lambda r: f"{r['line_gbps']:g} / {r['line_used_gbps']:.1f}" if r["line_gbps"] else "-",
        ),
        ("binding at reference load", lambda r: f"{r['binding']} ({_util(r['utilisation'])})"),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(r) for r in c.values()))
    console.print(table)
    versus = Table(title="the spec's figures, each against the deployment it was published against")
    for col in ("figure", "against", "simulated", "spec"):
        versus.add_column(col, justify="left" if col in ("figure", "against") else "right")
    for row in graded(result):
        versus.add_row(*row)
    console.print(versus)
    anchors = Table(title="anchors: single measurements the spec quotes")
    for col in ("", "spec", "simulated"):
        anchors.add_column(col, justify="left" if not col else "right")
    for name, a in result["anchors"].items():
        anchors.add_row(name, a["spec"], a["simulated"])
    console.print(anchors)
    if result["slo_sensitivity"]:
        slo = Table(
            title="goodput (req/s) of each family's best layout under other SLOs (TPOT "
            f"{result['assumptions']['slo']['tpot_ms']:g} ms)"
        )
        slo.add_column("SLO")
        for name in c:
            slo.add_column(name, justify="right")
        base = {name: r["goodput_rps"] for name, r in c.items()}
        slo.add_row(f"TTFT {paper.SLO_TTFT_MS / 1000:g} s, P90 (the default)", *(f"{base[n]:.1f}" for n in c))
        for key, per in result["slo_sensitivity"].items():
            slo.add_row(key, *(f"{per[n]['goodput_rps']:.1f}" if n in per else "-" for n in c))
        console.print(slo)
    e = paper.SETTING.eff
    console.print(
        f"Assumptions: {assumption_line(Probe(), agentic(paper.WORKLOAD))} Step model: kernels at "
        f"{e.mfu:.0%} of the tensor peak (GEMMs), {e.attn_mfu:.0%} (attention), {e.mbu:.0%} of HBM; "
        f"{1000 * e.step_overhead_s:g} ms a step, {1000 * e.chunk_overhead_s:g} ms a chunk; all-to-all "
        f"{1e6 * e.a2a_latency_up_s:g} / {1e6 * e.a2a_latency_out_s:g} us in / across nodes; routing skew "
        f"{e.routing_skew:g}. Everything in the JSON's `assumptions`."
    )
    ratio = paper.rho(tpot_ms=result["assumptions"]["slo"]["tpot_ms"])
    console.print(f"What the verdict rests on: {ratio.line() if ratio else 'rho: the model fits no instance'}")
    console.print(
        f"{len(result['layouts'])} layouts, {sum(r['simulated'] for r in result['layouts'])} simulated; "
        f"{result['wall_s']:.0f} s"
    )
