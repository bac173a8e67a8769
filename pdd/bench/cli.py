"""`pdd bench`: replay a workload against a live server, or benchmark one engine.

`pdd bench [serve] --url URL ...` replays agentic sessions or a Mooncake trace through
the OpenAI API and writes `{"summary", "requests", "config"}` JSON (DESIGN.md contract).
`pdd bench engine ...` is owned by `pdd.bench.engine`; its options are registered only
when that module is present. Heavy imports happen inside the command, not at parse
time, because `pdd --help` imports every command module.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdd.workload.types import Session

_ENGINE_MODULE = "pdd.bench.engine"


def _workload(value: str) -> tuple[str, Path | None]:
    if value == "agentic":
        return "agentic", None
    kind, _, path = value.partition(":")
    if kind == "mooncake" and path:
        return "mooncake", Path(path)
    raise argparse.ArgumentTypeError("expected 'agentic' or 'mooncake:PATH'")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `pdd bench` on the top-level sub-command parsers."""
    # The engine's options go in first and ours override any it shares (`--model` is
    # the served model id for serve and the model directory for engine): one option,
    # two targets, instead of a clash that would break `pdd bench` altogether.
    parser = sub.add_parser(
        "bench", help="replay a workload against a server, or benchmark one engine",
        description=__doc__.splitlines()[0], conflict_handler="resolve")
    if importlib.util.find_spec(_ENGINE_MODULE) is not None:
        importlib.import_module(_ENGINE_MODULE).add_arguments(parser)
    parser.add_argument("target", nargs="?", choices=("serve", "engine"), default="serve",
                        help="serve: a live OpenAI-compatible server (default); "
                             "engine: one engine in-process")
    parser.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000 (serve)")
    parser.add_argument("--workload", type=_workload, default=("agentic", None),
                        metavar="agentic|mooncake:PATH", help="default: agentic")
    parser.add_argument("--requests", type=int, default=100,
                        help="agentic: total turns; mooncake: first N trace lines (default 100)")
    parser.add_argument("--rate", type=float, default=math.inf,
                        help="agentic session starts per second, Poisson; inf = all at once")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="serve: model id (default: the first from /v1/models); "
                                         "engine: model directory (default: a fresh tiny model)")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument("--scale", type=int, default=16,
                        help="mooncake: divide lengths by this (512-token blocks -> 512/scale)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="mooncake: divide arrival times by this")
    parser.add_argument("--vocab-size", type=int, default=4096,
                        help="prompt token IDs are drawn below this; match the model")
    parser.add_argument("--max-context", type=int,
                        help="cap on prompt + output tokens (agentic default 2500; "
                             "mooncake: no cap)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per request")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=lambda args: _run(parser, args))


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.target == "engine":
        if importlib.util.find_spec(_ENGINE_MODULE) is None:
            print("pdd bench engine: not available in this build", file=sys.stderr)
            return 2
        return int(importlib.import_module(_ENGINE_MODULE).run(args))
    if not args.url:
        parser.error("--url is required to benchmark a server")
    if args.requests < 1:
        parser.error("--requests must be >= 1")
    try:
        sessions, workload = _plan(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    return _bench(args, sessions, workload)


def _plan(args: argparse.Namespace) -> tuple[list[Session], dict[str, Any]]:
    """The sessions to replay and the workload settings that produced them."""
    kind, path = args.workload
    cap = {} if args.max_context is None else {"max_context": args.max_context}
    if kind == "agentic":
        from pdd.workload.agentic import AgenticConfig, plan_sessions
        config = AgenticConfig(seed=args.seed, vocab_size=args.vocab_size, **cap)
        sessions = plan_sessions(config, args.requests, args.rate)
        return sessions, {"kind": kind, **asdict(config)}
    from pdd.workload.mooncake import MooncakeConfig, load_trace, trace_sessions
    config = MooncakeConfig(scale=args.scale, time_scale=args.time_scale, seed=args.seed,
                            vocab_size=args.vocab_size, **cap)
    sessions = trace_sessions(load_trace(path, limit=args.requests), config)
    return sessions, {"kind": kind, "path": str(path), **asdict(config)}


def _bench(args: argparse.Namespace, sessions: list[Session], workload: dict[str, Any]) -> int:
    from rich.console import Console

    from pdd.bench.client import BenchError, run_bench
    from pdd.bench.summary import format_table, summarize

    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    try:
        run = run_bench(args.url, sessions, model=args.model, timeout_s=args.timeout_s,
                        quiet=args.quiet)
    except BenchError as exc:
        print(f"pdd bench: {exc}", file=sys.stderr)
        return 1
    summary = summarize(run.records, wan_bytes=run.wan_bytes, slo_ttft_ms=args.slo_ttft_ms,
                        slo_tpot_ms=args.slo_tpot_ms)
    config = {"url": args.url, "model": run.model, "started_at": started_at,
              "requests": args.requests,
              # JSON has no infinity: null means every session started at once.
              "rate": args.rate if math.isfinite(args.rate) else None,
              "timeout_s": args.timeout_s, "workload": workload}
    if args.out is not None:
        _write_json(args.out, {"summary": summary,
                               "requests": [r.to_dict() for r in run.records],
                               "config": config})
    Console().print(format_table({workload["kind"]: summary}))
    if summary["completed"] == 0:
        sent = [r for r in run.records if r.start_s is not None]
        print("pdd bench: every request failed; first error: "
              f"{sent[0].error if sent else 'nothing was sent'}", file=sys.stderr)
        return 1
    return 0


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write through a temporary file so a reader never sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
