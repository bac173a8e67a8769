"""A simulated prefix cache: hash-chained blocks with LRU eviction.

A real radix cache (`pdd.engine.radix_cache`) holds token pages; the simulator only
needs which prefixes are held, so a prompt is a sequence of block keys (equal leading
keys mean a shared prefix, as the Mooncake trace's `hash_ids` do) and the cache is an
LRU of blocks. A match walks from the first block and stops at the first miss, so a
block whose parent was evicted is never matched: it ages out like a radix tree's leaf.

Eviction passes pinned blocks by. Under load the pool is mostly running requests'
pinned prefixes, so a pinned block that reaches the LRU's old end is set aside
(`_old`, in its LRU order) rather than passed over again at every eviction: every
block set aside is older than every block still in the LRU, so the order is the LRU's.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from itertools import filterfalse, repeat, takewhile


class BlockCache:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("a cache cannot hold fewer than 0 blocks")
        self.capacity = capacity_blocks
        self._lru: OrderedDict[Hashable, None] = OrderedDict()
        # Blocks older than all of `_lru`, found pinned at its old end: each with its place
        # in that order (larger: newer), and a heap of the unpinned ones (an entry whose
        # block has been pinned, used or evicted since is stale, and skipped).
        self._old: dict[Hashable, int] = {}
        self._old_free: list[tuple[int, Hashable]] = []
        self._aside = 0
        self._pins: dict[Hashable, int] = {}  # blocks running requests rely on: never evicted
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._lru) + len(self._old)

    @property
    def pinned(self) -> int:
        return len(self._pins)

    def match(self, blocks: Sequence[Hashable], touch: bool = True) -> int:
        """Leading blocks held; `touch` refreshes them (a use, not a look)."""
        lru, old = self._lru, self._old
        # (the walk runs for every instance a request might go to: C loops where they do)
        held = len(list(takewhile(lru.__contains__, blocks)))
        while old and held < len(blocks) and (blocks[held] in lru or blocks[held] in old):
            held += 1
        if touch:
            self._use(blocks[:held], fresh=False)
        return held

    def unpinned(self, blocks: Sequence[Hashable]) -> int:
        """How many of `blocks` no request pins."""
        return len(blocks) - sum(map(self._pins.__contains__, blocks))

    def _use(self, blocks: Sequence[Hashable], fresh: bool = True) -> None:
        """The newest blocks now, in this order (the keys of a prompt: no repeats);
        `fresh`: some may not be held yet."""
        lru, old = self._lru, self._old
        # C loops (map), no Python one: blocks not in the LRU join its end, then all move there in order
        back = list(filter(old.__contains__, blocks)) if old else []
        for key in back:  # set aside no longer: used
            del old[key]
        new = list(filterfalse(lru.__contains__, blocks)) if fresh else back
        deque(map(lru.__setitem__, new, repeat(None)), maxlen=0)
        deque(map(lru.move_to_end, blocks), maxlen=0)

    def pin(self, blocks: Sequence[Hashable]) -> None:
        pins = self._pins
        for key in blocks:
            pins[key] = pins.get(key, 0) + 1

    def unpin(self, blocks: Sequence[Hashable]) -> None:
        pins, old = self._pins, self._old
        for key in blocks:
            left = pins[key] - 1
            if left:
                pins[key] = left
                continue
            del pins[key]
            if key in old:  # evictable again, in its place
                heapq.heappush(self._old_free, (old[key], key))

    def insert(self, blocks: Sequence[Hashable], room_for: int = 0) -> None:
        """Keep `blocks` (newest last), evicting the least recently used to stay within
        capacity less `room_for` blocks that running sequences hold."""
        self._use(blocks)
        self.shrink(max(0, self.capacity - room_for))

    def shrink(self, limit: int) -> None:
        """Evict the least recently used unpinned blocks down to `limit` (or as far as
        pins allow)."""
        lru, old, free, pins = self._lru, self._old, self._old_free, self._pins
        while len(lru) + len(old) > limit:
            if free:  # the oldest unpinned block set aside is older than all of the LRU
                place, key = heapq.heappop(free)
                if old.get(key) == place and key not in pins:
                    del old[key]
                    self.evicted += 1
                continue
            if not lru:
                return
            key, _ = lru.popitem(last=False)
            if key in pins:
                self._aside += 1
                old[key] = self._aside
            else:
                self.evicted += 1
