"""Running a simulated deployment: once over a workload, or in steady state for a goodput.

Agentic sessions are closed loops (a turn waits for the previous answer) lasting minutes,
so a short run never reaches the load its rate implies: it ramps up and drains. Goodput
is therefore judged in steady state: sessions start at `rate` per second for a whole
window, the first `warmup_s` of arrivals are not judged, and the run stops a while
after the window, when every judged request has either finished or missed its SLO.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import simpy

from pdd.sim.cluster import Cluster, DeploymentSpec, Outcome
from pdd.sim.metrics import goodput, summary
from pdd.sim.workload import SimSession, agentic_sessions
from pdd.workload.agentic import AgenticConfig, plan_session_shapes


def simulate(spec: DeploymentSpec, sessions: list[SimSession], horizon_s: float = math.inf,
             warm: Sequence[Hashable] = ()) -> tuple[list[Outcome], int]:
    """The outcomes (unfinished ones too, when the horizon stops the run), and how many
    events the simulation processed. `warm`: blocks every instance holds at the start,
    as a deployment that has served them a while does."""
    env = simpy.Environment()
    cluster = Cluster(env, spec)
    for inst in cluster.instances.values():
        inst.cache.insert(list(warm))
    for s in sessions:
        cluster.start(s)
    events = 0
    while env.peek() < horizon_s:
        env.step()
        events += 1
    return cluster.outcomes, events


@dataclass(frozen=True)
class Window:
    """Judge the requests that arrive in [warmup_s, end_s); stop at `end_s + tail_s`
    (a judged request that meets the SLO has finished by then)."""

    warmup_s: float
    end_s: float
    tail_s: float

    def judged(self, outcomes: list[Outcome]) -> list[Outcome]:
        return [o for o in outcomes if self.warmup_s <= o.arrival_s < self.end_s]


Sessions = Callable[[float, float], list[SimSession]]  # (session rate, arrivals until s) -> sessions


def tail_s(longest_output: int, slo: tuple[float, float]) -> float:
    """The longest a request within the SLO can take: its TTFT plus every token at the TPOT."""
    return (slo[0] + slo[1] * longest_output) / 1000 + 1.0


def steady_sessions(config: AgenticConfig) -> Sessions:
    """Agentic sessions starting at a rate until a time (the stream is planned long
    enough, then cut there)."""
    turns = turns_per_session(config)

    def sessions(rate: float, end_s: float) -> list[SimSession]:
        requests = max(1, math.ceil(1.5 * rate * end_s * turns) + 100)
        return [s for s in agentic_sessions(config, requests, rate) if s.start_s < end_s]

    return sessions


def run_window(spec: DeploymentSpec, sessions: Sessions, rate: float, window: Window,
               slo: tuple[float, float], warm: Sequence[Hashable] = ()) -> dict[str, Any]:
    """The steady-state summary at a session rate; `offered_rps`: judged arrivals per second."""
    outcomes, events = simulate(spec, sessions(rate, window.end_s), window.end_s + window.tail_s, warm)
    judged = window.judged(outcomes)
    result = summary(judged, *slo)
    result |= {"events": events, "simulated_requests": len(outcomes), "session_rate": rate,
               "offered_rps": len(judged) / (window.end_s - window.warmup_s)}
    return result


def find_goodput(spec: DeploymentSpec, sessions: Sessions, slo: tuple[float, float], window: Window,
                 low: float, high: float, on_try: Callable[[float, dict[str, Any]], None] | None = None,
                 steps: int = 7, warm: Sequence[Hashable] = ()) -> dict[str, Any] | None:
    """The steady-state run at the highest session rate in [low, high] at which 90 % of
    requests meet `slo` (None when even `low` misses it)."""
    runs: dict[float, dict[str, Any]] = {}

    def attainment(rate: float) -> float:
        runs[rate] = run_window(spec, sessions, rate, window, slo, warm)
        if on_try is not None:
            on_try(rate, runs[rate])
        return runs[rate]["slo_attainment"] or 0.0

    best = goodput(attainment, low, high, steps)
    return runs.get(best) if best else None


def turns_per_session(config: AgenticConfig) -> float:
    """Mean turns of a session: a session rate times this is the offered request rate."""
    shapes = plan_session_shapes(config, 4000)
    return 4000 / len(shapes)
