"""`pdd soak`: the command line; starts the deployment, runs the plan, writes the report.

The line is the `paper` scenario's (`pdd.lab.workload.scenarios`: 50 Mbit/s, 2 ms +- 0.5
ms one way, the spec's evaluation scaled to the tiny model), whatever the config's
[line] says, so soaks of different days face the same line. Exit code 1 when any
request was lost, a page leaked, a process crashed or the deployment did not come back.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NoReturn

from pdd.lab import soak
from pdd.lab.soak.faults import KINDS

DEFAULT_REQUESTS = 3000


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "soak",
        help="many requests through a local deployment while faults strike; "
        "counts lost requests and leaked pages (--matrix: fault x outcome)",
        description=soak.__doc__.splitlines()[0],
    )
    p.add_argument(
        "--config",
        help="deployment TOML (default: the built-in one); its [line] is replaced by the paper scenario's line",
    )
    p.add_argument("--mode", default="pdd", help="deployment mode (default pdd)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--requests", type=int, help=f"requests to send (default {DEFAULT_REQUESTS})")
    size.add_argument("--duration-s", type=float, help="send requests for this long instead")
    p.add_argument("--concurrency", type=int, default=8, help="clients, each with one request at a time (default 8)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the requests and of the faults' kinds, times and durations"
    )
    p.add_argument(
        "--faults",
        default="all",
        help=f"comma-separated, from {','.join(KINDS)}; 'all' (default: those the mode has) or 'none'",
    )
    p.add_argument(
        "--fault-every-s",
        type=float,
        default=10.0,
        help="mean pause between the end of one fault and the next (0.5-1.5x; default 10)",
    )
    p.add_argument(
        "--matrix",
        action="store_true",
        help="each fault kind alone, --repeats times, and its pages "
        "settled; print the fault x outcome matrix as Markdown",
    )
    p.add_argument("--repeats", type=int, default=2, help="--matrix: strikes per kind (default 2)")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=120.0,
        help="a request with no end after this long is lost (default 120: past the router's 60 s first-token timeout)",
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=150.0,
        help="after the last request, how long pages may take to come back before they count as leaked "
        "(default 150: past MD's 60-120 s watchdog for a handoff that never comes)",
    )
    p.add_argument("--out", type=Path, default=Path("pdd-soak.json"), help="JSON report (default pdd-soak.json)")
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the run directory (config, logs); kept anyway when the run fails its checks",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _kinds(text: str, available: list[str]) -> list[str]:
    if text == "all":
        return available
    return [] if text == "none" else [k.strip() for k in text.split(",") if k.strip()]


def _on_sigterm(signum: int, frame: Any) -> NoReturn:
    raise SystemExit(128 + signum)  # unwinds through the launcher's stop()


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdd import config as cfg
    from pdd.lab.deploy import resolve
    from pdd.lab.soak import run as soak_run
    from pdd.lab.soak.cluster import Cluster
    from pdd.lab.soak.faults import check_kinds
    from pdd.lab.soak.report import print_summary
    from pdd.lab.workload.scenarios import SCENARIOS

    if args.mode not in cfg.MODES:
        print(f"pdd soak: mode must be one of {', '.join(cfg.MODES)}", file=sys.stderr)
        return 2
    dep = cfg.load(args.config)
    paper = SCENARIOS["paper"]
    line = replace(dep.line, bandwidth_mbps=paper.bandwidth_mbps, delay_ms=paper.delay_ms, jitter_ms=paper.jitter_ms)
    dep = resolve(replace(dep, line=line), args.mode, 0)
    run_dir = Path(tempfile.mkdtemp(prefix="pdd-soak-"))
    cluster = Cluster(dep, run_dir)
    available = [k for k in KINDS if check_kinds([k], cluster) is None]
    kinds = _kinds(args.faults, available)
    if problem := check_kinds(kinds, cluster):
        print(f"pdd soak: {problem}", file=sys.stderr)
        return 2
    requests = DEFAULT_REQUESTS if args.requests is None and args.duration_s is None else args.requests
    plan = soak_run.SoakPlan(
        tuple(kinds),
        args.concurrency,
        args.seed,
        args.timeout_s,
        args.settle_s,
        requests,
        args.duration_s,
        args.fault_every_s,
        args.repeats if args.matrix else 0,
    )
    signal.signal(signal.SIGTERM, _on_sigterm)
    print(f"pdd soak: mode {args.mode}, run directory {run_dir}", flush=True)
    try:
        cluster.start()
        result = soak_run.run(cluster, plan, args.quiet)
    except RuntimeError as e:  # a child did not start
        print(f"pdd soak: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    result["config"] = {
        "argv": sys.argv[1:],
        "plan": asdict(plan),
        "mode": args.mode,
        "run_dir": str(run_dir),
        "line": asdict(dep.line),
        "router": asdict(dep.router),
        "liveness": asdict(dep.liveness),
        "topology": asdict(dep.topology),
    }
    result["config"]["router"].pop("api_key", None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_summary(Console(), result)
    failures = soak_run.passed(result)
    for why in failures:
        print(f"pdd soak: FAILED: {why}", file=sys.stderr)
    if failures or args.keep:
        print(f"pdd soak: logs kept in {run_dir}", file=sys.stderr)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(f"pdd soak: report {args.out}", flush=True)
    return 1 if failures else 0
