"""Outbound connections from one instance to others: P to its decode side, RLD to MD.

One shared framed connection per peer (through the WAN emulator when the peer is in
the other datacenter), opened on first use. Each has a reader task that hands every
frame to the owner's callback; when the connection drops, the owner hears it once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pdd.config import Deployment, InstanceSpec
from pdd.transfer import wire
from pdd.transfer.wire import FramedConnection

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 10.0

OnFrame = Callable[[str, wire.Frame], Awaitable[None]]
OnLost = Callable[[str], None]


class PeerPool:
    def __init__(self, spec: InstanceSpec, dep: Deployment, key: bytes, on_frame: OnFrame, on_lost: OnLost) -> None:
        self._spec, self._dep, self._key = spec, dep, key
        self._on_frame, self._on_lost = on_frame, on_lost
        self._conns: dict[str, FramedConnection] = {}
        self._lock = asyncio.Lock()
        self._readers: set[asyncio.Task] = set()

    def remote(self, name: str) -> bool:
        """Whether traffic to `name` crosses the line between datacenters."""
        return self._dep.instance(name).dc != self._spec.dc

    async def get(self, name: str) -> FramedConnection:
        async with self._lock:
            conn = self._conns.get(name)
            if conn is not None and not conn.closed:
                return conn
            host, port = self._dep.address(self._dep.instance(name), self._spec.dc)
            conn = await wire.open_connection(host, port, self._key)
            try:
                await asyncio.wait_for(wire.client_handshake(conn, {"role": self._spec.role, "name": self._spec.name}),
                                       HELLO_TIMEOUT_S)
            except BaseException:
                conn.close()
                raise
            self._conns[name] = conn
            task = asyncio.ensure_future(self._read(name, conn))
            self._readers.add(task)
            task.add_done_callback(self._readers.discard)
            return conn

    async def _read(self, name: str, conn: FramedConnection) -> None:
        try:
            while True:
                await self._on_frame(name, await conn.recv())
        except (ConnectionError, wire.FrameError) as e:
            log.warning("connection to %s lost: %s", name, e)
        except Exception:
            log.exception("handling a frame from %s failed", name)
        finally:
            if self._conns.get(name) is conn:
                del self._conns[name]
            conn.close()
            self._on_lost(name)

    def close(self) -> None:
        for task in list(self._readers):
            task.cancel()
        for conn in self._conns.values():
            conn.close()
