"""`pdd bench`: replay a workload against a live server, or benchmark one engine.

`pdd bench [serve] --url URL ...` replays agentic sessions or a Mooncake trace through
the OpenAI API and writes `{"summary", "requests", "config"}` JSON (DESIGN.md contract).
`pdd bench engine`, `handoff`, `flood`, `overhead`, `sampling`, `stall` and `transfer` are owned by their
modules (in `pdd.lab.bench`; `transfer` in `pdd.lab.netns`, beside the lab it runs in), which
register their own options. Heavy imports happen inside the
command, not at parse time, because `pdd --help` imports every command module.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdd.errors import Mistake
from pdd.lab.bench import options
from pdd.lab.workload.types import Session

# in-process benchmarks: target -> the module that registers its options and runs it
_IN_PROCESS = {
    "engine": "pdd.lab.bench.engine",
    "handoff": "pdd.lab.bench.handoff",
    "flood": "pdd.lab.bench.flood",
    "overhead": "pdd.lab.bench.overhead",
    "sampling": "pdd.lab.bench.sampling",
    "stall": "pdd.lab.bench.stall",
    "transfer": "pdd.lab.netns.transfer",  # (beside the lab it runs in)
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `pdd bench TARGET`, each target with its own options and help."""
    parser = sub.add_parser(
        "bench",
        help="replay a workload against a server, or benchmark one part",
        description=__doc__.splitlines()[0] + " `pdd bench --url ...` is `pdd bench serve --url ...`.",
    )
    targets = parser.add_subparsers(dest="target", required=True, metavar="TARGET")
    serve = targets.add_parser(
        "serve",
        help="replay agentic sessions or a Mooncake trace against a live OpenAI-compatible server (the default)",
        description="Replay agentic sessions or a Mooncake trace against a live OpenAI-compatible server; "
        "print the summary, write {summary, requests, config} JSON with --out.",
    )
    add_arguments(serve)
    serve.set_defaults(func=lambda args: _run(serve, args))
    for name, module_name in _IN_PROCESS.items():
        module = importlib.import_module(module_name)
        doc = module.__doc__ or ""
        # its docstring's first line, after "`pdd bench NAME`: "
        summary = doc.splitlines()[0].split(": ", 1)[-1].rstrip(".")
        target = targets.add_parser(name, help=summary, description=doc.split("\n\n")[0].replace("\n", " "))
        module.add_arguments(target)
        target.set_defaults(func=module.run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.server(p)
    options.client(p)
    options.workload(p)
    options.out(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.requests < 1:
        parser.error("--requests must be >= 1")
    try:
        sessions, workload = plan_workload(args)
    except (ValueError, OSError) as exc:  # a workload file, a model
        raise Mistake(str(exc)) from None
    return _bench(args, sessions, workload)


def plan_workload(args: argparse.Namespace) -> tuple[list[Session], dict[str, Any]]:
    """The sessions to replay and the workload settings that produced them, fitted to
    the served model (its vocabulary, its context) unless the options say otherwise."""
    kind, path = args.workload
    cap = {} if args.max_context is None else {"max_context": args.max_context}
    served = served_model(args.url)
    vocab = args.vocab_size or served.get("vocab_size") or 4096
    context = served.get("max_model_len")
    if kind == "agentic":
        from dataclasses import replace

        from pdd.lab.workload.agentic import plan_sessions
        from pdd.lab.workload.scenarios import SCENARIOS, fit_workload

        config = replace(SCENARIOS[args.scenario].workload, seed=args.seed, vocab_size=vocab, **cap)
        if context is not None and not cap:
            config, scale = fit_workload(config, context, vocab)
            if scale < 1:
                print(
                    f"pdd bench: the served context is {context} tokens: scenario {args.scenario}'s lengths "
                    f"x {scale:.3g}, contexts up to {config.max_context}",
                    file=sys.stderr,
                )
        sessions = plan_sessions(config, args.requests, args.rate)
        return sessions, {"kind": kind, "scenario": args.scenario, **asdict(config)}
    from pdd.lab.workload.mooncake import MooncakeConfig, fit_to_context, load_trace, trace_sessions

    records = load_trace(path, limit=args.requests)
    base = MooncakeConfig(scale=args.scale or 16, time_scale=args.time_scale, seed=args.seed, vocab_size=vocab, **cap)
    if args.scale is None and args.max_context is None:
        if context is None:
            print(
                "pdd bench: the server does not say its context length; mooncake lengths / 16, uncut", file=sys.stderr
            )
        else:
            base, note = fit_to_context(records, base, context)
            print(f"pdd bench: {note}", file=sys.stderr)
    sessions = trace_sessions(records, base)
    return sessions, {"kind": kind, "path": str(path), **asdict(base)}


def served_model(url: str) -> dict[str, int]:
    """What /v1/models says of the served model: `max_model_len` (as vLLM reports it) and
    `vocab_size` (a pdd extension); {} from a server that does not answer."""
    import httpx

    from pdd.lab.bench.client import base_url

    try:
        data = httpx.get(f"{base_url(url)}/v1/models", timeout=10).json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return {}
    return {key: int(data[key]) for key in ("max_model_len", "vocab_size") if isinstance(data.get(key), int)}


def _bench(args: argparse.Namespace, sessions: list[Session], workload: dict[str, Any]) -> int:
    from rich.console import Console

    from pdd.lab.bench.client import BenchError, run_bench
    from pdd.lab.bench.summary import format_table, summarize

    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    try:
        run = run_bench(args.url, sessions, model=args.model, timeout_s=args.timeout_s, quiet=args.quiet)
    except BenchError as exc:
        print(f"pdd bench: {exc}", file=sys.stderr)
        return 1
    summary = summarize(
        run.records, line_bytes=run.line_bytes, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms
    )
    config = {
        "url": args.url,
        "model": run.model,
        "started_at": started_at,
        "requests": args.requests,
        # JSON has no infinity: null means every session started at once.
        "rate": args.rate if math.isfinite(args.rate) else None,
        "timeout_s": args.timeout_s,
        "workload": workload,
    }
    if args.out is not None:
        _write_json(args.out, {"summary": summary, "requests": [r.to_dict() for r in run.records], "config": config})
    Console().print(format_table({workload["kind"]: summary}))
    if summary["completed"] == 0:
        sent = [r for r in run.records if r.start_s is not None]
        print(
            f"pdd bench: every request failed; first error: {sent[0].error if sent else 'nothing was sent'}",
            file=sys.stderr,
        )
        return 1
    return 0


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write through a temporary file so a reader never sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
