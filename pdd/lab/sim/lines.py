"""The first-come lines a simulated deployment keeps: a decode-side instance's
reservation line (the live one: pdd/instance/reservations.py)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Generator
from typing import TypeAlias

import simpy

from pdd.lab.sim.sequence import Hold
from pdd.policy.retry import reserve_retry_delay

Granted: TypeAlias = tuple[int, Hold]  # (the reserved hit in tokens, the pool room held)


class ReservationLine:
    """First come, first served: only the head tries, and retries as the live line does
    (`reserve_retry_delay` without a limit); the next one tries as soon as it leaves."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self._turns: deque[simpy.Event] = deque()

    def __len__(self) -> int:
        return len(self._turns)

    def take(self, attempt: Callable[[], Granted | None]) -> Generator[simpy.Event, object, Granted]:
        turn = self.env.event()
        self._turns.append(turn)
        if len(self._turns) > 1:
            yield turn
        tries = 0
        while (granted := attempt()) is None:
            delay_s = reserve_retry_delay(tries, 0.0, math.inf)
            assert delay_s is not None  # no limit: the line never refuses
            yield self.env.timeout(delay_s)
            tries += 1
        self._turns.popleft()
        if self._turns:
            self._turns[0].succeed()
        return granted
