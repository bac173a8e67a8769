"""Radix prefix cache over KV pages.

Each edge holds exactly one full page of tokens, so a match is always page-aligned
and a node owns exactly one page. Sequences lock the path they reuse (a node with a
lock is never evicted); unlocked leaves are evicted least-recently-used first.
Every stored or removed page is reported as a chained block hash through `on_event`,
which is how a remote router keeps a mirror of this cache.

Eviction keeps its order as it goes: a heap of the leaves no sequence locks, by last
use, pushed when a node becomes one (inserted, unlocked, its last child evicted) or is
used again; an entry a later use, lock or child made stale is dropped when it surfaces.
So `evict` costs the pages it frees, not a walk of the tree (the simulator's instances
evict at nearly every insert, over trees of up to ~10^5 pages).

A page's key is its tokens. Where there are no tokens (the simulator, which knows a
prompt by its block keys), `match_keys` and `insert_keys` take one key per page, and
`chain` names a page's chain from its parent's.

Namespaces (`SamplingParams.cache_salt`): each salt has a root of its own, whose hash
starts its chains (`namespace_root`), so a prefix cached under one salt is never found
under another, nor in the shared namespace (salt ""); one pool and one eviction order
serve them all.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdd.kv.blocks import chain_hash, namespace_root
from pdd.kv.pages import PagePool

CacheEvent = tuple[str, list[int]]  # ("stored" | "removed", block hashes)


@dataclass(eq=False, slots=True)
class TreeNode:
    key: Hashable  # a page's tokens (a tuple), or its block key (`insert_keys`)
    page: int
    parent: TreeNode | None  # None: a namespace's root, or evicted
    hash: int
    children: dict[Hashable, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    depth: int = 0  # pages from its namespace's root to it, itself included


@dataclass
class Match:
    node: TreeNode  # deepest matched node (the root when nothing matched)

    @property
    def num_pages(self) -> int:
        return self.node.depth

    @property
    def pages(self) -> list[int]:
        """The matched prefix's pages, in order (a walk up: a caller that needs only the
        length reads `num_pages`)."""
        pages, node = [], self.node
        while node.parent is not None:
            pages.append(node.page)
            node = node.parent
        return pages[::-1]


class RadixCache:
    def __init__(
        self,
        pool: PagePool,
        on_event: Callable[[CacheEvent], None] | None = None,
        chain: Callable[[int, Any], int] = chain_hash,
    ) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.chain = chain
        self.root = TreeNode(key=(), page=-1, parent=None, hash=namespace_root(""))
        self.roots = {"": self.root}  # salt -> its namespace's root (pageless, parent None)
        self.on_event = on_event
        self._clock = itertools.count(1)
        self._order = itertools.count()  # breaks no tie (leaves never share a use), keeps heap entries comparable
        self._leaves: list[tuple[int, int, TreeNode]] = []  # (last use, order, node): eviction's heap
        self.cached_pages = 0
        self.locked_pages = 0  # cached pages some sequence holds (on a locked path): not evictable

    def _pages(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[i : i + ps]) for i in range(0, len(tokens) - ps + 1, ps)]

    def _candidate(self, node: TreeNode) -> None:
        """`node` may have just become an evictable leaf, or been used again: (re)enter it."""
        if not node.children and not node.lock_ref and node.parent is not None:
            heapq.heappush(self._leaves, (node.last_access, next(self._order), node))
            if len(self._leaves) > 2 * self.cached_pages + 1024:  # mostly stale entries: keep it in proportion
                current = {id(e[2]): e for e in self._leaves if self._current(*e)}  # one entry a leaf
                self._leaves = list(current.values())
                heapq.heapify(self._leaves)

    @staticmethod
    def _current(used: int, _order: int, node: TreeNode) -> bool:
        """Whether a heap entry still stands for an evictable leaf, as last used."""
        return node.parent is not None and not node.children and not node.lock_ref and node.last_access == used

    def _root(self, salt: str) -> TreeNode:
        if salt not in self.roots:
            self.roots[salt] = TreeNode(key=(), page=-1, parent=None, hash=namespace_root(salt))
        return self.roots[salt]

    def match_prefix(self, tokens: Sequence[int], touch: bool = True, salt: str = "") -> Match:
        """The cached pages of `tokens`' longest cached prefix in `salt`'s namespace.
        Without `touch` it is a look only: the pages keep their place in the eviction order."""
        return self.match_keys(self._pages(tokens), touch, salt)

    def match_keys(self, keys: Sequence[Hashable], touch: bool = True, salt: str = "") -> Match:
        """`match_prefix` of a prompt given as its pages' keys."""
        node = self.roots.get(salt)
        if node is None:  # nothing was ever cached under this salt
            return Match(self.root)
        children = node.children
        for key in keys:  # (the simulator's hottest loop: one look-up a page, nothing else)
            child = children.get(key)
            if child is None:
                break
            node, children = child, child.children
        if touch:
            self._use(node, next(self._clock))
        return Match(node)

    def _use(self, node: TreeNode, now: int) -> None:
        """`node` and its path were used at `now`."""
        used = node
        while node.parent is not None:
            node.last_access = now
            node = node.parent
        self._candidate(used)

    def lock(self, node: TreeNode | None) -> int:
        """Pin `node`'s path against eviction (None, or a namespace's root: a sequence that
        matched nothing yet: no-op). Returns how many of its pages no lock held before."""
        newly = 0
        while node is not None and node.parent is not None:
            node.lock_ref += 1
            newly += node.lock_ref == 1
            node = node.parent
        self.locked_pages += newly
        return newly

    def unlock(self, node: TreeNode | None) -> None:
        start = node
        while node is not None and node.parent is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unlock without lock"
            self.locked_pages -= node.lock_ref == 0
            node = node.parent
        if start is not None:
            self._candidate(start)  # evictable now, if this was its last lock and no child came meanwhile

    def insert(self, tokens: Sequence[int], pages: Sequence[int], salt: str = "") -> TreeNode:
        """Take ownership of the full pages of `tokens`, in `salt`'s namespace; duplicates
        go back to the pool.

        Returns the deepest node of the inserted path.
        """
        return self.insert_keys(self._pages(tokens), pages, salt)

    def insert_keys(
        self, keys: Sequence[Hashable], pages: Sequence[int], salt: str = "", below: TreeNode | None = None
    ) -> TreeNode:
        """`insert` of a prompt given as its pages' keys: one page each. `below`: a node a
        match found (and its caller locked meanwhile): the keys continue its path."""
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} pages' keys for {len(pages)} pages")
        node, duplicates = below or self._root(salt), []
        now = next(self._clock)
        held = 0  # the keys already cached: used again; a copy of their page goes back
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            if child.page != pages[held]:
                duplicates.append(pages[held])
            child.last_access = now
            node = child
            held += 1
        stored = []  # the rest is new, and so is every node below a new one: no look-ups
        chain, depth = self.chain, node.depth
        for key, page in zip(keys[held:], pages[held:], strict=True):
            depth += 1
            child = TreeNode(key, page, node, chain(node.hash, key), {}, 0, now, depth)
            node.children[key] = child
            stored.append(child.hash)
            node = child
        self.cached_pages += len(stored)
        self._candidate(node)
        self.pool.release(duplicates)
        if stored and self.on_event:
            self.on_event(("stored", stored))
        return node

    def evictable_pages(self) -> int:
        """Pages eviction could free now: nodes on no locked path (a parent is evictable
        once its children are, so every unlocked node counts)."""
        return self.cached_pages - self.locked_pages

    def hashes(self) -> list[int]:
        return [n.hash for n in self._walk()]

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages from unlocked leaves, oldest first."""
        freed: list[int] = []
        removed: list[int] = []
        while self._leaves and len(freed) < num_pages:  # (`_candidate` may replace the heap)
            entry = heapq.heappop(self._leaves)
            if not self._current(*entry):
                continue  # stale: evicted, grown, locked or used since it was entered
            node = entry[2]
            parent = node.parent
            assert parent is not None  # (current)
            del parent.children[node.key]
            node.parent = None
            freed.append(node.page)
            removed.append(node.hash)
            if parent.parent is not None:
                self._candidate(parent)
            elif not parent.children and parent is not self.root:
                self.roots = {s: r for s, r in self.roots.items() if r is not parent}  # an emptied namespace
        self.cached_pages -= len(freed)
        self.pool.release(freed)
        if removed and self.on_event:
            self.on_event(("removed", removed))
        return len(freed)

    def flush(self) -> int:
        return self.evict(self.cached_pages)

    def _walk(self):
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node
