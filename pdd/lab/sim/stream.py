"""The client's view of one simulated request's tokens, written into its record.

A simulated request is a `pdd.record.RequestRecord`, the very type the router and
`pdd bench` fill for a live one, so both are summarised by the same code. Its stream
sees positions in order, whoever produced them (P's first token, the relay's, MD's),
and fills what the client would measure, in the record's milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdd.lab.sim.sequence import SimSeq
from pdd.record import RequestRecord

UNFINISHED = "unfinished when the simulation stopped"


@dataclass
class Stream:
    rec: RequestRecord
    first_s: float | None = None
    last_s: float | None = None
    tokens: int = 0
    max_gap_s: float = 0.0

    def _first(self, at: float) -> None:
        self.first_s = at
        assert self.rec.start_s is not None  # the cluster stamps it as the request is sent
        self.rec.ttft_ms = 1000 * (at - self.rec.start_s)  # known as it streams: a probe reads it mid-run

    def emit(self, at: float) -> None:
        if self.first_s is None:
            self._first(at)
        else:
            assert self.last_s is not None  # set with the first token
            self.max_gap_s = max(self.max_gap_s, at - self.last_s)
        self.last_s = at
        self.tokens += 1

    def take(self, seq: SimSeq) -> None:
        """A producer's tokens after the ones already seen."""
        if seq.produced == 0:
            return
        first_s, last_s = seq.first_s, seq.last_s
        assert first_s is not None and last_s is not None  # it has produced
        if self.last_s is not None:
            self.max_gap_s = max(self.max_gap_s, first_s - self.last_s)
        elif self.first_s is None:
            self._first(first_s)
        self.max_gap_s = max(self.max_gap_s, seq.max_gap_s)
        self.last_s = last_s
        self.tokens += seq.produced

    def close(self) -> None:
        """The request has ended, served: what the client measured of it."""
        rec = self.rec
        if self.first_s is None or rec.error is not None:
            return
        assert self.last_s is not None and rec.ttft_ms is not None and rec.start_s is not None  # see _first
        rec.output_tokens = self.tokens
        rec.e2e_ms = e2e_ms = 1000 * (self.last_s - rec.start_s)
        rec.max_itl_ms = 1000 * self.max_gap_s
        if self.tokens >= 2:
            rec.tpot_ms = (e2e_ms - rec.ttft_ms) / (self.tokens - 1)


def fell_back(rec: RequestRecord, reason: str) -> None:
    """Count what the request survived, as the router does (once each)."""
    if reason not in rec.fallbacks:
        rec.fallbacks.append(reason)


def ended(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """The records as a run stopped at a horizon leaves them: one neither served nor
    failed counts as failed, unfinished."""
    return [r if r.e2e_ms is not None or r.error is not None else replace(r, error=UNFINISHED) for r in records]
