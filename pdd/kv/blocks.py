"""Chained block hashes: the identity of a token prefix, cheap to compare remotely.

Hash i covers tokens [0, (i+1)*block_size): equal hash i means an equal prefix, so
two instances (or a router and an instance) can agree on what is cached by
exchanging 8-byte numbers instead of token lists.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0
HASH_BLOCK = 16  # tokens per chained hash in exported KV headers, whatever the exporter's page size


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent))
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "little")


def namespace_root(salt: str) -> int:
    """The hash a chain starts from in the prefix-cache namespace of `salt`
    (`SamplingParams.cache_salt`): ROOT_HASH for the shared one, else a hash of the salt,
    so no prompt's chain in one namespace equals any in another."""
    if not salt:
        return ROOT_HASH
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8, person=b"pdd-salt").digest(), "little")


def block_hashes(tokens: Sequence[int], block_size: int, salt: str = "") -> list[int]:
    """Hashes of every full block of `tokens` (a partial tail block has no hash), chained
    from the root of `salt`'s namespace."""
    out: list[int] = []
    parent = namespace_root(salt)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(parent, tokens[start : start + block_size])
        out.append(parent)
    return out


class PrefixHashes:
    """The chained hashes of `tokens`' blocks, computed as far as asked and kept: a request
    whose KV is imported chunk by chunk checks each chunk's hashes against these, and
    recomputing the chain from the first token for each chunk made a long prompt's checks
    quadratic (a 64K-token prompt's chain takes milliseconds, and it has a thousand chunks)."""

    def __init__(self, tokens: Sequence[int], block_size: int = HASH_BLOCK) -> None:
        self.tokens, self.block_size = tokens, block_size
        self._hashes: list[int] = []

    def upto(self, end: int) -> list[int]:
        """The hashes of every full block of tokens [0, end)."""
        n, size = end // self.block_size, self.block_size
        parent = self._hashes[-1] if self._hashes else ROOT_HASH
        for i in range(len(self._hashes), n):
            parent = chain_hash(parent, self.tokens[i * size : (i + 1) * size])
            self._hashes.append(parent)
        return self._hashes[:n]
