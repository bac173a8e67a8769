"""The line itself: its settings, the shaper that paces each direction, and the
shared medium (`EmulatedLine`) with its delay, jitter, faults and byte counters.

"a→b" is client-to-server traffic (towards the route's target), "b→a" the replies.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

A_TO_B = "a_to_b"
B_TO_A = "b_to_a"
JITTER_DISTS = ("uniform", "normal")
BURST_S = 0.005  # idle credit of the token bucket: 5 ms of line time
QUEUE_S = 0.02  # how far ahead a stream may book line time (a router's queue)
CHUNK_S = 0.002  # forward in pieces of ~2 ms of line time so pacing stays smooth
MIN_CHUNK = 1024
MAX_CHUNK = 64 * 1024
MIN_INFLIGHT = 128 * 1024
POLL_S = 0.05  # how often a held chunk re-checks a stall that may have been lifted


@dataclass(frozen=True)
class LineSettings:
    """What a line is; validated on creation, so a bad value never reaches the relay."""

    bandwidth_mbps: float = 100.0  # per direction, shared by all connections
    delay_ms: float = 10.0  # one way
    jitter_ms: float = 0.0  # bound of the one-way jitter
    jitter_dist: str = "uniform"  # uniform in ±jitter, or normal (sigma jitter/2) clipped to ±jitter
    seed: int | None = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_mbps) and self.bandwidth_mbps > 0):
            raise ValueError("bandwidth_mbps must be a positive number")
        for name in ("delay_ms", "jitter_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a non-negative number")
        if self.jitter_dist not in JITTER_DISTS:
            raise ValueError(f"jitter_dist must be one of {', '.join(JITTER_DISTS)}")


class _Shaper:
    """Serializes one direction of the line (GCRA, i.e. a token bucket in virtual time).

    Every chunk books the next slice of line time; it has left the line when its slice
    ends. Idle time earns at most `BURST_S` of credit, which also absorbs the event
    loop oversleeping, so the long-run rate is the line rate and never more.
    """

    def __init__(self) -> None:
        self._busy_until = 0.0

    def book(self, nbytes: int, bytes_per_s: float, now: float) -> float:
        self._busy_until = max(self._busy_until, now - BURST_S) + nbytes / bytes_per_s
        return self._busy_until


class Crossing(Protocol):
    """A connection crossing the line, as the line's faults see it (`pdd.lab.line.relay`'s)."""

    poisoned: bool  # bytes were swallowed by a blackhole

    def abort(self) -> None: ...


class EmulatedLine:
    """The shared medium: rate, delay, jitter, faults and counters of one line."""

    def __init__(
        self,
        bandwidth_mbps: float,
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        *,
        jitter_dist: str = "uniform",
        seed: int | None = 0,
    ) -> None:
        self.settings = LineSettings(bandwidth_mbps, delay_ms, jitter_ms, jitter_dist, seed)
        self._rng = random.Random(seed)
        self._shapers = {A_TO_B: _Shaper(), B_TO_A: _Shaper()}
        self._stalled_until = 0.0
        self.blackholed = False
        self._conns: set[Crossing] = set()
        self.bytes_a_to_b = 0
        self.bytes_b_to_a = 0
        self.bytes_blackholed = 0
        self.connections_total = 0
        self.connect_errors = 0
        self.drops = 0

    @property
    def bandwidth_mbps(self) -> float:
        return self.settings.bandwidth_mbps

    @property
    def delay_ms(self) -> float:
        return self.settings.delay_ms

    @property
    def jitter_ms(self) -> float:
        return self.settings.jitter_ms

    # --- control -------------------------------------------------------------------

    def reshape(
        self, bandwidth_mbps: float | None = None, delay_ms: float | None = None, jitter_ms: float | None = None
    ) -> None:
        """Change the line at run time; data already on the line keeps its timing."""
        s = self.settings
        self.settings = replace(
            s,
            bandwidth_mbps=s.bandwidth_mbps if bandwidth_mbps is None else float(bandwidth_mbps),
            delay_ms=s.delay_ms if delay_ms is None else float(delay_ms),
            jitter_ms=s.jitter_ms if jitter_ms is None else float(jitter_ms),
        )

    def stall(self, seconds: float) -> None:
        """Hold all traffic for `seconds` from now, losing nothing; `stall(0)` ends a stall."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError("stall seconds must be a non-negative number")
        self._stalled_until = time.monotonic() + seconds

    def drop_all(self) -> int:
        """Reset every connection crossing the line now; returns how many."""
        dropped = list(self._conns)
        for conn in dropped:
            conn.abort()
        self.drops += len(dropped)
        return len(dropped)

    def blackhole(self, on: bool) -> None:
        """Silently swallow all traffic (peers hang until their own timeouts).

        Lifting it resets the connections that lost bytes: their streams can no
        longer be delivered intact, and a corrupted stream is worse than a reset.
        """
        self.blackholed = bool(on)
        if not self.blackholed:
            poisoned = [conn for conn in self._conns if conn.poisoned]
            for conn in poisoned:
                conn.abort()
            self.drops += len(poisoned)

    @property
    def connections(self) -> int:
        return len(self._conns)

    def stats(self) -> dict[str, Any]:
        return {
            "bandwidth_mbps": self.bandwidth_mbps,
            "delay_ms": self.delay_ms,
            "jitter_ms": self.jitter_ms,
            "jitter_dist": self.settings.jitter_dist,
            "stalled_for_s": max(0.0, self._stalled_until - time.monotonic()),
            "blackhole": self.blackholed,
            "bytes_a_to_b": self.bytes_a_to_b,
            "bytes_b_to_a": self.bytes_b_to_a,
            "bytes_blackholed": self.bytes_blackholed,
            "connections": self.connections,
            "connections_total": self.connections_total,
            "connect_errors": self.connect_errors,
            "drops": self.drops,
        }

    # --- used by the relay ---------------------------------------------------------

    @property
    def _bytes_per_s(self) -> float:
        return self.bandwidth_mbps * 125_000

    def chunk_size(self) -> int:
        return max(MIN_CHUNK, min(MAX_CHUNK, int(self._bytes_per_s * CHUNK_S)))

    def inflight_limit(self) -> int:
        """Bytes one stream may have on the line: over twice the bandwidth-delay product."""
        one_way_s = (self.delay_ms + self.jitter_ms) / 1000 + BURST_S + QUEUE_S
        return max(MIN_INFLIGHT, int(2 * self._bytes_per_s * one_way_s) + 4 * self.chunk_size())

    async def transmit(self, direction: str, nbytes: int) -> float:
        """Put `nbytes` on the line (after any stall); returns when they reach the far end.

        A stream may book line time up to `QUEUE_S` ahead — the line's queue — so an
        event loop that wakes late wastes no line time; still, bytes never leave faster
        than the line rate, nor arrive sooner than one delay after leaving.
        """
        await self._wait_stall()
        now = time.monotonic()
        sent = max(now, self._shapers[direction].book(nbytes, self._bytes_per_s, now))
        await asyncio.sleep(max(0.0, sent - QUEUE_S - now))
        return sent + self._one_way_delay_s()

    async def hold(self, arrival: float) -> None:
        """Sleep until `arrival` and until any stall is over."""
        while (wait := max(arrival, self._stalled_until) - time.monotonic()) > 0:
            await asyncio.sleep(min(wait, POLL_S))

    def register(self, conn: Crossing) -> None:
        self._conns.add(conn)
        self.connections_total += 1

    def unregister(self, conn: Crossing) -> None:
        self._conns.discard(conn)

    def count_delivered(self, direction: str, nbytes: int) -> None:
        if direction == A_TO_B:
            self.bytes_a_to_b += nbytes
        else:
            self.bytes_b_to_a += nbytes

    async def _wait_stall(self) -> None:
        while (wait := self._stalled_until - time.monotonic()) > 0:
            await asyncio.sleep(min(wait, POLL_S))

    def _one_way_delay_s(self) -> float:
        jitter = self.jitter_ms
        if jitter == 0:
            sample = 0.0
        elif self.settings.jitter_dist == "uniform":
            sample = self._rng.uniform(-jitter, jitter)
        else:
            sample = max(-jitter, min(jitter, self._rng.gauss(0.0, jitter / 2)))
        return max(0.0, self.delay_ms + sample) / 1000
