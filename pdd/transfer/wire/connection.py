"""A TCP connection speaking frames: traffic counters, keepalive, the rejection of bad
frames, and the client and server ends.

`FramedConnection.reject` (called by `recv`, and by `serve` for a payload the handler
could not parse) counts a bad frame in the process-wide `REJECTS` and closes the
connection, since a byte stream that has lost its framing cannot be trusted again.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Counter

from pdd.transfer.wire.frame import (
    DEFAULT_MAX_PAYLOAD,
    Frame,
    FrameCodec,
    FrameError,
    MsgType,
    encode_json,
    offered_protocol,
)

log = logging.getLogger(__name__)

MAX_UNAUTHENTICATED = 32  # connections a server holds that have not completed the handshake


class RejectCounter:
    """Process-wide count of rejected frames per error class: a Prometheus counter
    (`pdd_rejected_frames_total{reason}`), registered by each process's metrics, and
    read back for /pdd/stats. prometheus_client's counter is thread-safe, as it must be:
    several event loops (one per thread) may share a process."""

    def __init__(self) -> None:
        self.counter = Counter(
            "pdd_rejected_frames",
            "Inter-instance frames rejected (bad MAC, length, garbage), by the error class",
            ["reason"],
            registry=None,
        )
        for reason in FrameError.__subclasses__():  # each at 0 from the start (a series before its first event)
            self.counter.labels(reason=reason.__name__)

    def record(self, err: FrameError) -> None:
        self.counter.labels(reason=type(err).__name__).inc()

    def snapshot(self) -> dict[str, int]:
        """The count per reason that has any."""
        return {
            s.labels["reason"]: int(s.value)
            for metric in self.counter.collect()
            for s in metric.samples
            if s.name.endswith("_total") and s.value
        }

    def total(self) -> int:
        return sum(self.snapshot().values())


REJECTS = RejectCounter()


class FramedConnection:
    """One TCP connection speaking frames, with traffic counters.

    Sends may come from several tasks at once (a frame is written in one piece, so
    frames never interleave); receives must come from a single task.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, codec: FrameCodec) -> None:
        self._reader = reader
        self._writer = writer
        self._codec = codec
        self.peer: Any = writer.get_extra_info("peername")
        self.bytes_sent = 0
        self.bytes_received = 0
        self.frames_sent = 0
        self.frames_received = 0
        self.rejected: FrameError | None = None
        self.last_heard = time.monotonic()  # when the last whole frame arrived
        self.silent_for: float | None = None  # set when `keepalive` gave up on a silent peer

    async def send(self, msg_type: MsgType, payload: bytes | memoryview = b"") -> None:
        """Write one frame whole (concurrent senders never interleave), then wait for
        the socket buffer to drain, so a slow line pushes back on the producer."""
        self._write(msg_type, payload)
        await self._writer.drain()

    async def send_json(self, msg_type: MsgType, obj: dict[str, Any]) -> None:
        await self.send(msg_type, encode_json(obj))

    async def recv(self) -> Frame:
        """The next frame; on a bad one, reject it (count, drop the connection) and raise."""
        try:
            frame = await self._codec.read(self._reader)
        except FrameError as err:
            self.reject(err)
            raise
        self.bytes_received += len(frame.payload) + self._codec.overhead
        self.frames_received += 1
        self.last_heard = time.monotonic()
        return frame

    async def next_frame(self) -> Frame:
        """The next frame that is not liveness traffic: PINGs are answered here and
        PONGs only count as having heard from the peer."""
        while True:
            frame = await self.recv()
            if frame.type == MsgType.PING:
                self._write(MsgType.PONG, frame.payload)
            elif frame.type != MsgType.PONG:
                return frame

    def _write(self, msg_type: MsgType, payload: bytes | memoryview = b"") -> None:
        """Queue one frame whole without waiting for the buffer to drain (a liveness
        probe must not wait behind a slow line's backlog)."""
        parts = self._codec.encode_parts(msg_type, payload)
        self._writer.writelines(parts)
        self.bytes_sent += sum(len(p) for p in parts)
        self.frames_sent += 1

    async def keepalive(self, interval_s: float, dead_after_s: float) -> None:
        """PING the peer every `interval_s`; if nothing at all has arrived for
        `dead_after_s`, drop the connection, so its reader ends and its owner treats the
        peer as lost. A blackholed line keeps a TCP connection open and silent: without
        this, a dead peer would look healthy until every request on it timed out. The
        peer's reader must use `next_frame` (which answers PINGs)."""
        while not self.closed:
            await asyncio.sleep(interval_s)
            silent = time.monotonic() - self.last_heard
            if silent > dead_after_s:
                self.silent_for = silent
                log.warning("%s silent for %.1f s: dropping the connection", self.peer, silent)
                self.abort()
                return
            self._write(MsgType.PING)

    @property
    def socket(self) -> Any:
        """The underlying socket (for buffer sizes), if any."""
        return self._writer.get_extra_info("socket")

    @property
    def version(self) -> int:
        """The protocol version the connection speaks (a server's end: once the client's HELLO is in)."""
        return self._codec.version or offered_protocol()

    @property
    def codec(self) -> FrameCodec:
        return self._codec

    def reject(self, err: FrameError) -> None:
        """Count a bad frame (or payload) and drop the connection, whose stream is no longer trusted.

        Callers use it too when a payload fails to parse (`BadPayload`); rejecting
        the same error twice counts it once.
        """
        if self.rejected is err:
            return
        self.rejected = err
        REJECTS.record(err)
        log.warning("rejected frame from %s: %s: %s", self.peer, type(err).__name__, err)
        self.close()

    def close(self) -> None:
        self._writer.close()

    def abort(self) -> None:
        """Close at once, dropping unsent data (a flush would wait on a dead line)."""
        self._writer.transport.abort()

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    async def wait_closed(self) -> None:
        """Wait until the socket is closed; a reset while closing is not an error."""
        try:
            await self._writer.wait_closed()
        except ConnectionError:
            pass


async def open_connection(
    host: str,
    port: int,
    key: bytes | None,
    *,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    connect_timeout: float | None = 10.0,
    tls: ssl.SSLContext | None = None,
    version: int | None = None,
) -> FramedConnection:
    """Connect to a frame server (over TLS with `tls`), to speak protocol `version` (default
    the newest this process offers); the timeout, which covers the TLS handshake too,
    keeps a silent WAN from hanging us. `wire.connect` also says HELLO."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=tls), connect_timeout)
    return FramedConnection(reader, writer, FrameCodec(key, max_payload, version or offered_protocol()))


Handler = Callable[[FramedConnection], Awaitable[None]]


async def serve(
    handler: Handler,
    host: str,
    port: int,
    key: bytes | None,
    *,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    tls: ssl.SSLContext | None = None,
    sock: socket.socket | None = None,
) -> asyncio.Server:
    """Start a TCP server that hands every accepted connection to `handler`, listening on
    `host`:`port`, or on `sock` (one bound already: in another network namespace, say).

    A connection whose handler fails — bad frame, peer gone, or a bug — is closed
    and logged; the server keeps serving everyone else.
    """

    pending: set[FramedConnection] = set()  # accepted, not yet authenticated

    async def on_accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = FramedConnection(reader, writer, FrameCodec(key, max_payload, version=None))  # the client's
        pending.difference_update([c for c in pending if c.codec.authenticated or c.closed])
        if key and len(pending) >= MAX_UNAUTHENTICATED:
            log.warning(
                "refused a connection from %s: %d others have not completed the handshake", conn.peer, len(pending)
            )
            conn.close()
            await conn.wait_closed()
            return
        pending.add(conn)
        try:
            await handler(conn)
        except FrameError as err:
            conn.reject(err)  # a no-op when recv() already rejected it
        except ConnectionError as err:
            log.debug("connection from %s ended: %s", conn.peer, err)
        except TimeoutError:
            log.warning("connection from %s dropped: no complete handshake in time", conn.peer)
        except Exception:
            log.exception("handler for %s failed", conn.peer)
        finally:
            pending.discard(conn)
            conn.close()
            await conn.wait_closed()

    if sock is not None:
        return await asyncio.start_server(on_accept, sock=sock, ssl=tls)
    return await asyncio.start_server(on_accept, host, port, ssl=tls)
