"""Continuous batching: which sequences compute how many tokens this step.

One unified rule covers prefill, chunked prefill, extend and decode: every scheduled
sequence computes up to `num_pending` of its tokens within a per-step token budget.
Running sequences go first (decodes stay smooth); waiting ones are admitted while
budget, slots and pages last. Pages come from the free list, then from evicting the
prefix cache, then by preempting the newest running sequence (it recomputes later).
"""

from __future__ import annotations

from collections import deque

from pdd.engine.kv_pool import KVPool
from pdd.engine.sequence import Sequence, Status
from pdd.kv.radix_cache import RadixCache


class Scheduler:
    def __init__(self, pool: KVPool, cache: RadixCache, max_batch_tokens: int, max_running: int) -> None:
        self.pool = pool
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.max_batch_tokens
        batch: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted while making room for an earlier one
                continue
            n = self._step_tokens(seq, budget)
            while not self._grow(seq, n):
                scheduled = {id(b) for b, _ in batch}
                victim = next((s for s in reversed(self.running) if s is not seq and id(s) not in scheduled), None)
                if victim is None:  # everyone else is already in this step: seq waits its turn
                    victim = seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            matched_now = seq.cache_node is None  # (imported sequences arrive matched)
            if matched_now:
                self._match(seq)
            n = self._step_tokens(seq, budget)
            if not self._grow(seq, n):
                if matched_now:  # a waiting sequence must not pin cache pages others could evict
                    self._unmatch(seq)
                elif not self.running:  # nothing will finish and free pages: its KV goes to the cache
                    self._to_recompute(seq)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    @staticmethod
    def _step_tokens(seq: Sequence, budget: int) -> int:
        return min(seq.num_pending, budget, seq.step_cap or budget)

    def pause(self, seq: Sequence) -> None:
        """Stop scheduling a sequence that keeps its pages (a caught-up catch-up chunk)."""
        if seq in self.running:
            self.running.remove(seq)
        seq.status = Status.RESERVED

    def _match(self, seq: Sequence) -> None:
        # Leave at least one token to compute: its logits choose the next token. A request for
        # its prompt's logprobs computes all of it (the cache keeps KV, not logits).
        reusable = [] if seq.params.prompt_logprobs is not None else seq.tokens[: len(seq.tokens) - 1]
        match = self.cache.match_prefix(reusable, salt=seq.params.cache_salt)
        self.cache.lock(match.node)
        seq.cache_node = match.node
        seq.pages = list(match.pages)
        seq.num_computed = match.num_pages * self.pool.page_size
        seq.cached_tokens = min(seq.num_computed, seq.prompt_len)

    def _unmatch(self, seq: Sequence) -> None:
        """Undo `_match`: the pages it found stay in the cache, unlocked."""
        self.cache.unlock(seq.cache_node)
        seq.pages, seq.cache_node, seq.num_computed, seq.cached_tokens = [], None, 0, 0

    def _grow(self, seq: Sequence, n: int) -> bool:
        need = self.pool.pages_for(seq.num_computed + n) - len(seq.pages)
        if need <= 0:
            return True
        short = need - self.pool.free_pages
        if short > 0:
            self.cache.evict(short)
        if need > self.pool.free_pages:
            return False
        seq.pages.extend(self.pool.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._to_recompute(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _to_recompute(self, seq: Sequence) -> None:
        """Give up a sequence's pages (its KV stays in the cache, evictable); it will
        match what is left and recompute the rest when admitted again."""
        self.release(seq)
        seq.num_computed = seq.cached_tokens = 0
        seq.published = False  # (computed again, its prompt is published again)
        self.preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.hold:
            seq.status = Status.HELD
        else:
            self.release(seq)
            seq.status = Status.FINISHED

    def release(self, seq: Sequence) -> None:
        """Give a sequence's computed KV to the prefix cache and its other pages back."""
        full = seq.num_computed // self.pool.page_size
        if full:
            self.cache.insert(seq.tokens[: full * self.pool.page_size], seq.pages[:full], seq.params.cache_salt)
        self.pool.release(seq.pages[full:])
        if seq.cache_node is not None:
            self.cache.unlock(seq.cache_node)
        seq.pages = []
        seq.cache_node = None
