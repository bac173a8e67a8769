"""Goodput against a fixed prefix-cache hit rate: the spec's bathtub, as this simulator sees it.

PDD_SPEC § The bathtub says benefit against hit rate is bathtub-shaped, with singular
points around 20, 40 and 70 % hit where the uncached tail chunk is small, cannot be
batched with other work, and drags throughput down. If that held, more cache would not
always be worth buying, so this sweep holds everything but the hit rate fixed: one
request shape whose prompts share exactly `hit` of their blocks, on caches that start
warm at P and at the decode side alike, and it reports the goodput at each hit rate.

Why this simulator cannot show the valley. A step costs the roofline of what it
computes (`steps.Roofline`), under continuous batching with chunked prefill
(`instance.Instance`, 16K tokens a step):
- a prompt's last chunk shares its step with other requests' chunks and decodes. With
  63K prompts that last chunk is smallest at 20 % (2.5K tokens) and 70 % (3K), the
  spec's points, but it never runs alone, and it costs only its share of the step;
- a step is memory-bound (reading the active weights, 0.85 ms on 8 x GPU A) only below
  about 53 new tokens. The smallest tail here (768 tokens at 99 %) is compute-bound, so
  the only fixed cost is the 4 ms step overhead, and every sequence in the step shares it;
- an uncached token attends to a longer cached context as the hit rate rises, so P's
  time per uncached token grows from 37 us at 0 % to 62 us at 99 % (it falls 49x for
  84x fewer tokens). That is a smaller gain than the tail shrinks by, but still a gain;
- the decode side computes nothing of the prompt, and the line carries the tail's KV,
  in proportion to 1 - hit.
Every cost falls monotonically as the hit rate rises, so goodput only rises (the
numbers are in BENCHMARKS.md). A valley needs a cost that does not amortize across a
step: a scheduler that runs one prefill chunk per step, a per-sequence cost
(`steps.Fitted`'s `per_seq_s`, fitted on a real engine), or a kernel that is less
efficient with few query rows against a long KV.

Each point is judged in steady state (`runner.Window`): requests arrive for a warm-up
and a judged window, and only the window's are judged, so neither the ramp-up nor the
drain after the last arrival flatters a rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pdd.sim import paper
from pdd.sim.cluster import DeploymentSpec
from pdd.sim.metrics import GOODPUT_ATTAINMENT
from pdd.sim.runner import Window, find_goodput, run_window, tail_s
from pdd.sim.workload import SimSession, SimTurn

_DPI = 110
_LOG_RATIO = 30.0  # as pdd.bench.report: above this max/min a linear axis flattens the low end


def shared_blocks(hit: float, prompt_tokens: int, block: int) -> int:
    """Leading blocks every request shares: `hit` of the prompt, to block granularity."""
    return min(round(hit * prompt_tokens / block), prompt_tokens // block)


def fixed_hit_sessions(hit: float, rate: float, requests: int, prompt_tokens: int, output_tokens: int, block: int,
                       seed: int = 0) -> list[SimSession]:
    """Single-turn requests, a Poisson process of `rate` a second, whose prompts share
    their first `hit` with every other request and nothing after: once one request has
    left the prefix in a cache, every later one hits `hit` there. The same seed gives the
    same draws at every rate (arrival times scale with 1 / rate), so a goodput search
    compares loads, not samples."""
    shared = shared_blocks(hit, prompt_tokens, block)
    starts = np.cumsum(np.random.default_rng(seed).exponential(1.0, requests)) / rate
    turn = (SimTurn(prompt_tokens, output_tokens),)
    return [SimSession(i, float(start), turn, 0,
                       trace_keys=tuple(("shared", b) if b < shared else (i, b) for b in range(prompt_tokens // block)))
            for i, start in enumerate(starts)]


def _point(spec: DeploymentSpec, hit: float, slo: tuple[float, float], window: Window, prompt_tokens: int,
           output_tokens: int, low: float, high: float, reference_rate: float,
           progress: Callable[[str], None] | None) -> dict[str, Any]:
    warm = [("shared", b) for b in range(shared_blocks(hit, prompt_tokens, spec.block_tokens))]

    def sessions(rate: float, end_s: float) -> list[SimSession]:
        drawn = fixed_hit_sessions(hit, rate, math.ceil(rate * end_s) + 1, prompt_tokens, output_tokens,
                                   spec.block_tokens)
        return [s for s in drawn if s.start_s < end_s]

    def note(rate: float, run: dict[str, Any]) -> None:
        if progress is not None:
            progress(f"{spec.name} hit {hit:.0%}: {rate:.2f} req/s -> {run['slo_attainment'] or 0.0:.1%} in SLO")

    # Single-turn requests: the session rate is the request rate. ~15 % precision shows a valley.
    best = find_goodput(spec, sessions, slo, window, low, high, note, steps=5, warm=warm)
    at = best or run_window(spec, sessions, low, window, slo, warm)
    return {
        "deployment": spec.name, "hit": hit, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "slo_ttft_ms": slo[0], "slo_tpot_ms": slo[1], "window_s": [window.warmup_s, window.end_s],
        "goodput_rps": best["session_rate"] if best else 0.0, "d_hit_rate": at["d_hit_rate"],
        "slo_attainment": at["slo_attainment"],
        "ttft_p50_ms": at["ttft_ms"]["p50"], "ttft_p99_ms": at["ttft_ms"]["p99"], "tpot_p99_ms": at["tpot_ms"]["p99"],
        "wan_gbps": _gbps(at["wan_bytes"], window.end_s - window.warmup_s),
        "rld_share": at["rld_output_tokens"] / at["output_tokens"] if at["output_tokens"] else 0.0,
        "reference_rps": reference_rate,
        "wan_gbps_needed": _demand_gbps(at, reference_rate),
        "line_gbps": spec.wan.gbps if len({r.dc for r in spec.roles}) > 1 else None,
    }


def _gbps(nbytes: float, seconds: float | None) -> float:
    return 8 * nbytes / seconds / 1e9 if seconds else 0.0


def _demand_gbps(run: dict[str, Any], rate: float) -> float:
    """`rate` requests a second, each sending what a served request of `run` sent."""
    return _gbps(run["wan_bytes"] * rate / run["completed"], 1.0) if run["completed"] else 0.0


def bathtub(spec: DeploymentSpec, hits: Sequence[float], slo: tuple[float, float], window: Window,
            prompt_tokens: int = 63 * 1024, output_tokens: int = 1024, *, low: float, high: float,
            reference_rate: float, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One row per hit rate: goodput (req/s in [low, high], 0.0 when even `low` misses
    the SLO); what the run at that rate measured: TTFT, the relay's share of output
    tokens and the line's use (`wan_gbps`, the judged requests' bytes over the window);
    and the line's bandwidth needed at `reference_rate`: that rate times the bytes a
    served request sent (a line slower than the demand would cap what it carries)."""
    return [_point(spec, hit, slo, window, prompt_tokens, output_tokens, low, high, reference_rate, progress)
            for hit in hits]


HITS = (0.0, 0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)


def bathtub_figures(out: Path, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """`pdd sim --paper --plots DIR`: the sweep for the same-datacenter baseline and PDD
    of the published comparison, written as bathtub.png and wan.png."""
    specs = paper.paper_deployments()
    slo = (paper.SLO_TTFT_MS, paper.SLO_TPOT_MS)
    # Single-turn requests reach steady state within one answer (~10 s): a short window will do.
    window = Window(20.0, 60.0, tail_s(1024, slo))
    rows = [row for name in ("same-dc-pd", "pdd")
            for row in bathtub(specs[name], HITS, slo, window, low=0.5, high=120.0, reference_rate=10.0,
                               progress=progress)]
    out.mkdir(parents=True, exist_ok=True)
    plot_bathtub(rows, out / "bathtub.png")
    plot_wan(rows, out / "wan.png")
    return rows


# ---------------------------------------------------------------------------- plots

def _by_deployment(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["deployment"], []).append(row)
    return groups


def _setting(rows: Sequence[dict[str, Any]]) -> str:
    r = rows[0]
    return (f"{r['prompt_tokens'] / 1024:.0f}K-token prompts, {r['output_tokens']} output tokens, "
            f"judged over {r['window_s'][1] - r['window_s'][0]:g} s after {r['window_s'][0]:g} s of warm-up")


def _save(figure: Figure, path: Path) -> None:
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=_DPI)


def plot_bathtub(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Goodput against hit rate, one line per deployment: where a valley would show."""
    figure = Figure(figsize=(7.5, 4.6), layout="constrained")
    ax = figure.subplots()
    for name, group in _by_deployment(rows).items():
        ax.plot([100 * r["hit"] for r in group], [r["goodput_rps"] for r in group], marker="o", label=name)
    first = rows[0]
    ax.set_xlabel("prefix-cache hit rate (% of prompt tokens, at P and decode side)")
    ax.set_ylabel(f"goodput (req/s, {100 * GOODPUT_ATTAINMENT:.0f} % within "
                  f"TTFT {first['slo_ttft_ms'] / 1000:g} s, TPOT {first['slo_tpot_ms']:g} ms)")
    ax.set_title(f"Simulated goodput against a fixed hit rate\n{_setting(rows)}", fontsize=10)
    goodputs = [r["goodput_rps"] for r in rows]
    if min(goodputs) > 0 and max(goodputs) / min(goodputs) > _LOG_RATIO:
        ax.set_yscale("log")  # a dip at low hit, where goodput is small, must still show
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(figure, path)


def plot_wan(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """The line's bandwidth a load needs against hit rate: what a given line can carry."""
    figure = Figure(figsize=(7.5, 4.6), layout="constrained")
    ax = figure.subplots()
    for name, group in _by_deployment(rows).items():
        line = ax.plot([100 * r["hit"] for r in group], [r["wan_gbps_needed"] for r in group], marker="o",
                       label=name)[0]
        if group[0]["line_gbps"]:
            ax.axhline(group[0]["line_gbps"], color=line.get_color(), linestyle="--", linewidth=1,
                       label=f"{name}: its line, {group[0]['line_gbps']:g} Gbit/s")
    ax.set_xlabel("prefix-cache hit rate (% of prompt tokens, at P and decode side)")
    ax.set_ylabel("WAN bandwidth needed (Gbit/s)")
    ax.set_title(f"Simulated WAN bandwidth needed at {rows[0]['reference_rps']:g} req/s\n{_setting(rows)}",
                 fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(figure, path)
