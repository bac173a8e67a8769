"""The bounded queue in front of a server's token source (`pdd.policy.admission` decides).

Every /v1 request takes a slot before it is tokenized and holds it until its response
ends; requests past the running limit wait in a FIFO of bounded length, and past
that they are shed with 429 and a Retry-After estimated from recent service times.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdd.api.protocol import ApiError
from pdd.policy.admission import RUN, SHED, Limits, admit, retry_after_s

SERVICE_ALPHA = 0.2  # weight of the newest service time in the running mean


class Slot:
    """A request's place among the running ones; released once, however it ends."""

    def __init__(self, gate: AdmissionGate) -> None:
        self._gate = gate
        self._since = time.monotonic()
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._gate._leave(time.monotonic() - self._since)


class AdmissionGate:
    def __init__(self, limits: Limits, registry: CollectorRegistry) -> None:
        self.limits = limits
        self.running = 0
        self.shed = 0
        self.mean_service_s = 1.0
        self._queue: deque[asyncio.Future] = deque()
        r = registry
        Gauge("pdd_admission_running", "Requests holding a slot", registry=r).set_function(lambda: self.running)
        Gauge("pdd_admission_waiting", "Requests waiting for a slot", registry=r).set_function(lambda: self.waiting)
        self._shed = Counter("pdd_admission_shed", "Requests refused with 429: the queue was full", registry=r)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def retry_after(self) -> int:
        """Seconds a refused client should wait before coming back, from recent service times."""
        return retry_after_s(self.waiting, self.limits.max_running, self.mean_service_s)

    async def enter(self) -> Slot:
        """A slot, after waiting in the queue if need be; ApiError 429 when the queue is full."""
        decision = admit(self.running, self.waiting, self.limits)
        if decision == SHED:
            self.shed += 1
            self._shed.inc()
            after = self.retry_after()
            raise ApiError(
                429,
                f"the server is at capacity ({self.running} running, {self.waiting} waiting); retry after {after} s",
                "rate_limit_exceeded",
                code="overloaded",
                headers={"Retry-After": str(after)},
            )
        if decision == RUN:
            self.running += 1
            return Slot(self)
        turn = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        try:
            await turn  # `_leave` hands its slot over: `running` is unchanged
        except asyncio.CancelledError:  # the client left while waiting
            if turn in self._queue:
                self._queue.remove(turn)
            elif not turn.cancelled():  # the slot was handed over as it left: pass it on
                self._leave(None)
            raise
        return Slot(self)

    def _leave(self, service_s: float | None) -> None:
        if service_s is not None:
            self.mean_service_s += SERVICE_ALPHA * (service_s - self.mean_service_s)
        while self._queue:
            turn = self._queue.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.running -= 1
