"""A simulated engine: the engine's continuous batching and prefix cache over a pool
whose room a request reserves whole.

It runs the live `pdd.batching.Scheduler` (running sequences first, so decodes stay
smooth, then waiting ones admitted while the step's token budget, the running slots and
the pool last; each computes up to its pending tokens, or one to decode) and the live
`RadixCache`. What differs is the room (`pdd.lab.sim.room.ReservedKV`): the engine's
`PagedKV` takes pages as a sequence grows and preempts when none are left; here a
sequence reserves its prompt and all its output when admitted, so no step can run short
of pages and a run of decode-only steps can be priced as one event (below), which the
planner's time rests on. A step's time comes from a `StepModel`; on a machine whose processes share
cores (`cpu`), a step first waits for a core.

Decode stretches. Between two changes of its batch (an arrival, a finish, a chunk, a
handoff) a decoding instance runs identical steps, except that every context grows by
one token a step. Rather than one simulation event per step (per token), the instance
prices the whole stretch up to the next finish in one vectorized call (`decode_s`),
and sleeps until its end or until something pokes it (a new sequence, a released
hold, a stop); then the steps completed so far are applied and the batch is re-planned,
exactly where step-by-step simulation would have re-planned. Stretch follows stretch
in a decode run (`pdd.lab.sim.sequence._Run`) while the batch only decodes: a sequence
joins as it is admitted and leaves as it finishes or stops, and its own counts and
times are brought up to date only then, or when read (`produced`, `last_s`, ...), so
a stretch costs its changes, not a pass over a batch of hundreds.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import simpy

from pdd.batching import Scheduler, Status
from pdd.instance.reservations import ReservationQueue
from pdd.kv.pages import PagePool
from pdd.kv.radix_cache import RadixCache, TreeNode
from pdd.lab.sim.clock import SimClock
from pdd.lab.sim.room import ReservedKV, named_by_key
from pdd.lab.sim.sequence import Hold, Landing, SimSeq, _Run
from pdd.perf.steps import StepLoad, StepModel
from pdd.policy.capacity import Room

MAX_STRETCH_STEPS = 4096  # bounds one stretch's arrays; a longer run is several stretches


@dataclass
class InstanceStats:
    """What an instance did: each role's share of the work, and how busy it was."""

    tokens_out: int = 0
    prefill_tokens: int = 0
    busy_s: float = 0.0  # time spent in steps
    steps: int = 0
    peak_held: int = 0  # the most requests it held at once


@dataclass
class Instance:
    env: simpy.Environment
    name: str
    role: str  # standalone | prefill | relay | main
    dc: str
    steps: StepModel
    capacity_tokens: int
    block_tokens: int
    max_batch_tokens: int
    max_running: int
    cpu: simpy.PriorityResource | None = None
    cpu_priority: int = 0
    stretches: bool = True  # decode stretches (off: one event per step, the reference)
    max_chunks: int = 0  # prefill/extend chunks a step may hold (0: as many as the budget takes, as the engine)
    max_requests: int = 256  # most requests held at once (`EngineConfig.max_requests`)
    # the router's counts: work assigned here and not finished; pages and requests of
    # what it dispatched here to hold (`pdd.policy.capacity.fits`)
    queued_tokens: int = 0
    committed_pages: int = 0
    committed_requests: int = 0
    stats: InstanceStats = field(default_factory=InstanceStats)

    def __post_init__(self) -> None:
        # The engine's own prefix cache. A page is a block here, named by its block key (a key
        # names its whole prefix, as a chained hash does), and the pool is the cache's alone:
        # what sequences hold is counted in `used`, and the cache keeps within the rest.
        self.cache = RadixCache(PagePool(self.capacity_tokens // self.block_tokens, 1), chain=named_by_key)
        room = ReservedKV(self._admit, self.release)
        self.scheduler = Scheduler(room, self.max_batch_tokens, self.max_running, self.max_chunks)
        self.used = 0  # pool tokens held by sequences (reserved or running)
        self.holds = 0  # requests holding pool room
        self.without_room = 0  # requests held here without room yet (a reservation waiting; a sequence not admitted)
        self.unsettled: list[Landing] = []  # accepted requests not settled yet, in arrival order
        self.arrivals = itertools.count()  # numbers them
        # required reservations waiting for room: the live line, on the simulated clock (no
        # router here to be told a waiting request moves)
        self.reservations: ReservationQueue[Landing] = ReservationQueue(lambda landing: None, SimClock(self.env))
        self._run: _Run | None = None  # decode-only steps under way (see _stretch)
        self._wake = self.env.event()
        self.env.process(self._loop())

    @property
    def waiting(self) -> deque[SimSeq]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[SimSeq]:
        return self.scheduler.running

    # ---- the pool ------------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Requests this instance holds, as the live instance counts its jobs."""
        return self.holds + self.without_room

    @property
    def room(self) -> Room:
        """What it holds at most, as the router sees it: the pool in pages (a page is a
        block here) and `max_requests`."""
        return Room(self.capacity_tokens // self.block_tokens, self.max_requests)

    def hit_tokens(self, blocks: Sequence[Hashable], prompt_tokens: int, touch: bool = True) -> int:
        """Prompt tokens this instance holds, leaving at least one to compute (its logits
        give the next token), as the engine's match does."""
        return min(self.cache.match_keys(blocks, touch).num_pages * self.block_tokens, prompt_tokens - 1)

    @property
    def kv_held_tokens(self) -> int:
        """Pool tokens its requests hold: their own room, and the cached prefix blocks they
        pin (which no eviction may take either). `used` alone left the pins out: a pool
        shown 8 % full was about 65 % held at the publication's scale."""
        return self.used + self.cache.locked_pages * self.block_tokens

    def cache_room(self) -> int:
        """Blocks the cache may keep beside what sequences hold."""
        return max(0, (self.capacity_tokens - self.used) // self.block_tokens)

    def shrink(self) -> None:
        """Evict the least recently used unlocked blocks down to `cache_room` (or as far
        as locks allow)."""
        self.cache.evict(self.cache.cached_pages - self.cache_room())

    def keep(self, blocks: Sequence[Hashable]) -> None:
        """Cache `blocks` (a prompt's, or a finished sequence's context) as most recently
        used, evicting others for them within `cache_room`; a tail with no room is not kept."""
        cache = self.cache
        held = cache.match_keys(blocks).node
        new = len(blocks) - held.depth
        if not new:
            return
        cache.lock(held)  # (its own prefix is not evicted for its tail)
        cache.evict(cache.cached_pages + new - self.cache_room())
        cache.unlock(held)
        new = max(0, min(new, self.cache_room() - cache.cached_pages))
        tail = blocks[held.depth : held.depth + new]
        cache.insert_keys(tail, cache.pool.allocate(new), below=held)

    def hold(self, tokens: int, prefix: Sequence[Hashable] = ()) -> Hold | None:
        """Reserve pool room beside the cached `prefix` blocks, locked (no eviction takes
        them while it holds), evicting other cached blocks for it; None when the pool
        cannot hold it now."""
        node = self.cache.match_keys(prefix, touch=False).node
        self.cache.lock(node)
        if self.used + tokens + self.cache.locked_pages * self.block_tokens > self.capacity_tokens:
            self.cache.unlock(node)
            return None
        self.used += tokens
        self.holds += 1
        self.stats.peak_held = max(self.stats.peak_held, self.held)
        self.shrink()
        return Hold(self, tokens, node)

    def unhold(self, tokens: int, locked: TreeNode) -> None:
        """`hold`'s room and lock back (`Hold.release`): the blocks it kept may be evicted."""
        self.used -= tokens
        self.holds -= 1
        self.cache.unlock(locked)
        self.shrink()

    def accept(self, landing: Landing) -> None:
        """A request accepted here that has not settled yet (`Landing`), in arrival order."""
        self.unsettled.append(landing)

    def settle(self, landing: Landing) -> None:
        """It produces here now, or has gone (a second call is no change)."""
        if landing in self.unsettled:
            self.unsettled.remove(landing)

    def room_for(self, tokens: int, prefix: Sequence[Hashable] = ()) -> Hold | None:
        """`hold` for a request held here without room so far: held either way after."""
        self.without_room -= 1
        hold = self.hold(tokens, prefix)
        self.without_room += hold is None
        return hold

    def release(self, seq: SimSeq) -> None:
        """Its pool room back; its blocks stay cached (what the decode-side cache keeps
        for the next turn of the session)."""
        if seq.hold is not None:
            seq.hold.release()
            seq.hold = None
        if seq.blocks:
            self.keep(seq.blocks)

    # ---- work ----------------------------------------------------------------------------
    def submit(self, seq: SimSeq) -> None:
        self.without_room += seq.hold is None
        self.scheduler.add(seq)
        self.poke()

    def feed(self, seq: SimSeq, tokens: int, live: bool, step_cap: int = 0) -> None:
        """Hand-over tokens for a sequence that waits (or has not started): compute them
        (at most `step_cap` per step), then produce if `live`."""
        seq.pending += tokens
        seq.live, seq.step_cap = live, step_cap
        if self._run is not None:
            self._run.dirty = True
        if seq not in self.running and seq not in self.waiting:
            seq.status = Status.RUNNING
            self.running.append(seq)
        self.poke()

    def stop(self, seq: SimSeq) -> None:
        """A handoff cut: the sequence produces no more here and gives its room back."""
        seq._sync()
        if seq.done:
            return
        seq.stopped = True
        self._end(seq)

    def poke(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _schedule(self) -> tuple[list[tuple[SimSeq, int]], bool]:
        """The next step's batch, and whether it only decodes (a token for each, nothing pending)."""
        batch = self.scheduler.schedule()
        return batch, not any(seq.pending for seq, _ in batch)

    def _admit(self, seq: SimSeq) -> bool:
        seq.hold = self.room_for(seq.pending + seq.produce, seq.blocks[: seq.context // self.block_tokens])
        return seq.hold is not None

    def _loop(self):
        env = self.env
        while True:
            self._wake = env.event()
            if self._run is not None:
                if self._run_on():
                    yield from self._stretch()
                    continue
                self._run.dissolve(self.running)
                self._run = None
            batch, decodes = self._schedule()
            if not batch:
                yield self._wake
                continue
            if decodes and self.stretches and self.cpu is None:
                self._run = run = _Run(self)
                for seq, _ in batch:
                    run.join(seq)
                yield from self._stretch()
                continue
            seconds = self.steps.step_s(_load(batch))
            started = env.now
            if self.cpu is not None:
                with self.cpu.request(priority=self.cpu_priority) as core:
                    yield core
                    started = env.now
                    yield env.timeout(seconds)
            else:
                yield env.timeout(seconds)
            self.stats.busy_s += env.now - started
            self.stats.steps += 1
            self._apply(batch)

    def _run_on(self) -> bool:
        """Whether the next step still only decodes: the scheduler's admissions
        (`Scheduler.admit`) beside a batch that is the run's members (a token each) and
        sequences with nothing to do; a decoder admitted joins the run. False leaves what
        it admitted in `running` for `_schedule` to take from there, as it would have: a
        member's work changed, a chunk came in, or no member is left."""
        run = self._run
        assert run is not None  # called with one
        if run.dirty:
            return False
        admitted: list[tuple[SimSeq, int]] = []
        self.scheduler.admit(self.max_batch_tokens - run.members, 0, admitted)
        for seq, _ in admitted:
            if seq.pending:
                return False
            run.join(seq)
        return run.members > 0

    def _stretch(self):
        """Decode the run's members until the first of them finishes, or until poked;
        then apply the steps completed (the one in progress included) and return to
        re-plan."""
        env, run = self.env, self._run
        assert run is not None  # the loop's
        steps = min(MAX_STRETCH_STEPS, run.steps_to_finish())
        seconds = self.steps.decode_s(run.contexts(), run.members, steps)
        run.ends = ends = np.add.accumulate(np.concatenate(([env.now], seconds)))[1:]
        started = env.now
        yield env.timeout(float(ends[-1]) - env.now) | self._wake
        done = len(ends)
        if env.now < ends[-1]:
            done = bisect.bisect_right(ends, env.now)
            if done < len(ends) and ends[done] > env.now:  # the step in progress completes
                yield env.timeout(float(ends[done]) - env.now)
                done += 1
        self.stats.busy_s += env.now - started
        self.stats.steps += done
        for seq in run.advance(done):  # these produced their last token
            self._end(seq)
            if seq.on_finish is not None:
                seq.on_finish(seq)

    def _apply(self, batch: list[tuple[SimSeq, int]], now: float | None = None) -> None:
        now = self.env.now if now is None else now
        for seq, n in batch:
            if seq.done or seq.stopped:
                continue
            seq.context += n
            if not seq.pending and seq._produced + 1 < seq.produce:  # a decode token, not the last
                seq._token_at(now)
                self.stats.tokens_out += 1
                continue
            if seq.pending:
                seq.pending -= n
                self.stats.prefill_tokens += n
                if seq.pending:
                    continue
                if seq.on_computed is not None:
                    seq.on_computed(seq)
                if not seq.live or seq.stopped:
                    continue
            if seq._produced < seq.produce:
                self._token(seq, now)

    def _token(self, seq: SimSeq, now: float) -> None:
        seq._token_at(now)
        self.stats.tokens_out += 1
        if seq._produced >= seq.produce:
            self._end(seq)
            if seq.on_finish is not None:
                seq.on_finish(seq)

    def _end(self, seq: SimSeq) -> None:
        if seq._run is not None:  # a member stopped (brought up to date by its read)
            seq._run.leave(seq)
        seq.done = True
        if seq.status is Status.WAITING:
            self.without_room -= seq.hold is None
        self.scheduler.finish(seq)
        self.poke()


def _load(batch: list[tuple[SimSeq, int]]) -> StepLoad:
    """`steps.add` of each sequence's `chunk_load`, inlined (the simulator's hot loop)."""
    new = seqs = kv = chunks = outputs = 0
    pairs = chunk_pairs = output_pairs = 0.0
    for seq, n in batch:
        start = seq.context
        new += n
        seqs += 1
        kv += start + n
        p = n * start + n * (n + 1) / 2
        pairs += p
        if n > 1:
            chunks += 1
            chunk_pairs += p
            if start + n > seq.prompt:  # an extend of outputs (`chunk_load`)
                outputs += n
                output_pairs += p
    return StepLoad(new, pairs, seqs, kv, chunks, chunk_pairs, outputs, output_pairs)
