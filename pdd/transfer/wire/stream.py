"""A connection's incoming bytes, read by the kernel straight into the buffer they end in.

asyncio's `StreamReader` copies every byte three times on its way to a frame (the
transport's `recv` into a new bytes object, that into the reader's buffer, the frame
out of it, and the rest moved down), and with its default limit stops and restarts the
transport every 128 KiB. `FrameStream` is a buffered protocol instead: a frame's header
and small payloads land in one staging buffer and are copied out of it once; a large
payload is read by `recv_into` directly into a buffer of its size. On loopback between
two processes that took pdd's 4 MiB frames from about 0.35 GB/s to BENCHMARKS.md's
figure ("KV over a long line"). It is the write side's protocol too: asyncio's
`StreamWriter` drains and closes through it.
"""

from __future__ import annotations

import asyncio
import sys
from asyncio.streams import FlowControlMixin
from collections.abc import Callable, Coroutine
from typing import Any

STAGING_BYTES = 256 * 1024  # headers and small payloads land here
DIRECT_MIN_BYTES = 64 * 1024  # a read of at least this goes straight into a buffer of its own
SPARE_BUFFERS = 4  # a stream's large-read buffers kept for reuse once nobody holds them
SPARE_MAX_BYTES = 4 << 20  # (larger ones are not kept)
# a large read's buffer is this size's next multiple: frames a few bytes apart (a KV frame's
# header grows with its chunk's block hashes) reuse one another's buffers
BUFFER_STEP_BYTES = 64 * 1024

OnConnect = Callable[["FrameStream", asyncio.StreamWriter], Coroutine[Any, Any, None]]


class FrameStream(FlowControlMixin, asyncio.BufferedProtocol):
    """`readexactly(n)` as `asyncio.StreamReader` has it (the same errors: the peer gone
    part-way raises `IncompleteReadError`, a reset its own error); one reader at a time.
    `on_connect`: on a server, the task each accepted connection runs, with this stream
    and its writer."""

    def __init__(self, on_connect: OnConnect | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        super().__init__(self._loop)
        self._staging = bytearray(STAGING_BYTES)
        self._view = memoryview(self._staging)
        self._start = self._end = 0  # staged bytes not yet read: [start, end)
        self._direct: memoryview | None = None  # a large read's own buffer, while it fills
        self._filled = 0
        self._reading_direct = False  # the last buffer handed out was the large read's
        self._discarding = False  # the last buffer handed out was scratch
        self._scratch = memoryview(bytearray(4096))
        self._spare: list[bytearray] = []  # large-read buffers handed out, newest last
        self._want = 0  # staged bytes the reader waits for
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._error: BaseException | None = None
        self._reading_paused = False
        self._closed: asyncio.Future[None] = self._loop.create_future()
        self._on_connect = on_connect
        self._task: asyncio.Task | None = None  # (held: the loop keeps tasks only weakly)
        self.transport: Any = None

    # ---- the protocol (called by the transport) ----------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        if self._on_connect is not None:
            writer = asyncio.StreamWriter(transport, self, None, self._loop)
            self._task = self._loop.create_task(self._on_connect(self, writer))

    def get_buffer(self, sizehint: int) -> memoryview:
        # (a large read's buffer may be full and its reader not yet woken: what comes next is staged)
        self._reading_direct = self._direct is not None and self._filled < len(self._direct)
        if self._reading_direct:
            assert self._direct is not None
            return self._direct[self._filled :]
        if self._end == STAGING_BYTES and self._start:  # move what is unread to the front
            n = self._end - self._start
            self._view[:n] = self._view[self._start : self._end]
            self._start, self._end = 0, n
        self._discarding = self._end == STAGING_BYTES  # full, yet read: a closing transport ignores a pause
        return self._scratch if self._discarding else self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._reading_direct:
            self._filled += nbytes
            if self._filled == len(self._direct or b""):
                self._wake()
            return
        if self._discarding:  # (nobody reads a closing connection)
            return
        self._end += nbytes
        if self._end - self._start >= self._want:
            self._wake()
        if self._end == STAGING_BYTES and not self._start:  # full: the reader must take some first
            self._pause()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)  # (wakes a writer waiting to drain)
        self._eof = True
        self._error = exc
        self._wake()
        if not self._closed.done():
            self._closed.set_result(None)

    def _get_close_waiter(self, stream: asyncio.StreamWriter) -> asyncio.Future[None]:
        return self._closed  # (`StreamWriter.wait_closed` waits on it)

    # ---- the reader ----------------------------------------------------------------------
    async def readexactly(self, n: int) -> bytes | memoryview:
        while self._end - self._start < n:
            if n >= DIRECT_MIN_BYTES:
                return await self._read_direct(n)
            if self._eof:
                raise self._incomplete(n)
            self._want = n
            self._resume()
            await self._wait()
        out = bytes(self._view[self._start : self._start + n])
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        self._resume()
        return out

    def _buffer(self, n: int) -> bytearray:
        """A buffer for a large read of `n` bytes, `n` rounded up to `BUFFER_STEP_BYTES`: one
        this stream handed out before that nobody holds any more (its reader dropped it and
        every view of it: CPython's reference count says so), else a new one. A new buffer a
        frame is zeroed and its memory cold: that cost the receiver about as much again as
        the kernel's copy."""
        size = -(-n // BUFFER_STEP_BYTES) * BUFFER_STEP_BYTES
        for buf in self._spare:
            if len(buf) == size and sys.getrefcount(buf) == 3:  # (the list's, `buf`, the call's)
                return buf
        buf = bytearray(size)
        if size <= SPARE_MAX_BYTES:
            self._spare = [*self._spare[1 - SPARE_BUFFERS :], buf]
        return buf

    async def _read_direct(self, n: int) -> memoryview:
        """The next `n` bytes, read straight into a buffer of their own (`_buffer`), as a view
        of its first `n` bytes: the buffer is free for reuse once that view and every view
        of it are dropped."""
        buf = self._buffer(n)
        have = self._end - self._start
        buf[:have] = self._view[self._start : self._end]
        self._start = self._end = 0
        view = memoryview(buf)[:n]
        self._direct, self._filled = view, have
        try:
            while self._filled < n:
                if self._eof:
                    raise self._incomplete(n, bytes(buf[: self._filled]))
                self._resume()
                await self._wait()
        finally:
            self._direct = None
        return view

    def _incomplete(self, n: int, partial: bytes | None = None) -> BaseException:
        if self._error is not None:
            return self._error
        if partial is None:
            partial = bytes(self._view[self._start : self._end])
        return asyncio.IncompleteReadError(partial, n)

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _pause(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self._reading_paused and self.transport is not None and not self.transport.is_closing():
            self._reading_paused = False
            self.transport.resume_reading()
