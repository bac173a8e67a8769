"""Outbound connections from one instance to others: P to its decode side, RLD to MD.

Three framed connections per peer (through the WAN emulator when the peer is in the
other datacenter), opened on first use: control, for small frames (reservations,
handoffs, aborts); urgent KV, on a request's critical path (P -> MD, the relay's
copy); and background KV (MD's copy behind a relay). A reservation never waits behind
megabytes of KV, and background frames hold back while urgent ones are being sent;
the KV connections keep few unsent bytes in the kernel (TCP_NOTSENT_LOWAT), so what
waits, waits here, while their windows grow to the line's bandwidth-delay product. Each
connection's reader hands every body, typed, to the owner; when one drops, the owner hears.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pdd
from pdd.config import Deployment, InstanceSpec
from pdd.policy.transfer import Priority
from pdd.tasks import Tasks
from pdd.transfer import messages as m
from pdd.transfer import wire
from pdd.transfer.tls import client_context
from pdd.transfer.wire import FramedConnection

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 10.0
# A KV connection's unsent bytes in the kernel, at most: what waits, waits in userspace,
# where background KV yields to urgent KV frame by frame. Not a cap on the send buffer:
# that (SO_SNDBUF 64 KiB, until 0.2) also capped the bytes in flight, to 128 KiB a round
# trip, 4.4 MB/s through a 2 Gbit/s lab line at 20 ms (tests/test_line_delay.py), where
# autotuning carries 232 MB/s. Bytes in flight grow with the window, as TCP grows it.
BULK_NOTSENT_LOWAT = 128 * 1024
CHANNEL_NAMES = {Priority.CONTROL: "control", Priority.URGENT: "urgent", Priority.BACKGROUND: "background"}

OnBody = Callable[[str, Any], Awaitable[None]]
OnLost = Callable[[str], None]


class _Yield:
    """Background frames wait while urgent ones are being sent to the same peer."""

    def __init__(self) -> None:
        self.urgent = 0
        self.quiet = asyncio.Event()
        self.quiet.set()


class PeerPool:
    def __init__(
        self, spec: InstanceSpec, deployment: Callable[[], Deployment], key: bytes, on_body: OnBody, on_lost: OnLost
    ) -> None:
        self._spec, self._deployment, self._key = spec, deployment, key  # (read at use: instances join)
        self._tls = client_context(deployment().tls)
        self._on_body, self._on_lost = on_body, on_lost
        # keyed by (peer, Priority.CONTROL / Priority.URGENT / Priority.BACKGROUND)
        self._conns: dict[tuple[str, Priority], FramedConnection] = {}
        self._yields: dict[str, _Yield] = {}
        self._lock = asyncio.Lock()
        self._tasks = Tasks()  # readers and heartbeats

    def remote(self, name: str) -> bool:
        """Whether traffic to `name` crosses the line between datacenters."""
        return self._deployment().instance(name).dc != self._spec.dc

    async def get(self, name: str, channel: Priority = Priority.CONTROL) -> FramedConnection:
        async with self._lock:
            conn = self._conns.get((name, channel))
            if conn is not None and not conn.closed:
                return conn
            dep = self._deployment()
            host, port = dep.address(dep.instance(name), self._spec.dc)
            hello = m.Hello(self._spec.role, self._spec.name, channel=CHANNEL_NAMES[channel], software=pdd.__version__)
            conn, _ = await wire.connect(
                host, port, self._key, functools.partial(m.to_dict, hello), tls=self._tls, hello_timeout=HELLO_TIMEOUT_S
            )
            if channel != Priority.CONTROL:
                sock = conn.socket
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, BULK_NOTSENT_LOWAT)
            self._conns[(name, channel)] = conn
            self._tasks.spawn(self._read(name, channel, conn))
            if channel == Priority.CONTROL:
                live = self._deployment().liveness
                self._tasks.spawn(conn.keepalive(live.heartbeat_s, live.dead_after_s))
            return conn

    async def send(self, name: str, body: Any) -> None:
        await m.send(await self.get(name), body)

    async def send_bulk(
        self, name: str, priority: Priority, body: Any = None, kv: tuple[str, bytes] | None = None
    ) -> int:
        """One frame on the Priority.URGENT or Priority.BACKGROUND connection: a body (ordered after the KV
        sent before it there) or a KV layer `(rid, blob)`; the payload bytes sent."""
        conn = await self.get(name, priority)
        y = self._yields.setdefault(name, _Yield())
        if priority == Priority.BACKGROUND:
            # woken by the end of one urgent frame, it is no turn if the next has begun: a
            # transfer sends frame after frame, and a stale wake-up would slip one in between
            while y.urgent:
                await y.quiet.wait()
        else:
            y.urgent += 1
            y.quiet.clear()
        try:
            if kv is not None:
                return await m.send_kv(conn, *kv)
            await m.send(conn, body)
            return 0
        finally:
            if priority != Priority.BACKGROUND:
                y.urgent -= 1
                if not y.urgent:
                    y.quiet.set()

    async def _read(self, name: str, channel: Priority, conn: FramedConnection) -> None:
        try:
            while True:
                frame = await conn.next_frame()
                try:
                    body = m.decode(frame)
                except m.BadMessage as e:  # a peer's bug, not a reason to drop the connection
                    log.warning("bad reply from %s: %s", name, e)
                    continue
                await self._on_body(name, body)
        except (ConnectionError, wire.FrameError) as e:
            log.warning("connection to %s lost: %s", name, e)
        except Exception:
            log.exception("handling a frame from %s failed", name)
        finally:
            if self._conns.get((name, channel)) is conn:
                del self._conns[(name, channel)]
            conn.close()
            if channel == Priority.CONTROL and conn.silent_for:  # the peer is gone: so are its KV connections
                for ch in (Priority.URGENT, Priority.BACKGROUND):
                    other = self._conns.pop((name, ch), None)
                    if other is not None:
                        other.abort()
            self._on_lost(name)

    def close(self) -> None:
        self._tasks.cancel_all()
        for conn in self._conns.values():
            conn.close()
