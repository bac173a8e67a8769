"""The fault menu, and when faults strike.

Each fault runs to its end before the next: an instance killed with -9 and started
again after a pause (its fault is over once the router counts it healthy), a stalled
line, a silent blackhole lifted after a few seconds, every connection on the line reset,
the line narrowed and widened back. One at a time keeps each request's outcome
attributable to the one fault in whose window it ran (the chaos matrix). Kinds come in
rounds of a seeded shuffle, so a soak meets every kind about as often; times and
durations are seeded draws.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from pdd.lab.soak.cluster import Cluster

KILL_ROLES = {"kill-p": "prefill", "kill-rld": "relay", "kill-md": "main"}
LINE_KINDS = ("stall", "blackhole", "drop", "bandwidth")
KINDS = (*KILL_ROLES, *LINE_KINDS)


@dataclass(frozen=True)
class FaultRanges:
    """How long each fault lasts, drawn uniformly from these (seconds)."""

    restart_after_s: tuple[float, float] = (1.0, 3.0)
    stall_s: tuple[float, float] = (1.0, 4.0)
    # either side of the default liveness.dead_after_s (5 s): some are ridden out, some
    # make the router and P drop MD as lost
    blackhole_s: tuple[float, float] = (2.0, 7.0)
    narrow_s: tuple[float, float] = (3.0, 8.0)
    narrow_factor: float = 0.05  # the line's bandwidth while narrowed, as a share of its own
    rejoin_timeout_s: float = 180.0


@dataclass
class FaultEvent:
    """One fault; `start` and `clear` are seconds since the run started."""

    kind: str
    target: str  # the instance, or "line"
    start: float
    clear: float = 0.0  # over: the instance is back in the router's set, or the line healed
    params: dict[str, Any] = field(default_factory=dict)
    ok: bool = True  # False: the instance did not rejoin within rejoin_timeout_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_kinds(kinds: Sequence[str], cluster: Cluster) -> str | None:
    """Why these faults cannot hit this deployment, or None."""
    for kind in kinds:
        if kind not in KINDS:
            return f"unknown fault {kind!r}; have {', '.join(KINDS)}"
        if kind in KILL_ROLES and not cluster.dep.by_role(KILL_ROLES[kind]):
            return f"{kind}: this deployment has no {KILL_ROLES[kind]} instance"
        if kind in LINE_KINDS and cluster.line_admin is None:
            return f"{kind}: this deployment has no line"
    return None


class Injector:
    def __init__(self, cluster: Cluster, rng: random.Random, t0: float, ranges: FaultRanges = FaultRanges()) -> None:
        self.cluster = cluster
        self.rng = rng
        self.t0 = t0
        self.ranges = ranges
        self.active: str | None = None  # the fault under way, for progress displays

    def _now(self) -> float:
        return time.monotonic() - self.t0

    async def inject(self, kind: str) -> FaultEvent:
        """Strike with `kind` and return once the fault is over."""
        self.active = kind
        try:
            return await self._inject(kind)
        finally:
            self.active = None

    async def _inject(self, kind: str) -> FaultEvent:
        if kind in KILL_ROLES:
            return await self._kill(kind)
        event = FaultEvent(kind, "line", self._now())
        r = self.ranges
        if kind == "stall":
            event.params["stall_s"] = s = self.rng.uniform(*r.stall_s)
            await self._post("/fault", stall_s=s)
            await asyncio.sleep(s)
        elif kind == "blackhole":
            event.params["blackhole_s"] = s = self.rng.uniform(*r.blackhole_s)
            await self._post("/fault", blackhole=True)
            try:
                await asyncio.sleep(s)
            finally:
                await self._post("/fault", blackhole=False)
        elif kind == "drop":
            event.params["connections"] = (await self._post("/fault", drop=True))["drops"]
        else:
            full = self.cluster.dep.line.bandwidth_mbps
            event.params.update(bandwidth_mbps=full * r.narrow_factor, narrow_s=self.rng.uniform(*r.narrow_s))
            await self._post("/line", bandwidth_mbps=event.params["bandwidth_mbps"])
            try:
                await asyncio.sleep(event.params["narrow_s"])
            finally:
                await self._post("/line", bandwidth_mbps=full)
        event.clear = self._now()
        return event

    async def _kill(self, kind: str) -> FaultEvent:
        name = self.rng.choice([i.name for i in self.cluster.dep.by_role(KILL_ROLES[kind])])
        pause = self.rng.uniform(*self.ranges.restart_after_s)
        event = FaultEvent(kind, name, self._now(), params={"restart_after_s": pause})
        self.cluster.kill(name)
        await asyncio.sleep(pause)
        self.cluster.restart(name)
        event.ok = await self.cluster.wait_rejoined(name, self.ranges.rejoin_timeout_s)
        event.clear = self._now()
        return event

    async def _post(self, path: str, **body: Any) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            response = await client.post(f"{self.cluster.line_admin}{path}", json=body)
            response.raise_for_status()
            return response.json()


async def schedule(
    injector: Injector,
    kinds: Sequence[str],
    every_s: float,
    stop: asyncio.Event,
    on_event: Callable[[FaultEvent], None],
) -> None:
    """Inject faults until `stop` is set: a pause of 0.5-1.5x `every_s`, then the next
    kind of the current shuffled round. A fault under way runs to its end."""
    if not kinds:
        await stop.wait()
        return
    rounds: list[str] = []
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), injector.rng.uniform(0.5, 1.5) * every_s)
            return
        except TimeoutError:
            pass
        if not rounds:
            rounds = list(kinds)
            injector.rng.shuffle(rounds)
        on_event(await injector.inject(rounds.pop()))
