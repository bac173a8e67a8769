"""Closed-loop load: a fixed number of clients, each sending its next request when the
last one ended.

Closed loop, not open: under a fault the offered load falls with the service instead
of piling up, so what a fault does is seen in outcomes, not in a backlog the machine
(two cores for every process) would take minutes to drain. After a failure a client
pauses for the Retry-After it was given (or half a second), as a well-behaved client
does, rather than burning the run's requests on a router that just said it cannot serve.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from pdd.lab.soak.client import FAILED, SoakOutcome, send
from pdd.lab.soak.workload import SoakWorkload


class Load:
    def __init__(
        self,
        url: str,
        model: str,
        workload: SoakWorkload,
        timeout_s: float,
        t0: float,
        on_outcome: Callable[[SoakOutcome], None],
    ) -> None:
        self.url = url
        self.model = model
        self.workload = workload
        self.timeout_s = timeout_s
        self.t0 = t0
        self.on_outcome = on_outcome
        self.next_index = 0  # requests sent so far, over every `drive`
        self.outcomes: list[SoakOutcome] = []

    async def drive(self, concurrency: int, done: Callable[[], bool]) -> None:
        """Run `concurrency` clients until `done()` holds; requests in flight then finish."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False) as client:

            async def one_client() -> None:
                while not done():
                    out = await self.send(client)
                    if out.outcome == FAILED:
                        await asyncio.sleep(out.retry_after_s)

            await asyncio.gather(*(one_client() for _ in range(concurrency)))

    async def send(self, client: httpx.AsyncClient) -> SoakOutcome:
        """The next request of the workload, recorded."""
        request = self.workload.request(self.next_index)
        self.next_index += 1
        out = await send(client, self.url, self.model, request, self.timeout_s, self.t0)
        self.outcomes.append(out)
        self.on_outcome(out)
        return out
