"""A simulated engine: continuous batching over a KV pool with a prefix cache.

The same rule as `pdd.engine.scheduler`: running sequences go first (decodes stay
smooth), then waiting ones are admitted while the step's token budget, the running
slots and the pool last; every sequence computes up to its pending tokens (chunked
prefill, extend) or one token (decode). A step's time comes from a `StepModel`; on a
machine whose processes share cores (`cpu`), a step first waits for a core.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import simpy

from pdd.sim.cache import BlockCache
from pdd.sim.steps import StepLoad, StepModel


@dataclass(eq=False)
class Hold:
    """Pool room reserved for one request on one instance, and the cached prefix blocks
    it relies on, pinned (eviction passes them by) until the hold is released."""

    inst: Instance
    tokens: int
    pinned: Sequence[Hashable]
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.inst.used -= self.tokens
            self.inst.cache.unpin(self.pinned)
            self.inst.cache.shrink(self.inst.cache_room())


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
    on_computed: Callable[[SimSeq], None] | None = None  # pending reached 0
    on_finish: Callable[[SimSeq], None] | None = None
    produced: int = 0
    first_s: float | None = None
    last_s: float | None = None
    max_gap_s: float = 0.0
    done: bool = False
    stopped: bool = False  # cut by a handoff: produces no more


@dataclass
class InstanceStats:
    """The tokens an instance computed: what each role's share of the work is read from."""

    tokens_out: int = 0
    prefill_tokens: int = 0


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
    queued_tokens: int = 0  # the router's count of work assigned here and not finished
    stats: InstanceStats = field(default_factory=InstanceStats)

    def __post_init__(self) -> None:
        self.cache = BlockCache(self.capacity_tokens // self.block_tokens)
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []
        self.used = 0  # pool tokens held by sequences (reserved or running)
        self._wake = self.env.event()
        self.env.process(self._loop())

    # ---- the pool ------------------------------------------------------------------------
    def hit_tokens(self, blocks: Sequence[Hashable], prompt_tokens: int, touch: bool = True) -> int:
        """Prompt tokens this instance holds, leaving at least one to compute (its logits
        give the next token), as the engine's match does."""
        return min(self.cache.match(blocks, touch) * self.block_tokens, prompt_tokens - 1)

    def cache_room(self) -> int:
        """Blocks the cache may keep beside what sequences hold."""
        return max(0, (self.capacity_tokens - self.used) // self.block_tokens)

    def hold(self, tokens: int, pinned: Sequence[Hashable] = ()) -> Hold | None:
        """Reserve pool room beside the `pinned` prefix blocks, evicting other cached
        blocks for it; None when the pool cannot hold it now."""
        new_pins = sum(1 for key in pinned if not self.cache.is_pinned(key))
        if self.used + tokens + (self.cache.pinned + new_pins) * self.block_tokens > self.capacity_tokens:
            return None
        self.cache.pin(pinned)
        self.used += tokens
        self.cache.shrink(self.cache_room())
        return Hold(self, tokens, pinned)

    def release(self, seq: SimSeq) -> None:
        """Its pool room back; its blocks stay cached (what the decode-side cache keeps
        for the next turn of the session)."""
        if seq.hold is not None:
            seq.hold.release()
            seq.hold = None
        if seq.blocks:
            self.cache.insert(seq.blocks, room_for=self.used // self.block_tokens)

    # ---- work ----------------------------------------------------------------------------
    def submit(self, seq: SimSeq) -> None:
        self.waiting.append(seq)
        self._poke()

    def feed(self, seq: SimSeq, tokens: int, live: bool, step_cap: int = 0) -> None:
        """Hand-over tokens for a sequence that waits (or has not started): compute them
        (at most `step_cap` per step), then produce if `live`."""
        seq.pending += tokens
        seq.live, seq.step_cap = live, step_cap
        if seq not in self.running and seq not in self.waiting:
            self.running.append(seq)
        self._poke()

    def stop(self, seq: SimSeq) -> None:
        """A handoff cut: the sequence produces no more here and gives its room back."""
        seq.stopped = True
        self._end(seq)

    def _poke(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _schedule(self) -> list[tuple[SimSeq, int]]:
        budget = self.max_batch_tokens
        batch: list[tuple[SimSeq, int]] = []
        for seq in self.running:
            if budget <= 0:
                break
            n = self._tokens(seq, budget)
            if n:
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if seq.hold is None and not self._admit(seq):
                break
            self.waiting.popleft()
            self.running.append(seq)
            n = self._tokens(seq, budget)
            if n:
                batch.append((seq, n))
                budget -= n
        return batch

    def _admit(self, seq: SimSeq) -> bool:
        seq.hold = self.hold(seq.pending + seq.produce, seq.blocks[: seq.context // self.block_tokens])
        return seq.hold is not None

    @staticmethod
    def _tokens(seq: SimSeq, budget: int) -> int:
        if seq.pending:
            return min(seq.pending, budget, seq.step_cap or budget)
        return 1 if seq.live and seq.produced < seq.produce else 0

    def _loop(self):
        env = self.env
        while True:
            batch = self._schedule()
            if not batch:
                self._wake = env.event()
                yield self._wake
                continue
            load = _load(batch)
            seconds = self.steps.step_s(load)
            if self.cpu is not None:
                with self.cpu.request(priority=self.cpu_priority) as core:
                    yield core
                    yield env.timeout(seconds)
            else:
                yield env.timeout(seconds)
            self._apply(batch)

    def _apply(self, batch: list[tuple[SimSeq, int]]) -> None:
        now = self.env.now
        for seq, n in batch:
            if seq.done or seq.stopped:
                continue
            seq.context += n
            if seq.pending:
                seq.pending -= n
                self.stats.prefill_tokens += n
                if seq.pending:
                    continue
                if seq.on_computed is not None:
                    seq.on_computed(seq)
                if not seq.live or seq.stopped:
                    continue
            if seq.produced < seq.produce:
                self._token(seq, now)

    def _token(self, seq: SimSeq, now: float) -> None:
        if seq.last_s is not None:
            seq.max_gap_s = max(seq.max_gap_s, now - seq.last_s)
        else:
            seq.first_s = now
        seq.last_s = now
        seq.produced += 1
        self.stats.tokens_out += 1
        if seq.produced >= seq.produce:
            self._end(seq)
            if seq.on_finish is not None:
                seq.on_finish(seq)

    def _end(self, seq: SimSeq) -> None:
        seq.done = True
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)
        self._poke()

    def load(self) -> tuple[float, int]:
        """(occupancy, waiting): the relay's load as `choose_handoff` reads it."""
        return len(self.running) / self.max_running, len(self.waiting)


def _load(batch: list[tuple[SimSeq, int]]) -> StepLoad:
    new = seqs = kv = 0
    pairs = 0.0
    for seq, n in batch:
        start = seq.context
        new += n
        seqs += 1
        kv += start + n
        pairs += n * start + n * (n + 1) / 2
    return StepLoad(new, pairs, seqs, kv)
