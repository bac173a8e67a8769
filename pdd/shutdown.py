"""A server's SIGTERM as an orchestrator expects it: stop taking work, finish what is in
flight, exit 0.

Kubernetes (and systemd) send SIGTERM, wait `terminationGracePeriodSeconds` (30 s by
default), then SIGKILL; meanwhile they stop routing new work to a process once its
readiness probe fails. uvicorn's own SIGTERM closes the listening socket at once and gives
open streams a fixed few seconds, and re-raises the signal after, so the process dies of
it (exit code -15). `GracefulExit` takes the server's signal handler over instead:

1. calls `begin()` on the first SIGTERM or SIGINT: the process stops admitting work and
   its `/ready` fails from that moment, while `/health` (alive) still answers;
2. waits until `idle()` says nothing is in flight, at most `grace_s`;
3. lets uvicorn close the listener and exit, and the process exits 0. What is left after
   the grace is ended with a clear error first (`expire()`: a stream gets an error event
   saying the grace ran out), and on an instance, what it ran for a router ends with the
   connection: the router hands it on where it can (`pdd.policy.recovery`) and fails it
   naming the instance where it cannot.

A second signal during the wait ends it at once (an operator's second Ctrl+C).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)
DEFAULT_GRACE_S = 30.0  # Kubernetes' default terminationGracePeriodSeconds: manifests give more
POLL_S = 0.1
EXPIRE_WAIT_S = 2.0  # after the grace: the streams ended with an error get this long to say so


class GracefulExit:
    """`server`'s SIGTERM and SIGINT, taken over (uvicorn installs `server.handle_exit` as the
    handler when it starts serving; this module is imported by the CLI, uvicorn only by a
    server, hence an attribute set rather than a subclass)."""

    def __init__(
        self,
        server: uvicorn.Server,
        grace_s: float,
        begin: Callable[[], None],
        idle: Callable[[], bool],
        expire: Callable[[str], None] = lambda why: None,
    ) -> None:
        self.server = server
        setattr(server, "handle_exit", self.handle_exit)  # noqa: B010 (mypy forbids assigning a method)
        self.grace_s = grace_s
        self._begin, self._idle, self._expire = begin, idle, expire
        self.stopping = False
        self._wind_down: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler, replaced: not recorded for re-raising (exit 0, not -15)."""
        if self.stopping:  # a second signal: no more waiting
            log.warning("second signal %s: exiting now", signal.Signals(sig).name)
            self.server.should_exit = True
            return
        self.stopping = True
        self._begin()
        log.info(
            "signal %s: taking no new work; finishing what is in flight (at most %g s)",
            signal.Signals(sig).name,
            self.grace_s,
        )
        # (the handler runs on the loop's thread, maybe while it sleeps in select: wake it)
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(self._start_finish)

    def _start_finish(self) -> None:
        self._wind_down = asyncio.get_running_loop().create_task(self._finish())

    async def _finish(self) -> None:
        started = time.monotonic()
        while not self._idle() and time.monotonic() - started < self.grace_s:
            await asyncio.sleep(POLL_S)
        if self._idle():
            log.info("nothing left in flight after %.1f s: exiting", time.monotonic() - started)
        else:
            why = f"the server shut down before the request finished: its grace of {self.grace_s:g} s ran out"
            log.warning("the grace of %g s ran out with work in flight: ending it", self.grace_s)
            self._expire(why)
            ended = time.monotonic()
            while not self._idle() and time.monotonic() - ended < EXPIRE_WAIT_S:  # (their error events sent)
                await asyncio.sleep(POLL_S)
        self.server.should_exit = True


def add_grace_flag(parser) -> None:
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=DEFAULT_GRACE_S,
        help="on SIGTERM: stop taking work (/ready fails), finish what is in flight for at most this long, exit 0 "
        f"(default {DEFAULT_GRACE_S:g}; an orchestrator's grace period must be longer)",
    )
