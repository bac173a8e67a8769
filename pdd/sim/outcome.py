"""What one simulated request measured, as `pdd bench` records it, and the client's
view of its token stream."""

from __future__ import annotations

from dataclasses import dataclass

from pdd.sim.sequence import SimSeq

@dataclass
class Outcome:
    """One request, as `pdd bench` records it."""

    session: int
    turn: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    ttft_s: float | None = None
    end_s: float | None = None
    tokens: int = 0
    max_itl_s: float = 0.0
    pipeline: str | None = None
    handoff: str | None = None
    handoff_tokens: int = 0
    handoff_stall_s: float | None = None
    rld_tokens: int = 0
    md_tokens: int = 0
    wan_bytes: float = 0.0
    p_hit: int = 0
    d_hit: int = 0
    anomalous: bool = False
    fallback: str | None = None
    failed: str | None = None
    first_token_s: float | None = None  # when the client saw a first token (set as it streams)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.end_s is None or self.tokens < 2:
            return None
        return (self.end_s - self.arrival_s - self.ttft_s) / (self.tokens - 1)


@dataclass
class Stream:
    """The client's view of one request: positions arrive in order, whoever produced them."""

    out: Outcome
    first_s: float | None = None
    last_s: float | None = None
    tokens: int = 0
    max_gap_s: float = 0.0

    def emit(self, at: float) -> None:
        if self.first_s is None:
            self.first_s = self.out.first_token_s = at
        else:
            self.max_gap_s = max(self.max_gap_s, at - self.last_s)
        self.last_s = at
        self.tokens += 1

    def take(self, seq: SimSeq) -> None:
        """A producer's tokens after the ones already seen."""
        if seq.produced == 0:
            return
        if self.last_s is not None:
            self.max_gap_s = max(self.max_gap_s, seq.first_s - self.last_s)
        elif self.first_s is None:
            self.first_s = self.out.first_token_s = seq.first_s
        self.max_gap_s = max(self.max_gap_s, seq.max_gap_s)
        self.last_s = seq.last_s
        self.tokens += seq.produced
