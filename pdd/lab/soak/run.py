"""Drive a soak or a chaos-matrix run against a started `Cluster`, and build the report.

Soak: the load runs for its requests (or duration) while faults strike on a seeded
schedule. Matrix: each fault kind alone, `repeats` times: load, strike, wait for the
recovery, stop the load, let the pages settle, and count what that kind left held.
Both end the same way: every fault over, the router sees every instance, a few probe
requests must complete, and then no page may be held by a request.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import Progress

from pdd.lab.soak import report
from pdd.lab.soak.client import COMPLETED, FAILED, LOST, OUTCOMES, SoakOutcome
from pdd.lab.soak.cluster import Cluster, self_peak_rss_kib
from pdd.lab.soak.faults import FaultEvent, FaultRanges, Injector, schedule
from pdd.lab.soak.load import Load
from pdd.lab.soak.workload import SoakWorkload
from pdd.progress import progress_bar

PROBES = 5
HEALTHY_TIMEOUT_S = 180.0
WATCH_S = 1.0
MATRIX_WARM_S = 3.0  # load before the strike
MATRIX_COOL_S = 3.0  # load after the recovery
MATRIX_RECOVER_S = 120.0  # most time to wait for a completed request after the clear


@dataclass(frozen=True)
class SoakPlan:
    kinds: tuple[str, ...]
    concurrency: int
    seed: int
    timeout_s: float
    settle_s: float
    requests: int | None = None  # soak: stop after this many (or after duration_s)
    duration_s: float | None = None
    fault_every_s: float = 10.0
    repeats: int = 0  # > 0: a matrix run, each kind this many times


class Run:
    """One soak or matrix run: its load, its faults, and the watchers around them."""

    def __init__(self, cluster: Cluster, plan: SoakPlan, console: Console, progress: Progress) -> None:
        self.cluster = cluster
        self.plan = plan
        self.console = console
        self.t0 = time.monotonic()
        self.injector = Injector(cluster, random.Random(plan.seed), self.t0, FaultRanges())
        self.faults: list[FaultEvent] = []
        self.settled_by_kind: dict[str, tuple[int, float]] = {}  # matrix: pages held at the end, seconds waited
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self._progress = progress
        self._task = progress.add_task("requests", total=plan.requests)
        workload = SoakWorkload(seed=plan.seed)
        self.load = Load(cluster.router_url, cluster.dep.model.name, workload, plan.timeout_s, self.t0, self._seen)
        self.probes = Load(
            cluster.router_url, cluster.dep.model.name, workload, plan.timeout_s, self.t0, lambda _: None
        )

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _seen(self, out: SoakOutcome) -> None:
        self.counts[out.outcome] += 1
        c = self.counts
        fault = self.injector.active or "-"
        self._progress.update(
            self._task, advance=1, description=f"{c[COMPLETED]} ok, {c[FAILED]} failed, {c[LOST]} lost | fault: {fault}"
        )
        if out.outcome == LOST:
            self.console.print(
                f"lost request {out.index} at {out.start:.1f}-{out.end:.1f} s: {out.detail}", markup=False
            )

    def _fault_done(self, event: FaultEvent) -> None:
        self.faults.append(event)
        where = f" ({event.target})" if event.target != "line" else ""
        params = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in event.params.items())
        self.console.print(
            f"fault {event.kind}{where} at {event.start:.1f} s, over at {event.clear:.1f} s"
            f" [{params}]" + ("" if event.ok else " - DID NOT REJOIN"),
            markup=False,
        )

    async def _watch(self) -> None:
        """Sample peak RSS; a child that exits on its own is a crash: report and restart it."""
        while True:
            self.cluster.sample_rss()
            for crash in self.cluster.check_crashes(self._now()):
                self.console.print(
                    f"CRASH: {crash.name} exited with code {crash.code} at {crash.at:.1f} s\n{crash.log_tail}",
                    markup=False,
                )
                if crash.name in {i.name for i in self.cluster.dep.instances}:
                    self.cluster.restart(crash.name)
            await asyncio.sleep(WATCH_S)

    async def execute(self) -> dict[str, Any]:
        watcher = asyncio.create_task(self._watch())
        try:
            if self.plan.repeats:
                await self._matrix()
            else:
                await self._soak()
            return await self._finish()
        finally:
            watcher.cancel()

    async def _soak(self) -> None:
        plan = self.plan
        stop = asyncio.Event()
        faults = asyncio.create_task(schedule(self.injector, plan.kinds, plan.fault_every_s, stop, self._fault_done))
        end = None if plan.duration_s is None else time.monotonic() + plan.duration_s

        def done() -> bool:
            over = (
                (plan.requests is not None and self.load.next_index >= plan.requests)
                or (end is not None and time.monotonic() >= end)
                or faults.done()
            )
            if over:
                stop.set()  # no new fault while the last requests finish
            return over

        await self.load.drive(plan.concurrency, done)
        await faults  # the fault under way ends; a failing injector raises here

    async def _matrix(self) -> None:
        for kind in self.plan.kinds:
            for _ in range(self.plan.repeats):
                stop = asyncio.Event()
                load = asyncio.create_task(self.load.drive(self.plan.concurrency, stop.is_set))
                await asyncio.sleep(MATRIX_WARM_S)
                event = await self.injector.inject(kind)
                self._fault_done(event)

                def recovered(e: FaultEvent = event) -> bool:
                    return report.recovery_s(e, self.load.outcomes) is not None

                await _until(recovered, MATRIX_RECOVER_S)
                await asyncio.sleep(MATRIX_COOL_S)
                stop.set()
                await load
            await self.cluster.all_healthy(HEALTHY_TIMEOUT_S)
            pages, waited = await self.cluster.settled_pages(self.plan.settle_s)
            self.settled_by_kind[kind] = (_leaked(pages), waited)
            where = ", ".join(f"{n} {p['held']}" for n, p in pages.items() if p.get("held"))
            self.console.print(
                f"after {kind}: {_leaked(pages)} pages held ({where or 'none'}) after {waited:.0f} s", markup=False
            )

    async def _finish(self) -> dict[str, Any]:
        healthy = await self.cluster.all_healthy(HEALTHY_TIMEOUT_S)
        self.probes.next_index = self.load.next_index
        await self.probes.drive(1, lambda: self.probes.next_index >= self.load.next_index + PROBES)
        held = _leaked(await self.cluster.pages())
        pages, waited = await self.cluster.settled_pages(self.plan.settle_s)
        self.cluster.sample_rss()
        return {**self._report(healthy, pages), "held_pages_after_load": held, "settle_s": waited}

    def _report(self, healthy: bool, pages: dict[str, dict[str, Any]]) -> dict[str, Any]:
        outcomes = self.load.outcomes
        rss = {name: kib / 1024 for name, kib in self.cluster.peak_rss_kib.items()}
        rss["soak (client)"] = self_peak_rss_kib() / 1024
        rows = report.matrix(
            self.plan.kinds,
            self.faults,
            outcomes,
            self.probes.outcomes,
            self.settled_by_kind if self.plan.repeats else None,
        )
        return {
            "totals": report.totals(outcomes),
            "probes": report.totals(self.probes.outcomes),
            "healthy_at_end": healthy,
            "leaked_pages": _leaked(pages),
            "pages": pages,
            "peak_rss_mib": rss,
            "lives": self.cluster.lives,
            "crashes": [vars(c) for c in self.cluster.crashes],
            "faults": [f.to_dict() for f in self.faults],
            "matrix": rows,
            "matrix_markdown": report.matrix_markdown(rows),
            "failed_reasons": report.reasons(outcomes, FAILED),
            "lost_requests": [o.to_dict() for o in outcomes if o.outcome == LOST],
            "pipelines": report.counter(o.pipeline for o in outcomes if o.outcome == COMPLETED),
            "fallbacks": report.counter(kind for o in outcomes for kind in o.fallbacks),
            "wall_s": self._now(),
            "requests": [o.to_dict() for o in outcomes],
        }


def passed(result: dict[str, Any]) -> list[str]:
    """Why the run failed its checks (empty: it passed)."""
    why = []
    if not result["totals"][COMPLETED]:
        why.append("no request completed")
    if result["totals"][LOST]:
        why.append(f"{result['totals'][LOST]} requests lost")
    if result["leaked_pages"]:
        why.append(f"{result['leaked_pages']} pages leaked")
    if unknown := [name for name, p in result["pages"].items() if "error" in p]:
        why.append(f"no page counts from {', '.join(unknown)}")
    if result["crashes"]:
        why.append(f"{len(result['crashes'])} processes crashed")
    if not result["healthy_at_end"]:
        why.append("not every instance was healthy at the end")
    if result["probes"][COMPLETED] != result["probes"]["sent"]:
        why.append("probe requests after the run did not all complete")
    if any(not f["ok"] for f in result["faults"]):
        why.append("a restarted instance did not rejoin")
    return why


def _leaked(pages: dict[str, dict[str, Any]]) -> int:
    """Pages still held by requests once all have ended (instances that answered)."""
    return sum(p.get("held", 0) for p in pages.values())


async def _until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


def run(cluster: Cluster, plan: SoakPlan, quiet: bool) -> dict[str, Any]:
    """Run the plan with a progress bar on stderr (hidden when quiet or not a terminal);
    what happens on the way (faults, lost requests, crashes) is printed there too."""
    with progress_bar(Console(stderr=True), quiet) as progress:
        return asyncio.run(Run(cluster, plan, progress.console, progress).execute())
