"""A simulated instance's KV room: a sequence reserves its prompt and every token it will
produce when admitted, where the engine's `PagedKV` takes pages as it grows.

No step can then run short of pages, so none is preempted, and a run of decode-only
steps can be priced as one event (`pdd.lab.sim.instance`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from pdd.batching import BaseKV, Status, step_tokens
from pdd.lab.sim.sequence import SimSeq


class ReservedKV(BaseKV[SimSeq]):
    """A sequence's whole room, taken when it is admitted (`take`: the instance's hold)
    unless it arrived holding it; `give_back` returns it when the sequence finishes."""

    def __init__(self, take: Callable[[SimSeq], bool], give_back: Callable[[SimSeq], None]) -> None:
        self.take = take
        self.give_back = give_back

    def admit(self, seq: SimSeq, budget: int, alone: bool) -> int | None:
        if seq.hold is None and not self.take(seq):
            return None
        return step_tokens(seq.num_pending, seq.step_cap, budget)

    def grow(self, seq: SimSeq, n: int) -> bool:
        return True

    def finish(self, seq: SimSeq) -> None:
        seq.status = Status.FINISHED
        self.give_back(seq)


def named_by_key(_parent: int, key: Hashable) -> int:
    """A simulated page's chain hash: its block key's (which names its whole prefix)."""
    return hash(key)
