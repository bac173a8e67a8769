"""Continuous batching: which sequences compute how many tokens a step, shared by the
embedded engine and the simulator.

One unified rule covers prefill, chunked prefill, extend and decode: every scheduled
sequence computes up to `num_pending` of its tokens within a per-step token budget.
Running sequences go first (decodes stay smooth); waiting ones are admitted while
budget, slots and KV room last.

The rule (`Scheduler`) is composed with what gives a sequence its KV room (a
`BaseKV`). The engine's is `pdd.engines.embedded.paged_kv.PagedKV`: pages as a sequence grows,
from the free list, then from evicting the prefix cache, then by preempting the newest
running sequence (it recomputes later). The simulator runs this same `Scheduler` over
room reserved whole at admission (`pdd.lab.sim.instance`), which never runs short.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections import deque
from typing import Generic, Protocol, TypeVar


class Status(enum.Enum):
    RESERVED = "reserved"  # KV being imported (or a catch-up chunk computed); not schedulable
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"  # finished, pages kept for export until released
    FINISHED = "finished"


class Schedulable(Protocol):
    status: Status
    step_cap: int  # most pending tokens a step (0: the step's budget)

    @property
    def num_pending(self) -> int:
        """Tokens it would compute now (a decode: one)."""
        ...


S = TypeVar("S", bound=Schedulable)


def step_tokens(pending: int, step_cap: int, budget: int) -> int:
    """What a sequence with `pending` tokens computes in a step with `budget` left."""
    return min(pending, budget, step_cap or budget)


class BaseKV(ABC, Generic[S]):
    """Where a scheduled sequence's KV room comes from."""

    @abstractmethod
    def admit(self, seq: S, budget: int, alone: bool) -> int | None:
        """Room for a waiting sequence's first step: the tokens it computes in it (up to
        `budget`), or None when there is no room now (nothing taken). `alone`: nothing
        else runs, so nothing will finish and free room; a room may then give up what the
        sequence held (`preempt`) rather than keep it waiting on itself."""

    @abstractmethod
    def grow(self, seq: S, n: int) -> bool:
        """Room for `n` more tokens of a running sequence; False when there is none."""

    def preempt(self, seq: S) -> None:
        """Give up a running sequence's room: it computes again when admitted again.
        Asked only of a room whose `grow` can fail."""
        raise NotImplementedError(f"{type(self).__name__} never runs short of room")

    @abstractmethod
    def finish(self, seq: S) -> None:
        """A sequence is out of the queues: its room back (or kept, where it is held)."""


class Scheduler(Generic[S]):
    def __init__(self, kv: BaseKV[S], max_batch_tokens: int, max_running: int, max_chunks: int = 0) -> None:
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.max_chunks = max_chunks  # prefill/extend chunks a step may hold (0: as many as the budget takes)
        self.waiting: deque[S] = deque()
        self.running: list[S] = []

    def add(self, seq: S) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def schedule(self) -> list[tuple[S, int]]:
        budget, chunks, max_chunks = self.max_batch_tokens, 0, self.max_chunks
        batch: list[tuple[S, int]] = []
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:  # preempted while making room for an earlier one
                continue
            pending = seq.num_pending
            if not pending or (pending > 1 and max_chunks and chunks >= max_chunks):
                continue
            n = step_tokens(pending, seq.step_cap, budget)
            if not self._grow(seq, n, batch):
                continue
            batch.append((seq, n))
            budget -= n
            chunks += n > 1
        self.admit(budget, chunks, batch)
        return batch

    def _grow(self, seq: S, n: int, batch: list[tuple[S, int]]) -> bool:
        """Room for a running sequence's step, preempting the newest running sequences not
        in this step for it (or itself, when every other one is)."""
        while not self.kv.grow(seq, n):
            scheduled = {id(b) for b, _ in batch}
            victim = next((s for s in reversed(self.running) if s is not seq and id(s) not in scheduled), seq)
            self.running.remove(victim)
            self.kv.preempt(victim)
            victim.status = Status.WAITING
            self.waiting.appendleft(victim)
            if victim is seq:
                return False
        return True

    def admit(self, budget: int, chunks: int, batch: list[tuple[S, int]]) -> None:
        """Admit waiting sequences, in order, while budget, slots and room last; those with
        tokens to compute join `batch` (which holds `chunks` chunks so far)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            if self.max_chunks and chunks >= self.max_chunks:
                break
            seq = self.waiting[0]
            n = self.kv.admit(seq, budget, not self.running)
            if n is None:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            if n:
                batch.append((seq, n))
                budget -= n
                chunks += n > 1

    def pause(self, seq: S) -> None:
        """Stop scheduling a sequence that keeps its room (a caught-up catch-up chunk)."""
        if seq in self.running:
            self.running.remove(seq)
        seq.status = Status.RESERVED

    def finish(self, seq: S) -> None:
        """Take a sequence out of the queues, done; its room goes as `BaseKV.finish` says."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.finish(seq)
