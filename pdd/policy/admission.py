"""Admission: run a new request now, hold it in a bounded queue, or shed it — and when
a shed client should come back.

Past its capacity a server must say so (HTTP 429 with Retry-After) rather than queue
without bound: an unbounded queue only turns overload into timeouts and memory growth,
and a client told when to return can spread its retries. Pure functions over counts,
so the router's gate and an instance's gate decide alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RUN, WAIT, SHED = "run", "wait", "shed"
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True)
class Limits:
    max_running: int  # requests worked on at once
    max_waiting: int  # requests held in the queue for a slot; past this, new ones are shed

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_waiting < 0:
            raise ValueError("max_running must be at least 1 and max_waiting at least 0")


def admit(running: int, waiting: int, limits: Limits) -> str:
    """RUN when a slot is free and nobody is ahead; WAIT while the line has room; else SHED."""
    if running < limits.max_running and waiting == 0:
        return RUN
    return WAIT if waiting < limits.max_waiting else SHED


def retry_after_s(waiting: int, max_running: int, mean_service_s: float) -> int:
    """Seconds until the line ahead of a shed request would have cleared, if every slot
    frees once per mean service time; at least 1 (HTTP's unit), at most a minute."""
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil((waiting + 1) * mean_service_s / max_running)))
