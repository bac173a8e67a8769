"""`pdd sim check`: does the simulator agree with the system it models?

It simulates the deployment and workload of a `pdd demo` run, with this machine's
measured profile (`pdd sim calibrate`), and puts each mode's predicted TTFT next to the
measured one. The simulator's numbers at cluster scale are only as good as this table.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pdd import config as cfg
from pdd.lab.calibration.local import simulate_demo
from pdd.lab.calibration.profile import LocalProfile
from pdd.lab.sim.metrics import summary
from pdd.lab.workload.scenarios import SCENARIOS
from pdd.names import mode_options

P50_TOLERANCE, P99_TOLERANCE = 0.25, 0.50


def mode_deployment(dep: cfg.Deployment, mode: str) -> tuple[cfg.Deployment, str]:
    """`dep` as `pdd demo` starts the mode `MODE[:KEY=VALUE...]` (the options it passes
    `pdd up`), and the bare mode; an option the simulator does not model is refused."""
    base, options = mode_options(mode)
    for key, value in options:
        if key in ("main", "prefill", "relay") and value.isdigit():
            dep = replace(dep, topology=replace(dep.topology, **{key: int(value)}))  # type: ignore[arg-type]
        elif key == "drc" and value in ("on", "off"):
            dep = replace(dep, policy=replace(dep.policy, decode_radix_cache=value == "on"))
        else:
            raise ValueError(f"mode {mode!r}: the simulator does not model the option {key}={value!r}")
    return dep, base


def check(report: dict[str, Any], profile: LocalProfile) -> dict[str, Any]:
    """Predicted against measured, per mode of a demo report (in emulated time where
    the demo paced its instances)."""
    conf = report["meta"]["config"]
    scenario = SCENARIOS[conf["scenario"]]
    rate = math.inf if conf["rate"] is None else conf["rate"]
    loaded = cfg.load(conf.get("deployment_config"))
    hardware, dilation = conf.get("hardware", "native"), float(conf.get("dilation", 1.0))
    loaded = replace(loaded, topology=replace(loaded.topology, hardware=hardware, dilation=dilation))
    rows = {}
    for mode, measured in report["modes"].items():
        dep, base = mode_deployment(loaded, mode)
        predicted = summary(
            simulate_demo(dep, base, profile, scenario, conf["requests"], rate, conf["seed"]),
            conf["slo_ttft_ms"] * dilation,
            conf["slo_tpot_ms"] * dilation,
        )
        rows[mode] = {
            q: {
                "predicted": predicted["ttft_ms"][q],
                "measured": measured["ttft_ms"][q],
                "error": predicted["ttft_ms"][q] / measured["ttft_ms"][q] - 1,
            }
            for q in ("p50", "p90", "p99")
        }
        rows[mode]["tpot_p50"] = {"predicted": predicted["tpot_ms"]["p50"], "measured": measured["tpot_ms"]["p50"]}
        rows[mode]["relay_output_tokens"] = {
            "predicted": predicted["relay_output_tokens"],
            "measured": measured["relay_output_tokens"],
        }
        rows[mode]["within"] = (
            abs(rows[mode]["p50"]["error"]) <= P50_TOLERANCE and abs(rows[mode]["p99"]["error"]) <= P99_TOLERANCE
        )
    return {
        "modes": rows,
        "scenario": scenario.name,
        "requests": conf["requests"],
        "profile": profile.steps.source,
        "pacing": f"emulated chips, time x{dilation:g}" if hardware == "emulated" else "native",
        "request_overhead_ms": 1000 * profile.request_overhead_s,
    }


def print_check(result: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"simulated vs measured: pdd demo, scenario {result['scenario']}, {result['requests']} requests per mode"
    )
    for col in (
        "mode",
        "TTFT p50 sim / real (ms)",
        "err",
        "TTFT p90 sim / real",
        "err",
        "TTFT p99 sim / real",
        "err",
        "TPOT p50 sim / real",
        "RLD tokens sim / real",
        "within 25 % / 50 %",
    ):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for mode, r in result["modes"].items():
        cells = [mode]
        for q in ("p50", "p90", "p99"):
            cells += [f"{r[q]['predicted']:,.1f} / {r[q]['measured']:,.1f}", f"{r[q]['error']:+.0%}"]
        cells += [
            f"{r['tpot_p50']['predicted']:.1f} / {r['tpot_p50']['measured']:.1f}",
            f"{r['relay_output_tokens']['predicted']:,} / {r['relay_output_tokens']['measured']:,}",
            "yes" if r["within"] else "NO",
        ]
        table.add_row(*cells)
    console.print(table)
    console.print(
        f"pacing: {result['pacing']}; profile: {result['profile']}; request path {result['request_overhead_ms']:.1f} ms"
    )


def load_report(path: Path) -> dict[str, Any]:
    report = json.loads(path.read_text())
    if "modes" not in report or "config" not in report.get("meta", {}):
        raise ValueError(f"{path}: not a `pdd demo` report.json")
    return report
