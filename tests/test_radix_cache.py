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


def test_each_cache_salt_is_a_namespace_of_its_own():
    pool, cache, events = _cache(16)
    tokens = list(range(100, 108))  # two pages
    pages = pool.allocate(2)
    cache.insert(tokens, pages, salt="alice")
    assert cache.match_prefix(tokens + [1], salt="alice").pages == pages
    assert cache.match_prefix(tokens + [1]).num_pages == 0  # not in the shared namespace
    assert cache.match_prefix(tokens + [1], salt="bob").num_pages == 0
    shared = pool.allocate(2)
    cache.insert(tokens, shared)  # the same tokens, shared: pages of their own, not duplicates
    assert cache.match_prefix(tokens + [1]).pages == shared and cache.cached_pages == 4
    # the events name each namespace's chain as the router hashes it
    assert events[0] == ("stored", block_hashes(tokens, 4, "alice"))
    assert events[1] == ("stored", block_hashes(tokens, 4))
    assert set(block_hashes(tokens, 4, "alice")).isdisjoint(block_hashes(tokens, 4, "bob"))
    node = cache.match_prefix(tokens + [1], salt="alice").node
    cache.lock(node)
    assert cache.evict(16) == 2 and cache.match_prefix(tokens + [1], salt="alice").pages == pages  # locked: kept
    cache.unlock(node)
    assert cache.evict(16) == 2 and set(cache.roots) == {""}  # alice's emptied namespace is dropped
    assert pool.free_pages == pool.num_pages
