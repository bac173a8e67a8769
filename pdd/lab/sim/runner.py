"""Running a simulated deployment: once over a workload, or in steady state for a goodput.

Agentic sessions are closed loops (a turn waits for the previous answer) lasting minutes,
so a run that starts empty ramps up for minutes before it carries the load its rate
implies. Goodput is therefore judged in steady state: requests arriving in a window
after a warm-up are judged, and the run stops a while after the window, when every
judged request has either finished or missed its SLO.

Warm start. Rather than minutes of warm-up, a steady run starts from a stationary
session mix: sessions are drawn as if they had been arriving for as long as the
longest lasts (`history_s`), each one caught in progress resumes at its next turn, and the context its
earlier turns left is already in the caches of the instances the router will send it
to. Queues still have to form, which a short warm-up covers.

Early stopping. A probe above goodput is the dearest (its queues grow without bound),
and its verdict is known long before it ends: once the judged requests that have
certainly missed the SLO (finished late, or waiting longer than the TTFT target for a
first token) outnumber what the attainment allows of every request the window will
judge, the probe stops and fails: in the window, or in its tail, where it would otherwise
run on until the last judged request ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import simpy

from pdd.heap import no_cyclic_collection
from pdd.lab.sim.cluster import Cluster
from pdd.lab.sim.fleet import DeploymentSpec, Proc
from pdd.lab.sim.metrics import GOODPUT_ATTAINMENT, goodput, summary
from pdd.lab.workload.agentic import AgenticConfig, plan_session_shapes, session_shape_stream
from pdd.lab.workload.types import Session
from pdd.record import RequestRecord

NOMINAL_TTFT_S, NOMINAL_TPOT_S = 1.0, 0.035  # a turn's length, to place warm-started sessions
CHECK_S = 5.0  # how often a probe looks at its misses


@dataclass(frozen=True)
class Window:
    """Judge the requests that arrive in [warmup_s, end_s); stop at `end_s + tail_s`
    (a judged request that meets the SLO has finished by then)."""

    warmup_s: float
    end_s: float
    tail_s: float

    def judged(self, records: list[RequestRecord]) -> list[RequestRecord]:
        """(A turn never sent, after an earlier one of its session failed, has no arrival.)"""
        return [r for r in records if r.start_s is not None and self.warmup_s <= r.start_s < self.end_s]


Sessions = Callable[[float, float], list[Session]]  # (session rate, arrivals until s) -> sessions


def tail_s(longest_output: int, slo: tuple[float, float]) -> float:
    """The longest a request within the SLO can take: its TTFT plus every token at the TPOT."""
    return (slo[0] + slo[1] * longest_output) / 1000 + 1.0


def history_s(config: AgenticConfig) -> float:
    """How long the longest session lasts, at the nominal turn length: a warm start
    needs sessions drawn that far back."""
    return config.turns[1] * (NOMINAL_TTFT_S + NOMINAL_TPOT_S * config.output_tokens[1] + config.tool_time_s[1])


def _resume(s: Session, history: float) -> Session | None:
    """A session drawn as if it started `history` ago: None if it has ended by now,
    else from its next turn on (a turn whose tool still runs is sent when it ends), with
    the context its earlier turns left cached."""
    t = s.start_s - history
    if t >= 0:
        return replace(s, start_s=t)
    context = s.warm_tokens
    for k, (turn, prompt) in enumerate(zip(s.turns, s.prompts(), strict=True)):
        t += turn.pause_s
        if t > 0:  # its tool still runs: it is sent at t
            turns = (replace(turn, pause_s=0.0), *s.turns[k + 1 :])
            return replace(s, start_s=t, turns=turns, warm_tokens=context)
        t += NOMINAL_TTFT_S + NOMINAL_TPOT_S * turn.max_tokens
        context = prompt + turn.max_tokens
        if t > 0:
            if k + 1 == len(s.turns):
                return None
            return replace(s, start_s=t, turns=s.turns[k + 1 :], warm_tokens=context)
    return None


@dataclass
class _Drawn:
    """A config's sessions at a unit rate as far as drawn, and the stream that draws on."""

    stream: Iterator[Session]
    sessions: list[Session]


_DRAWN: dict[AgenticConfig, _Drawn] = {}


def _at_unit_rate(config: AgenticConfig, until_s: float) -> list[Session]:
    """`session_shape_stream(config, 1.0)`'s sessions that start before `until_s`, and one
    more (it starts at or after it), drawn on from where the last call stopped: a search
    probes many rates of one workload, and the draw is most of a probe's set-up."""
    held = _DRAWN.get(config)
    if held is None:
        held = _DRAWN[config] = _Drawn(session_shape_stream(config, 1.0), [])
    while not held.sessions or held.sessions[-1].start_s < until_s:
        held.sessions.append(next(held.stream))
    return held.sessions


def draw_ahead(config: AgenticConfig, rate: float, end_s: float) -> None:
    """Draw the sessions of the largest steady run a search will make now, before its
    worker processes fork: they inherit the draw and draw on only past it."""
    _at_unit_rate(config, rate * (end_s + history_s(config)))


def _drawn(config: AgenticConfig, rate: float, until_s: float) -> list[Session]:
    """`plan_session_shapes(config, ..., rate)`'s sessions that start before `until_s`,
    from the one draw at a unit rate: start times are a Poisson process, so at `rate`
    they are the unit-rate ones / `rate`."""
    drawn = []
    for s in _at_unit_rate(config, rate * until_s):
        start = s.start_s / rate
        if start >= until_s:  # (starts only grow)
            break
        drawn.append(replace(s, start_s=start))
    return drawn


def steady_sessions(config: AgenticConfig, warm: bool = True) -> Sessions:
    """Agentic sessions starting at a rate until a time (the stream is planned long
    enough, then cut there); `warm`: from a stationary mix (see the module's note)."""

    def sessions(rate: float, end_s: float) -> list[Session]:
        history = history_s(config) if warm else 0.0
        drawn = _drawn(config, rate, end_s + history)
        if not warm:
            return drawn
        resumed = (_resume(s, history) for s in drawn)
        return [s for s in resumed if s is not None]

    return sessions


@dataclass
class _Probe:
    """Watches a run: snapshots of every instance's work at the window's edges (what
    binds), and the early stop."""

    cluster: Cluster
    window: Window
    slo_s: tuple[float, float]
    attainment: float
    stop_early: bool
    marks: dict[str, dict[str, tuple[float, float, float]]]
    failed_early: bool = False
    done: bool = False

    def snapshot(self) -> dict[str, tuple[float, float, float]]:
        c = self.cluster
        marks = {
            name: (i.stats.busy_s, float(i.stats.steps), float(i.kv_held_tokens)) for name, i in c.instances.items()
        }
        marks["line"] = (c.line.stats.bytes if c.line is not None else 0.0, 0.0, 0.0)
        return marks

    def misses(self) -> tuple[int, int]:
        """(judged requests so far, those certainly out of the SLO)."""
        now = self.cluster.env.now
        judged = self.window.judged(self.cluster.records)
        missed = 0
        for r in judged:
            assert r.start_s is not None  # judged by its arrival
            waited = r.ttft_ms / 1000 if r.ttft_ms is not None else now - r.start_s
            if r.error or waited > self.slo_s[0] or (r.tpot_ms is not None and r.tpot_ms > 1000 * self.slo_s[1]):
                missed += 1
        return len(judged), missed

    def settled(self) -> bool:
        """Every judged request has finished or failed: nothing left to learn."""
        return all(r.e2e_ms is not None or r.error is not None for r in self.window.judged(self.cluster.records))

    def run(self) -> Proc:
        env, w = self.cluster.env, self.window
        yield env.timeout(w.warmup_s)
        self.marks["start"] = self.snapshot()
        while env.now < w.end_s:
            yield env.timeout(min(CHECK_S, w.end_s - env.now))
            if self.stop_early and env.now > w.warmup_s + 2 * CHECK_S and self.lost():
                self.failed_early = True
                self.marks["end"] = self.snapshot()
                return
        self.marks["end"] = self.snapshot()
        while not self.settled():  # the tail: only until the last judged request is done
            yield env.timeout(CHECK_S)
            if self.stop_early and self.lost():  # every request is judged now: the verdict is certain
                self.failed_early = True
                return
        self.done = True

    def lost(self) -> bool:
        """The certain misses outnumber what the attainment allows of every request the
        window will judge (extrapolated from those so far while it is open)."""
        w, now = self.window, self.cluster.env.now
        judged, missed = self.misses()
        expected = judged * (w.end_s - w.warmup_s) / (min(now, w.end_s) - w.warmup_s)
        return missed > (1 - self.attainment) * expected


@no_cyclic_collection()
def simulate(
    spec: DeploymentSpec,
    sessions: list[Session],
    horizon_s: float = math.inf,
    warm: Sequence[Sequence[Hashable]] = (),
) -> tuple[list[RequestRecord], int]:
    """The records (unfinished ones too, when the horizon stops the run), and how many
    events the simulation processed. `warm`: prefixes (each a prompt's blocks) every
    instance holds at the start, as a deployment that has served them a while does."""
    env = simpy.Environment()
    cluster = Cluster(env, spec)
    cluster.warm(sessions, warm)
    for s in sessions:
        cluster.start(s)
    events = 0
    while env.peek() < horizon_s:
        env.step()
        events += 1
    return cluster.records, events


def utilisation(
    spec: DeploymentSpec, marks: dict[str, dict[str, tuple[float, float, float]]], seconds: float, tpot_s: float
) -> dict[str, float]:
    """How close each resource ran to its limit over the window: a prefill instance's
    share of time in steps (it queues work); a decoding one's mean step over the TPOT
    target (it always has steps to run; their length is what the SLO bounds) and its
    pool held at the window's end (requests' room and the prefixes they pin); the line's
    share of its bandwidth. Per role, the mean over its instances."""
    if "start" not in marks or "end" not in marks or seconds <= 0:
        return {}
    start, end = marks["start"], marks["end"]
    values: dict[str, list[float]] = {}
    for name in start:
        if name == "line":
            continue
        role = name.split("@")[0].rstrip("0123456789")
        busy, steps = end[name][0] - start[name][0], end[name][1] - start[name][1]
        if role == "prefill":
            values.setdefault(role, []).append(busy / seconds)
        else:
            values.setdefault(role, []).append(busy / steps / tpot_s if steps else 0.0)
            cap = next(r.capacity_tokens for r in spec.roles if r.role == role)
            values.setdefault(f"{role}_kv", []).append(end[name][2] / cap)
    result = {k: sum(v) / len(v) for k, v in values.items()}
    if len({r.dc for r in spec.roles}) > 1:
        result["line"] = (end["line"][0] - start["line"][0]) / (spec.line.bytes_per_s * seconds)
    return result


def binding(util: dict[str, float]) -> str:
    """The resource closest to its limit."""
    return max(util, key=util.__getitem__) if util else "-"


@no_cyclic_collection()
def run_window(
    spec: DeploymentSpec,
    sessions: Sessions,
    rate: float,
    window: Window,
    slo: tuple[float, float],
    stop_early: bool = False,
    attainment: float = GOODPUT_ATTAINMENT,
    intervals: bool = True,
) -> dict[str, Any]:
    """The steady-state summary at a session rate; `offered_rps`: judged arrivals per
    second; `utilisation` and `binding`: what the deployment ran out of. `intervals`
    False: the latencies without their bootstrap intervals (a goodput probe reads none)."""
    env = simpy.Environment()
    cluster = Cluster(env, spec)
    drawn = sessions(rate, window.end_s)
    cluster.warm(drawn)
    for s in drawn:
        cluster.start(s)
    marks: dict[str, dict[str, tuple[float, float, float]]] = {}
    probe = _Probe(cluster, window, (slo[0] / 1000, slo[1] / 1000), attainment, stop_early, marks)
    env.process(probe.run())
    events, horizon = 0, window.end_s + window.tail_s
    while env.peek() < horizon and not (probe.failed_early or probe.done):
        env.step()
        events += 1
    judged = window.judged(cluster.records)
    seconds = (min(env.now, window.end_s) if probe.failed_early else window.end_s) - window.warmup_s
    result = summary(judged, *slo, intervals=intervals)
    util = utilisation(spec, marks, seconds, slo[1] / 1000)
    result |= {
        "events": events,
        "simulated_requests": len(cluster.records),
        "session_rate": rate,
        "offered_rps": len(judged) / max(seconds, 1e-9),
        "stopped_early": probe.failed_early,
        "utilisation": util,
        "binding": binding(util),
    }
    if probe.failed_early:
        result["slo_attainment"] = min(result["slo_attainment"] or 0.0, attainment - 1e-6)
    return result


def find_goodput(
    spec: DeploymentSpec,
    sessions: Sessions,
    slo: tuple[float, float],
    window: Window | Callable[[float], Window],
    low: float,
    high: float,
    on_try: Callable[[float, dict[str, Any]], None] | None = None,
    steps: int = 7,
    stop_early: bool = True,
    attainment: float = GOODPUT_ATTAINMENT,
    runs: dict[float, dict[str, Any]] | None = None,
) -> dict[str, Any] | None:
    """The steady-state run at the highest session rate in [low, high] at which
    `attainment` of requests meet `slo` (None when even `low` misses it). `window`: one
    for every rate, or per session rate (to judge about as many requests at each).
    `runs`: the runs already made of this deployment and workload, by session rate; a
    rate found there is not run again (the simulation is deterministic), and new ones
    are added. A probe's latencies come without bootstrap intervals: a bisection reads
    its attainment, and the goodput's run its percentiles."""
    runs = {} if runs is None else runs

    def attained(rate: float) -> float:
        if rate not in runs:
            at = window(rate) if callable(window) else window
            runs[rate] = run_window(spec, sessions, rate, at, slo, stop_early, attainment, intervals=False)
            if on_try is not None:
                on_try(rate, runs[rate])
        return runs[rate]["slo_attainment"] or 0.0

    best = goodput(attained, low, high, steps, attainment)
    return runs.get(best) if best else None


@lru_cache(maxsize=8)
def turns_per_session(config: AgenticConfig) -> float:
    """Mean turns of a session: a session rate times this is the offered request rate."""
    shapes = plan_session_shapes(config, 4000)
    return 4000 / len(shapes)
