"""Radix prefix cache over KV pages.

Each edge holds exactly one full page of tokens, so a match is always page-aligned
and a node owns exactly one page. Sequences lock the path they reuse (a node with a
lock is never evicted); unlocked leaves are evicted least-recently-used first.
Every stored or removed page is reported as a chained block hash through `on_event`,
which is how a remote router keeps a mirror of this cache.

Namespaces (`SamplingParams.cache_salt`): each salt has a root of its own, whose hash
starts its chains (`namespace_root`), so a prefix cached under one salt is never found
under another, nor in the shared namespace (salt ""); one pool and one eviction order
serve them all.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdd.engine.kv_pool import KVPool
from pdd.kv.blocks import chain_hash, namespace_root

CacheEvent = tuple[str, list[int]]  # ("stored" | "removed", block hashes)


@dataclass(eq=False)
class TreeNode:
    key: tuple[int, ...]
    page: int
    parent: TreeNode | None
    hash: int
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


@dataclass
class Match:
    pages: list[int]
    node: TreeNode  # deepest matched node (the root when nothing matched)

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class RadixCache:
    def __init__(self, pool: KVPool, on_event: Callable[[CacheEvent], None] | None = None) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.root = TreeNode(key=(), page=-1, parent=None, hash=namespace_root(""))
        self.roots = {"": self.root}  # salt -> its namespace's root (pageless, parent None)
        self.on_event = on_event
        self._clock = itertools.count(1)
        self.cached_pages = 0
        self.locked_pages = 0  # cached pages some sequence holds (on a locked path): not evictable

    def _pages(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[i : i + ps]) for i in range(0, len(tokens) - ps + 1, ps)]

    def _root(self, salt: str) -> TreeNode:
        if salt not in self.roots:
            self.roots[salt] = TreeNode(key=(), page=-1, parent=None, hash=namespace_root(salt))
        return self.roots[salt]

    def match_prefix(self, tokens: Sequence[int], touch: bool = True, salt: str = "") -> Match:
        """The cached pages of `tokens`' longest cached prefix in `salt`'s namespace.
        Without `touch` it is a look only: the pages keep their place in the eviction order."""
        node, pages = self.roots.get(salt), []
        if node is None:  # nothing was ever cached under this salt
            return Match([], self.root)
        now = next(self._clock) if touch else None
        for key in self._pages(tokens):
            child = node.children.get(key)
            if child is None:
                break
            if now is not None:
                child.last_access = now
            node = child
            pages.append(child.page)
        return Match(pages, node)

    def lock(self, node: TreeNode | None) -> None:
        """Pin `node`'s path against eviction (None, or a namespace's root: a sequence that
        matched nothing yet: no-op)."""
        while node is not None and node.parent is not None:
            node.lock_ref += 1
            self.locked_pages += node.lock_ref == 1
            node = node.parent

    def unlock(self, node: TreeNode | None) -> None:
        while node is not None and node.parent is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unlock without lock"
            self.locked_pages -= node.lock_ref == 0
            node = node.parent

    def insert(self, tokens: Sequence[int], pages: Sequence[int], salt: str = "") -> TreeNode:
        """Take ownership of the full pages of `tokens`, in `salt`'s namespace; duplicates
        go back to the pool.

        Returns the deepest node of the inserted path.
        """
        node, stored, duplicates = self._root(salt), [], []
        now = next(self._clock)
        for key, page in zip(self._pages(tokens), pages, strict=True):  # one page per full page of tokens
            child = node.children.get(key)
            if child is None:
                child = TreeNode(key=key, page=page, parent=node, hash=chain_hash(node.hash, key))
                node.children[key] = child
                self.cached_pages += 1
                stored.append(child.hash)
            elif child.page != page:
                duplicates.append(page)
            child.last_access = now
            node = child
        self.pool.release(duplicates)
        if stored and self.on_event:
            self.on_event(("stored", stored))
        return node

    def evictable_pages(self) -> int:
        """Pages eviction could free now: nodes on no locked path (a parent is evictable
        once its children are, so every unlocked node counts)."""
        return sum(1 for n in self._walk() if n.lock_ref == 0)

    def hashes(self) -> list[int]:
        return [n.hash for n in self._walk()]

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages from unlocked leaves, oldest first."""
        heap = [(n.last_access, id(n), n) for n in self._walk() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        removed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            freed.append(node.page)
            removed.append(node.hash)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
            elif parent.parent is None and not parent.children and parent is not self.root:
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
