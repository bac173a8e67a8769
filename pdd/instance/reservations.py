"""The queue of reservations a full decode instance holds back until pages free up.

The router dispatches a request only once its decode instance has room for it
(`pdd.policy.capacity`), so this queue is short; it absorbs what the router cannot
see (another router's requests, a relay's fill still computing, shared prefixes it
counted once too few). A reservation here waits as long as it takes — pages come back
as the requests ahead finish — and leaves only when it is granted or its request
ends (an abort, a lost P or router). First come, first served: a large prompt is not
passed over forever by small ones. Each time the queue moves, the requests still in it
are reported as progressing, so the router does not take them for stuck ones.

The simulator runs this class under its simulated clock (`pdd.clock`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from pdd.clock import ASYNCIO, Clock
from pdd.kv.pages import OutOfPages
from pdd.policy.retry import reserve_retry_delay

J = TypeVar("J")
R = TypeVar("R")
PROGRESS_EVERY_S = 1.0  # at most this often, a waiting request is reported as moving


class ReservationQueue(Generic[J]):
    def __init__(self, on_moved: Callable[[J], None], clock: Clock = ASYNCIO) -> None:
        self._queue: deque[J] = deque()
        self._clock = clock
        self._moved = clock.signal()
        self._on_moved = on_moved
        self._reported: dict[int, float] = {}  # id(job) -> when last reported

    def __len__(self) -> int:
        return len(self._queue)

    async def take(self, job: J, attempt: Callable[[], Awaitable[R]], ended: Callable[[], bool]) -> R | None:
        """`attempt()` (a reservation raising OutOfPages while the pool is full) once
        `job` is first in the queue, retried as pages may have freed; its result, or None if
        the request ended while waiting."""
        self._queue.append(job)
        tries = 0
        try:
            while not ended():
                if self._queue[0] is job:
                    try:
                        return await attempt()
                    except OutOfPages:
                        tries += 1
                delay_s = reserve_retry_delay(tries, 0.0, math.inf)
                assert delay_s is not None  # no limit: the queue never refuses
                await self._moved.wait(delay_s)
            return None
        finally:
            head = self._queue[0] is job
            self._queue.remove(job)
            self._reported.pop(id(job), None)
            if head:
                self._advance()

    def _advance(self) -> None:
        """The head left: wake the next, and report everyone still waiting as moving."""
        self._moved.set()
        self._moved = self._clock.signal()
        now = self._clock.now()
        for job in self._queue:
            if now - self._reported.get(id(job), 0.0) >= PROGRESS_EVERY_S:
                self._reported[id(job)] = now
                self._on_moved(job)
