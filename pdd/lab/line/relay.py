"""The TCP relay: listeners on a set of routes, each accepted connection joined to its
target by two pipes that cross one `EmulatedLine`, in order and at the line's pace."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdd.addresses import parse_addr
from pdd.lab.line.emulated import A_TO_B, B_TO_A, EmulatedLine

log = logging.getLogger(__name__)

# A line's far end accepts little more than what is on the line: without this, loopback
# TCP (which sees no delay) buffers megabytes in the kernel ahead of the line, and a
# sender's later frames (a reservation behind bulk KV) would wait seconds behind them.
RCVBUF_BYTES = 128 * 1024
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Route:
    listen_host: str
    listen_port: int
    target_host: str
    target_port: int

    @classmethod
    def parse(cls, spec: str) -> Route:
        """Parse `LISTEN_HOST:PORT=TARGET_HOST:PORT`."""
        listen, sep, target = spec.partition("=")
        if not sep:
            raise ValueError(f"route {spec!r} is not LISTEN_HOST:PORT=TARGET_HOST:PORT")
        return cls(*parse_addr(listen), *parse_addr(target))


def _listening_socket(host: str, port: int) -> socket.socket:
    """A listener whose connections inherit a small receive buffer (set before listen)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _reset(writer: asyncio.StreamWriter) -> None:
    """Abort a socket with an RST, as a broken line does, rather than a polite FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Pipe:
    """One direction of one relayed connection: read, pace, delay, deliver in order."""

    def __init__(
        self,
        line: EmulatedLine,
        direction: str,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        conn: _RelayedConnection,
    ) -> None:
        self._line = line
        self._direction = direction
        self._src = src
        self._dst = dst
        self._conn = conn
        self._queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()  # b"" marks EOF
        self._inflight = 0
        self._room = asyncio.Event()

    async def read_side(self) -> None:
        last_arrival = 0.0
        while True:
            while self._inflight >= self._line.inflight_limit():
                self._room.clear()
                await self._room.wait()
            data = await self._src.read(self._line.chunk_size())
            # EOF (b"") crosses the line too: behind the data, after the delay
            last_arrival = max(last_arrival, await self._line.transmit(self._direction, len(data)))
            self._inflight += len(data)
            self._queue.put_nowait((last_arrival, data))
            if not data:
                return

    async def write_side(self) -> None:
        while True:
            arrival, data = await self._queue.get()
            await self._line.hold(arrival)
            if self._line.blackholed:
                self._conn.poisoned = True
                self._line.bytes_blackholed += len(data)
            elif data:
                self._dst.write(data)
                await self._dst.drain()
                self._line.count_delivered(self._direction, len(data))
            elif self._dst.can_write_eof():
                self._dst.write_eof()
            self._inflight -= len(data)
            self._room.set()
            if not data:
                return


class _RelayedConnection:
    """A client connection and its upstream twin, joined by two pipes over the line."""

    def __init__(self, line: EmulatedLine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._line = line
        self._client = (reader, writer)
        self._upstream: asyncio.StreamWriter | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._aborted = False
        self.poisoned = False  # bytes were swallowed by a blackhole

    def abort(self) -> None:
        self._aborted = True
        for writer in (self._client[1], self._upstream):
            if writer is not None:
                _reset(writer)
        for task in self._tasks:
            task.cancel()

    async def run(self, target_host: str, target_port: int) -> None:
        """Connect upstream and relay until both directions end; any failure resets both sides."""
        client_reader, client_writer = self._client
        graceful = False
        try:
            try:
                up_reader, upstream = await asyncio.wait_for(
                    asyncio.open_connection(target_host, target_port), CONNECT_TIMEOUT_S
                )
                self._upstream = upstream
            except (TimeoutError, OSError) as err:
                self._line.connect_errors += 1
                log.warning("line: cannot reach %s:%d: %s", target_host, target_port, err)
                return
            if self._aborted:
                return
            pipes = (
                _Pipe(self._line, A_TO_B, client_reader, upstream, self),
                _Pipe(self._line, B_TO_A, up_reader, client_writer, self),
            )
            self._tasks = [asyncio.create_task(p.read_side()) for p in pipes]
            self._tasks += [asyncio.create_task(p.write_side()) for p in pipes]
            for task in self._tasks:
                task.add_done_callback(_log_unexpected)
            done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
            graceful = len(done) == len(self._tasks) and not any(t.cancelled() or t.exception() for t in done)
        finally:
            # close before any await: a cancel (relay stop) may land on the next one
            for task in self._tasks:
                task.cancel()
            for writer in (client_writer, self._upstream):
                if writer is None:
                    continue
                if graceful:
                    writer.close()
                else:
                    _reset(writer)
            if self._tasks:
                await asyncio.wait(self._tasks)


def _log_unexpected(task: asyncio.Task[None]) -> None:
    """Collect a pump's outcome: network errors are routine, anything else is a bug."""
    if not task.cancelled() and (exc := task.exception()) is not None and not isinstance(exc, OSError):
        log.error("line: relay task failed", exc_info=exc)


class LineRelay:
    """The listeners of a set of routes, all crossing one `EmulatedLine`."""

    def __init__(self, line: EmulatedLine, routes: Sequence[Route]) -> None:
        self.line = line
        self.routes = list(routes)
        self.listen_ports: list[int] = []
        self._servers: list[asyncio.Server] = []
        self._relaying: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Listen on every route (port 0 picks a free port; see `listen_ports`)."""
        routes, self.routes = self.routes, []
        try:
            for route in routes:
                await self.add_route(route)
        except BaseException:
            await self.stop()
            raise

    async def add_route(self, route: Route) -> int:
        """Listen on one more route across the same line (an instance that joined); its port."""
        server = await asyncio.start_server(
            lambda r, w: self._on_accept(route, r, w), sock=_listening_socket(route.listen_host, route.listen_port)
        )
        self._servers.append(server)
        self.routes.append(route)
        self.listen_ports.append(server.sockets[0].getsockname()[1])
        return self.listen_ports[-1]

    async def stop(self) -> None:
        """Stop listening and reset every connection this relay carries."""
        for server in self._servers:
            server.close()
        for task in list(self._relaying):
            task.cancel()
        if self._relaying:
            await asyncio.wait(self._relaying, timeout=5)
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()

    def stats(self) -> dict[str, Any]:
        routes = [
            {"listen": f"{r.listen_host}:{port}", "target": f"{r.target_host}:{r.target_port}"}
            for r, port in zip(self.routes, self.listen_ports, strict=True)
        ]
        return {**self.line.stats(), "routes": routes}

    async def _on_accept(self, route: Route, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _RelayedConnection(self.line, reader, writer)
        # relay in a task of our own: stop() cancels it, never asyncio's accept task,
        # whose done-callback (Python 3.11) logs a cancelled accept task as an error
        task = asyncio.create_task(conn.run(route.target_host, route.target_port))
        self._relaying.add(task)
        self.line.register(conn)
        try:
            await asyncio.wait([task])
        finally:
            self.line.unregister(conn)
            self._relaying.discard(task)
