"""When the router releases tokens to the client: a playout reserve that hides handoffs.

At a handoff the main instance needs a round trip, the rest of its current step and
one extend step before its first token, a gap the user would see. So while a relay
produces a request that will be handed over, the router builds a reserve of up to
`reserve` tokens (never holding the first: TTFT is not delayed): it releases the
relay's tokens one per `fill_spacing` — a little slower than the slower of the relay
and the main instance — until that many are in hand, then each as the next arrives.
Once the relay has stopped, it releases the reserve one token per `spacing` (the main
instance's own pace) until the main instance's tokens arrive. The user sees the
relay's tokens a few tokens late, a gap between them at most `FILL_STRETCH` times the
slower tier's, and no gap at the handoff. (A relay that outpaces the main instance, as
the spec's does, fills the reserve at once; one no faster, as on chips of equal decode
speed, fills it over a few dozen tokens.)

How many to keep comes from the handoffs the router has seen: the gap between a
relay's last token and the main instance's first (`observe_stall`) over the main
instance's pace (`reserve_tokens`), so the reserve lasts what a handoff really takes
on that line and that instance, not what a constant guessed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FILL_STRETCH = 1.5  # while the reserve fills, the client's gap is at most this times the slower tier's


@dataclass(frozen=True)
class Playout:
    reserve: int  # tokens kept in hand while a relay produces (0: release at once)
    spacing_s: float  # the main instance's gap between tokens, as measured
    fill_spacing_s: float  # the gap between released relay tokens while the reserve fills


def playout(reserve: int, main_pace_s: float, relay_pace_s: float) -> Playout:
    return Playout(reserve, main_pace_s, FILL_STRETCH * max(main_pace_s, relay_pace_s))


def release(
    held: int, delivered: int, since_last_s: float, relay_producing: bool, relay_stopped: bool, playout: Playout
) -> int:
    """How many of the `held` tokens (in order) to release now.

    `relay_producing`: a relay produces and will hand over; `relay_stopped`: it has
    handed over and the main instance has not produced yet. Otherwise (the main
    instance produces, or nothing will be handed over) everything goes at once.
    """
    if not held:
        return 0
    if relay_producing:
        keep = 0 if delivered == 0 and held == 1 else playout.reserve
        due = 1 if since_last_s >= playout.fill_spacing_s else 0
        return max(held - keep, min(due, held), 1 if delivered == 0 else 0)
    if relay_stopped:
        return 1 if since_last_s >= playout.spacing_s else 0
    return held


def next_release_s(
    held: int, since_last_s: float, relay_producing: bool, relay_stopped: bool, playout: Playout
) -> float | None:
    """Seconds until a held token is due on its own (None: only new tokens release)."""
    if not held or not (relay_producing or relay_stopped):
        return None
    return max(0.0, (playout.fill_spacing_s if relay_producing else playout.spacing_s) - since_last_s)


PACE_ALPHA = 0.05  # weight of the newest gap in an instance's pace
DEFAULT_PACE_S = 0.025  # until one is measured


def observe_pace(pace_s: float, gap_s: float) -> float:
    """An instance's gap between tokens, a slow moving average: the reserve fills and
    drains at the usual pace, not at one stalled step's."""
    return (1 - PACE_ALPHA) * pace_s + PACE_ALPHA * gap_s


STALL_ALPHA = 0.1  # how fast the handoff gap to cover comes down after a slow one
MAX_RESERVE = 32  # tokens: a bound on how late the relay's tokens reach the client


def observe_stall(stall_s: float | None, gap_s: float) -> float:
    """The handoff gap to cover, from one more measured gap (a relay's last token to
    the main instance's first): a slow handoff raises it at once, quick ones lower it
    slowly, so one lucky handoff does not leave the next one bare."""
    if stall_s is None:
        return gap_s
    return max(gap_s, (1 - STALL_ALPHA) * stall_s + STALL_ALPHA * gap_s)


def reserve_tokens(stall_s: float | None, spacing_s: float, floor: int) -> int:
    """Tokens to keep in hand so that, released one per `spacing_s`, they last the
    handoff gap `stall_s` (None: none measured yet, `floor`). `floor` (the configured
    reserve) is also the least kept; 0 turns the reserve off."""
    if floor == 0:
        return 0
    if stall_s is None or spacing_s <= 0:
        return floor
    return min(MAX_RESERVE, max(floor, math.ceil(stall_s / spacing_s)))
