"""A line between two sites: bandwidth shared fairly among concurrent transfers.

Processor sharing, the model `pdd.policy.transfer.finish_s` predicts with: n active
transfers each progress at bandwidth / n. One SimPy process re-plans at every arrival
and completion, so a run costs two events per transfer, whatever its size.
"""

from __future__ import annotations

from dataclasses import dataclass

import simpy

from pdd.perf.hardware import Line


@dataclass
class _Transfer:
    left: float
    done: simpy.Event
    priority: int


@dataclass
class LineStats:
    bytes: float = 0.0  # what the line carried (read by the tests' bandwidth checks)


class Delivery:
    """What every line does with bytes that have left it: they arrive a one-way delay
    later (an empty transfer takes that delay only)."""

    env: simpy.Environment
    line: Line

    def _deliver(self, done: simpy.Event):
        yield self.env.timeout(self.line.one_way_ms / 1000)
        done.succeed()

    def _empty(self) -> simpy.Event:
        done = self.env.event()
        self.env.process(self._deliver(done))
        return done


class SharedLine(Delivery):
    """`send(nbytes)` returns an event that fires when the bytes have arrived (one-way
    delay included). Urgent transfers (priority 0) share the line among themselves and
    take it ahead of background ones (priority 1), as the instances' two connections do."""

    def __init__(self, env: simpy.Environment, line: Line, name: str = "") -> None:
        self.env, self.line, self.name = env, line, name
        self.active: list[_Transfer] = []
        self.stats = LineStats()
        self._last = 0.0
        self._wake = env.event()
        env.process(self._run())

    def send(self, nbytes: float, priority: int = 0, conn: object = None) -> simpy.Event:
        """(`conn`, the connection, is TcpLine's: a fluid pipe shares per transfer.)"""
        if nbytes <= 0:
            return self._empty()
        done = self.env.event()
        self._advance()
        self.active.append(_Transfer(float(nbytes), done, priority))
        self.stats.bytes += nbytes
        if not self._wake.triggered:
            self._wake.succeed()
        return done

    def in_flight(self, priority: int = 0) -> list[int]:
        """Bytes still to go of the transfers a new one at `priority` would share with."""
        self._advance()
        return [int(t.left) for t in self.active if t.priority <= priority]

    def _sharing(self) -> list[_Transfer]:
        top = min(t.priority for t in self.active)
        return [t for t in self.active if t.priority == top]

    def _advance(self) -> None:
        """Account for the bytes moved since the last change."""
        now = self.env.now
        elapsed, self._last = now - self._last, now
        if not self.active or elapsed <= 0:
            return
        sharing = self._sharing()
        moved = elapsed * self.line.bytes_per_s / len(sharing)
        for t in sharing:
            t.left -= moved

    def _run(self):
        while True:
            self._advance()
            done = self.line.bytes_per_s * 1e-9  # a nanosecond's bytes: float residue, not data
            for t in [t for t in self.active if t.left <= done]:
                self.active.remove(t)
                self.env.process(self._deliver(t.done))
            if not self.active:
                self._wake = self.env.event()
                yield self._wake
                continue
            sharing = self._sharing()
            next_s = min(t.left for t in sharing) * len(sharing) / self.line.bytes_per_s
            self._wake = self.env.event()
            yield self._wake | self.env.timeout(next_s)
