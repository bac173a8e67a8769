"""What an instance holds for a request: its pool room (`Hold`), its work (`SimSeq`),
and the decode steps not yet applied to it (`_Run`, see pdd.lab.sim.instance)."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

import numpy as np
import simpy

from pdd.batching import Status
from pdd.kv.radix_cache import TreeNode


class _Counts(Protocol):
    tokens_out: int


class SimInstance(Protocol):
    """What a hold, a landing and a decode run ask of the instance they belong to
    (`pdd.lab.sim.instance.Instance`, which is built from them: named by shape here)."""

    @property
    def env(self) -> simpy.Environment: ...

    @property
    def stats(self) -> _Counts: ...

    def unhold(self, tokens: int, locked: TreeNode) -> None: ...

    def accept(self, landing: Landing) -> None: ...

    def settle(self, landing: Landing) -> None: ...

    def poke(self) -> None: ...


@dataclass(eq=False)
class Landing:
    """A request accepted at a decode side that has not settled there: not reserved yet
    (waiting for a prefix, or in the reservation queue), or reserved with its KV, a
    handoff or a fill still to land. A later request sharing most of `keys` may wait for
    it (`settled`), as the live side waits for its jobs (`pdd.policy.prefix.may_hold`)."""

    inst: SimInstance
    keys: Sequence[Hashable]  # its prompt; once reserved, its prompt and output
    order: int  # its arrival at `inst`
    reserved: bool = False
    _settled: simpy.Event | None = None

    def __post_init__(self) -> None:
        self.inst.accept(self)

    def settled(self) -> simpy.Event:
        if self._settled is None:
            self._settled = self.inst.env.event()
        return self._settled

    def settle(self) -> None:
        """Its request produces here now, or has gone: nothing more to wait for."""
        self.inst.settle(self)
        settled = self.settled()
        if not settled.triggered:
            settled.succeed()


@dataclass(eq=False)
class Hold:
    """Pool room reserved for one request on one instance, and the cached prefix blocks
    it relies on, locked in the instance's radix cache (eviction passes them by) until
    the hold is released."""

    inst: SimInstance
    tokens: int
    locked: TreeNode  # the deepest block of its prefix (the cache's root: none)
    released: bool = False
    landing: Landing | None = None  # while its request has not settled here

    def settle(self) -> None:
        """Its request produces here now, or has gone: nothing more to wait for."""
        if self.landing is not None:
            self.landing.settle()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.inst.unhold(self.tokens, self.locked)
            self.settle()
            self.inst.poke()  # a waiting sequence may fit now


Granted: TypeAlias = tuple[int, Hold]  # a reservation: (the reserved hit in tokens, the pool room held)


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
    # its prompt's length: what it holds and computes first (context + pending at the start);
    # a chunk ending past it is an extend of outputs (a handoff's), priced as outputs are
    prompt: int = -1
    status: Status = Status.RESERVED  # (the scheduler's; RESERVED: in no queue yet)
    done: bool = False
    stopped: bool = False  # cut by a handoff: produces no more
    _produced: int = 0
    _first_s: float | None = None
    _last_s: float | None = None
    _max_gap_s: float = 0.0
    _run: _Run | None = None  # the decode run it is a member of, whose steps it has up to `_at`
    _at: int = 0

    def __post_init__(self) -> None:
        if self.prompt < 0:
            self.prompt = self.context + self.pending

    def _sync(self) -> None:
        if self._run is not None:
            self._run.sync(self)

    @property
    def num_pending(self) -> int:
        """Tokens it would compute now (`pdd.batching.Schedulable`): its pending ones, or
        one to decode while it produces. (Not brought up to date: the scheduler plans
        only when no decode run holds it.)"""
        if self.pending:
            return self.pending
        return 1 if self.live and self._produced < self.produce else 0

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
class _Run:
    """An instance's decode-only steps, stretch after stretch, and its `members`: the
    sequences decoding in each of them. A member's own fields are brought up to date
    (`bring`) only when it is read, finishes or leaves, so a stretch costs what changes
    in it, not a pass over the batch: the steps' times are kept (`log`), and the sums a
    stretch is priced from are kept as members join and leave."""

    inst: SimInstance
    # end times of the steps applied, in order: the first `logged` of `log`
    log: np.ndarray = field(default_factory=lambda: np.empty(1024))
    logged: int = 0
    ends: np.ndarray = field(default_factory=lambda: np.empty(0))  # the stretch in progress
    members: int = 0
    dirty: bool = False  # a member's work changed outside the run (`Instance.feed`): re-plan it
    _contexts: int = 0  # sum over members of context - at (a member's context at log length L: that + L)
    # (log length at its last token, join order, it) of every member, and of some that left
    _finishes: list[tuple[int, int, SimSeq]] = field(default_factory=list)
    _joined: int = 0

    def join(self, seq: SimSeq) -> None:
        seq._run, seq._at = self, self.logged
        self.members += 1
        self._contexts += seq.context - seq._at
        self._joined += 1
        heapq.heappush(self._finishes, (seq._at + seq.produce - seq._produced, self._joined, seq))

    def leave(self, seq: SimSeq) -> None:
        """(Brought up to date first.)"""
        seq._run = None
        self.members -= 1
        self._contexts -= seq.context - seq._at

    def contexts(self) -> int:
        """Every member's context now (what the next stretch's first step extends)."""
        return self._contexts + self.members * self.logged

    def steps_to_finish(self) -> int:
        """Steps until the first member produces its last token."""
        heap = self._finishes
        while heap[0][2]._run is not self:  # it left
            heapq.heappop(heap)
        return heap[0][0] - self.logged

    def sync(self, seq: SimSeq) -> None:
        """A member read during a stretch: the steps completed by now (never the last:
        the stretch's end is the loop's)."""
        done = min(bisect.bisect_right(self.ends, self.inst.env.now), len(self.ends) - 1)
        self.bring(seq, self.logged + max(0, done))

    def bring(self, seq: SimSeq, upto: int) -> None:
        """Steps [its `_at`, `upto`) into `seq` (positions past `log` are the stretch's)."""
        count = upto - seq._at
        if count <= 0:
            return
        logged = self.logged
        times = self.log[seq._at : min(upto, logged)]
        if upto > logged:
            times = np.concatenate((times, self.ends[max(0, seq._at - logged) : upto - logged]))
        first, last = float(times[0]), float(times[-1])
        seq.context += count
        if seq._last_s is None:
            seq._first_s = first
        else:
            seq._max_gap_s = max(seq._max_gap_s, first - seq._last_s)
        if count > 1:
            seq._max_gap_s = max(seq._max_gap_s, float((times[1:] - times[:-1]).max()))  # (np.diff's, less overhead)
        seq._last_s = last
        seq._produced += count
        if seq.token_times is not None:
            seq.token_times.extend(times.tolist())
        self.inst.stats.tokens_out += count
        seq._at = upto

    def advance(self, done: int) -> list[SimSeq]:
        """The stretch ends after `done` steps: the members that produced their last
        token, brought up to date and out of the run, in join order."""
        if self.logged + done > self.log.size:  # room for it, and as much again
            self.log = np.concatenate((self.log[: self.logged], np.empty(self.logged + 2 * done)))
        self.log[self.logged : self.logged + done] = self.ends[:done]
        self.logged += done
        self.ends = np.empty(0)
        heap, now, finished = self._finishes, self.logged, []
        while heap and (heap[0][2]._run is not self or heap[0][0] == now):
            seq = heapq.heappop(heap)[2]
            if seq._run is self:
                self.bring(seq, now)
                self.leave(seq)
                finished.append(seq)
        return finished

    def dissolve(self, seqs: Sequence[SimSeq]) -> None:
        """Every member of `seqs` brought up to date and out: the instance re-plans."""
        for seq in seqs:
            if seq._run is self:
                self.bring(seq, self.logged)
                self.leave(seq)
