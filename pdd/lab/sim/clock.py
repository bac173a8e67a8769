"""The simulated clock the live waiting queues run under (`pdd.clock`).

A live line is a coroutine that awaits only its clock's signals. Here a signal is a
simpy event and its wait yields that event (or it, or a timeout), so `drive` steps the
line's coroutine inside a simulated process, as simpy steps a generator: what the
line would await on asyncio's loop, it awaits on the simulated clock.
"""

from __future__ import annotations

import math
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

import simpy

from pdd.clock import Signal

T = TypeVar("T")


class _Yield:
    """An awaitable that hands one simpy event to whoever steps the coroutine."""

    __slots__ = ("event",)

    def __init__(self, event: simpy.Event) -> None:
        self.event = event

    def __await__(self) -> Generator[simpy.Event, object, None]:
        yield self.event


class SimSignal:
    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self._event = env.event()

    def set(self) -> None:
        if not self._event.triggered:
            self._event.succeed()

    def clear(self) -> None:
        if self._event.triggered:
            self._event = self.env.event()

    def wait(self, timeout_s: float) -> _Yield:
        if math.isinf(timeout_s):
            return _Yield(self._event)
        return _Yield(self._event | self.env.timeout(timeout_s))


class SimClock:
    def __init__(self, env: simpy.Environment) -> None:
        self.env = env

    def now(self) -> float:
        return float(self.env.now)

    def signal(self) -> Signal:
        return SimSignal(self.env)


def drive(coro: Coroutine[Any, Any, T]) -> Generator[simpy.Event, object, T]:
    """Step a live line's coroutine in the calling simulated process (`yield from`):
    the events it awaits are yielded, and their values sent back, until it returns."""
    try:
        event = coro.send(None)
        while True:
            event = coro.send((yield event))
    except StopIteration as done:
        return done.value
