"""The router's dispatch queue: a request leaves for the instances once there is room.

Admission (`pdd.api.admission`) bounds how many requests the router holds; this queue
bounds how many it has out at the instances, by what they can hold: a request is
planned, and its decode-side instance charged with its pages, only once the plan fits
(`pdd.policy.capacity.fits`). Until then it waits here, first come first served, and
no timeout runs for it: the request is admitted and will run. Whatever an instance
still refuses after this (another router filled it) is the rare case its own queue
absorbs. The simulator runs this class under its simulated clock (`pdd.clock`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TypeVar

from pdd.clock import ASYNCIO, Clock

T = TypeVar("T")
RECHECK_S = 0.5  # a waiting head also looks again this often (an instance joined or came back)


class DispatchQueue:
    def __init__(self, clock: Clock = ASYNCIO) -> None:
        self._queue: deque[object] = deque()
        self._changed = clock.signal()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def changed(self) -> None:
        """Room may have come free (a request ended, an instance came back)."""
        self._changed.set()

    async def turn(self, attempt: Callable[[], T | None]) -> T:
        """`attempt()` once first in the queue, and again whenever room may have come free,
        until it gives something other than None (what it raises ends the wait)."""
        ticket = object()
        self._queue.append(ticket)
        try:
            while True:
                if self._queue[0] is ticket:
                    got = attempt()
                    if got is not None:
                        return got
                self._changed.clear()
                await self._changed.wait(RECHECK_S)
        finally:
            head = self._queue[0] is ticket
            self._queue.remove(ticket)
            if head:
                self._changed.set()  # the next one's turn
