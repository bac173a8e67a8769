"""What a request takes of a decode-side instance, and whether it fits there now.

Under load an admitted request must complete, or be refused before it is admitted:
a decode instance whose pool is full cannot refuse a reservation without failing a
request the client was told would run. So the router dispatches a request only once
its decode-side instance has room for it (`fits`), and holds the rest in its line,
where the wait is visible and bounded (past it, 429 with Retry-After). The decode
instance's own queue of reservations then only absorbs the router's estimation error.

The relay is different: a request never needs it (MD can always produce, only later),
so a loaded relay turns an optional request away at once (`relay_accepts`) and P sends
it P -> MD. The relay is held to its one job, hiding latency, and is never driven past
what it can decode at once — the spec's failure mode is a relay made to digest load.
"""

from __future__ import annotations

from dataclasses import dataclass

RELAY_ANSWER_S = 1.0  # the relay is next door: an answer later than this is a loaded relay


def pages_needed(prompt_tokens: int, max_tokens: int, hit_tokens: int, page_size: int) -> int:
    """KV pages a decode-side instance allocates over a request's life: every page of
    prompt and output beyond the cached hit (those pages are resident already, shared)."""
    total = -(-(prompt_tokens + max_tokens) // page_size)
    return max(1, total - min(hit_tokens, prompt_tokens) // page_size)


@dataclass(frozen=True)
class Room:
    """What one instance holds at most."""

    pages: int  # its KV pool
    requests: int  # `max_requests`


def fits(need_pages: int, committed_pages: int, committed_requests: int, room: Room) -> bool:
    """Whether one more request of `need_pages` fits beside the ones committed there.
    An idle instance takes any request (one larger than its pool is refused by the
    engine as too long, with a clear error, rather than waiting forever)."""
    if committed_requests == 0:
        return True
    return committed_requests < room.requests and committed_pages + need_pages <= room.pages


def relay_accepts(held: int, waiting: int, max_running: int) -> bool:
    """Whether a relay takes one more optional request: only while it can decode every
    request it holds in one batch and none waits for a slot. (Pages are checked by the
    reservation itself, which a relay never queues.)"""
    return waiting == 0 and held < max_running
