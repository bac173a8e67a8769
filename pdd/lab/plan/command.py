"""`pdd plan`: the layouts of a GPU budget, searched for the best BCR per family
(`pdd.lab.plan.planner`), printed with every assumption."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from pdd.lab.plan import paper
from pdd.lab.plan.args import DEFAULTS, probe_of
from pdd.lab.plan.file import Fleet, read_plan_file
from pdd.lab.plan.layouts import choose, smallest
from pdd.lab.plan.planner import Layout, OnProgress, Probe, candidates, cells_for
from pdd.lab.plan.published import breakdown, cheapest_at, head_to_head, published
from pdd.lab.plan.report import (
    assumption_line,
    assumptions,
    breakdown_table,
    cells_line,
    rows_table,
    seeds_line,
    sides_table,
    slim,
    step_lines,
    verdict_lines,
    versus_line,
)
from pdd.lab.plan.search import Search, run
from pdd.lab.plan.verdict import best_per_family, screen_error, seed_spread, verdict
from pdd.lab.plan.workload import Workload, agentic, mooncake
from pdd.lab.workload.mooncake import load_trace


@dataclass(frozen=True)
class Plan:
    """What a `pdd plan` run searches: its layouts, workload, setting (each side's layout
    chosen) and fleet, and every side layout priced."""

    layouts: list[Layout]
    workload: Workload
    setting: paper.Setting
    fleet: Fleet
    sides: list[dict[str, Any]]
    steps: list[dict[str, Any]]  # each side's step times' source (`pdd.lab.plan.measured`); empty: the roofline's
    cells: int  # the identical deployments the budget is planned in (`--cell-gpus`)


def setting_of(args: argparse.Namespace) -> tuple[paper.Setting, Fleet]:
    """The setting of the plan file (if any) with each side's layout chosen; fills the
    options the command line left unset from the file, then from `DEFAULTS`."""
    setting, fleet = paper.SETTING, Fleet()
    if args.plan_file is not None:
        setting, fleet = read_plan_file(args.plan_file, args)
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return setting, fleet


def _prepare(args: argparse.Namespace) -> Plan:
    """The plan's layouts and workload, or a ValueError saying what is wrong with the options."""
    setting, fleet = setting_of(args)
    if (
        min(args.requests, args.top, args.workers, args.seeds) < 1
        or min(args.steps, args.warmup_s, args.contenders, args.cell_gpus) < 0
    ):
        raise ValueError(
            "--requests, --workers, --seeds, --top must be >= 1, --steps, --warmup-s, --contenders, --cell-gpus >= 0"
        )
    if args.target_rps is not None and not args.target_rps > 0:
        raise ValueError("--target-rps must be > 0")
    if not 0 < args.attainment < 1:
        raise ValueError("--attainment must lie in (0, 1)")
    setting, sides = choose(setting, args.slo_tpot_ms / 1000, args.attention)
    steps: list[dict[str, Any]] = []
    if args.aiconfigurator:
        try:
            from pdd.lab.plan.measured import measure
        except ImportError:
            raise ValueError("--aiconfigurator needs the plan extra: pip install 'pdd-serving[plan]'") from None
        setting, steps = measure(setting, args.aiconfigurator)
    cells = cells_for(args.max_gpus, args.cell_gpus)
    everything = candidates(args.max_gpus, args.line_gbps, args.chips, setting, spend=False, cells=cells)
    layouts = fleet.spending(everything, setting, args.max_gpus)
    if not layouts:
        cell = f"a cell of {args.max_gpus // cells} GPUs (--cell-gpus)" if cells > 1 else "the budget"
        raise ValueError(f"no layout fits {cell}: it (and the fleet) must hold two instances the model fits on")
    kind, path = args.workload
    if kind != "agentic":
        if args.tool_time_s or args.task_tokens:
            raise ValueError("--tool-time-s and --task-tokens shape the agentic workload, not a trace")
        return Plan(layouts, mooncake(load_trace(path)), setting, fleet, sides, steps, cells)
    config = paper.WORKLOAD
    if args.tool_time_s:
        config = replace(config, tool_time_s=args.tool_time_s)
    if args.task_tokens:
        config = replace(config, task_tokens=args.task_tokens)
    return Plan(layouts, agentic(config), setting, fleet, sides, steps, cells)


def plan_main(args: argparse.Namespace) -> int:
    """Search; print the verdict first, then the best `--top` layouts, each family's best,
    each side's layout and the assumptions; write `--out`."""
    from rich.console import Console

    try:
        plan = _prepare(args)
    except (ValueError, OSError) as exc:
        print(f"pdd plan: {exc}", file=sys.stderr)
        return 2
    probe, setting = probe_of(args), plan.setting
    console, out = Console(stderr=True), Console()
    started = time.perf_counter()
    rows, given, as_given = _searches(console, args, plan, probe)
    wall = time.perf_counter() - started
    ratio = paper.rho(setting, tpot_ms=probe.slo[1])
    found = verdict(rows, setting.b.price_per_hour, probe)
    spread = (
        seed_spread(args.seeds, found, rows, plan.workload, plan.setting, probe) if found and args.seeds > 1 else []
    )
    for line in verdict_lines(found, ratio, probe):
        out.print(line)
    if spread:
        out.print(seeds_line(spread, probe))
    simulated, screened = sum(r["simulated"] for r in rows), sum(r["screened_out"] for r in rows)
    title = f"the best {min(args.top, len(rows))} of {len(rows)} layouts by BCR ({simulated} simulated, "
    title += f"{screened} screened out; G: line Gbit/s)"
    out.print(rows_table(rows[: args.top], f"pdd plan: {title}", probe))
    families = sorted(best_per_family(rows).values(), key=lambda r: -r["bcr"])
    out.print(rows_table(families, "each family's best", probe))
    out.print(sides_table(plan.sides))
    for line in step_lines(plan.steps):
        out.print(line)
    out.print(f"Assumptions: {assumption_line(probe, plan.workload, setting)}")
    if plan.cells > 1:
        out.print(cells_line(args.max_gpus, args.cell_gpus))
    out.print(f"What the verdict rests on: {ratio.line() if ratio else 'rho: the model fits no instance of A or B'}")
    versus, steps = None, None
    if as_given is not None:
        out.print(rows_table(given, "the publication's layouts, as given (nearest buildable)", probe))
        versus = head_to_head(given, as_given)
        out.print(versus_line(versus, probe))
        steps = breakdown(given)
        out.print(breakdown_table(steps, probe))
    at_target = _at_target(console, out, args, plan, probe) if args.target_rps is not None else []
    probes, screen = sum(r["probes"] for r in rows), screen_error(rows)
    if screen is not None:
        out.print(
            f"The analytic screen against the simulation: capacity / goodput - 1 is {screen['median']:+.0%} "
            f"(median; {screen['low']:+.0%} to {screen['high']:+.0%}) over {screen['layouts']} simulated layouts."
        )
    out.print(
        f"{len(plan.layouts)} layouts, {simulated} simulated ({probes} probes)"
        + (f"; the publication's, {sum(r['probes'] for r in given)} probes more" if given else "")
        + f"; searched in {wall:.0f} s ({args.workers} worker(s)), {time.perf_counter() - started:.0f} s in all."
    )
    if args.out is not None:
        report = {
            "verdict": found,
            "seeds": spread,
            "sides": plan.sides,
            "step_times": plan.steps,
            "layouts": slim(rows),
            "assumptions": assumptions(setting, probe, plan.workload, plan.fleet),
            "rho": ratio.to_dict() if ratio else None,
            "published": versus,
            "published_layouts": slim(given),
            "breakdown": steps,
            "at_target": {"target_rps": args.target_rps, "layouts": slim(at_target)}
            if args.target_rps is not None
            else None,
            "screen_error": screen,
            "wall_s": wall,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


def _searches(
    console, args: argparse.Namespace, plan: Plan, probe: Probe
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], paper.Setting | None]:
    """The plan's search (`--contenders` of each family; 0: all) and, with `--published`,
    the publication's layouts (each searched whole, in the setting they are counted in),
    on one pool under one progress bar: the rows of each, and the publication's setting."""
    from pdd.progress import progress_bar

    as_given = smallest(plan.setting) if args.published else None  # (counted in the fewest nodes that hold the model)
    with progress_bar(console, args.quiet) as bar:

        def shown(what: str, total: int) -> OnProgress:
            task = bar.add_task(what, total=total)
            return lambda done, total, msg: bar.update(task, completed=done, total=total, description=msg)

        searches = [
            Search(
                plan.layouts,
                plan.workload,
                probe,
                plan.setting,
                shown("layouts", len(plan.layouts)),
                args.exact,
                args.contenders or None,
            )
        ]
        if as_given is not None:
            layouts = published(args.line_gbps[0], as_given)
            progress = shown("the publication's layouts", len(layouts))
            searches.append(Search(layouts, plan.workload, probe, as_given, progress, exact=True))
        found = run(searches, args.workers)
    return found[0], found[1] if as_given is not None else [], as_given


def _at_target(console, out, args: argparse.Namespace, plan: Plan, probe: Probe) -> list[dict[str, Any]]:
    """Each family's cheapest layout within the budget that meets the SLO at `--target-rps`."""
    from pdd.progress import progress_bar

    everything = candidates(args.max_gpus, args.line_gbps, args.chips, plan.setting, spend=False, cells=plan.cells)
    with progress_bar(console, args.quiet) as bar:
        task = bar.add_task("at the target", total=None)
        found = cheapest_at(
            everything,
            args.target_rps,
            plan.workload,
            probe,
            plan.setting,
            progress=lambda done, _total, msg: bar.update(task, completed=done, description=msg),
        )
    at_target = [found[f] for f in sorted(found, key=lambda f: found[f]["cost_per_hour"])]
    title = f"each family's cheapest layout within {args.max_gpus} GPUs that meets the SLO at {args.target_rps:g} req/s"
    out.print(rows_table(at_target, title, probe))
    missing = sorted({lay.family for lay in everything} - set(found))
    if missing:
        out.print(f"No layout of {', '.join(missing)} within the budget meets it.")
    return at_target
