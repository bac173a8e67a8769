"""A simulated prefix cache: hash-chained blocks with LRU eviction.

A real radix cache (`pdd.engine.radix_cache`) holds token pages; the simulator only
needs which prefixes are held, so a prompt is a sequence of block keys (equal leading
keys mean a shared prefix, as the Mooncake trace's `hash_ids` do) and the cache is an
LRU of blocks. A match walks from the first block and stops at the first miss, so a
block whose parent was evicted is never matched: it ages out like a radix tree's leaf.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class BlockCache:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("a cache cannot hold fewer than 0 blocks")
        self.capacity = capacity_blocks
        self._lru: OrderedDict[Hashable, None] = OrderedDict()
        self._pins: dict[Hashable, int] = {}  # blocks running requests rely on: never evicted
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def pinned(self) -> int:
        return len(self._pins)

    def is_pinned(self, key: Hashable) -> bool:
        return key in self._pins

    def match(self, blocks: Sequence[Hashable], touch: bool = True) -> int:
        """Leading blocks held; `touch` refreshes them (a use, not a look)."""
        held = 0
        for key in blocks:
            if key not in self._lru:
                break
            held += 1
        if touch:
            for key in blocks[:held]:
                self._lru.move_to_end(key)
        return held

    def pin(self, blocks: Sequence[Hashable]) -> None:
        for key in blocks:
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, blocks: Sequence[Hashable]) -> None:
        for key in blocks:
            left = self._pins[key] - 1
            if left:
                self._pins[key] = left
            else:
                del self._pins[key]

    def insert(self, blocks: Sequence[Hashable], room_for: int = 0) -> None:
        """Keep `blocks` (newest last), evicting the least recently used to stay within
        capacity less `room_for` blocks that running sequences hold."""
        for key in blocks:
            self._lru[key] = None
            self._lru.move_to_end(key)
        self.shrink(max(0, self.capacity - room_for))

    def shrink(self, limit: int) -> None:
        """Evict the least recently used unpinned blocks down to `limit` (or as far as
        pins allow)."""
        passed: list[Hashable] = []
        while self._lru and len(self._lru) + len(passed) > limit:
            key, _ = self._lru.popitem(last=False)
            if key in self._pins:
                passed.append(key)
            else:
                self.evicted += 1
        for key in reversed(passed):
            self._lru[key] = None
            self._lru.move_to_end(key, last=False)
