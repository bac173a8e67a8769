"""`pdd plan`'s searches run on one pool of worker processes: each family's layouts in
the order of the analytic screen, a layout simulated only while it can still beat its
family's best (`pdd.lab.plan.planner`). Several searches (the plan's own and the
publication's layouts) share the pool, so no worker idles while another search has a
layout left; each search's rows depend only on its own layouts' results."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from typing import Any

from pdd.lab.plan import paper
from pdd.lab.plan.planner import (
    HEADROOM,
    Layout,
    OnProgress,
    Probe,
    capacity_of,
    goodput_of,
    row_of,
    search_resolution,
)
from pdd.lab.plan.workload import Workload


class Search:
    """One search's state: each family's queue of layouts left, the rows so far, and the
    best BCR each family has shown (what prunes and seeds its later layouts). Made in the
    parent process before any worker forks: its sessions are drawn here, once."""

    def __init__(
        self,
        layouts: Sequence[Layout],
        workload: Workload,
        probe: Probe = Probe(),
        setting: paper.Setting = paper.SETTING,
        progress: OnProgress | None = None,
        exact: bool = False,
        contenders: int | None = None,
    ) -> None:
        self.workload, self.probe, self.setting, self.progress, self.exact = workload, probe, setting, progress, exact
        shape = workload.shape()
        self.caps = {lay: capacity_of(lay, setting, workload, shape, probe) for lay in layouts}
        self.queues, self.rows = _contenders(layouts, self.caps, setting, contenders)
        self.cost = {lay: lay.bill(setting).per_hour for q in self.queues.values() for lay in q}
        self.best = {f: 0.0 for f in self.queues}
        self.pace = {f: 0.0 for f in self.queues}  # the probed rate per cost of the family's best: what beat_rps scales
        self.busy: set[str] = set()  # families with a layout in a worker
        if self.cost:  # the largest probe's sessions, drawn once here rather than in every worker
            top = (1 + search_resolution(probe)) * HEADROOM * max(self.caps[lay] / lay.cells for lay in self.cost)
            workload.draw_ahead(top, probe.window(top, workload).end_s)

    def next_layout(self) -> tuple[Layout, float | None] | None:
        """The next layout to simulate and the rate that decides whether it can win (None:
        search it whole), from the idle family with the most layouts left; those that
        cannot beat their family's best even with `HEADROOM` are pruned on the way."""
        for f in sorted((f for f in self.queues if f not in self.busy), key=lambda f: -len(self.queues[f])):
            queue = self.queues[f]
            while queue and HEADROOM * self.caps[queue[0]] / self.cost[queue[0]] < self.best[f]:
                lay = queue.pop(0)
                self.rows.append(row_of(lay, self.setting, None, self.caps[lay], None) | {"simulated": False})
            if not queue:
                continue
            lay = queue.pop(0)
            self.busy.add(f)
            return lay, None if self.exact or not self.best[f] else self.pace[f] * self.cost[lay]
        return None

    def take(self, row: dict[str, Any]) -> None:
        """A simulated layout's row: its family is free again, and its best may rise."""
        family = row["family"]
        self.busy.discard(family)
        self.rows.append(row)
        if (row["bcr"] or 0.0) > self.best[family]:
            self.best[family] = row["bcr"]
            self.pace[family] = row["probed_rps"] / row["cost_per_hour"]
        if self.progress is not None:
            found = row["goodput_rps"] is not None
            self.progress(
                sum(r["simulated"] for r in self.rows),
                len(self.cost),
                f"{row['layout']}: "
                + (f"{row['goodput_rps']:.1f} req/s" if found else f"missed at {row['missed_rps']:.1f} req/s"),
            )

    def ranked(self) -> list[dict[str, Any]]:
        return sorted(self.rows, key=_rank)


def run(searches: Sequence[Search], workers: int = 2) -> list[list[dict[str, Any]]]:
    """Each search's rows, best BCR first, on one pool of `workers` processes (one: no
    process): a free worker takes the next layout of the first search that has one."""
    running: dict[Future, Search] = {}
    with ProcessPoolExecutor(workers) if workers > 1 else ThreadPoolExecutor(1) as pool:
        while True:
            for s in searches:
                while len(running) < workers and (picked := s.next_layout()) is not None:
                    lay, beat = picked
                    args = (lay, s.setting, s.workload, s.probe, s.caps[lay], beat)
                    running[pool.submit(goodput_of, *args)] = s
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                running.pop(future).take(future.result())
    return [s.ranked() for s in searches]


def search(
    layouts: Sequence[Layout],
    workload: Workload,
    probe: Probe = Probe(),
    setting: paper.Setting = paper.SETTING,
    workers: int = 2,
    progress: OnProgress | None = None,
    exact: bool = False,
    contenders: int | None = None,
) -> list[dict[str, Any]]:
    """Every layout's row, best BCR first: simulated ones with their goodput, pruned ones
    with their capacity (`simulated` False). Each family's layouts go in order of
    capacity per cost (the analytic screen), its first `contenders` (None: all) only
    (`_contenders`); the next is simulated only while `HEADROOM` x its capacity per cost
    can beat its family's best BCR so far, and (unless `exact`) first at the one rate
    that decides whether it does (`goodput_of`'s `beat_rps`): a layout shown not to
    win has the rate it missed at, not a goodput. Up to `workers` layouts run at once, one
    process each and one per family, the family with the most layouts left first: what a
    layout is probed at and whether it is pruned depend only on its own family's earlier
    layouts, never on which of two processes finished first, so the rows are the same
    whatever the workers and the machine's load."""
    return run([Search(layouts, workload, probe, setting, progress, exact, contenders)], workers)[0]


def _contenders(
    layouts: Sequence[Layout], caps: dict[Layout, float], setting: paper.Setting, contenders: int | None
) -> tuple[dict[str, list[Layout]], list[dict[str, Any]]]:
    """Each family's layouts by the screen (capacity per cost), best first, cut to its first
    `contenders` (at least one); and the rows of those cut (`screened_out`). The screen
    orders, it does not price (its error against the simulation is printed): the verdict
    rests on simulations, and a layout the screen underrates can be cut."""
    per_cost = {lay: caps[lay] / lay.bill(setting).per_hour for lay in layouts}
    queues = {
        f: sorted((lay for lay in layouts if lay.family == f), key=lambda x: -per_cost[x])
        for f in sorted({lay.family for lay in layouts})
    }
    keep = len(layouts) if contenders is None else max(1, contenders)
    cut = [row_of(lay, setting, None, caps[lay], None) for q in queues.values() for lay in q[keep:]]
    return {f: q[:keep] for f, q in queues.items()}, [r | {"simulated": False, "screened_out": True} for r in cut]


def _rank(row: dict[str, Any]) -> tuple[int, float, float, str]:
    """Best BCR first; then the layouts shown not to win, by the rate per cost they missed at; pruned last
    (ties by name, not by which finished first)."""
    if row["bcr"] is not None:
        return 0 if row["simulated"] else 2, -row["bcr"], row["cost_per_hour"], row["layout"]
    return 1, -row["missed_rps"] / row["cost_per_hour"], row["cost_per_hour"], row["layout"]
