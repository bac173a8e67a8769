"""Measure this machine's engine into a `Fitted` step model (`pdd sim calibrate`).

The simulator prices steps it never runs, so its step model has to come from steps
that did run: `pdd.lab.calibration.measure` times the engine, through the engine port (any
backend), in the step shapes a deployment makes (prefills, prefix-cached tails,
decode batches, extends, prefills riding along a decode batch); `fit` solves for the
linear model's coefficients, and a small JSON profile carries them, with how well they
fit, to simulations on any machine. No engine is loaded until measuring, so a
simulation can load a profile without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

import numpy as np

from pdd.engines.port import EngineConfig, engine_names
from pdd.lab.calibration.fit import Sample, fit, relative_errors
from pdd.lab.calibration.measure import Measured, measure
from pdd.lab.calibration.profile import TERMS, LocalProfile, profile_to_json
from pdd.perf.steps import Fitted, chunk_load


def request_overhead_s(steps: Fitted, requests: int = 12, prompt_tokens: int = 64) -> float:
    """An idle request's TTFT through `pdd up --mode colocated` (router, HTTP, the
    instance's framed connection) less what its one prefill step costs: the path's own time,
    which the simulator adds to every request. The median of `requests`, one at a time."""
    from pdd.lab.bench.client import run_bench
    from pdd.lab.demo_deploy import DemoDeployment
    from pdd.lab.workload.types import Session, Turn

    rng = random.Random(0)
    sessions = [
        Session(i, (Turn.of([rng.randrange(16, 4000) for _ in range(prompt_tokens)], 1),), start_s=0.3 * i)
        for i in range(requests)
    ]
    deployment = DemoDeployment("colocated", None)
    try:
        url = deployment.wait_router(120.0)
        records = run_bench(url, sessions, quiet=True).records
    finally:
        deployment.stop()
    ttfts = sorted(r.ttft_ms / 1000 for r in records if r.ttft_ms is not None)
    if not ttfts:
        raise RuntimeError("no request of the overhead measurement was answered")
    return max(0.0, ttfts[len(ttfts) // 2] - steps.step_s(chunk_load(0, prompt_tokens)))


# ---- the command -----------------------------------------------------------------------


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: a fresh tiny model)")
    p.add_argument("--out", default="pdd-profile.json", help="profile file to write")
    p.add_argument("--threads", type=int, default=1, help="torch threads the engine steps with")
    p.add_argument(
        "--budget-s",
        type=float,
        default=60.0,
        help="seconds of measuring; loading the model and warming up come on top",
    )
    p.add_argument(
        "--skip-http",
        action="store_true",
        help="do not measure the request path through `pdd up` (its overhead is then 0)",
    )
    p.add_argument(
        "--backend",
        default=EngineConfig.backend,
        choices=engine_names(),
        help=f"the engine to time, through the engine port (default {EngineConfig.backend})",
    )


def _measure_with_bar(model_dir: str, backend: str, threads: int, budget_s: float) -> Measured:
    from rich.console import Console

    from pdd.progress import progress_bar

    with progress_bar(Console(stderr=True), quiet=False) as bar:
        task = bar.add_task("step shapes", total=None)
        return measure(
            model_dir,
            EngineConfig(backend=backend),
            threads,
            budget_s,
            lambda done, total: bar.update(task, completed=done, total=total),
        )


def _held_out(samples: list[Sample], threads: int) -> tuple[np.ndarray, int] | None:
    """Errors on a random fifth of the steps, fitted on the rest: how the model prices
    steps it never saw, which the errors on its own steps flatter."""
    if len(samples) < 2 * len(TERMS):
        return None
    shuffled = random.Random(0).sample(samples, len(samples))
    k = len(samples) // 5
    return relative_errors(fit(shuffled[k:], threads), shuffled[:k]), len(samples) - k


def _quality(errors: np.ndarray) -> tuple[str, str]:
    return f"{np.median(errors):.1%}", f"{np.percentile(errors, 90):.1%}"


def _report(fitted: Fitted, samples: list[Sample], held: tuple[np.ndarray, int] | None, out: str) -> None:
    from rich.console import Console
    from rich.table import Table

    coefficients = Table(title="step-time profile")
    coefficients.add_column("term")
    coefficients.add_column("cost", justify="right")
    for label, value, unit, scale in (
        ("per step", fitted.base_s, "us", 1e6),
        ("per new token", fitted.per_token_s, "us", 1e6),
        ("per attention pair", fitted.per_pair_s, "ns", 1e9),
        ("per sequence", fitted.per_seq_s, "us", 1e6),
        ("per KV token read", fitted.per_kv_token_s, "ns", 1e9),
    ):
        coefficients.add_row(label, f"{value * scale:.4g} {unit}" if value else "0 (dropped by the fit)")
    quality = Table(title="relative error of predicted step time")
    for column in ("steps", "median", "p90"):
        quality.add_column(column, justify="right" if column != "steps" else "left")
    quality.add_row(f"all {len(samples)} (fitted on them)", *_quality(relative_errors(fitted, samples)))
    if held is not None:
        errors, trained = held
        quality.add_row(f"held-out {len(errors)} (fitted on the other {trained})", *_quality(errors))
    console = Console()
    console.print(f"measured on {fitted.source}")
    console.print(coefficients)
    console.print(quality)
    console.print(f"wrote {out}", markup=False, soft_wrap=True)


def calibrate_main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from pdd.model.tiny import make_tiny

            model_dir = str(make_tiny(Path(tmp) / "tiny"))
        measured = _measure_with_bar(model_dir, args.backend, args.threads, args.budget_s)
    samples = measured.samples
    fitted = fit(samples, args.threads)
    overhead = 0.0 if args.skip_http else request_overhead_s(fitted)
    profile = LocalProfile(fitted, measured.kv_bytes_per_token, measured.max_context, overhead, os.cpu_count() or 1)
    Path(args.out).write_text(json.dumps(profile_to_json(profile, samples, args.threads), indent=2) + "\n")
    _report(fitted, samples, _held_out(samples, args.threads), args.out)
    print(
        f"request path overhead: {1000 * overhead:.1f} ms per request"
        + (" (not measured: --skip-http)" if args.skip_http else "")
    )
    return 0
