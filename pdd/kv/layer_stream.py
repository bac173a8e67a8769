"""A prefill's KV as its forward pass computes it, one layer of one chunk at a time.

P hands an engine a `LayerStream` with the request (`EnginePort.generate`). The engine's
model thread puts each layer's KV of the prompt tokens a step computes as soon as that
layer is computed (`put`); P's senders follow the stream on the event loop and send each
piece while later layers and chunks are still computing, so the line and the relay's
path are busy during the forward. The stream is a log: every sender reads it from its
start, whenever its peer's reservation answers.

Only computed tokens are put: the prefix P's cache served is not (the stream says from
which token on it covers, `first`), and an engine that streams nothing closes the stream
empty; a sender exports what the stream did not cover. A token range put twice (a
preempted prefill computed again) is put once: the later copy is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pdd.kv.codec import KVBlob, token_slice


@dataclass(frozen=True)
class Piece:
    """One layer of tokens [token_start, token_end): `ready` (a thread's wait, None when the
    bytes are there already) must return before they are read: a device's copy in flight."""

    blob: KVBlob
    ready: Callable[[], None] | None = None


class LayerStream:
    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self.pieces: list[Piece] = []
        self.first: int | None = None  # the first token the stream covers (None: not begun)
        self.closed = False
        self._changed = asyncio.Event()
        # (the model thread's own:) where the pieces begin, and each layer's reach so far
        self._floor: int | None = None
        self._high: dict[int, int] = {}

    # ---- the engine's model thread -------------------------------------------------------
    def begin(self, first: int) -> None:
        """The prefill computes from token `first` on (what the prefix cache did not serve)."""
        if self._floor is None:
            self._floor = first
            self._loop.call_soon_threadsafe(self._begun, first)

    def put(self, blob: KVBlob, ready: Callable[[], None] | None = None) -> None:
        """One layer's KV of the tokens a step computed (one layer, `blob.header`)."""
        h = blob.header
        start = max(h.token_start, self._high.get(h.layer_start, self._floor or 0))
        if start >= h.token_end:
            return
        if start > h.token_start:
            blob = token_slice(blob, start, h.token_end)
        self._high[h.layer_start] = h.token_end
        self._loop.call_soon_threadsafe(self._add, Piece(blob, ready))

    # ---- the event loop ------------------------------------------------------------------
    def _begun(self, first: int) -> None:
        self.first = first
        self._changed.set()

    def _add(self, piece: Piece) -> None:
        if not self.closed:
            self.pieces.append(piece)
            self._changed.set()

    def close(self) -> None:
        """No more pieces (the prompt is computed, the request ended, or it streams nothing).
        Call on the loop, after the engine reported the prefill's end: every piece put
        before that report is in by then (both travel in call order on this loop)."""
        self.closed = True
        self._changed.set()

    async def started(self) -> int | None:
        """The first token the stream covers, once known; None if it closed without one."""
        while self.first is None and not self.closed:
            await self._wait()
        return self.first

    async def follow(self) -> AsyncIterator[Piece]:
        """Every piece, from the first, as it comes, until the stream is closed."""
        i = 0
        while True:
            while i < len(self.pieces):
                yield self.pieces[i]
                i += 1
            if self.closed:
                return
            await self._wait()

    async def _wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()
