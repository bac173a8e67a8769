"""`pdd demo`: run the same agentic workload through every deployment mode and compare.

This is the project's main job: one command on one machine that shows what PDD changes
against colocated serving and plain PD disaggregation (same datacenter, and across the
emulated line). Each mode is a real `pdd up` process tree, started and stopped here in
turn, so modes never compete for the CPU and every one replays identical requests.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdd.engines.port import engine_names
from pdd.errors import Mistake
from pdd.lab.demo_deploy import START_TIMEOUT_S, DemoDeployment, DeployError, accepted_modes
from pdd.lab.workload.scenarios import SCENARIOS, Scenario, fit_scenario
from pdd.names import EMULATED, HARDWARE, HARDWARE_HELP, Mode, mode_options

if TYPE_CHECKING:
    from rich.console import Console

# The PD modes at PDD's instance count (P + 2 D against P + RLD + MD: equal hardware),
# each instance paced as its own emulated chip (`--hardware emulated`), so a run does not
# depend on how the processes of one machine shared its two cores: the run BENCHMARKS.md
# records three times. Colocated (one instance) is the reference a user expects first;
# the plain PD modes (one D) are one `--modes` away.
EQUAL_HARDWARE_MODES = (f"{Mode.PD_SAME_DC}:main=2", f"{Mode.PD_CROSS_DC}:main=2")
DEFAULT_MODES = (Mode.COLOCATED, *EQUAL_HARDWARE_MODES, Mode.PDD)
DEFAULT_HARDWARE = EMULATED
# Emulated time runs this much slower than the chips, so this CPU finishes each step within
# its chip's time (the report counts the steps it did not): at x3, PDD's one MD on B (the
# fastest decode steps, the largest batch) overran 10-20 % of its steps with anything else
# running; at x4, 2 %. Measured in BENCHMARKS.md.
DEFAULT_DILATION = 4.0
REQUEST_TIMEOUT_S = 120.0


def _run_mode(mode: str, args: argparse.Namespace, console: Console) -> tuple[dict[str, Any], list[dict]]:
    """Start one deployment, replay the workload against it, stop it; the summary and
    the per-request records."""
    from pdd.lab.bench.client import run_bench
    from pdd.lab.bench.summary import summarize
    from pdd.lab.workload.agentic import plan_sessions

    scenario = _scenario(args)
    sessions = plan_sessions(dataclasses.replace(scenario.workload, seed=args.seed), args.requests, args.rate)
    line = [
        f"--bandwidth-mbps={scenario.bandwidth_mbps}",
        f"--delay-ms={scenario.delay_ms}",
        f"--jitter-ms={scenario.jitter_ms}",
        f"--hardware={args.hardware}",
        f"--dilation={args.dilation}",
        *(["--model", args.model] if args.model else []),
        *(["--engine", args.engine] if args.engine else []),
    ]
    deployment = DemoDeployment(mode, args.config, line)
    try:
        with (
            contextlib.nullcontext() if args.quiet or not console.is_terminal else console.status(f"starting {mode} …")
        ):
            url = deployment.wait_router(START_TIMEOUT_S)
        if not args.quiet:
            console.print(
                f"{mode}: serving at {url}, replaying {args.requests} requests", markup=False, highlight=False
            )
        run = run_bench(url, sessions, timeout_s=REQUEST_TIMEOUT_S, quiet=args.quiet)
        instances = _instance_steps(deployment.instances)
    finally:
        deployment.stop()
    summary = summarize(
        run.records,
        line_bytes=run.line_bytes,
        slo_ttft_ms=args.slo_ttft_ms * args.dilation,
        slo_tpot_ms=args.slo_tpot_ms * args.dilation,
    )
    summary["pacing"] = deployment.pacing
    summary["instances"] = instances
    return summary, [r.to_dict() for r in run.records]


def _instance_steps(urls: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each instance's pacing: its chip, its prefill and decode step times, its overruns."""
    import httpx

    out = {}
    for name, url in urls.items():
        try:
            out[name] = httpx.get(f"{url}/pdd/stats", timeout=5).json()["engine"]["pacing"]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _scenario(args: argparse.Namespace) -> Scenario:
    return args.fitted


def fitted_scenario(args: argparse.Namespace) -> tuple[Scenario, str]:
    """The scenario fitted to the model the deployments will serve (`fit_scenario`): its
    context (and the KV pool's), its vocabulary, its KV bytes per token; and what changed."""
    from pdd import config as cfg
    from pdd.kv.codec import DTYPES
    from pdd.model.config import Declared, ModelConfig
    from pdd.model.store import resolve_model
    from pdd.model.tokenizer import Tokenizer

    dep = cfg.load(args.config, backend=args.engine)
    model_dir = resolve_model(args.model or dep.model.path)
    if dep.engine.backend == "embedded":
        ModelConfig.from_dir(model_dir)  # (the embedded engine's gate: refused before anything starts)
    model = Declared.from_dir(model_dir)
    vocab = min(model.vocab_size, Tokenizer.from_dir(model_dir).vocab_size)
    # (a pool vLLM sizes itself holds the model's whole context, as vLLM requires)
    pool = dep.engine.num_pages * dep.engine.page_size or model.max_position
    context = min(model.max_position or pool, pool)
    dtype = dep.engine.kv_dtype or dep.engine.dtype
    kv_bytes = model.kv_values_per_token * (DTYPES[dtype].itemsize if dtype in DTYPES else 2)  # ("auto": 16-bit)
    return fit_scenario(SCENARIOS[args.scenario], context, vocab, kv_bytes)


def _modes(value: str) -> list[str]:
    modes = [m.strip() for m in value.split(",")]
    if not all(modes) or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError("expected distinct comma-separated mode names")
    return modes


def _command_line(args: argparse.Namespace) -> str:
    """An equivalent `pdd demo` command line, so a report says how to reproduce it."""
    parts = [
        "pdd",
        "demo",
        "--scenario",
        args.scenario,
        "--out",
        str(args.out),
        "--modes",
        ",".join(args.modes),
        "--requests",
        str(args.requests),
        "--rate",
        str(args.rate),
        "--seed",
        str(args.seed),
        "--hardware",
        args.hardware,
        "--dilation",
        f"{args.dilation:g}",
        "--slo-ttft-ms",
        f"{args.slo_ttft_ms:g}",
        "--slo-tpot-ms",
        f"{args.slo_tpot_ms:g}",
    ]
    if args.config is not None:
        parts += ["--config", str(args.config)]
    if args.model:
        parts += ["--model", args.model]
    if args.engine:
        parts += ["--engine", args.engine]
    return shlex.join(parts)


def _note(console: Console, text: str) -> None:
    # Plain text: output tails and mode names may hold brackets rich would eat as markup.
    console.print(f"pdd demo: {text}", markup=False, highlight=False)


def run(args: argparse.Namespace) -> int:
    """`pdd demo`: every mode in turn, then the table and the report.

    The exit code is non-zero only when no mode produced a completed request: one
    missing or broken mode should not hide the comparison of the others.
    """
    from rich.console import Console

    from pdd.lab.bench.headline import headlines
    from pdd.lab.bench.report import write_report, write_requests

    err = Console(stderr=True)
    scenario = _scenario(args)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    try:
        accepted = accepted_modes()
    except DeployError as exc:
        _note(err, f"`pdd up` is not usable, no mode can run: {exc}")
        return 1
    _note(err, args.fit_note)
    summaries, records, failed = _run_modes(args, accepted, err)
    out = Console()
    figures = headlines(summaries)
    _print_results(out, summaries, figures)
    meta = _meta(args, scenario, started, failed, figures)
    title = f"pdd demo, scenario {scenario.name}: {args.requests} agentic requests per mode (seed {args.seed})"
    paths = write_report(args.out, summaries, title=title, meta=meta)
    write_requests(args.out, records)
    # soft_wrap: a long path must stay on one line, copyable
    out.print(f"report: {paths['html'].resolve()}", markup=False, highlight=False, soft_wrap=True)
    return 0 if any(s["completed"] for s in summaries.values()) else 1


def _run_modes(
    args: argparse.Namespace, accepted: frozenset[str] | None, err: Any
) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict]], dict[str, str]]:
    """Each mode's run: (summaries, request records, why each mode that did not run failed)."""
    from pdd.lab.bench.client import BenchError

    summaries: dict[str, dict[str, Any]] = {}
    records: dict[str, list[dict]] = {}
    failed: dict[str, str] = {}
    for i, mode in enumerate(args.modes, 1):
        if accepted is not None and mode_options(mode)[0] not in accepted:
            failed[mode] = "not offered by the installed `pdd up`"
            _note(err, f"skipping mode {mode!r}: the installed `pdd up` accepts only {', '.join(sorted(accepted))}")
            continue
        if not args.quiet:
            err.rule(f"[{i}/{len(args.modes)}] {mode}")
        try:
            summary, records[mode] = _run_mode(mode, args, err)
        except (DeployError, BenchError, OSError) as exc:
            # One broken mode must not end the demo: the others still compare.
            failed[mode] = f"{type(exc).__name__}: {exc}"
            _note(err, f"mode {mode!r} failed: {exc}")
            continue
        summaries[mode] = summary
        if summary["completed"] == 0:
            failed[mode] = "every request failed"
            _note(err, f"mode {mode!r}: every request failed")
    return summaries, records, failed


def _print_results(out: Any, summaries: dict[str, dict[str, Any]], figures: list[Any]) -> None:
    """The comparison table, the emulated chips', the pacing lines and the headline."""
    from pdd.lab.bench.headline import format_headlines
    from pdd.lab.bench.summary import format_hardware_table, format_table

    if summaries:
        table = format_table(summaries)
        table.title = "pdd demo"
        out.print(table)
        hardware = format_hardware_table(summaries)
        if hardware is not None:
            out.print(hardware)
        for line in sorted({s.get("pacing", "") for s in summaries.values()} - {""}):
            out.print(line, markup=False, highlight=False, soft_wrap=True)
    if any(h.value is not None for h in figures):
        out.print(format_headlines(figures))


def _meta(args: argparse.Namespace, scenario: Any, started: str, failed: dict[str, str], figures: list[Any]) -> dict:
    """What the report says of the run: when, the command, its settings, what failed."""
    return {
        "date": started,
        "command": _command_line(args),
        "config": {
            "modes": args.modes,
            "requests": args.requests,
            # JSON has no infinity: null means every session started at once.
            "rate": args.rate if math.isfinite(args.rate) else None,
            "seed": args.seed,
            "deployment_config": None if args.config is None else str(args.config),
            "model": args.model or None,
            "slo_ttft_ms": args.slo_ttft_ms,
            "slo_tpot_ms": args.slo_tpot_ms,
            "hardware": args.hardware,
            "dilation": args.dilation,
            "scenario": scenario.name,
            "line": {
                "bandwidth_mbps": scenario.bandwidth_mbps,
                "delay_ms": scenario.delay_ms,
                "jitter_ms": scenario.jitter_ms,
            },
            "workload": {
                "kind": "agentic",
                **dataclasses.asdict(dataclasses.replace(scenario.workload, seed=args.seed)),
            },
        },
        "scenario_notes": scenario.notes,
        "scenario_fit": args.fit_note,
        "failed_modes": failed,
        "headline": {h.name: h.to_dict() for h in figures},
    }


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `pdd demo` on the top-level sub-command parsers."""
    parser = sub.add_parser(
        "demo",
        help="compare every deployment mode on one workload",
        description="Run the same agentic workload through every deployment mode and compare them.",
    )
    _add_arguments(parser)

    def func(args: argparse.Namespace) -> int:
        _resolve(parser, args)
        return run(args)

    parser.set_defaults(func=func)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, default=Path("pdd-demo"), metavar="DIR", help="report folder (default: ./pdd-demo)"
    )
    parser.add_argument(
        "--modes",
        type=_modes,
        default=list(DEFAULT_MODES),
        metavar="LIST",
        help="comma-separated, run in order; MODE:KEY=VALUE passes --KEY VALUE to "
        f"`pdd up` (e.g. pd-cross-dc:drc=off) (default: {','.join(DEFAULT_MODES)})",
    )
    parser.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="paper",
        help="paper: a scaled copy of the published evaluation (default); "
        "short: short outputs, every session at once (see BENCHMARKS.md)",
    )
    parser.add_argument("--requests", type=int, metavar="N", help="agentic turns per mode (default: the scenario's)")
    parser.add_argument(
        "--rate",
        type=float,
        metavar="R",
        help="agentic session starts per second, Poisson; inf = all at once (default: the scenario's)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="S", help="workload seed; every mode replays the same requests"
    )
    parser.add_argument("--config", type=Path, metavar="FILE", help="deployment TOML passed to `pdd up`")
    parser.add_argument(
        "--model",
        metavar="DIR|ORG/NAME",
        help="model directory or hub name in the local Hugging Face cache, passed to `pdd up` "
        "(default: the config's, else the tiny model); the scenario is fitted to it",
    )
    parser.add_argument(
        "--engine",
        choices=engine_names(),
        help="run every instance of every mode on this engine backend, passed to `pdd up` (default: the config's)",
    )
    # The same SLO defaults as `pdd bench`, so attainment reads the same in both.
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="default 2000")
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0, help="default 200")
    parser.add_argument(
        "--hardware",
        choices=HARDWARE,
        default=DEFAULT_HARDWARE,
        help=f"{HARDWARE_HELP} (pd-same-dc all on A). Default {DEFAULT_HARDWARE}: native instances share "
        "this machine's CPU, so a run then depends on what else the machine does",
    )
    parser.add_argument(
        "--dilation",
        type=float,
        default=DEFAULT_DILATION,
        help=f"emulated time runs this many times slower than the chips, so this CPU keeps up "
        f"(default {DEFAULT_DILATION:g}); the line and the SLOs are stretched alike",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress display")


def _resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The scenario's defaults where no flag said, each flag checked, the scenario fitted
    to the model: a mistake is one line naming the flag."""
    scenario = SCENARIOS[args.scenario]
    args.requests = scenario.requests if args.requests is None else args.requests
    args.rate = scenario.rate if args.rate is None else args.rate
    if args.requests < 1:
        parser.error("--requests must be >= 1")
    if args.config is not None and not args.config.is_file():
        raise Mistake(f"--config {args.config}: no such file")
    if not args.rate > 0:
        parser.error("--rate must be > 0 (inf starts every session at once)")
    if args.hardware == "native":
        args.dilation = 1.0  # nothing is emulated, so nothing is stretched
    if not args.dilation >= 1:
        parser.error("--dilation must be at least 1")
    try:
        args.fitted, args.fit_note = fitted_scenario(args)
    except (OSError, ValueError) as exc:  # no such model, one pdd cannot run, a bad config
        raise Mistake(str(exc)) from None
