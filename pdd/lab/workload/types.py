"""The workload shapes the replay client understands.

Both workloads reduce to sessions of sequential turns: an agentic task is a session of
many turns, a trace request is a session of one. One shape means one replay path, so the
agentic and trace benchmarks measure the same way.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    """One request of a session: it appends `append_tokens` to the session's context,
    then asks for up to `max_tokens`.

    The prompt of turn 0 is what it appends. Turn k > 0 re-sends the whole context: the
    prompt of turn k-1, the tokens the server returned for it, then what it appends (the
    new tool output). Outputs are only known at run time, which is why a turn stores the
    increment and not the full prompt. `append_ids` are the appended tokens themselves,
    where a client sends them (`pdd bench`); the simulator needs only their number, and
    a workload drawn for it leaves them out (`iter_session_shapes`). `pause_s`: how long
    it waits after the previous turn's answer (a tool runs) before it is sent.
    """

    append_tokens: int
    max_tokens: int
    append_ids: tuple[int, ...] = ()
    pause_s: float = 0.0

    def __post_init__(self) -> None:
        if self.append_ids and len(self.append_ids) != self.append_tokens:
            raise ValueError(f"a turn of {len(self.append_ids)} token IDs appends {self.append_tokens} tokens")
        if self.pause_s < 0:
            raise ValueError(f"a turn cannot wait {self.pause_s} s")

    @classmethod
    def of(cls, append_ids: Sequence[int], max_tokens: int) -> Turn:
        """The turn that appends these tokens."""
        ids = tuple(append_ids)
        return cls(len(ids), max_tokens, ids)


@dataclass(frozen=True)
class Session:
    """Turns that run one after another, starting `start_s` seconds into the run.

    What the simulator also reads (a client needs none of it): the leading tokens every
    session shares (`shared_tokens`: the system prompt), a trace request's block hashes
    (`trace_keys`: which prefixes it shares with which), and the context its earlier
    turns left cached when it is resumed part-way (`warm_tokens`: a warm start)."""

    id: int
    turns: tuple[Turn, ...]
    start_s: float = 0.0
    anomalous: bool = False
    shared_tokens: int = 0
    trace_keys: tuple[Hashable, ...] = ()
    warm_tokens: int = 0

    def prompts(self) -> list[int]:
        """Each turn's prompt length when every answer is `max_tokens` long (the simulator's
        requests): the context before it, then what it appends."""
        context, out = self.warm_tokens, []
        for turn in self.turns:
            out.append(context + turn.append_tokens)
            context = out[-1] + turn.max_tokens
        return out
