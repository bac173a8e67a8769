"""`pdd sim` (the published comparison, a live deployment simulated, the calibration
check, the calibration itself) and `pdd plan`."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from rich.console import Console


def _write(path: str | None, data: dict, console: Console) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")
        console.print(f"wrote {path}", markup=False, soft_wrap=True)


def _paper(args: argparse.Namespace) -> int:
    from pdd.sim.compare import print_paper, run_paper

    console = Console()
    err = Console(stderr=True)
    with err.status("simulating") as status:
        result = run_paper(args.requests, args.low, args.high, progress=status.update)
    print_paper(result, console)
    if args.plots:
        from pdd.sim.bathtub import bathtub_figures

        with err.status("the bathtub") as status:
            result["bathtub"] = bathtub_figures(Path(args.plots), status.update)
        console.print(f"plots in {args.plots}", markup=False, soft_wrap=True)
    _write(args.out, result, console)
    return 0


def _live(args: argparse.Namespace) -> int:
    from pdd import config as cfg
    from pdd.bench.summary import format_table
    from pdd.sim.calibrate import load_profile
    from pdd.sim.local import simulate_demo
    from pdd.sim.metrics import summary
    from pdd.workload.scenarios import SCENARIOS

    console = Console()
    try:
        dep, profile, scenario = cfg.load(args.config), load_profile(args.profile), SCENARIOS[args.scenario]
    except (ValueError, OSError) as e:
        print(f"pdd sim: {e}", file=sys.stderr)
        return 2
    modes = {mode: summary(simulate_demo(dep, mode, profile, scenario, args.requests or scenario.requests,
                                         scenario.rate, args.seed), dep.slo.ttft_ms, dep.slo.tpot_ms)
             for mode in args.modes.split(",")}
    table = format_table(modes)
    table.title = f"simulated: scenario {scenario.name} on {profile.steps.source}"
    console.print(table)
    _write(args.out, {"modes": modes}, console)
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.paper:
        return _paper(args)
    if args.profile is None:
        print("pdd sim: give --paper, or --profile (from `pdd sim calibrate`, with --config for a deployment file "
              "other than the built-in one) to simulate a deployment of this machine", file=sys.stderr)
        return 2
    return _live(args)


def _calibrate(args: argparse.Namespace) -> int:
    from pdd.sim.calibrate import calibrate_main

    return calibrate_main(args)


def _check(args: argparse.Namespace) -> int:
    """Calibrate and run the demo first when their files are missing: one command."""
    from pdd.sim.calibrate import load_profile
    from pdd.sim.check import check, load_report, print_check

    console = Console()
    profile, report = Path(args.profile), Path(args.demo) / "report.json"
    if not profile.exists():
        subprocess.run([sys.executable, "-m", "pdd.cli", "sim", "calibrate", "--out", str(profile)], check=True)
    if not report.exists():
        subprocess.run([sys.executable, "-m", "pdd.cli", "demo", "--out", args.demo, "--scenario", args.scenario],
                       check=True)
    try:
        result = check(load_report(report), load_profile(profile))
    except (ValueError, KeyError) as e:
        print(f"pdd sim check: {e}", file=sys.stderr)
        return 2
    print_check(result, console)
    _write(args.out, result, console)
    return 0 if all(r["within"] for r in result["modes"].values()) else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pdd.sim.calibrate import add_calibrate_arguments

    p = sub.add_parser("sim", help="simulate deployments at cluster scale (the published comparison, the planner's "
                                   "model) or this machine's (calibrated against `pdd demo`)")
    p.add_argument("--paper", action="store_true", help="the published scenario and its two baselines")
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument("--requests", type=int, default=None,
                   help="--paper: judged requests of the reference run (default 10,000); a live deployment: "
                        "requests (default: the scenario's)")
    p.add_argument("--low", type=float, default=0.5, help="--paper: lowest session rate the goodput search tries")
    p.add_argument("--high", type=float, default=8.0, help="--paper: highest session rate it tries")
    p.add_argument("--plots", default=None, help="--paper: directory for the bathtub and line-bandwidth PNGs")
    p.add_argument("--config", default=None, help="a `pdd up` deployment file to simulate (default: the built-in)")
    p.add_argument("--profile", default=None, help="this machine's profile, from `pdd sim calibrate`")
    p.add_argument("--scenario", default="paper", choices=("paper", "short"), help="the demo scenario to replay")
    p.add_argument("--modes", default="colocated,pd-same-dc,pd-cross-dc,pdd")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=lambda a: _run(_defaults(a)))
    steps = p.add_subparsers(dest="sim_command", metavar="{calibrate,check}")
    c = steps.add_parser("calibrate", help="measure this machine's engine and request path into a profile")
    add_calibrate_arguments(c)
    c.set_defaults(func=_calibrate)
    k = steps.add_parser("check", help="simulated vs measured TTFT of a `pdd demo` run (runs calibrate and the "
                                       "demo first if their files are missing)")
    k.add_argument("--profile", default="pdd-profile.json")
    k.add_argument("--demo", default="pdd-demo", help="a `pdd demo --out` directory")
    k.add_argument("--scenario", default="paper", choices=("paper", "short"), help="the scenario, if the demo has to run")
    k.add_argument("--out", default=None, help="JSON file for the table")
    k.set_defaults(func=_check)


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    if args.requests is None and args.paper:
        args.requests = 10_000
    if not math.isfinite(args.low) or args.low <= 0 or args.high <= args.low:
        raise SystemExit("pdd sim: need 0 < --low < --high")
    return args


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from pdd.sim.plan_cli import add_plan_arguments, plan_main

    p = sub.add_parser("plan", help="search instance counts per role and datacenter, and the line, for the best BCR")
    add_plan_arguments(p)
    p.set_defaults(func=plan_main)
