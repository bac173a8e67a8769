"""`pdd plan`: the layouts of a GPU budget, searched for the best BCR per family
(`pdd.lab.sim.planner`), printed with every assumption."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdd.lab.sim import paper
from pdd.lab.sim.plan_workload import Workload, agentic, mooncake
from pdd.lab.sim.planner import (
    Probe,
    best_per_family,
    breakdown,
    candidates,
    cheapest_at,
    head_to_head,
    published,
    search,
    search_resolution,
    tie,
)
from pdd.lab.workload.mooncake import load_trace
from pdd.perf.hardware import LINE_PRICE_PER_GBPS_HOUR


def _floats(value: str) -> list[float]:
    try:
        return [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {value!r}") from None


def _pair(kind: type) -> Callable[[str], tuple[Any, Any]]:
    def parse(value: str) -> tuple[Any, Any]:
        try:
            low, high = (kind(v) for v in value.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected LOW,HIGH, got {value!r}") from None
        return low, high

    return parse


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
    """Options of `pdd plan`; defaults are the spec's setting (pdd/lab/sim/paper.py)."""
    p.add_argument("--max-gpus", type=int, default=88, help="GPU budget; layouts spend all of it (default 88)")
    p.add_argument(
        "--line-gbps",
        type=_floats,
        default=[25.0, 100.0],
        help="line bandwidths to try for the cross-datacenter layouts (default 25,100)",
    )
    p.add_argument(
        "--chips",
        type=_names,
        default=["A", "B"],
        help="A and/or B: the first is datacenter A's (P, relays), the last B's (MD across the line); "
        "same-dc PD is tried on each (default A,B)",
    )
    p.add_argument(
        "--workload",
        type=_workload_arg,
        default=("agentic", None),
        metavar="agentic|mooncake:PATH",
        help="agentic: the spec's 64K agentic sessions (default); mooncake: the trace, its arrivals "
        "rescaled to each probed rate",
    )
    p.add_argument(
        "--tool-time-s",
        type=_pair(float),
        metavar="LOW,HIGH",
        help="agentic: seconds a tool runs between a turn's answer and the next turn, drawn uniformly "
        "(default none); the session's KV waits in the decode side's cache meanwhile",
    )
    p.add_argument(
        "--task-tokens",
        type=_pair(int),
        metavar="LOW,HIGH",
        help=f"agentic: a session's first prompt beyond the system prompt, drawn uniformly (default "
        f"{paper.WORKLOAD.task_tokens[0]},{paper.WORKLOAD.task_tokens[1]}); near the context "
        f"({paper.WORKLOAD.max_context:,}) every request is about that long",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=Probe.requests,
        help=f"requests judged per goodput probe, after the warm-up (default {Probe.requests})",
    )
    p.add_argument(
        "--warmup-s",
        type=float,
        default=Probe.warmup_s,
        help=f"seconds of arrivals before a probe judges any, after a warm start (default {Probe.warmup_s:g})",
    )
    p.add_argument(
        "--min-window-s",
        type=float,
        default=Probe.min_window_s,
        help=f"shortest judged window of a probe, whatever its requests (default {Probe.min_window_s:g})",
    )
    p.add_argument("--steps", type=int, default=Probe.steps, help=f"bisection steps per layout (default {Probe.steps})")
    p.add_argument(
        "--workers",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="layouts simulated at once, one process each (default: 2, or the cores if fewer)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=paper.SLO_TTFT_MS)
    p.add_argument("--slo-tpot-ms", type=float, default=paper.SLO_TPOT_MS)
    p.add_argument(
        "--attainment",
        type=float,
        default=Probe.attainment,
        help="share of requests within the SLO that goodput requires (default 0.9)",
    )
    p.add_argument("--top", type=int, default=8, help="layouts to print (default 8)")
    p.add_argument(
        "--exact",
        action="store_true",
        help="find every simulated layout's goodput (default: only until it is shown not to beat its "
        "family's best, one probe at the rate that would)",
    )
    p.add_argument(
        "--published",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="evaluate the publication's layouts as given (88 A against 43 A + 32 B, the nearest buildable), "
        "head to head, on the first --line-gbps (default: yes; four layouts, about 10 s on two cores)",
    )
    p.add_argument(
        "--target-rps",
        type=float,
        help="also find each family's cheapest layout within the budget that meets the SLO at this many "
        "requests a second (one probe at that rate a layout, cheapest first)",
    )
    p.add_argument(
        "--dp-attention",
        action="store_true",
        help="data-parallel attention: every GPU holds and reads the dense weights (23 GB), as SGLang serves "
        "DeepSeek-class models. A keeps less room for KV than B: rho 1.66 where it is 0.98, the premise the "
        "publication's figures imply (BENCHMARKS.md)",
    )
    p.add_argument("--out", type=Path, help="write every layout's numbers and the assumptions here (JSON)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def probe_of(args: argparse.Namespace) -> Probe:
    return Probe(
        args.requests,
        args.warmup_s,
        (args.slo_ttft_ms, args.slo_tpot_ms),
        args.attainment,
        args.steps,
        args.min_window_s,
    )


def assumption_line(probe: Probe, workload: Workload, setting: paper.Setting = paper.SETTING) -> str:
    chips = "; ".join(
        f"GPU {hw} = {c.name} ({c.bf16_tflops:g} TFLOPS BF16, {c.mem_bw_gbs / 1000:g} TB/s, "
        f"{c.mem_gb:g} GB) at {c.price_per_hour:g}, {setting.instance_gpus(hw)} per instance"
        for hw, c in (("A", setting.a), ("B", setting.b))
    )
    attention = "data-parallel attention (the dense weights on every GPU)" if setting.dp_attention else "TP attention"
    return (
        f"{setting.model.name} ({setting.model.note}), {attention}. {chips}. Memory "
        f"{setting.memory_utilization:.0%} for weights + KV. A line costs {LINE_PRICE_PER_GBPS_HOUR:g} per "
        f"Gbit/s, {setting.one_way_ms:g} ms one way, "
        f"TCP (initial window {setting.tcp.initial_window_segments}, {setting.tcp.window_bytes / 2**20:g} MiB "
        f"buffers). SLO: TTFT <= {probe.slo[0]:g} ms and TPOT <= {probe.slo[1]:g} ms for "
        f"{probe.attainment:.0%} of requests. Workload: {workload.name}; each probe judges {probe.requests} "
        f"requests, and at least {probe.min_window_s:g} s, after a warm start and {probe.warmup_s:g} s; "
        f"goodput found to "
        f"{search_resolution(probe):.0%}. Costs in GPU A hours per hour; BCR = goodput / cost."
    )


def _table(rows: list[dict[str, Any]], total: int, title: str):
    from rich.table import Table

    table = Table(title=title)
    for col in ("#", "layout", "GPUs", "goodput req/s", "capacity", "cost/h", "BCR", "binding", "TTFT p50/p99 ms"):
        table.add_column(col, justify="left" if col in ("layout", "GPUs", "binding") else "right")
    for i, r in enumerate(rows, 1):
        ttft = (
            "-"
            if r["ttft_p50_ms"] is None or r["goodput_rps"] is None
            else f"{r['ttft_p50_ms']:,.0f}/{r['ttft_p99_ms']:,.0f}"
        )
        if r["goodput_rps"] is None:  # missed the SLO at the rate that would beat its family's best
            goodput, bcr = f"missed {r['missed_rps']:.1f}", "-"
        else:
            goodput, bcr = f"{r['goodput_rps']:.1f}" if r["simulated"] else "pruned", f"{r['bcr']:.3f}"
        table.add_row(
            str(i),
            r["layout"],
            "+".join(f"{n}{k}" for k, n in r["gpus"].items()),
            goodput,
            f"{r['capacity_rps']:.1f}",
            f"{r['cost_per_hour']:.1f}",
            bcr,
            r["binding"],
            ttft,
        )
    return table


def setting_of(args: argparse.Namespace) -> paper.Setting:
    return replace(paper.SETTING, dp_attention=args.dp_attention)


def _prepare(args: argparse.Namespace) -> tuple[list, Workload]:
    """The layouts and the workload, or a ValueError saying what is wrong with the options."""
    if args.requests < 1 or args.steps < 0 or args.top < 1 or args.warmup_s < 0 or args.workers < 1:
        raise ValueError("--requests, --workers and --top must be >= 1, --steps and --warmup-s >= 0")
    if args.target_rps is not None and not args.target_rps > 0:
        raise ValueError("--target-rps must be > 0")
    if not 0 < args.attainment < 1:
        raise ValueError("--attainment must lie in (0, 1)")
    layouts = candidates(args.max_gpus, args.line_gbps, args.chips, setting_of(args))
    if not layouts:
        raise ValueError("no layout fits: the budget must hold two instances the model fits on")
    kind, path = args.workload
    if kind != "agentic":
        if args.tool_time_s or args.task_tokens:
            raise ValueError("--tool-time-s and --task-tokens shape the agentic workload, not a trace")
        return layouts, mooncake(load_trace(path))
    config = paper.WORKLOAD
    if args.tool_time_s:
        config = replace(config, tool_time_s=args.tool_time_s)
    if args.task_tokens:
        config = replace(config, task_tokens=args.task_tokens)
    return layouts, agentic(config)


def plan_main(args: argparse.Namespace) -> int:
    """Search, print the best `--top` layouts, each family's best and the assumptions, write `--out`."""
    from rich.console import Console

    from pdd.progress import progress_bar

    try:
        layouts, workload = _prepare(args)
    except (ValueError, OSError) as exc:
        print(f"pdd plan: {exc}", file=sys.stderr)
        return 2
    probe, setting = probe_of(args), setting_of(args)
    console = Console(stderr=True)
    started = time.perf_counter()
    with progress_bar(console, args.quiet) as bar:
        task = bar.add_task("layouts", total=len(layouts))
        rows = search(
            layouts,
            workload,
            probe,
            setting,
            workers=args.workers,
            progress=lambda done, total, msg: bar.update(task, completed=done, total=total, description=msg),
            exact=args.exact,
        )
    wall = time.perf_counter() - started
    out = Console()
    simulated = sum(r["simulated"] for r in rows)
    out.print(
        _table(
            rows[: args.top],
            len(rows),
            f"pdd plan: the best {min(args.top, len(rows))} of {len(rows)} "
            f"layouts by BCR ({simulated} simulated; G: line Gbit/s)",
        )
    )
    families = best_per_family(rows)
    out.print(_table(list(families.values()), len(families), "each family's best"))
    out.print(f"Assumptions: {assumption_line(probe, workload, setting)}")
    ratio = paper.rho(setting, tpot_ms=probe.slo[1])
    out.print(f"What the verdict rests on: {ratio.line() if ratio else 'rho: the model fits no instance of A or B'}")
    versus, steps, given = None, None, []
    if args.published:
        with progress_bar(console, args.quiet) as bar:
            task = bar.add_task("the publication's layouts", total=4)
            given = search(
                published(args.line_gbps[0], setting),
                workload,
                probe,
                setting,
                args.workers,
                progress=lambda done, total, msg: bar.update(task, completed=done, total=total, description=msg),
                exact=True,
            )
        out.print(_table(given, len(given), "the publication's layouts, as given (nearest buildable)"))
        versus = head_to_head(given, setting)
        out.print(_versus_line(versus, probe))
        steps = breakdown(given)
        out.print(_breakdown_table(steps, probe))
    at_target: list[dict[str, Any]] = []
    if args.target_rps is not None:
        everything = candidates(args.max_gpus, args.line_gbps, args.chips, setting, spend=False)
        with progress_bar(console, args.quiet) as bar:
            task = bar.add_task("at the target", total=None)
            found = cheapest_at(
                everything,
                args.target_rps,
                workload,
                probe,
                setting,
                progress=lambda done, _total, msg: bar.update(task, completed=done, description=msg),
            )
        at_target = [found[f] for f in sorted(found, key=lambda f: found[f]["cost_per_hour"])]
        title = (
            f"each family's cheapest layout within {args.max_gpus} GPUs that meets the SLO at {args.target_rps:g} req/s"
        )
        out.print(_table(at_target, len(at_target), title))
        missing = sorted({lay.family for lay in everything} - set(found))
        if missing:
            out.print(f"No layout of {', '.join(missing)} within the budget meets it.")
    probes = sum(r["probes"] for r in rows)
    out.print(
        f"{len(layouts)} layouts, {simulated} simulated ({probes} probes), in {wall:.0f} s ({args.workers} worker(s))"
        + (f"; the publication's, {sum(r['probes'] for r in given)} probes more" if given else "")
        + f"; {time.perf_counter() - started:.0f} s in all."
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)

        def slim(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [{k: v for k, v in r.items() if k != "run"} for r in rows]

        args.out.write_text(
            json.dumps(
                {
                    "layouts": slim(rows),
                    "assumptions": setting.to_dict()
                    | {
                        "slo": {"ttft_ms": probe.slo[0], "tpot_ms": probe.slo[1], "attainment": probe.attainment},
                        "workload": workload.name,
                        "probe": {
                            "judged_requests": probe.requests,
                            "warmup_s": probe.warmup_s,
                            "min_window_s": probe.min_window_s,
                            "steps": probe.steps,
                        },
                    },
                    "rho": ratio.to_dict() if ratio else None,
                    "published": versus,
                    "published_layouts": slim(given),
                    "breakdown": steps,
                    "at_target": {"target_rps": args.target_rps, "layouts": slim(at_target)}
                    if args.target_rps is not None
                    else None,
                    "wall_s": wall,
                },
                indent=2,
                default=str,
            )
            + "\n",
            encoding="utf-8",
        )
    return 0


def _breakdown_table(steps: list[dict[str, Any]], probe: Probe):
    from rich.table import Table

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:+.1%}"

    table = Table(
        title="from same-dc PD on A to PDD, one change at a time (each against the row before; "
        f"tie: inside the search's {search_resolution(probe):.0%})"
    )
    for col in ("step", "layout", "goodput", "cost", "BCR", "TTFT p99"):
        table.add_column(col, justify="left" if col in ("step", "layout") else "right")
    for s in steps:
        table.add_row(
            s["step"],
            s["layout"] or "-",
            judged(s["goodput_change"], probe, short=True),
            pct(s["cost_change"]),  # (exact: goodput, and so BCR, are known to the search's resolution)
            judged(s["bcr_change"], probe, short=True),
            pct(s["ttft_p99_change"]),
        )
    return table


def judged(change: float | None, probe: Probe, short: bool = False) -> str:
    """A change of goodput or BCR, a tie where it is inside the search's resolution (`tie`)."""
    if change is None:
        return "-"
    if not tie(change, probe):
        return f"{change:+.1%}"
    return (
        f"{change:+.1%} (tie)"
        if short
        else f"{change:+.1%} (a tie: inside the search's {search_resolution(probe):.0%})"
    )


def _versus_line(versus: dict[str, Any] | None, probe: Probe) -> str:
    if versus is None:
        return "Head to head: a published layout met the SLO at no rate searched."
    pub = versus["published"]
    changes = [versus[k] for k in ("goodput_change", "bcr_change", "bcr_change_their_costs")]
    ties = (
        f" (A tie: inside the search's {search_resolution(probe):.0%}.)" if any(tie(c, probe) for c in changes) else ""
    )
    goodput, bcr, theirs = (judged(c, probe, short=True) for c in changes)
    return (
        f"Head to head, PDD against same-dc PD as published: goodput {goodput} "
        f"(published {pub['goodput_change']:+.1%}), cost {versus['cost_change']:+.1%} as built, line priced "
        f"({versus['their_cost_change']:+.1%} by the publication's GPU counts; published "
        f"{pub['cost_change'][0]:+.1%} to {pub['cost_change'][1]:+.1%}), BCR {bcr} "
        f"({theirs} at the publication's costs; published up to "
        f"{pub['bcr_change']:+.1%}). {_flip_line(versus)}{ties}"
    )


def _flip_line(versus: dict[str, Any]) -> str:
    """What would make PDD's BCR equal same-dc PD's, one figure at a time."""
    price = versus["flip_b_price"]
    if price is None:
        at_price = ""
    elif price <= 0:
        at_price = f"; no price of B would, not even free B GPUs (B is at {versus['b_price']:g} a GPU hour)"
    else:
        at_price = f", or B at {price:.2f} a GPU hour (now {versus['b_price']:g})"
    return f"The BCRs would be equal at a PDD goodput of {versus['flip_goodput_rps']:.1f} req/s{at_price}."
