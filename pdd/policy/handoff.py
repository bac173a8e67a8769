"""How a relay hands a request to the main decode instance (PDD_SPEC item 3).

The relay sends only token IDs; MD recomputes their KV by extend. One-shot sends them
all at once: the relay is freed soonest, but MD's step that extends them all is one
big stall (for every sequence in MD's batch). Catch-up sends them in chunks computed
at most `chunk` per MD step while the relay keeps producing, and cuts over once MD is
within `threshold` tokens: several small stalls instead of one, at the price of the
relay running longer. A loaded relay should be freed: it hands off one-shot.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.names import HandoffMode

BUSY = 0.75  # relay occupancy (running / max running) above which it hands off one-shot
MAX_CATCH_UP_ROUNDS = 8  # acknowledgements after which catch-up cuts over, converged or not


def occupancy(running: int, max_running: int) -> float:
    """A relay's running share of what it can decode at once."""
    return running / max(1, max_running)


@dataclass(frozen=True)
class HandoffPlan:
    mode: HandoffMode
    chunk: int  # catch-up: most handed-over tokens MD computes in one step


def choose_handoff(
    gap_tokens: int, occupancy: float, queued: int, threshold: int, chunk: int, forced: str = "auto"
) -> HandoffPlan:
    """`gap_tokens`: tokens the relay produced that MD lacks; `occupancy` and `queued`:
    the relay's running share of its capacity and its waiting requests."""
    if forced != "auto":  # pinned for experiments: exactly as configured
        mode = HandoffMode(forced)  # the config allows only its modes besides "auto"
        return HandoffPlan(mode, chunk if mode == HandoffMode.CATCH_UP else 0)
    if gap_tokens <= threshold or queued > 0 or occupancy >= BUSY:
        return HandoffPlan(HandoffMode.ONE_SHOT, 0)
    # A half-busy relay is freed sooner by larger chunks: MD catches up in fewer steps.
    return HandoffPlan(HandoffMode.CATCH_UP, chunk if occupancy < BUSY / 2 else 2 * chunk)


def cut_over(produced: int, computed: int, threshold: int, rounds: int, previous_gap: int | None = None) -> bool:
    """Catch-up, at an acknowledgement: stop relaying once MD has computed all but
    `threshold` of the produced tokens (its last extend is then small); or once a round
    no longer halves the gap (the relay produces about as much as a round trip lets MD
    absorb: more rounds only keep the relay busy); or after `MAX_CATCH_UP_ROUNDS`."""
    gap = produced - computed
    return gap <= threshold or (previous_gap is not None and 2 * gap > previous_gap) or rounds >= MAX_CATCH_UP_ROUNDS
