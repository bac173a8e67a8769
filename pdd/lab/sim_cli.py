"""`pdd sim` (the published comparison, a live deployment simulated, the calibration
check, the calibration itself) and `pdd plan`: the one command line in front of the
simulator (`pdd.lab.sim`), the planner (`pdd.lab.plan`), the published comparison
(`pdd.lab.paper`) and the calibration (`pdd.lab.calibration`), each imported when its
command runs; none of them imports this."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console


def _write(path: str | None, data: dict, console: Console) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")
        console.print(f"wrote {path}", markup=False, soft_wrap=True)


def _paper(args: argparse.Namespace) -> int:
    from pdd.lab.paper.compare import run_paper
    from pdd.lab.paper.report import print_paper
    from pdd.lab.plan.planner import Probe

    console = Console()
    err = Console(stderr=True)
    with err.status("simulating") as status:
        result = run_paper(
            args.requests, Probe(), workers=args.workers, slo_sweep=not args.no_slo_sweep, progress=status.update
        )
    print_paper(result, console)
    _write(args.out, result, console)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from pdd.lab.paper.sweep import run_sweep
    from pdd.lab.plan.planner import Probe

    console = Console()
    with Console(stderr=True).status("simulating") as status:
        result = run_sweep(Probe(steps=3), args.workers, status.update)
    from rich.table import Table

    table = Table(title="pdd sim sweep: one assumption at a time, every family searched again")
    for col in ("variant", "pd-same-dc (A)", "pdd", "PDD goodput / cost / BCR vs same-dc"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, v in result["variants"].items():
        fam, delta = v["families"], v["pdd_vs_same_dc"]

        def cell(f: str, fam: dict[str, Any] = fam) -> str:
            return (
                "-"
                if f not in fam
                else f"{fam[f]['layout']}: {fam[f]['goodput_rps']:.1f} req/s, BCR {fam[f]['bcr']:.3f}"
            )

        table.add_row(
            name,
            cell("pd-same-dc"),
            cell("pdd"),
            " / ".join("-" if delta.get(k) is None else f"{delta[k]:+.1%}" for k in ("goodput", "cost", "bcr")),
        )
    console.print(table)
    _write(args.out, result, console)
    return 0


def _line(args: argparse.Namespace) -> int:
    from rich.table import Table

    from pdd.lab.calibration.line_check import line_check

    console = Console()
    r = line_check(args.mbps, args.runs, not args.no_emulator)
    table = Table(title="the spec's handoff microbenchmark: 4,649 KB over the line, fresh connections")
    for col in ("", "mean ms", "peak ms"):
        table.add_column(col, justify="left" if not col else "right")
    table.add_row("spec", f"{r['spec']['mean_ms']:.1f}", f"{r['spec']['peak_ms']:.1f}")
    tcp = r["tcp_model_25g"]
    table.add_row("TCP model, 25 Gbit/s", f"{tcp['mean_ms']:.1f}", f"{tcp['peak_ms']:.1f}")
    e = r["emulator"]
    table.add_row(
        f"TCP model, {e['mbps']:g} Mbit/s",
        f"{r['tcp_model_at_emulator_rate']['mean_ms']:.1f}",
        f"{r['tcp_model_at_emulator_rate']['peak_ms']:.1f}",
    )
    table.add_row(
        f"fluid model, {e['mbps']:g} Mbit/s (the emulator's terms)", f"{r['fluid_model_at_emulator_rate_ms']:.1f}", ""
    )
    if "mean_ms" in e:
        table.add_row(
            f"`pdd line` emulator, {e['mbps']:g} Mbit/s, {e['one_way_ms']:g} ms ({e['runs']} runs)",
            f"{e['mean_ms']:.1f}",
            f"{e['peak_ms']:.1f}",
        )
    console.print(table)
    _write(args.out, r, console)
    return 0


def _bathtub(args: argparse.Namespace) -> int:
    from pdd.lab.paper.bathtub import CACHED_PRICE, economics, plot, sweep, valleys

    console = Console()
    hits = tuple(h / 100 for h in range(0, 100, max(1, round(args.step * 100))))
    with Console(stderr=True).status("simulating") as status:
        rows = sweep(hits, tuple(range(args.seeds)), progress=status.update)
    found = valleys(rows)
    for v in found:
        console.print(
            f"valley: {v['scheduler']} at {v['hit']:.0%} hit: {v['throughput_rps']:.2f} req/s against "
            f"{v['neighbours_rps'][0]:.2f} / {v['neighbours_rps'][1]:.2f} beside it"
        )
    if not found:
        console.print("no valley in req/s: throughput never falls below both neighbours by more than its spread")
    money = economics(rows)
    for price in CACHED_PRICE:
        key = f"billed_ktok_s_at_{price:g}"
        low = min(money, key=lambda r: r[key])
        console.print(
            f"input tokens billed a second (cached at {price:.0%}): {money[0][key]:.1f}K at 0 % hit, "
            f"lowest {low[key]:.1f}K at {low['hit']:.0%}, {money[-1][key]:.1f}K at {money[-1]['hit']:.0%}"
        )
    peaks = [
        b
        for a, b, c in zip(money, money[1:], money[2:], strict=False)  # each hit with its two neighbours
        if b["tail_cost"] is not None
        and a["tail_cost"] is not None
        and c["tail_cost"] is not None
        and b["tail_cost"] > max(a["tail_cost"], c["tail_cost"])
        and b["tail_cost"] > 0.01
    ]
    console.print(
        "tails alone cost most at "
        + (", ".join(f"{p['hit']:.0%} ({p['tail_cost']:.1%})" for p in peaks) or "no hit rate")
    )
    if args.plots:
        Path(args.plots).mkdir(parents=True, exist_ok=True)
        plot(rows, Path(args.plots) / "bathtub.png")
    _write(args.out, {"rows": rows, "valleys": found, "economics": money}, console)
    return 0


def _live(args: argparse.Namespace) -> int:
    from pdd import config as cfg
    from pdd.lab.bench.summary import format_table
    from pdd.lab.calibration.local import simulate_demo
    from pdd.lab.calibration.profile import load_profile
    from pdd.lab.sim.metrics import summary
    from pdd.lab.workload.scenarios import SCENARIOS

    console = Console()
    try:
        dep, profile, scenario = cfg.load(args.config), load_profile(args.profile), SCENARIOS[args.scenario]
    except (ValueError, OSError) as e:
        print(f"pdd sim: {e}", file=sys.stderr)
        return 2
    modes = {
        mode: summary(
            simulate_demo(dep, mode, profile, scenario, args.requests or scenario.requests, scenario.rate, args.seed),
            dep.slo.ttft_ms,
            dep.slo.tpot_ms,
        )
        for mode in args.modes.split(",")
    }
    table = format_table(modes)
    table.title = f"simulated: scenario {scenario.name} on {profile.steps.source}"
    console.print(table)
    _write(args.out, {"modes": modes}, console)
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.paper:
        return _paper(args)
    if args.profile is None:
        print(
            "pdd sim: give --paper, or --profile (from `pdd sim calibrate`, with --config for a deployment file "
            "other than the built-in one) to simulate a deployment of this machine",
            file=sys.stderr,
        )
        return 2
    return _live(args)


def _calibrate(args: argparse.Namespace) -> int:
    from pdd.lab.calibration.calibrate import calibrate_main

    return calibrate_main(args)


def _check(args: argparse.Namespace) -> int:
    """Calibrate and run the demo first when their files are missing: one command."""
    from pdd.lab.calibration.check import check, load_report, print_check
    from pdd.lab.calibration.profile import load_profile

    console = Console()
    profile, report = Path(args.profile), Path(args.demo) / "report.json"
    if not profile.exists():
        subprocess.run([sys.executable, "-m", "pdd.cli", "sim", "calibrate", "--out", str(profile)], check=True)
    if not report.exists():
        subprocess.run(
            [sys.executable, "-m", "pdd.cli", "demo", "--out", args.demo, "--scenario", args.scenario], check=True
        )
    try:
        result = check(load_report(report), load_profile(profile))
    except (ValueError, KeyError) as e:
        print(f"pdd sim check: {e}", file=sys.stderr)
        return 2
    print_check(result, console)
    _write(args.out, result, console)
    return 0 if all(r["within"] for r in result["modes"].values()) else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pdd.lab.calibration.calibrate import add_calibrate_arguments

    p = sub.add_parser(
        "sim",
        help="simulate deployments at cluster scale (the published comparison, the planner's "
        "model) or this machine's (calibrated against `pdd demo`)",
    )
    p.add_argument(
        "--paper",
        action="store_true",
        help="the published scenario: every family's best layout within 88 GPUs, graded against the spec",
    )
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="--paper: judged requests of each reference run (default 1,000); a live deployment: "
        "requests (default: the scenario's)",
    )
    p.add_argument("--workers", type=int, default=2, help="--paper: layouts simulated at once (processes)")
    p.add_argument("--no-slo-sweep", action="store_true", help="--paper: skip the goodput under other SLOs")
    p.add_argument("--config", default=None, help="a `pdd up` deployment file to simulate (default: the built-in)")
    p.add_argument("--profile", default=None, help="this machine's profile, from `pdd sim calibrate`")
    p.add_argument("--scenario", default="paper", choices=("paper", "short"), help="the demo scenario to replay")
    p.add_argument("--modes", default="colocated,pd-same-dc,pd-cross-dc,pdd")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=lambda a: _run(_defaults(a)))
    steps = p.add_subparsers(dest="sim_command", metavar="{calibrate,check,sweep,bathtub,line}")
    w = steps.add_parser(
        "sweep",
        help="the published comparison again under each assumption varied (B's compute, "
        "prices, memory utilisation, weight precision)",
    )
    w.add_argument("--workers", type=int, default=2)
    w.add_argument("--out", default=None, help="JSON file for the table")
    w.set_defaults(func=_sweep)
    n = steps.add_parser("line", help="the line model against the spec's handoff microbenchmark and `pdd line`")
    n.add_argument("--mbps", type=float, default=1000.0, help="the emulator's rate (default 1000)")
    n.add_argument("--runs", type=int, default=20)
    n.add_argument("--no-emulator", action="store_true", help="the models only")
    n.add_argument("--out", default=None)
    n.set_defaults(func=_line)
    b = steps.add_parser("bathtub", help="P's throughput against the prefix-cache hit rate, two schedulers, over seeds")
    b.add_argument("--step", type=float, default=0.02, help="hit-rate resolution: 0.01 or 0.02 (default)")
    b.add_argument("--seeds", type=int, default=3)
    b.add_argument("--plots", default=None, help="directory for bathtub.png")
    b.add_argument("--out", default=None, help="JSON file for the rows")
    b.set_defaults(func=_bathtub)
    c = steps.add_parser("calibrate", help="measure this machine's engine and request path into a profile")
    add_calibrate_arguments(c)
    c.set_defaults(func=_calibrate)
    k = steps.add_parser(
        "check",
        help="simulated vs measured TTFT of a `pdd demo` run (runs calibrate and the "
        "demo first if their files are missing)",
    )
    k.add_argument("--profile", default="pdd-profile.json")
    k.add_argument("--demo", default="pdd-demo", help="a `pdd demo --out` directory")
    k.add_argument(
        "--scenario", default="paper", choices=("paper", "short"), help="the scenario, if the demo has to run"
    )
    k.add_argument("--out", default=None, help="JSON file for the table")
    k.set_defaults(func=_check)


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    if args.requests is None and args.paper:
        args.requests = 1000
    if args.workers < 1 or (args.requests is not None and args.requests < 1):
        raise SystemExit("pdd sim: --workers and --requests must be >= 1")
    return args


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from pdd.lab.plan.args import add_plan_arguments
    from pdd.lab.plan.command import plan_main

    p = sub.add_parser("plan", help="search instance counts per role and datacenter, and the line, for the best BCR")
    add_plan_arguments(p)
    p.set_defaults(func=plan_main)
