"""What a waiting line waits with: the clock, and a signal that wakes its waiters.

The router's dispatch queue and an instance's reservation queue wait for a signal (room
came free, the head left) or a timeout, and read the time. Live, that is asyncio's
loop (`ASYNCIO`). The simulator runs the same queue classes under its simulated clock
(`pdd.lab.sim.clock`): a line's coroutine awaits only what its clock gives it, so the
simulator steps it as one of its own processes, and no second copy of the line's
rules is kept.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Protocol


class Signal(Protocol):
    def set(self) -> None:
        """Wake every waiter."""

    def clear(self) -> None:
        """Waiters from now on wait for the next `set` (those already woken stay woken)."""

    def wait(self, timeout_s: float) -> Awaitable[None]:
        """Until `set`, or `timeout_s` has passed."""


class Clock(Protocol):
    def now(self) -> float:
        """Seconds, on a clock that only moves forward."""

    def signal(self) -> Signal: ...


class _AsyncioSignal:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    async def wait(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._event.wait(), timeout_s)
        except TimeoutError:
            pass


class _AsyncioClock:
    def now(self) -> float:
        return time.monotonic()

    def signal(self) -> Signal:
        return _AsyncioSignal()


ASYNCIO: Clock = _AsyncioClock()
