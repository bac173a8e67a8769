"""What an instance holds for a request: its pool room (`Hold`), its work (`SimSeq`),
and a decode stretch's steps not yet applied to it (`_Stretch`, see pdd.sim.instance)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import simpy

if TYPE_CHECKING:
    from pdd.sim.instance import Instance


@dataclass(eq=False)
class Hold:
    """Pool room reserved for one request on one instance, and the cached prefix blocks
    it relies on, pinned (eviction passes them by) until the hold is released."""

    inst: Instance
    tokens: int
    pinned: Sequence[Hashable]
    released: bool = False
    keys: Sequence[Hashable] = ()  # its request's prompt and output, while it has not settled
    _settled: simpy.Event | None = None

    def unsettled(self, keys: Sequence[Hashable]) -> None:
        """Its request will land `keys` here (KV on the line, a handoff or a fill to
        come): a reservation sharing most of them may wait for it (`settled`)."""
        self.keys = keys
        self.inst.unsettled.append(self)

    def settled(self) -> simpy.Event:
        if self._settled is None:
            self._settled = self.inst.env.event()
        return self._settled

    def settle(self) -> None:
        """Its request produces here now, or has gone: nothing more to wait for."""
        if self in self.inst.unsettled:
            self.inst.unsettled.remove(self)
        settled = self.settled()
        if not settled.triggered:
            settled.succeed()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.inst.used -= self.tokens
            self.inst.holds -= 1
            self.inst.cache.unpin(self.pinned)
            self.inst.cache.shrink(self.inst.cache_room())
            self.settle()
            self.inst.poke()  # a waiting sequence may fit now


@dataclass(eq=False)
class SimSeq:
    """One request's work on one instance.

    It computes `pending` tokens (a prompt's uncached tail, or handed-over tokens), then,
    while `live`, produces tokens until it has produced `produce` of them. A sequence
    that is not live stops once its pending tokens are computed (a catch-up chunk) and
    waits for more (`Instance.feed`)."""

    context: int  # tokens whose KV the instance holds for it
    pending: int
    produce: int
    hold: Hold | None  # its pool room (None: taken when it is admitted)
    live: bool = True
    step_cap: int = 0  # most pending tokens per step (0: the step budget)
    blocks: Sequence[Hashable] = ()  # its prompt's cache keys, inserted when it ends
    on_computed: Callable[[SimSeq], object] | None = None  # pending reached 0 (what it returns is unused)
    on_finish: Callable[[SimSeq], object] | None = None
    token_times: list[float] | None = None  # every token's time, when a test asks for them
    done: bool = False
    stopped: bool = False  # cut by a handoff: produces no more
    _produced: int = 0
    _first_s: float | None = None
    _last_s: float | None = None
    _max_gap_s: float = 0.0
    _stretch: _Stretch | None = None

    def _sync(self) -> None:
        if self._stretch is not None:
            self._stretch.catch_up()

    @property
    def produced(self) -> int:
        self._sync()
        return self._produced

    @property
    def first_s(self) -> float | None:
        self._sync()
        return self._first_s

    @property
    def last_s(self) -> float | None:
        self._sync()
        return self._last_s

    @property
    def max_gap_s(self) -> float:
        self._sync()
        return self._max_gap_s

    def _token_at(self, at: float) -> None:
        if self._last_s is None:
            self._first_s = at
        else:
            self._max_gap_s = max(self._max_gap_s, at - self._last_s)
        self._last_s = at
        self._produced += 1
        if self.token_times is not None:
            self.token_times.append(at)


@dataclass(eq=False)
class _Stretch:
    """Decode steps of `seqs` ending at `ends`; `applied` of them are in the sequences."""

    inst: Instance
    seqs: list[SimSeq]
    ends: np.ndarray = field(default_factory=lambda: np.empty(0))
    applied: int = 0

    def catch_up(self, upto: int | None = None) -> None:
        """Apply the steps completed by now (never the last: its finish is the loop's)."""
        if upto is None:
            upto = min(bisect.bisect_right(self.ends, self.inst.env.now), len(self.ends) - 1)
        if upto > self.applied:
            self._apply(upto)

    def _apply(self, upto: int) -> list[SimSeq]:
        """Steps [applied, upto) into every sequence still producing; those whose last
        token that was."""
        times = self.ends[self.applied : upto]
        count, first, last = len(times), float(times[0]), float(times[-1])
        inner = float(np.max(np.diff(times))) if count > 1 else 0.0
        finished, producing = [], 0
        for seq in self.seqs:  # `count` tokens each, at `times` (at most `inner` apart), in one update
            if seq.done or seq.stopped:
                continue
            producing += 1
            seq.context += count
            if seq._last_s is None:
                seq._first_s = first
            else:
                seq._max_gap_s = max(seq._max_gap_s, first - seq._last_s)
            seq._max_gap_s = max(seq._max_gap_s, inner)
            seq._last_s = last
            seq._produced += count
            if seq.token_times is not None:
                seq.token_times.extend(float(t) for t in times)
            if seq._produced >= seq.produce:
                finished.append(seq)
        self.inst.stats.tokens_out += count * producing
        self.applied = upto
        return finished

    def finish(self, done: int) -> list[SimSeq]:
        """The stretch ends after `done` steps: every sequence leaves it with them; the
        ones that produced their last token."""
        for seq in self.seqs:
            seq._stretch = None
        return self._apply(done) if done > self.applied else []
