"""The radix prefix cache: page-aligned matches, locks, LRU eviction, events."""

from __future__ import annotations

import torch

from pdd.engine.kv_pool import KVPool
from pdd.engine.radix_cache import RadixCache
from pdd.kv.blocks import block_hashes
from pdd.model.config import ModelConfig

CFG = ModelConfig("llama", 100, 8, 16, 1, 2, 1, 4, 1e-5, 512, False, False, False)


def _cache(pages: int = 16):
    pool = KVPool(CFG, pages, 4, torch.float32, "cpu")
    events = []
    return pool, RadixCache(pool, events.append), events


def test_match_is_page_aligned_and_insert_dedupes():
    pool, cache, events = _cache()
    a = pool.allocate(3)
    cache.insert(list(range(12)), a)
    assert cache.match_prefix(list(range(11))).pages == a[:2]
    assert cache.match_prefix(list(range(13))).pages == a
    assert cache.match_prefix([1, 2, 3, 4]).pages == []
    dup = pool.allocate(3)
    cache.insert(list(range(12)), dup)  # same content from another sequence
    assert cache.cached_pages == 3 and pool.free_pages == 13
    assert events == [("stored", block_hashes(list(range(12)), 4))]


def test_locked_paths_survive_eviction_and_lru_goes_first():
    pool, cache, events = _cache()
    old = list(range(8))
    new = [50 + i for i in range(8)]
    cache.insert(old, pool.allocate(2))
    cache.insert(new, pool.allocate(2))
    m = cache.match_prefix(new)
    cache.lock(m.node)
    assert cache.evict(4) == 2  # only the unlocked (older) branch goes
    assert cache.match_prefix(old).pages == [] and len(cache.match_prefix(new).pages) == 2
    assert events[-1] == ("removed", list(reversed(block_hashes(old, 4))))
    cache.unlock(m.node)
    assert cache.flush() == 2 and pool.free_pages == 16


def test_evicts_leaves_before_shared_parents():
    pool, cache, _ = _cache()
    cache.insert(list(range(8)), pool.allocate(2))
    cache.insert(list(range(4)) + [70, 71, 72, 73], pool.allocate(2))
    assert cache.cached_pages == 3
    cache.match_prefix(list(range(8)))  # touch the first branch
    cache.evict(1)
    assert len(cache.match_prefix(list(range(8))).pages) == 2
    assert len(cache.match_prefix(list(range(4)) + [70, 71, 72, 73]).pages) == 1


def test_a_look_without_touch_keeps_the_eviction_order():
    for touch, survivor in ((False, "new"), (True, "old")):
        pool, cache, _ = _cache()
        prefixes = {"old": list(range(8)), "new": [50 + i for i in range(8)]}
        cache.insert(prefixes["old"], pool.allocate(2))
        cache.insert(prefixes["new"], pool.allocate(2))
        assert len(cache.match_prefix(prefixes["old"], touch=touch).pages) == 2
        assert cache.evict(2) == 2  # the least recently used branch goes: a mere look does not count as use
        assert len(cache.match_prefix(prefixes[survivor]).pages) == 2
        cache.flush()
