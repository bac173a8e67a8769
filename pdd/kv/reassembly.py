"""A request's KV as it arrives at the decode side: one or more layers of one chunk a frame, over
several connections (`pdd.instance.peers` stripes urgent KV), so in any order. Chunks are
gathered by their first token, each layer by layer until whole; whole chunks are handed
out for import in token order, from the first token the receiver lacked on."""

from __future__ import annotations

from pdd.kv.codec import KVBlob, KVFormatError, join_layers


class Reassembly:
    def __init__(self, start: int, end: int) -> None:
        """The KV of prompt tokens [start, end) is expected (from the reserved hit on)."""
        self.next = start  # the first token not yet handed out for import
        self.end = end
        self._chunks: dict[int, list[KVBlob]] = {}  # by first token: layers in so far
        self._whole: dict[int, KVBlob] = {}  # whole, behind a chunk still arriving

    @property
    def complete(self) -> bool:
        """Every expected token's KV has been handed out."""
        return self.next >= self.end

    def add(self, blob: KVBlob) -> list[KVBlob]:
        """Take one layer slice (or several); the chunks that it lets through, whole and in
        token order. KVFormatError for KV not expected: tokens handed out already or
        outside the range, or layers that repeat or do not fit their chunk."""
        h = blob.header
        if not (self.next <= h.token_start < h.token_end <= self.end) or h.token_start in self._whole:
            raise KVFormatError(f"KV of tokens [{h.token_start}, {h.token_end}) is not expected here")
        layers = self._chunks.setdefault(h.token_start, [])
        layers.append(blob)
        if sum(b.header.layer_end - b.header.layer_start for b in layers) < h.num_layers:
            return []
        del self._chunks[h.token_start]
        self._whole[h.token_start] = join_layers(sorted(layers, key=lambda b: b.header.layer_start))
        out = []
        while self.next in self._whole:
            whole = self._whole.pop(self.next)
            self.next = whole.header.token_end
            out.append(whole)
        return out
