"""The embedded engine's KV room for the batching rule (`pdd.batching`): pages as a
sequence grows, over the prefix cache."""

from __future__ import annotations

from pdd.batching import BaseKV, Status, step_tokens
from pdd.engines.embedded.sequence import Sequence
from pdd.kv.pages import PagePool
from pdd.kv.radix_cache import RadixCache


class PagedKV(BaseKV[Sequence]):
    """Pages from the free list, then from evicting the prefix cache; when neither has
    enough, `grow` fails and the scheduler preempts."""

    def __init__(self, pool: PagePool, cache: RadixCache) -> None:
        self.pool = pool
        self.cache = cache
        self.preemptions = 0  # sequences that gave up their pages to compute again later

    def admit(self, seq: Sequence, budget: int, alone: bool) -> int | None:
        matched_now = seq.cache_node is None  # (imported sequences arrive matched)
        if matched_now:
            self._match(seq)
        n = step_tokens(seq.num_pending, seq.step_cap, budget)
        if self.grow(seq, n):
            return n
        if matched_now:  # a waiting sequence must not pin cache pages others could evict
            self._unmatch(seq)
        elif alone:  # nothing will finish and free pages: its KV goes to the cache
            self.preempt(seq)
        return None

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

    def grow(self, seq: Sequence, n: int) -> bool:
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

    def preempt(self, seq: Sequence) -> None:
        """Give up a sequence's pages (its KV stays in the cache, evictable); it will
        match what is left and recompute the rest when admitted again."""
        self.release(seq)
        seq.num_computed = seq.cached_tokens = 0
        seq.published = False  # (computed again, its prompt is published again)
        self.preemptions += 1

    def finish(self, seq: Sequence) -> None:
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
