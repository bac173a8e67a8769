"""Measure this machine's engine into a `Fitted` step model (`pdd sim calibrate`).

The simulator prices steps it never runs, so its step model has to come from steps
that did run: `measure` drives the real engine through the step shapes a deployment
makes (prefills, prefix-cached tails, decode batches, extends, prefills riding along a
decode batch), `fit` solves for the linear model's coefficients, and a small JSON
profile carries them, with how well they fit, to simulations on any machine. torch is
imported only when measuring, so a simulation can load a profile without it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pdd.engine_port import EngineConfig
from pdd.sim.fit import Sample, fit, relative_errors
from pdd.sim.profile import _TERMS, LocalProfile, profile_to_json
from pdd.sim.steps import EMPTY, Fitted, StepLoad, add, chunk_load

if TYPE_CHECKING:
    from pdd.engine.engine import Engine
    from pdd.engine.sequence import Sequence as EngineSequence

# Runs of each shape; the median one is kept, since the machine is shared and noisy. Cheap
# shapes get more: a millisecond step is the one a stray scheduler tick distorts most.
_MIN_RUNS, _MAX_RUNS, _CHEAP_S = 3, 7, 0.05
_OWN_TOKENS = 16  # each decoder's prompt after the shared prefix: one page of its own


@dataclass(frozen=True)
class _Group:
    """Shapes sharing one setup: `decoders` sequences decoding at about `context` tokens
    (a shared, cached prefix plus a page of their own) and, per size n, a new sequence
    computing n tokens in the same step (0: the decode batch alone), after that prefix
    when `cached`, else from an empty context."""

    context: int
    decoders: int
    cached: bool
    sizes: tuple[int, ...]


# Cheap shapes first, and every kind in each round, so a short budget still sees all of
# them: prefill from empty, cached tail, decode alone, extend (small cached tail beside
# decoders), prefill beside decoders. Contexts are whole pages so a tail is exactly n.
_PLAN = (
    _Group(0, 0, False, (32, 100, 300)),
    _Group(512, 0, True, (8, 64, 256, 1000)),
    _Group(64, 1, True, (0, 1, 8, 32)),
    _Group(256, 8, True, (0, 1, 8, 32, 128)),
    _Group(256, 8, False, (64, 256, 1000)),
    _Group(0, 0, False, (700, 1500)),
    _Group(1504, 0, True, (8, 64, 256, 1000)),
    _Group(1024, 4, True, (0, 1, 8, 32, 128)),
    _Group(1024, 16, False, (0, 64, 256, 1000)),
    _Group(2992, 48, True, (0, 1, 32, 128)),
    _Group(0, 0, False, (2000, 3000)),
    _Group(2992, 0, True, (8, 64, 256, 1000)),
    _Group(2048, 1, True, (0, 1, 32, 128)),
    _Group(1024, 48, True, (0, 8, 128)),
    _Group(2992, 16, False, (0, 64, 256, 1000)),
    _Group(512, 32, True, (0, 1, 32, 128)),
    _Group(64, 48, False, (0, 64, 300)),
)


def _step_load(computed: list[tuple[int, int]]) -> StepLoad:
    load = EMPTY
    for start, n in computed:
        load = add(load, chunk_load(start, n))
    return load


class _Meter:
    """Drives one engine through the plan; only the labelled steps are timed, the setup
    (cached prefixes, decoders' prompts, a chunked prefill's rest) is not."""

    def __init__(self, engine: Engine, progress: Callable[[int, int], None] | None) -> None:
        self.engine = engine
        self.progress = progress
        self.rng = random.Random(0)
        self.vocab = engine.model_cfg.vocab_size
        self.rids = 0
        self.runs: dict[tuple[int, int], list[Sample]] = {}

    def run(self, plan: Sequence[_Group], budget_s: float) -> None:
        self._warm_up()
        deadline = time.perf_counter() + budget_s
        total, done = sum(len(g.sizes) for g in plan), 0
        for index, group in enumerate(plan):
            if self.runs and time.perf_counter() > deadline:
                break
            prefix = self._setup(group)
            for n in group.sizes:
                if self.runs and time.perf_counter() > deadline:
                    break
                self.runs[(index, n)] = self._shape(prefix, n)
                done += 1
                if self.progress:
                    self.progress(done, total)

    def samples(self) -> list[Sample]:
        """Per shape the run of median time, kept whole: a real step's load with its time."""
        return [sorted(runs, key=lambda s: s[1])[len(runs) // 2] for runs in self.runs.values()]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(16, self.vocab) for _ in range(n)]  # random: no accidental prefix hits

    def _add(self, prompt: list[int], max_tokens: int) -> EngineSequence:
        from pdd.sampling import SamplingParams

        self.rids += 1
        return self.engine.add_request(f"calibrate-{self.rids}", prompt,
                                       SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    def _finish(self, seqs: list[EngineSequence]) -> None:
        while any(s.num_computed < s.prompt_len for s in seqs):
            self.engine.step()

    def _warm_up(self) -> None:
        """First steps pay for allocations and lazy initialisation that serving never sees again."""
        for n in (300, 40, 40):
            self._add(self._tokens(n), 8)
        while self.engine.has_work():
            self.engine.step()

    def _setup(self, group: _Group) -> list[int]:
        """Start the group's decoders; return what its new sequences start with."""
        for rid in list(self.engine.seqs):
            self.engine.abort(rid)
        self.engine.flush_cache()
        prefix = self._tokens(group.context)
        if prefix:
            self._finish([self._add(prefix, 1)])  # finished, so its pages are in the prefix cache
        steps = 2 * _MAX_RUNS * len(group.sizes) + 2  # enough output to decode through every shape
        self._finish([self._add(prefix + self._tokens(_OWN_TOKENS), steps) for _ in range(group.decoders)])
        return prefix if group.cached else []

    def _shape(self, prefix: list[int], n: int) -> list[Sample]:
        runs = [self._run(prefix, n) for _ in range(_MIN_RUNS)]
        while len(runs) < _MAX_RUNS and sum(t for _, t in runs) < _CHEAP_S:
            runs.append(self._run(prefix, n))
        return runs

    def _run(self, prefix: list[int], n: int) -> Sample:
        seq = self._add(prefix + self._tokens(n), 1) if n else None
        t = time.perf_counter()
        self.engine.step()
        elapsed = time.perf_counter() - t
        sample = (_step_load(self.engine.last_step), elapsed)
        if seq is not None:
            self._finish([seq])  # a prefill over the step budget: its rest, untimed
        return sample


def measure(model_dir: str, config: EngineConfig, threads: int = 1, budget_s: float = 60.0,
            progress: Callable[[int, int], None] | None = None) -> list[Sample]:
    """Time real engine steps of every shape a deployment makes, one (load, median seconds)
    per shape. `budget_s` bounds the measuring (loading the model and warming up come on
    top); `progress(done, total)` is told of each finished shape."""
    import torch

    from pdd.engine.engine import Engine

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        meter = _Meter(Engine(model_dir, config), progress)
        meter.run(_PLAN, budget_s)
        return meter.samples()
    finally:
        torch.set_num_threads(previous)


def request_overhead_s(steps: Fitted, requests: int = 12, prompt_tokens: int = 64) -> float:
    """An idle request's TTFT through `pdd up --mode colocated` (router, HTTP, the
    instance's framed link) less what its one prefill step costs: the path's own time,
    which the simulator adds to every request. The median of `requests`, one at a time."""
    from pdd.bench.client import run_bench
    from pdd.demo import Deployment
    from pdd.workload.types import Session, Turn

    rng = random.Random(0)
    sessions = [Session(i, (Turn(tuple(rng.randrange(16, 4000) for _ in range(prompt_tokens)), 1),), start_s=0.3 * i)
                for i in range(requests)]
    deployment = Deployment("colocated", None)
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
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="seconds of measuring; loading the model and warming up come on top")
    p.add_argument("--skip-http", action="store_true",
                   help="do not measure the request path through `pdd up` (its overhead is then 0)")


def _measure_with_bar(model_dir: str, threads: int, budget_s: float) -> list[Sample]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task("step shapes", total=None)
        return measure(model_dir, EngineConfig(), threads, budget_s,
                       lambda done, total: bar.update(task, completed=done, total=total))


def _held_out(samples: list[Sample], threads: int) -> tuple[np.ndarray, int] | None:
    """Errors on a random fifth of the steps, fitted on the rest: how the model prices
    steps it never saw, which the errors on its own steps flatter."""
    if len(samples) < 2 * len(_TERMS):
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
    for label, value, unit, scale in (("per step", fitted.base_s, "us", 1e6),
                                      ("per new token", fitted.per_token_s, "us", 1e6),
                                      ("per attention pair", fitted.per_pair_s, "ns", 1e9),
                                      ("per sequence", fitted.per_seq_s, "us", 1e6),
                                      ("per KV token read", fitted.per_kv_token_s, "ns", 1e9)):
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
    from pdd.model.config import ModelConfig

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from pdd.model.tiny import make_tiny

            model_dir = str(make_tiny(Path(tmp) / "tiny"))
        model = ModelConfig.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))
        samples = _measure_with_bar(model_dir, args.threads, args.budget_s)
    fitted = fit(samples, args.threads)
    overhead = 0.0 if args.skip_http else request_overhead_s(fitted)
    profile = LocalProfile(fitted, model.kv_bytes_per_token(4), model.max_position, overhead, os.cpu_count() or 1)
    Path(args.out).write_text(json.dumps(profile_to_json(profile, samples, args.threads), indent=2) + "\n")
    _report(fitted, samples, _held_out(samples, args.threads), args.out)
    print(f"request path overhead: {1000 * overhead:.1f} ms per request"
          + (" (not measured: --skip-http)" if args.skip_http else ""))
    return 0
