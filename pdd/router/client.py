"""The router's connection to one instance: requests out, tokens and cache events in.

One long-lived framed connection per instance (through the line when the instance is in
the other datacenter). Every body that names a request goes to that request's queue
as (instance name, body); cache events feed the mirror. When the connection drops,
every request waiting on it gets a "lost" error at once — a dead instance must never
leave a client hanging — and the client reconnects in the background. Heartbeats
(`FramedConnection.keepalive`) turn a silent instance (a blackholed line, a hung
process) into a dropped connection within `[liveness] dead_after_s`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from collections.abc import Callable
from typing import assert_never

import pdd
from pdd.config import InstanceSpec, LivenessSpec
from pdd.names import RoleName
from pdd.router.mirror import CacheMirror
from pdd.transfer import messages as m
from pdd.transfer import wire
from pdd.transfer.wire import FramedConnection

log = logging.getLogger(__name__)


class InstanceDown(ConnectionError):
    pass


class InstanceClient:
    def __init__(
        self,
        spec: InstanceSpec,
        host: str,
        port: int,
        key: bytes,
        router_id: str,
        liveness: LivenessSpec = LivenessSpec(),
        roster: Callable[[], list[m.Member]] | None = None,
        on_left: Callable[[InstanceClient], None] | None = None,
        tls: ssl.SSLContext | None = None,
        on_result: Callable[[m.Result], None] | None = None,
        on_member: Callable[[m.Member], None] | None = None,
    ) -> None:
        self.spec = spec
        self.liveness = liveness
        self._roster = roster  # the deployment's members, told to the instance on every connect
        self._on_left = on_left  # called once a draining instance's connection ends
        # every RESULT, also one arriving after its request ended (the relay finished it while
        # P's copy to MD still crossed): the bytes crossed all the same
        self._on_result = on_result
        self._on_member = on_member  # a member the instance knows of (one that joined through another router)
        self.kv_open: set[str] = set()  # submitted to this P, its RESULT not in yet
        self.draining = False  # no new work goes here
        self.refusing = False  # the instance said it takes no new work (a DRAIN back): until it reconnects
        self.group_short = False  # a rank of a data-parallel group not all of whose ranks have joined yet
        self._tls = tls
        self.router_id = router_id
        self.name = spec.name
        self.addr = (host, port)
        self.key = key
        self.mirror = CacheMirror(spec.engine.page_size)
        # the instance's KV pages and context as its engine sized them (its snapshots say;
        # until then its config's, 0 where its engine sizes itself)
        self.pages = spec.engine.num_pages
        self.max_context = 0
        self.queued_tokens = 0  # work assigned by this router and not finished
        self.committed_pages = 0  # KV pages the requests this router dispatched here will take
        self.committed_requests = 0
        self.conn: FramedConnection | None = None
        self.protocol: int | None = None  # the version the connection speaks (settled in HELLO)
        self.software = ""  # the instance's release, as its HELLO said (protocol 5 on)
        self._queues: dict[str, asyncio.Queue] = {}
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def healthy(self) -> bool:
        return self.conn is not None and not self.conn.closed

    @property
    def available(self) -> bool:
        """Whether new work may be planned onto this instance."""
        return self.healthy and not self.draining and not self.refusing and not self.group_short

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

    async def send(self, body: m.FromRouter) -> None:
        conn = self.conn
        if conn is None or conn.closed:  # not `healthy`
            raise InstanceDown(f"instance {self.name} is not connected")
        if isinstance(body, m.Submit) and self.spec.role == RoleName.PREFILL:
            self.kv_open.add(body.rid)
        elif isinstance(body, m.Abort):
            self.kv_open.discard(body.rid)
        try:
            await m.send(conn, body)
        except (ConnectionError, RuntimeError) as e:
            raise InstanceDown(f"instance {self.name}: {e}") from None

    async def _run(self) -> None:
        backoff = 0.2
        while True:
            conn, beat = None, None
            try:
                hello = m.Hello("router", router_id=self.router_id, software=pdd.__version__)
                conn, reply = await wire.connect(
                    *self.addr, self.key, functools.partial(m.to_dict, hello), tls=self._tls, connect_timeout=5.0
                )
                self.protocol, self.software = conn.version, str(reply.get("software", ""))
                for body in self._roster() if self._roster else []:
                    await m.send(conn, body)
                self.conn, backoff = conn, 0.2  # from here on, a loss fails the requests waiting on it
                self.refusing = False  # (a new process, or one that says so again at once)
                log.info(
                    "connected to %s at %s:%s (protocol %s, pdd %s)",
                    self.name,
                    *self.addr,
                    self.protocol,
                    self.software or "before 0.2",
                )
                beat = asyncio.ensure_future(conn.keepalive(self.liveness.heartbeat_s, self.liveness.dead_after_s))
                await self._read(conn)
            except asyncio.CancelledError:
                raise
            except (TimeoutError, OSError, wire.FrameError) as e:
                log.warning("instance %s: %s", self.name, e)
            except Exception:  # a malformed message: drop the connection, never the client
                log.exception("instance %s sent something unusable", self.name)
            finally:
                if beat is not None:
                    beat.cancel()
                if conn is not None:
                    conn.close()
                self._ready.clear()
                self.mirror.stale = True
                lost, self.conn = self.conn, None
                if lost is not None:  # once per lost connection, not per failed reconnect
                    silent = f" (silent for {lost.silent_for:.1f} s)" if lost.silent_for else ""
                    self._fail_all(f"lost the connection to instance {self.name}{silent}")
            if self.draining and self._on_left is not None:  # it finished and left: stop calling it
                self._on_left(self)
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _read(self, conn: FramedConnection) -> None:
        resync_asked = False
        while True:
            body = m.to_router(await conn.next_frame())
            match body:
                case m.CacheUpdate():
                    if body.kind == "snapshot":
                        resync_asked = False
                        self._ready.set()
                    if not self.on_cache_update(body) and not resync_asked:  # one request per gap
                        resync_asked = True
                        await m.send(conn, m.CacheUpdate("snapshot_request"))
                case m.Member():
                    if self._on_member is not None:
                        self._on_member(body)
                case m.Drain():  # the instance drains, shuts down or lost its engine
                    if not self.refusing:
                        log.info("instance %s takes no new work: planning around it", self.name)
                    self.refusing = True
                case m.Tokens() | m.PipelineChosen() | m.Result() | m.HandedOff() | m.Progress() | m.Error():
                    self._for_request(body)
                case _:
                    assert_never(body)

    def _for_request(self, body: m.ForRequest) -> None:
        """A body to its request's queue (none: the request is over)."""
        if isinstance(body, (m.Result, m.Error)):
            self.kv_open.discard(body.rid or "")
        if isinstance(body, m.Result) and self._on_result is not None:
            self._on_result(body)
        q = self._queues.get(body.rid or "")
        if q is not None:
            q.put_nowait((self.name, body))

    def on_cache_update(self, body: m.CacheUpdate) -> bool:
        """Apply an instance's cache event (a snapshot also says the pages and context its
        engine sized); False when the mirror needs a fresh snapshot."""
        if body.kind == "snapshot":
            self.pages, self.max_context = body.pages or self.pages, body.max_context
        return self.mirror.apply(body)

    def _fail_all(self, reason: str) -> None:
        self.kv_open.clear()
        for rid, q in self._queues.items():
            q.put_nowait((self.name, m.Error(reason, rid, lost=True)))
