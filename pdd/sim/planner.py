"""`pdd plan`: which deployment gives the most goodput per unit of hardware cost (BCR).

The spec compares three hand-picked deployments; a user with a GPU budget, a line to
rent and two kinds of hardware wants the best one. This enumerates layouts that spend
the budget (same-datacenter PD on each hardware, cross-datacenter PD, PDD with one or
two relays, at each line bandwidth), searches each one's goodput with the simulator in
steady state (see pdd.sim.runner) and ranks them by BCR = goodput / cost per hour.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdd.sim import paper
from pdd.sim.cluster import DeploymentSpec
from pdd.sim.hardware import CATALOG, LINE_ONE_WAY_MS, LINE_PRICE_PER_GBPS_HOUR
from pdd.sim.metrics import goodput
from pdd.sim.runner import Window, run_window, steady_sessions, tail_s, turns_per_session
from pdd.sim.workload import SimSession, trace_sessions
from pdd.workload.agentic import AgenticConfig
from pdd.workload.mooncake import TRACE_BLOCK_TOKENS, TraceRecord, load_trace

# P:D instance ratios outside this band leave one side idle while the other queues.
MIN_P_PER_D, MAX_P_PER_D = 0.25, 2.0
RELAYS = (1, 2)


@dataclass(frozen=True)
class Layout:
    """A deployment to price: P (and relays) in datacenter A, MD in A when there is no
    line, else across the line in B."""

    prefill: int
    main: int
    relays: int = 0
    prefill_hw: str = "A"  # P and the relays
    main_hw: str = "A"
    line_gbps: float = 0.0  # 0: one datacenter, no line
    gpus_per_instance: int = paper.GPUS_PER_INSTANCE

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.main < 1 or self.relays < 0:
            raise ValueError("a layout needs at least one prefill and one main instance")
        if self.relays and not self.line_gbps:
            raise ValueError("relays only make sense when MD is across a line")

    @property
    def family(self) -> str:
        return "pdd" if self.relays else "cross-dc-pd" if self.line_gbps else "same-dc-pd"

    @property
    def name(self) -> str:
        if not self.line_gbps:
            return f"same-dc {self.prefill}P+{self.main}D {self.prefill_hw}"
        near = f"{self.prefill}P" + (f"+{self.relays}R" if self.relays else "")
        return f"{'pdd' if self.relays else 'cross-dc'} {near} {self.prefill_hw} | {self.main}MD {self.main_hw} " \
               f"{self.line_gbps:g}G"

    @property
    def instances(self) -> int:
        return self.prefill + self.relays + self.main

    def spec(self) -> DeploymentSpec:
        far = "B" if self.line_gbps else "A"
        gpus = self.gpus_per_instance
        roles = [paper.role("prefill", "A", self.prefill, self.prefill_hw, gpus=gpus)]
        if self.relays:
            roles.append(paper.role("relay", "A", self.relays, self.prefill_hw, gpus=gpus))
        roles.append(paper.role("main", far, self.main, self.main_hw, gpus=gpus))
        return paper.deployment(self.family, tuple(roles), self.line_gbps)


def _fits(hw: str, gpus_per_instance: int) -> bool:
    """Whether the model's weights leave room for KV on one instance of `hw`."""
    try:
        paper.kv_capacity_tokens(CATALOG[hw], paper.MODEL, gpus_per_instance)
    except ValueError:
        return False
    return True


def _splits(instances: int) -> list[tuple[int, int]]:
    """(P, D) pairs using all `instances`, within the sensible P:D band."""
    return [(p, instances - p) for p in range(1, instances)
            if MIN_P_PER_D <= p / (instances - p) <= MAX_P_PER_D]


def candidates(max_gpus: int, gpus_per_instance: int, line_gbps: Sequence[float],
               hardware: Sequence[str]) -> list[Layout]:
    """Layouts that spend the whole budget (a smaller copy of a layout has about the same
    BCR, less the line's share): same-dc PD on each hardware, and for each line P (and
    relays) on `hardware[0]` with MD on `hardware[-1]`, the far site's."""
    unknown = [h for h in hardware if h not in CATALOG]
    if unknown or not hardware:
        raise ValueError(f"hardware must be catalog names ({', '.join(CATALOG)}), got {list(hardware)}")
    usable = [h for h in hardware if _fits(h, gpus_per_instance)]
    n = max_gpus // gpus_per_instance
    layouts = [Layout(p, d, 0, hw, hw, 0.0, gpus_per_instance) for hw in usable for p, d in _splits(n)]
    near, far = hardware[0], hardware[-1]
    if near not in usable or far not in usable:
        return layouts
    for gbps in line_gbps:
        layouts += [Layout(p, d, 0, near, far, gbps, gpus_per_instance) for p, d in _splits(n)]
        layouts += [Layout(p, d, r, near, far, gbps, gpus_per_instance) for r in RELAYS for p, d in _splits(n - r)]
    return layouts


# ---- the workload a probe replays ----------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """What a goodput probe replays: sessions starting at a session rate until a time.
    `turns` converts a session rate to a request rate; `longest_output` bounds how long
    a request within the SLO runs; a trace needs the simulator's cache blocks to be its own."""

    name: str
    turns: float
    sessions: Callable[[float, float], list[SimSession]]  # (sessions/s, until s)
    longest_output: int
    block_tokens: int = paper.BLOCK_TOKENS


def agentic(config: AgenticConfig = paper.WORKLOAD) -> Workload:
    return Workload("agentic", turns_per_session(config), steady_sessions(config),
                    config.output_tokens[1])


def mooncake(records: Sequence[TraceRecord], max_context: int = paper.WORKLOAD.max_context) -> Workload:
    """The trace, its arrival times squeezed or stretched to the probed rate (its
    burstiness kept); a probe longer than the trace offers less than its rate, and its
    measured rate says so."""
    if len(records) < 2 or records[-1].timestamp_ms == records[0].timestamp_ms:
        raise ValueError("the trace needs at least two distinct timestamps to be replayed at a rate")
    natural = len(records) / ((records[-1].timestamp_ms - records[0].timestamp_ms) / 1000)

    def sessions(rate: float, end_s: float) -> list[SimSession]:
        replay = trace_sessions(records, time_scale=rate / natural, max_context=max_context)
        return [s for s in replay if s.start_s < end_s]

    return Workload("mooncake", 1.0, sessions, max(r.output_length for r in records), TRACE_BLOCK_TOKENS)


# ---- the search ---------------------------------------------------------------------------

OnProgress = Callable[[int, str], None]  # (layouts done, what is being probed)


@dataclass(frozen=True)
class Probe:
    """One steady-state run: sessions arrive for `warmup_s` unjudged, then until about
    `requests` requests are judged (short closed-loop runs never reach the load their
    rate implies; see pdd.sim.runner)."""

    requests: int
    warmup_s: float
    slo: tuple[float, float]

    def run(self, spec: DeploymentSpec, workload: Workload, session_rate: float) -> dict[str, Any]:
        rps = session_rate * workload.turns
        window = Window(self.warmup_s, self.warmup_s + self.requests / rps, tail_s(workload.longest_output, self.slo))
        return run_window(spec, workload.sessions, session_rate, window, self.slo)


def _search(spec: DeploymentSpec, workload: Workload, probe: Probe, low: float, high: float, steps: int,
            note: Callable[[str], None]) -> tuple[dict[str, Any] | None, bool]:
    """The run at the highest request rate in [low, high] that meets the SLO (None when
    even `low` misses it), and whether that was `high`."""
    runs: dict[float, dict[str, Any]] = {}

    def attainment(rps: float) -> float:
        runs[rps] = probe.run(spec, workload, rps / workload.turns)
        value = runs[rps]["slo_attainment"] or 0.0
        note(f"{rps:.1f} req/s nominal, {runs[rps]['offered_rps']:.1f} arrived -> {value:.0%} in SLO")
        return value

    best = goodput(attainment, low, high, steps)
    return runs.get(best), best == high


def _row(layout: Layout, run: dict[str, Any] | None, at_ceiling: bool) -> dict[str, Any]:
    bill = paper.bill(layout.spec())
    ttft = run["ttft_ms"] if run else {}
    rps = run["offered_rps"] if run else 0.0
    return {"layout": layout.name, "family": layout.family, "prefill": layout.prefill, "relays": layout.relays,
            "main": layout.main, "prefill_hw": layout.prefill_hw, "main_hw": layout.main_hw,
            "line_gbps": layout.line_gbps, "gpus": bill.gpus, "cost_per_hour": bill.per_hour,
            "goodput_rps": rps, "at_ceiling": at_ceiling, "bcr": rps / bill.per_hour,
            "ttft_p50_ms": ttft.get("p50"), "ttft_p99_ms": ttft.get("p99"),
            "slo_attainment": run["slo_attainment"] if run else None}


def plan(workload: Workload, slo: tuple[float, float], layouts: Sequence[Layout], requests: int, low: float,
         high: float, progress: OnProgress | None = None, steps: int = 4,
         warmup_s: float = 120.0) -> list[dict[str, Any]]:
    """Each layout's goodput (the arrival rate of the best run searched in [low, high]
    requests/s, `requests` judged per run after `warmup_s`), cost, BCR and TTFT at its
    goodput, best BCR first."""
    probe = Probe(requests, warmup_s, slo)
    rows = []
    for done, layout in enumerate(layouts):
        def note(msg: str, done: int = done, name: str = layout.name) -> None:
            if progress is not None:
                progress(done, f"{name}: {msg}")

        spec = replace(layout.spec(), block_tokens=workload.block_tokens)
        rows.append(_row(layout, *_search(spec, workload, probe, low, high, steps, note)))
        note("done")
    if progress is not None:
        progress(len(layouts), "done")
    return sorted(rows, key=lambda r: (-r["bcr"], r["cost_per_hour"]))


# ---- the command ---------------------------------------------------------------------------

def _floats(value: str) -> list[float]:
    try:
        return [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {value!r}") from None


def _names(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _workload_arg(value: str) -> tuple[str, Path | None]:
    kind, _, path = value.partition(":")
    if kind == "agentic" and not path:
        return "agentic", None
    if kind == "mooncake" and path:
        return "mooncake", Path(path)
    raise argparse.ArgumentTypeError("expected 'agentic' or 'mooncake:PATH'")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `pdd plan`; defaults are the spec's setting (pdd/sim/paper.py)."""
    p.add_argument("--max-gpus", type=int, default=88, help="GPU budget; layouts spend all of it (default 88)")
    p.add_argument("--gpus-per-instance", type=int, default=paper.GPUS_PER_INSTANCE,
                   help=f"devices per instance (default {paper.GPUS_PER_INSTANCE}: what the model needs)")
    p.add_argument("--line-gbps", type=_floats, default=[25.0, 100.0],
                   help="line bandwidths to try for the cross-datacenter layouts (default 25,100; every line adds "
                        "about 15 layouts to the search)")
    p.add_argument("--hardware", type=_names, default=["A", "B"],
                   help=f"catalog names ({', '.join(CATALOG)}): the first is datacenter A's (P, relays), the last "
                        "B's (MD across the line); same-dc PD is tried on each (default A,B)")
    p.add_argument("--workload", type=_workload_arg, default=("agentic", None), metavar="agentic|mooncake:PATH",
                   help="agentic: the spec's 64K agentic sessions (default); mooncake: the trace, its arrivals "
                        "rescaled to each probed rate")
    p.add_argument("--requests", type=int, default=300,
                   help="requests judged per goodput probe, after the warm-up (default 300)")
    p.add_argument("--warmup-s", type=float, default=120.0,
                   help="seconds of arrivals before a probe judges any, so sessions (minutes long) reach the load "
                        "their rate implies (default 120)")
    p.add_argument("--rps", type=_floats, default=[4.0, 64.0], metavar="LOW,HIGH",
                   help="request rates the goodput search spans (default 4,64)")
    p.add_argument("--steps", type=int, default=4, help="bisection steps per layout (default 4)")
    p.add_argument("--slo-ttft-ms", type=float, default=paper.SLO_TTFT_MS)
    p.add_argument("--slo-tpot-ms", type=float, default=paper.SLO_TPOT_MS)
    p.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    p.add_argument("--out", type=Path, help="write every layout's numbers and the assumptions here (JSON)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def assumptions(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    return {"model": paper.MODEL.to_dict(), "hardware": {k: v.to_dict() for k, v in CATALOG.items()},
            "gpus_per_instance": args.gpus_per_instance,
            "line": {"price_per_gbps_hour": LINE_PRICE_PER_GBPS_HOUR, "one_way_ms": LINE_ONE_WAY_MS},
            "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "attainment": 0.9},
            "workload": workload.name, "turns_per_session": workload.turns,
            "probe": {"judged_requests": args.requests, "warmup_s": args.warmup_s}, "rps_range": args.rps,
            "steps": args.steps}


def _assumption_line(args: argparse.Namespace, workload: Workload) -> str:
    hw = "; ".join(f"GPU {h.name} ({h.note}) costs {h.price_per_hour:g}" for h in CATALOG.values())
    return (f"{paper.MODEL.name} ({paper.MODEL.note}) on {args.gpus_per_instance} GPUs per instance. {hw}. "
            f"A line costs {LINE_PRICE_PER_GBPS_HOUR:g} per Gbit/s, {LINE_ONE_WAY_MS:g} ms one way. "
            f"SLO: TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms for 90 % of requests. "
            f"Workload: {workload.name}; each probe judges {args.requests} requests after {args.warmup_s:g} s of "
            f"warm-up, {args.rps[0]:g}-{args.rps[1]:g} req/s searched in steps of "
            f"{(args.rps[1] / args.rps[0]) ** (0.5 ** args.steps) - 1:.0%}. Costs in GPU A hours per hour; "
            f"BCR = goodput / cost.")


def _table(rows: list[dict[str, Any]], total: int):
    from rich.table import Table

    table = Table(title=f"pdd plan: the best {len(rows)} of {total} layouts by BCR (G: line Gbit/s)")
    for col in ("#", "layout", "GPUs", "goodput req/s", "cost/h", "BCR", "TTFT p50/p99 ms"):
        table.add_column(col, justify="left" if col in ("layout", "GPUs") else "right")
    for i, r in enumerate(rows, 1):
        ttft = "-" if r["ttft_p50_ms"] is None else f"{r['ttft_p50_ms']:,.0f}/{r['ttft_p99_ms']:,.0f}"
        table.add_row(str(i), r["layout"], "+".join(f"{n}{k}" for k, n in r["gpus"].items()),
                      (">=" if r["at_ceiling"] else "") + f"{r['goodput_rps']:.1f}", f"{r['cost_per_hour']:.1f}",
                      f"{r['bcr']:.3f}", ttft)
    return table


def _prepare(args: argparse.Namespace) -> tuple[list[Layout], Workload]:
    """The layouts and the workload, or a ValueError saying what is wrong with the options."""
    if args.requests < 1 or args.steps < 0 or args.top < 1 or args.warmup_s < 0:
        raise ValueError("--requests and --top must be >= 1, --steps and --warmup-s >= 0")
    if len(args.rps) != 2 or not 0 < args.rps[0] < args.rps[1]:
        raise ValueError("--rps needs LOW,HIGH with 0 < LOW < HIGH")
    layouts = candidates(args.max_gpus, args.gpus_per_instance, args.line_gbps, args.hardware)
    if not layouts:
        raise ValueError("no layout fits: the budget must hold two instances the model fits on")
    kind, path = args.workload
    return layouts, agentic() if kind == "agentic" else mooncake(load_trace(path))


def plan_main(args: argparse.Namespace) -> int:
    """Search, print the best `--top` layouts and the assumptions, write `--out`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    try:
        layouts, workload = _prepare(args)
    except (ValueError, OSError) as exc:
        print(f"pdd plan: {exc}", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    started = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=args.quiet or not console.is_terminal) as bar:
        task = bar.add_task("layouts", total=len(layouts))
        rows = plan(workload, (args.slo_ttft_ms, args.slo_tpot_ms), layouts, args.requests, args.rps[0],
                    args.rps[1], lambda done, msg: bar.update(task, completed=done, description=msg), args.steps,
                    args.warmup_s)
    wall = time.perf_counter() - started
    out = Console()
    out.print(_table(rows[: args.top], len(rows)))
    if any(r["at_ceiling"] for r in rows[: args.top]):
        out.print(">= : still within the SLO at the top of the search; raise the --rps ceiling to rank these.")
    out.print(f"Assumptions: {_assumption_line(args, workload)}")
    out.print(f"{len(layouts)} layouts searched in {wall:.0f} s.")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"layouts": rows, "assumptions": assumptions(args, workload),
                                        "wall_s": wall}, indent=2) + "\n", encoding="utf-8")
    return 0
