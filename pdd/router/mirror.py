"""The router's copy of one instance's radix cache, kept from its cache events.

It only estimates: the instance's reservation is the truth. Events carry sequence
numbers; a gap means a lost event, so the mirror declares itself stale until the next
snapshot rather than guess.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdd.kv.blocks import block_hashes
from pdd.transfer.messages import CacheUpdate


class CacheMirror:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.hashes: set[int] = set()
        self.seq = 0
        self.stale = True
        self.gaps = 0

    def apply(self, event: CacheUpdate) -> bool:
        """Apply one event; False when the mirror needs a fresh snapshot."""
        kind, seq, hashes = event.kind, event.seq, event.hashes
        if kind == "snapshot":
            self.hashes = set(hashes)
            self.page_size = event.page_size or self.page_size
            self.seq, self.stale = seq, False
            return True
        if self.stale:
            return False
        if seq <= self.seq:  # already in the snapshot
            return True
        if seq != self.seq + 1:
            self.gaps += 1
            self.stale = True
            return False
        self.seq = seq
        if kind == "stored":
            self.hashes.update(hashes)
        elif kind == "removed":
            self.hashes.difference_update(hashes)
        return True

    def predicted_hit(self, prompt: Sequence[int], salt: str = "") -> int:
        """Tokens a reservation would lock: full pages of prompt[:-1] held in order, in
        `salt`'s namespace."""
        if self.stale:
            return 0
        hit = 0
        for h in block_hashes(prompt[: len(prompt) - 1], self.page_size, salt):
            if h not in self.hashes:
                break
            hit += self.page_size
        return hit
