"""The radix prefix cache: page-aligned matches, locks, LRU eviction, events."""

from __future__ import annotations

import torch

from pdd.engines.embedded.kv_pool import KVPool
from pdd.kv.blocks import block_hashes
from pdd.kv.radix_cache import RadixCache
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


def _oldest_evictable_leaf(cache: RadixCache):
    """The reference order: walk the whole tree for the least recently used leaf no lock holds."""
    leaves = [n for n in cache._walk() if not n.children and n.lock_ref == 0]
    return min(leaves, key=lambda n: n.last_access, default=None)


def test_eviction_keeps_its_order_as_it_goes_and_frees_what_a_walk_would():
    """Random inserts, uses, looks, locks and evictions over shared prefixes: every page
    `evict` frees is the one a walk of the whole tree finds oldest at that moment, and the
    heap of entries stays in proportion to the tree (stale ones are dropped)."""
    import random

    rng = random.Random(7)
    pool, cache, events = _cache(64)
    held: list = []
    for _ in range(3000):
        op = rng.random()
        prompt = [rng.randrange(3) for _ in range(4 * rng.randrange(1, 6))]  # few distinct pages: deep sharing
        if op < 0.35:
            m = cache.match_prefix(prompt)
            need = len(prompt) // 4 - m.num_pages
            cache.lock(m.node)
            if need > pool.free_pages:
                cache.evict(need - pool.free_pages)
            if need <= pool.free_pages:
                cache.insert(prompt, m.pages + pool.allocate(need))
            cache.unlock(m.node)
        elif op < 0.5:
            cache.match_prefix(prompt, touch=rng.random() < 0.5)
        elif op < 0.65:
            node = cache.match_prefix(prompt).node
            cache.lock(node)
            held.append(node)
        elif op < 0.8 and held:
            cache.unlock(held.pop(rng.randrange(len(held))))
        else:
            for _ in range(rng.randrange(1, 4)):
                expected = _oldest_evictable_leaf(cache)
                assert cache.evict(1) == (expected is not None)
                if expected is not None:
                    assert events[-1] == ("removed", [expected.hash])
        assert cache.evictable_pages() == sum(1 for n in cache._walk() if n.lock_ref == 0)
        assert len(cache._leaves) <= 2 * cache.cached_pages + 1024
    assert cache.cached_pages + pool.free_pages == 64
    for _ in range(3000):  # uses alone, nothing evicted: each enters its leaf again
        cache.match_prefix(prompt)
    assert len(cache._leaves) <= 2 * cache.cached_pages + 1024


def test_keys_stand_for_pages_where_there_are_no_tokens():
    """The simulator's use: one key a page, chained by its own rule, on a pool without tensors."""
    from pdd.kv.pages import PagePool

    pool = PagePool(8, 1)
    cache = RadixCache(pool, chain=lambda parent, key: hash((parent, key)))
    shared, mine = [-1, -2], [(5, 2), (5, 3)]
    node = cache.insert_keys(shared + mine, pool.allocate(4))
    assert cache.match_keys(shared + [(6, 2)]).num_pages == 2
    assert cache.lock(node) == 4 and cache.lock(cache.match_keys(shared).node) == 0
    assert cache.evictable_pages() == 0 and cache.evict(4) == 0
