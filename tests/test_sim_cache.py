"""The simulated prefix cache against the plainest LRU that passes pinned blocks by:
the same blocks held, the same evicted, after every operation of a random run."""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

from pdd.lab.sim.cache import BlockCache


class _PlainLru:
    """Newest last; eviction walks from the oldest and skips pinned blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.order, self.pins, self.evicted = capacity, [], {}, 0

    def match(self, blocks: Sequence[Hashable], touch: bool) -> int:
        held = 0
        for key in blocks:
            if key not in self.order:
                break
            held += 1
        if touch:
            self._use(blocks[:held])
        return held

    def _use(self, blocks: Sequence[Hashable]) -> None:
        for key in blocks:
            if key in self.order:
                self.order.remove(key)
            self.order.append(key)

    def pin(self, blocks: Sequence[Hashable]) -> None:
        for key in blocks:
            self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, blocks: Sequence[Hashable]) -> None:
        for key in blocks:
            self.pins[key] -= 1
            if not self.pins[key]:
                del self.pins[key]

    def insert(self, blocks: Sequence[Hashable], room_for: int) -> None:
        self._use(blocks)
        self.shrink(max(0, self.capacity - room_for))

    def shrink(self, limit: int) -> None:
        for key in list(self.order):
            if len(self.order) <= limit:
                return
            if key not in self.pins:
                self.order.remove(key)
                self.evicted += 1


def test_cache_evicts_as_a_plain_lru_does() -> None:
    rng = random.Random(7)
    cache, plain = BlockCache(24), _PlainLru(24)
    pinned: list[list[tuple[int, int]]] = []
    for _ in range(4000):
        session = rng.randrange(8)
        blocks = [(session, i) for i in range(rng.randrange(1, 12))]
        op = rng.random()
        if op < 0.3:
            room = rng.randrange(12)
            cache.insert(blocks, room)
            plain.insert(blocks, room)
        elif op < 0.5:
            touch = rng.random() < 0.7
            assert cache.match(blocks, touch) == plain.match(blocks, touch)
        elif op < 0.7:
            cache.pin(blocks)
            plain.pin(blocks)
            pinned.append(blocks)
        elif op < 0.9 and pinned:
            done = pinned.pop(rng.randrange(len(pinned)))
            cache.unpin(done)
            plain.unpin(done)
        else:
            limit = rng.randrange(24)
            cache.shrink(limit)
            plain.shrink(limit)
        assert len(cache) == len(plain.order) and cache.evicted == plain.evicted
        assert cache.pinned == len(plain.pins)
        # the same blocks held (a one-block match is a membership test)
        assert all(cache.match([key], touch=False) == 1 for key in plain.order)
