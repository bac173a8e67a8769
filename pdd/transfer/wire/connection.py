"""A TCP connection speaking frames: traffic counters, keepalive, the rejection of bad
frames, and the client and server ends.

`FramedConnection.reject` (called by `recv`, and by `serve` for a payload the handler
could not parse) counts a bad frame in the process-wide `REJECTS` and closes the
connection, since a byte stream that has lost its framing cannot be trusted again.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import socket
import ssl
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Counter

from pdd.transfer.wire.frame import (
    DEFAULT_MAX_PAYLOAD,
    Buffer,
    ByteSource,
    Frame,
    FrameCodec,
    FrameError,
    MsgType,
    Payload,
    offered_protocol,
)
from pdd.transfer.wire.payload import encode_json
from pdd.transfer.wire.stream import FrameStream

log = logging.getLogger(__name__)

MAX_UNAUTHENTICATED = 32  # connections a server holds that have not completed the handshake
SIOCOUTQNSD = 0x894B  # linux/sockios.h: a TCP socket's unsent bytes
SIOCOUTQ = 0x5411  # (TIOCOUTQ) its unsent and unacknowledged bytes: all it has not delivered


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

    def subkey(self, label: bytes, sending: bool) -> bytes | None:
        """A key of this connection's for `label` (`FrameCodec.subkey`)."""
        return self._codec.subkey(label, sending)

    def __init__(self, reader: ByteSource, writer: asyncio.StreamWriter, codec: FrameCodec) -> None:
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
        sock = writer.get_extra_info("socket")
        # plain TCP: frames may go to the kernel by `writev` (`_write`); under TLS only the transport writes
        self._fd = sock.fileno() if sock is not None and writer.get_extra_info("sslcontext") is None else -1

    async def send(self, msg_type: MsgType, payload: Payload = b"") -> None:
        """Write one frame whole (concurrent senders never interleave), then wait for
        the socket buffer to drain, so a slow line pushes back on the producer."""
        self.post(msg_type, payload)
        await self.drain()

    async def drain(self) -> None:
        """Wait until what is queued has gone into the kernel, but for a little."""
        await self._writer.drain()

    def unsent(self, unacked: bool = False) -> int:
        """Bytes written to the socket that the kernel has not yet sent (SIOCOUTQNSD), or,
        with `unacked`, not yet had acknowledged (SIOCOUTQ: in flight on the line too)."""
        sock = self.socket
        if sock is None or self.closed:
            return 0
        try:
            request = SIOCOUTQ if unacked else SIOCOUTQNSD
            return int.from_bytes(fcntl.ioctl(sock.fileno(), request, bytes(4)), sys.byteorder, signed=True)
        except OSError:
            return 0

    async def writable(self) -> None:
        """Wait until the kernel would take more, by its own measure: with TCP_NOTSENT_LOWAT
        set, until its unsent bytes are under that. (A write goes straight into the
        kernel while the send buffer, autotuned to megabytes, has room; only polling
        honours the mark.) The socket is polled through a duplicate of its descriptor,
        since the transport's own is registered already."""
        sock = self.socket
        if sock is None or self.closed:
            return
        loop = asyncio.get_running_loop()
        fd = os.dup(sock.fileno())
        ready = loop.create_future()
        loop.add_writer(fd, _settle, ready)
        try:
            while not self.closed:  # (the duplicate keeps a socket the transport closed alive)
                try:
                    await asyncio.wait_for(asyncio.shield(ready), 1.0)
                    return
                except TimeoutError:
                    continue
        finally:
            loop.remove_writer(fd)
            os.close(fd)

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
                self.post(MsgType.PONG, frame.payload)
            elif frame.type != MsgType.PONG:
                return frame

    def post(self, msg_type: MsgType, payload: Payload = b"") -> None:
        """Queue one frame whole without waiting for the buffer to drain (a liveness
        probe must not wait behind a slow line's backlog; a striped sender drains each
        stream while it fills the next)."""
        parts = self._codec.encode_parts(msg_type, payload)
        self._write(parts)
        self.bytes_sent += sum(len(p) for p in parts)
        self.frames_sent += 1

    def _write(self, parts: list[Buffer]) -> None:
        """Hand a frame's parts to the kernel in one `writev` where the transport holds
        nothing unsent (ordering is kept) and the socket is plain TCP; only what the
        kernel did not take goes through the transport. asyncio 3.11's `writelines`
        joins the parts into one new bytes object first: a 4 MiB copy a KV frame."""
        transport = self._writer.transport
        if self._fd < 0 or transport.get_write_buffer_size() or transport.is_closing():
            self._writer.writelines(parts)
            return
        try:
            sent = os.writev(self._fd, parts)
        except OSError:  # (would block, or a broken connection: the transport's own write reports it)
            sent = 0
        for part in parts:
            if sent >= len(part):
                sent -= len(part)
                continue
            self._writer.write(memoryview(part)[sent:] if sent else part)
            sent = 0

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
            self.post(MsgType.PING)

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
    keeps a silent line from hanging us. `wire.connect` also says HELLO."""
    loop = asyncio.get_running_loop()
    transport, stream = await asyncio.wait_for(
        loop.create_connection(FrameStream, host, port, ssl=tls), connect_timeout
    )
    writer = asyncio.StreamWriter(transport, stream, None, loop)
    return FramedConnection(stream, writer, FrameCodec(key, max_payload, version or offered_protocol()))


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


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

    async def on_accept(reader: FrameStream, writer: asyncio.StreamWriter) -> None:
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
        except asyncio.CancelledError:  # the loop is closing: end quietly (asyncio 3.11's stream
            conn.abort()  # callback logs a cancelled connection task as an error)
            return
        finally:
            pending.discard(conn)
            conn.close()
        await conn.wait_closed()

    loop = asyncio.get_running_loop()
    if sock is not None:
        return await loop.create_server(lambda: FrameStream(on_accept), sock=sock, ssl=tls)
    return await loop.create_server(lambda: FrameStream(on_accept), host, port, ssl=tls)
