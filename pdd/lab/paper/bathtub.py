"""Throughput against the prefix-cache hit rate: the spec's bathtub, as the physics has it.

PDD_SPEC § The bathtub: benefit against hit rate is bathtub-shaped, with singular
points around 20, 40 and 70 % hit where the uncached tail chunk is small, cannot be
batched with other requests, and drags throughput down. What makes a small tail dear
is in the step model (`pdd.perf.physics`): a chunk of a few hundred tokens still reads
every expert's weights once, attends to its whole cached prefix, and pays a per-chunk
cost; what decides whether it is batched is the scheduler.

The sweep holds everything but the hit rate fixed: single-turn 63K-token prompts in
`GROUPS` prefix groups (so requests do not all share one prefix), each sharing the
first `hit` of its prompt with its group, on caches warm with every group's prefix; P
is offered more than it can prefill, so what it completes a second is its throughput.
The live scheduler (`pdd.batching.Scheduler`) two ways: as the engine runs it (a step
takes chunks of as many requests as its token budget holds, so a tail rides along with
the next request's head) and with `max_chunks` 1 (a tail runs alone). Each point is
repeated over seeds: the mean and the spread are reported.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pdd.lab.plan import paper
from pdd.lab.plan.bounds import Shape, prefill_rps
from pdd.lab.sim.fleet import DeploymentSpec
from pdd.lab.sim.runner import Window, simulate
from pdd.lab.workload.types import Session, Turn

GROUPS = 16
PROMPT_TOKENS, OUTPUT_TOKENS = 63 * 1024, 16  # a short output: only P's work differs with the hit
HITS = tuple(h / 100 for h in range(0, 100, 2))
SEEDS = (0, 1, 2)
OVERLOAD = 1.5  # offered load over P's analytic capacity
MIN_JUDGED = 150
SCHEDULERS = {"engine (tails batch)": 0, "one chunk a step (tails alone)": 1}


def shared_blocks(hit: float, prompt_tokens: int, block: int) -> int:
    """Leading blocks a request shares with its group: `hit` of the prompt, to block granularity."""
    return min(round(hit * prompt_tokens / block), prompt_tokens // block)


def group_sessions(
    hit: float,
    rate: float,
    requests: int,
    prompt_tokens: int,
    output_tokens: int,
    block: int,
    seed: int = 0,
    groups: int = GROUPS,
) -> list[Session]:
    """Single-turn requests, a Poisson process of `rate` a second, each in one of `groups`
    prefix groups (drawn at random) whose first `hit` of the prompt it shares."""
    rng = np.random.default_rng(seed)
    shared = shared_blocks(hit, prompt_tokens, block)
    starts = np.cumsum(rng.exponential(1.0, requests)) / rate
    turn = (Turn(prompt_tokens, output_tokens),)
    return [
        Session(
            i,
            turn,
            float(start),
            trace_keys=tuple(("group", int(g), b) if b < shared else (i, b) for b in range(prompt_tokens // block)),
        )
        for i, (start, g) in enumerate(zip(starts, rng.integers(0, groups, requests), strict=True))
    ]


def deployment(max_chunks: int, setting: paper.Setting = paper.SETTING) -> DeploymentSpec:
    """One P and three decode instances on GPU A in one site: P is what runs out."""
    p = replace(setting.role("prefill", "A", 1, "A"), max_chunks=max_chunks)
    return setting.deployment("bathtub", (p, setting.role("main", "A", 3, "A")))


def point(spec: DeploymentSpec, hit: float, seed: int, window: Window) -> dict[str, Any]:
    """P's throughput (requests whose first token came in the window, per second) at one hit."""
    block = spec.block_tokens
    shared = shared_blocks(hit, PROMPT_TOKENS, block)
    p = next(r for r in spec.roles if r.role == "prefill")
    capacity = prefill_rps(p, Shape([(PROMPT_TOKENS, shared * block)], OUTPUT_TOKENS, PROMPT_TOKENS))
    rate = OVERLOAD * capacity
    warm = [[("group", g, b) for b in range(shared)] for g in range(GROUPS)]

    # at least `MIN_JUDGED` completions judged, so a low hit's throughput is not one request's grain
    window = replace(window, end_s=max(window.end_s, window.warmup_s + MIN_JUDGED / capacity))
    drawn = group_sessions(hit, rate, int(rate * window.end_s) + 1, PROMPT_TOKENS, OUTPUT_TOKENS, block, seed)
    records, _ = simulate(spec, [s for s in drawn if s.start_s < window.end_s], window.end_s, warm)
    first = [
        r
        for r in records
        if r.ttft_ms is not None
        and r.start_s is not None  # (one with a TTFT was sent)
        and window.warmup_s <= r.start_s + r.ttft_ms / 1000 < window.end_s
    ]
    seconds = window.end_s - window.warmup_s
    return {
        "hit": hit,
        "seed": seed,
        "throughput_rps": len(first) / seconds,
        "capacity_rps": capacity,
        "p_hit_rate": sum(r.p_hit_tokens for r in first) / sum(r.prompt_tokens for r in first) if first else 0.0,
    }


def sweep(
    hits: Sequence[float] = HITS,
    seeds: Sequence[int] = SEEDS,
    window: Window = Window(5.0, 25.0, 0.0),
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per scheduler and hit: P's throughput over seeds (mean, standard deviation)."""
    rows = []
    for name, max_chunks in SCHEDULERS.items():
        spec = deployment(max_chunks)
        for hit in hits:
            runs = [point(spec, hit, seed, window) for seed in seeds]
            values = [r["throughput_rps"] for r in runs]
            rows.append(
                {
                    "scheduler": name,
                    "hit": hit,
                    "throughput_rps": statistics.mean(values),
                    "std_rps": statistics.stdev(values) if len(values) > 1 else 0.0,
                    "p_hit_rate": statistics.mean(r["p_hit_rate"] for r in runs),
                    "capacity_rps": runs[0]["capacity_rps"],
                    "seeds": len(values),
                }
            )
            if progress is not None:
                progress(f"{name}, hit {hit:.0%}: {rows[-1]['throughput_rps']:.2f} req/s")
    return rows


def valleys(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Hit rates where throughput falls below both neighbours' by more than the spread:
    the singular points, per scheduler."""
    found = []
    for name in SCHEDULERS:
        curve = [r for r in rows if r["scheduler"] == name]
        for a, b, c in zip(curve, curve[1:], curve[2:], strict=False):  # each point with its two neighbours
            if b["throughput_rps"] + b["std_rps"] < min(a["throughput_rps"], c["throughput_rps"]):
                found.append(
                    {
                        "scheduler": name,
                        "hit": b["hit"],
                        "throughput_rps": b["throughput_rps"],
                        "neighbours_rps": (a["throughput_rps"], c["throughput_rps"]),
                    }
                )
    return found


CACHED_PRICE = (0.10, 0.25)  # a cached input token billed at this share of an uncached one (PDD_SPEC)


def economics(rows: Sequence[dict[str, Any]], block: int = paper.SETTING.block_tokens) -> list[dict[str, Any]]:
    """Per hit: input tokens billed a second by one P (uncached ones whole, cached ones
    at 10 and 25 %), with the engine's scheduler; and what tails that run alone cost
    (1 - their throughput over the engine's): where that peaks, the singular points."""
    names = list(SCHEDULERS)
    by = {(r["scheduler"], round(r["hit"], 4)): r for r in rows}
    out = []
    for hit in sorted({round(r["hit"], 4) for r in rows}):
        engine, alone = by.get((names[0], hit)), by.get((names[1], hit))
        if engine is None:
            continue
        cached = shared_blocks(hit, PROMPT_TOKENS, block) * block
        row = {"hit": hit, "tail_cost": 1 - alone["throughput_rps"] / engine["throughput_rps"] if alone else None}
        for price in CACHED_PRICE:
            billed = PROMPT_TOKENS - cached + price * cached
            row[f"billed_ktok_s_at_{price:g}"] = engine["throughput_rps"] * billed / 1e3
        out.append(row)
    return out


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Throughput against hit rate, per scheduler, with one standard deviation over seeds."""
    figure = Figure(figsize=(8, 4.8), layout="constrained")
    ax = figure.subplots()
    for name in SCHEDULERS:
        curve = [r for r in rows if r["scheduler"] == name]
        ax.errorbar(
            [100 * r["hit"] for r in curve],
            [r["throughput_rps"] for r in curve],
            yerr=[r["std_rps"] for r in curve],
            marker=".",
            capsize=2,
            label=name,
        )
    for x in (20, 40, 70):
        ax.axvline(x, color="grey", linestyle=":", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("prefix-cache hit rate (% of a 63K-token prompt, in 16 prefix groups)")
    ax.set_ylabel("P throughput (req/s, one P of 16 x GPU A)")
    ax.set_title("Prefill throughput against the hit rate (dotted: the spec's 20 / 40 / 70 %)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=110)
