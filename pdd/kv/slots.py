"""Which of a region's slots are free: taken by one piece of KV, given back when whoever
reads the other side of it is done (a vLLM worker's staging region, a transfer engine's
region on the receiving instance). Waiters are futures of whichever event loop asks,
woken first come, first served; a slot may be given back from any thread."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable


class Slots:
    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count))
        self._waiting: collections.deque[asyncio.Future[int]] = collections.deque()
        self._closed: Exception | None = None

    async def take(self) -> int:
        if self._closed is not None:
            raise self._closed
        if self._free and not self._waiting:
            return self._free.pop()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slot as it was cancelled: pass it on
                self.give(fut.result())
            raise

    def close(self, error: Exception) -> None:
        """No slot will be given back (the other side is gone): every taker, now and later, gets `error`."""
        self._closed = error
        while self._waiting:
            fut = self._waiting.popleft()
            _soon(fut.get_loop(), _fail, fut, error)

    def give(self, index: int) -> None:
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                _soon(fut.get_loop(), _hand, fut, index, self)
                return
        self._free.append(index)


def _soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    """`fn(*args)` on `loop`, soon: from a thread of its own, woken through its self-pipe;
    from the loop's own thread (a slot given back as its KV_SLOT_FREE is read), without
    that write and wake-up."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    (loop.call_soon if running is loop else loop.call_soon_threadsafe)(fn, *args)


def _fail(fut: asyncio.Future[int], error: Exception) -> None:
    if not fut.done():
        fut.set_exception(error)


def _hand(fut: asyncio.Future[int], index: int, slots: Slots) -> None:
    if fut.done():  # cancelled meanwhile: the slot goes to the next waiter
        slots.give(index)
    else:
        fut.set_result(index)
