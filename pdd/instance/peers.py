"""Outbound connections from one instance to others: P to its decode side, RLD to MD.

Two framed connections per peer (through the WAN emulator when the peer is in the
other datacenter), opened on first use: a control one for small frames
(reservations, handoffs, aborts) and a bulk one for KV, so a reservation never waits
behind megabytes of someone else's KV. On the bulk connection frames take turns
through a priority gate, urgent transfers (on a request's critical path) before
background ones (MD's copy behind a relay), and the kernel's send buffer is kept
small so the queue stays here where the gate can order it. Each connection's reader
hands every frame to the owner; when one drops, the owner hears it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from pdd.config import Deployment, InstanceSpec
from pdd.transfer import messages as m
from pdd.transfer import wire
from pdd.transfer.wire import FramedConnection

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 10.0
BULK_SNDBUF = 128 * 1024
URGENT, BACKGROUND = 0, 1

OnFrame = Callable[[str, wire.Frame], Awaitable[None]]
OnLost = Callable[[str], None]


class PriorityGate:
    """One sender at a time; waiting senders go by priority, then arrival."""

    def __init__(self) -> None:
        self._busy = False
        self._waiting: list[tuple[int, int, asyncio.Future]] = []
        self._order = itertools.count()

    async def acquire(self, priority: int) -> None:
        if not self._busy and not self._waiting:
            self._busy = True
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._order), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # the turn was ours: pass it on
                self.release()
            raise

    def release(self) -> None:
        while self._waiting:
            _, _, fut = heapq.heappop(self._waiting)
            if not fut.done():
                fut.set_result(None)
                return
        self._busy = False


class PeerPool:
    def __init__(self, spec: InstanceSpec, dep: Deployment, key: bytes, on_frame: OnFrame, on_lost: OnLost) -> None:
        self._spec, self._dep, self._key = spec, dep, key
        self._on_frame, self._on_lost = on_frame, on_lost
        self._conns: dict[tuple[str, bool], FramedConnection] = {}  # (peer, bulk)
        self._gates: dict[str, PriorityGate] = {}
        self._lock = asyncio.Lock()
        self._readers: set[asyncio.Task] = set()

    def remote(self, name: str) -> bool:
        """Whether traffic to `name` crosses the line between datacenters."""
        return self._dep.instance(name).dc != self._spec.dc

    async def get(self, name: str, bulk: bool = False) -> FramedConnection:
        async with self._lock:
            conn = self._conns.get((name, bulk))
            if conn is not None and not conn.closed:
                return conn
            host, port = self._dep.address(self._dep.instance(name), self._spec.dc)
            conn = await wire.open_connection(host, port, self._key)
            if bulk:
                sock = conn.socket
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BULK_SNDBUF)
            try:
                await asyncio.wait_for(wire.client_handshake(conn, {"role": self._spec.role, "name": self._spec.name}),
                                       HELLO_TIMEOUT_S)
            except BaseException:
                conn.close()
                raise
            self._conns[(name, bulk)] = conn
            task = asyncio.ensure_future(self._read(name, bulk, conn))
            self._readers.add(task)
            task.add_done_callback(self._readers.discard)
            return conn

    async def send(self, name: str, body: Any) -> None:
        await m.send(await self.get(name), body)

    async def send_bulk(self, name: str, priority: int, body: Any = None, kv: tuple[str, bytes] | None = None) -> int:
        """One frame on the bulk connection in priority order: a body (ordered after the
        KV before it) or a KV layer `(rid, blob)`; the payload bytes sent."""
        conn = await self.get(name, bulk=True)
        gate = self._gates.setdefault(name, PriorityGate())
        await gate.acquire(priority)
        try:
            if kv is not None:
                return await m.send_kv(conn, *kv)
            await m.send(conn, body)
            return 0
        finally:
            gate.release()

    async def _read(self, name: str, bulk: bool, conn: FramedConnection) -> None:
        try:
            while True:
                await self._on_frame(name, await conn.recv())
        except (ConnectionError, wire.FrameError) as e:
            log.warning("connection to %s lost: %s", name, e)
        except Exception:
            log.exception("handling a frame from %s failed", name)
        finally:
            if self._conns.get((name, bulk)) is conn:
                del self._conns[(name, bulk)]
            conn.close()
            self._on_lost(name)

    def close(self) -> None:
        for task in list(self._readers):
            task.cancel()
        for conn in self._conns.values():
            conn.close()
