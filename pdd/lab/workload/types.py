"""The workload shapes the replay client understands.

Both workloads reduce to sessions of sequential turns: an agentic task is a session of
many turns, a trace request is a session of one. One shape means one replay path, so the
agentic and trace benchmarks measure the same way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    """One request of a session.

    The prompt of turn 0 is `append_ids`. Turn k > 0 re-sends the whole context: the
    prompt of turn k-1, the token IDs the server actually returned for it, then
    `append_ids` (the new tool output). Output IDs are only known at run time, which is
    why a turn stores the increment and not the full prompt.
    """

    append_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Session:
    """Turns that run one after another, starting `start_s` seconds into the run."""

    id: int
    turns: tuple[Turn, ...]
    start_s: float = 0.0
    anomalous: bool = False


@dataclass(frozen=True)
class TurnShape:
    """A turn as the simulator sees it: how many tokens it appends (the first turn's
    count includes the shared system prompt), and its output length."""

    append_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class SessionShape:
    id: int
    turns: tuple[TurnShape, ...]
    start_s: float = 0.0
    anomalous: bool = False
