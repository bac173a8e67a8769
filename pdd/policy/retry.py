"""Waiting and retrying: how long a reservation waits for pages, when a request moves."""

from __future__ import annotations

FIRST_WAIT_S = 0.05
MAX_WAIT_S = 0.5
MIN_WAIT_S = 0.001


def reserve_retry_delay(attempt: int, elapsed_s: float, limit_s: float) -> float | None:
    """A full decode pool holds a reservation back: requests finishing there free pages.
    The pause before try `attempt + 1` (doubling from 50 ms to 0.5 s), or None once
    `limit_s` has passed and the reservation is refused."""
    left = limit_s - elapsed_s
    if left < MIN_WAIT_S:  # (a last, shorter wait would only chase the limit)
        return None
    return min(MAX_WAIT_S, FIRST_WAIT_S * 2 ** min(attempt, 4), left)


def retry_on_new_prefill(tokens_delivered: int, attempts: int, max_attempts: int, others_healthy: bool) -> bool:
    """A prefill instance was lost. Before any token reached the client, nothing is
    lost by starting over on another one; after, a restart could not be told apart
    from a glitch in the stream, so the request fails instead."""
    return tokens_delivered == 0 and attempts < max_attempts and others_healthy
