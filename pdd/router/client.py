"""The router's connection to one instance: requests out, tokens and cache events in.

One long-lived framed connection per instance (through the WAN when the instance is in
the other datacenter). Every frame that names a request goes to that request's queue;
cache events feed the mirror. When the connection drops, every request waiting on it
gets an error at once — a dead instance must never leave a client hanging — and the
client reconnects in the background.
"""

from __future__ import annotations

import asyncio
import logging

from pdd.config import InstanceSpec
from pdd.router.mirror import CacheMirror
from pdd.transfer import wire
from pdd.transfer.wire import FramedConnection, MsgType

log = logging.getLogger(__name__)


class InstanceDown(ConnectionError):
    pass


class InstanceClient:
    def __init__(self, spec: InstanceSpec, host: str, port: int, key: bytes) -> None:
        self.spec = spec
        self.name = spec.name
        self.addr = (host, port)
        self.key = key
        self.mirror = CacheMirror(spec.engine.page_size)
        self.queued_tokens = 0  # work assigned by this router and not finished
        self.conn: FramedConnection | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def healthy(self) -> bool:
        return self.conn is not None and not self.conn.closed

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        if self.conn:
            self.conn.close()

    async def wait_ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout)

    def register(self, rid: str, q: asyncio.Queue) -> None:
        self._queues[rid] = q

    def unregister(self, rid: str) -> None:
        self._queues.pop(rid, None)

    async def send(self, kind: MsgType, msg: dict) -> None:
        if not self.healthy:
            raise InstanceDown(f"instance {self.name} is not connected")
        try:
            await self.conn.send_json(kind, msg)
        except (ConnectionError, RuntimeError) as e:
            raise InstanceDown(f"instance {self.name}: {e}") from None

    async def _run(self) -> None:
        backoff = 0.2
        while True:
            conn = None
            try:
                conn = await wire.open_connection(*self.addr, self.key, connect_timeout=5.0)
                await asyncio.wait_for(wire.client_handshake(conn, {"role": "router"}), 10.0)
                self.conn, backoff = conn, 0.2
                log.info("connected to %s at %s:%s", self.name, *self.addr)
                await self._read(conn)
            except asyncio.CancelledError:
                raise
            except (OSError, asyncio.TimeoutError, wire.FrameError) as e:
                log.warning("instance %s: %s", self.name, e)
            except Exception:  # a malformed message: drop the connection, never the client
                log.exception("instance %s sent something unusable", self.name)
            finally:
                if conn is not None:
                    conn.close()
                self._ready.clear()
                self.conn = None
                self.mirror.stale = True
                self._fail_all(f"lost the connection to instance {self.name}")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _read(self, conn: FramedConnection) -> None:
        resync_asked = False
        while True:
            frame = await conn.recv()
            msg = frame.json()
            if frame.type == MsgType.CACHE_EVENT:
                if msg.get("kind") == "snapshot":
                    resync_asked = False
                    self._ready.set()
                if not self.mirror.apply(msg) and not resync_asked:  # one request per gap
                    resync_asked = True
                    await conn.send_json(MsgType.CACHE_EVENT, {"kind": "snapshot_request"})
                continue
            q = self._queues.get(str(msg.get("rid")))
            if q is not None:
                q.put_nowait((self.name, frame.type, msg))

    def _fail_all(self, reason: str) -> None:
        for q in self._queues.values():
            q.put_nowait((self.name, MsgType.ERROR, {"message": reason, "lost": True}))
