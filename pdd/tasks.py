"""Background tasks a component starts and does not await.

asyncio keeps only weak references to tasks, so a fire-and-forget task must be held
somewhere until it ends; holding them in one place also lets the owner cancel the lot
when it closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Tasks:
    def __init__(self) -> None:
        self._live: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._live.add(task)
        task.add_done_callback(self._live.discard)
        return task

    def cancel_all(self) -> None:
        for task in list(self._live):
            task.cancel()

    async def wait_all(self) -> None:
        """Until every task live now has ended (their errors are theirs to handle)."""
        if self._live:
            await asyncio.wait(list(self._live))


def settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Give `fut` its result or `error`, unless it is done already (cancelled meanwhile): what
    a thread hands an event loop's waiter through `call_soon_threadsafe`."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
