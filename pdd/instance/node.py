"""An instance's framed-protocol side: accept, handshake, dispatch to its role.

Routers connect to every instance (requests in, tokens and cache events out); other
instances connect to the decode side (KV in, replies out). The node authenticates the
connection, reads typed bodies (`pdd.transfer.messages`) and hands them to the role
object that owns the requests (`pdd.instance.roles`), which sees the node only as a
`pdd.instance.role.Node`. A role never touches sockets beyond sending on them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Literal, assert_never, cast

from pdd.config import ROLES, Deployment, InstanceSpec
from pdd.engines.port import EnginePort
from pdd.instance.liveness import WATCH_S, engine_failure
from pdd.instance.placement import Regions, check_start
from pdd.instance.role import Node, Role, Tombstones
from pdd.names import RoleName
from pdd.tasks import Tasks
from pdd.transfer import messages as m
from pdd.transfer import wire
from pdd.transfer.tls import server_context
from pdd.transfer.wire import FramedConnection

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 10.0
DRAIN_QUIET_S = 1.0


class InstanceNode:
    def __init__(
        self, spec: InstanceSpec, dep: Deployment, engine: EnginePort, key: bytes, make_role: Callable[[Node], Role]
    ) -> None:
        self.spec = spec
        self.dep = dep
        self.engine = engine
        self.key = key
        self.routers: dict[str, FramedConnection] = {}
        self._peer_conns: dict[str, set[FramedConnection]] = {}  # by peer name
        self.aborted = Tombstones()
        self.server: asyncio.Server | None = None
        self._tasks = Tasks()
        self.role: Role = make_role(self)
        self.draining = False
        self.refusing = ""  # why it takes no new work ("" while it does): every router has heard it
        self.peak_held = 0  # the most requests held at once (a relay must stay within its batch)
        self.on_drained: Callable[[], None] = lambda: None  # the process exits (set by `pdd serve`)
        self._quiet_since: float | None = None
        self.regions = Regions(spec)  # where peers of this datacenter place KV with a transfer engine

    async def start(self) -> None:
        check_start(self.spec, self.dep.line.intra_kv)
        self.engine.set_cache_listener(self._publish)
        self.server = await wire.serve(
            self._handle, self.spec.host, self.spec.kv_port, self.key, tls=server_context(self.dep.tls)
        )
        self.spawn(self._watch_engine())

    async def stop(self) -> None:
        if self.server:
            self.server.close()
        self._tasks.cancel_all()
        for conn in self.routers.values():
            conn.close()
        self.role.close()

    # ---- membership --------------------------------------------------------------------
    def _learn(self, member: m.Member, router_id: str) -> None:
        """Where a member of the deployment is (one that joined after our config was
        written); one it did not know, it tells its other routers too: a router learns
        every member that joined through another, also one that starts later (`_members`)."""
        if member.role not in ROLES:
            log.warning("ignoring member %s with role %r", member.name, member.role)
            return
        known = next((i for i in self.dep.instances if i.name == member.name), None)
        if known is not None and self._member(known) == member:
            return
        for other, conn in list(self.routers.items()):
            if other != router_id:
                self.spawn(self.send(conn, member))
        spec = InstanceSpec(
            member.name,
            member.role,
            member.dc,
            member.host,
            kv_port=member.kv_port,
            advertise=dict(member.advertise),
            engine=self.dep.engine,
        )
        others = tuple(i for i in self.dep.instances if i.name != member.name)
        self.dep = replace(self.dep, instances=(*others, spec))

    @staticmethod
    def _member(spec: InstanceSpec) -> m.Member:
        return m.Member(spec.name, RoleName(spec.role), spec.dc, spec.host, spec.kv_port, dict(spec.advertise))

    def _members(self) -> list[m.Member]:
        """Every other member this instance knows, for a router that connects: those in its
        file and those it heard of since."""
        return [self._member(i) for i in self.dep.instances if i.name != self.spec.name and i.role in ROLES]

    def refuse_work(self, why: str) -> None:
        """Take no new work from now on, and tell every router (a DRAIN frame back, which a
        router before 0.5 ignores): each stops planning onto this instance until it
        connects again. A router that connects meanwhile hears it on connecting."""
        if not self.refusing:
            self.refusing = why
            log.info("taking no new work: %s", why)
            for conn in list(self.routers.values()):
                self.spawn(self.send(conn, m.Drain()))

    def quiet_for(self) -> float:
        """Seconds this instance has held nothing (0 while it holds a request)."""
        now = asyncio.get_running_loop().time()
        if self.role.held():
            self._quiet_since = None
            return 0.0
        if self._quiet_since is None:
            self._quiet_since = now
        return now - self._quiet_since

    async def _watch_engine(self) -> None:
        """An engine that died takes no more work: its routers plan around it at once."""
        while not self.refusing:
            why = engine_failure(self.engine)
            if why:
                self.refuse_work(why)
            await asyncio.sleep(WATCH_S)

    def drain(self) -> None:
        """Finish what this instance holds, then exit (`on_drained`). The router planned
        nothing here since it sent DRAIN, but work it planned just before may still be
        on its way (a reservation from P): the instance leaves only once it has held
        nothing for `DRAIN_QUIET_S`."""
        if not self.draining:
            self.draining = True
            log.info("draining: %d requests to finish", self.role.held())
            self.refuse_work("draining")  # every router, not only the one that asked
            self.spawn(self._drained())

    async def _drained(self) -> None:
        while self.quiet_for() < DRAIN_QUIET_S:
            await asyncio.sleep(0.05)
        log.info("drained: every request finished; leaving")
        self.on_drained()

    def full(self) -> bool:
        """Whether a new request would take this instance past `max_requests`."""
        return self.role.held() >= self.spec.engine.max_requests

    def took(self) -> None:
        """A role took a request: keep the high-water mark."""
        self.peak_held = max(self.peak_held, self.role.held())

    def stats(self) -> dict:
        waiting = getattr(self.role, "line", None)
        return {
            "role": self.spec.role,
            "held": self.role.held(),
            "peak_held": self.peak_held,
            "kv_placed": dict(self.regions.placed),
            "reservations_waiting": len(waiting) if waiting is not None else 0,
            "prefix_waits_expired": getattr(self.role, "prefix_waits_expired", 0),  # (decode-side roles)
            "background_held": getattr(self.role, "background_held", 0),  # (a prefill role)
            "kv_frames_in_prefill": getattr(self.role, "kv_frames_in_prefill", 0),  # (a prefill role)
            "aborted": self.aborted.count,
            "peers": peers.connected() if (peers := getattr(self.role, "peers", None)) else [],  # (P's, a relay's)
        }

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        return self._tasks.spawn(coro)

    async def send(self, conn: FramedConnection, body: m.Message) -> bool:
        """Send, or log why not: a peer that went away is its reader's business."""
        try:
            await m.send(conn, body)
            return True
        except (ConnectionError, RuntimeError) as e:
            log.debug("send to %s failed: %s", conn.peer, e)
            return False

    def to_router(self, router_id: str, body: m.ToRouter) -> None:
        """Queue a body for one router, in order; dropped if that router is gone."""
        conn = self.routers.get(router_id)
        if conn is not None:
            self.spawn(self.send(conn, body))

    # ---- cache events ------------------------------------------------------------------
    def _publish(self, seq: int, kind: str, hashes: list[int]) -> None:
        # `CacheListener` types the kind as str; the engine's radix cache emits only these two
        event = cast(Literal["stored", "removed"], kind)
        for conn in list(self.routers.values()):
            self.spawn(self.send(conn, m.CacheUpdate(event, seq, hashes)))

    async def _send_snapshot(self, conn: FramedConnection) -> None:
        """All cached hashes and the number of the last event they include.

        The router is subscribed before this, so no later event is missed; events it gets
        that the snapshot already holds (numbers up to the snapshot's) it ignores.
        """
        seq, hashes = await self.engine.cache_snapshot()
        e = self.engine
        await self.send(conn, m.CacheUpdate("snapshot", seq, hashes, e.page_size, e.load().pages, e.max_context))

    # ---- inbound connections -----------------------------------------------------------
    async def _handle(self, conn: FramedConnection) -> None:
        # a peer that connects and says nothing (or half a frame) does not hold a slot forever
        raw = await asyncio.wait_for(wire.server_handshake(conn), HELLO_TIMEOUT_S)
        try:
            hello = m.from_dict(m.Hello, {k: v for k, v in raw.items() if k != "nonce"}, conn.version)
        except m.BadMessage as e:
            await self.send(conn, m.Error(f"bad HELLO: {e}"))
            return
        log.info(
            "%s %s connected (protocol %s, pdd %s)",
            hello.role,
            hello.name or hello.router_id,
            conn.codec.version,
            hello.software or "before 0.2",
        )
        if hello.role == "router" and hello.router_id:
            await self._serve_router(conn, hello.router_id)
        elif hello.role in (RoleName.PREFILL, RoleName.RELAY) and self.spec.role in (RoleName.RELAY, RoleName.MAIN):
            await self._serve_peer(conn, hello.name, hello.channel)
        else:
            await self.send(conn, m.Error(f"{self.spec.role} does not serve {hello.role!r}"))

    def _keepalive(self, conn: FramedConnection) -> asyncio.Task:
        """Heartbeats on a control connection: a silent router or peer is dropped (and
        its requests ended) within `[liveness] dead_after_s`."""
        return self.spawn(conn.keepalive(self.dep.liveness.heartbeat_s, self.dep.liveness.dead_after_s))

    async def _serve_router(self, conn: FramedConnection, router_id: str) -> None:
        old = self.routers.get(router_id)
        self.routers[router_id] = conn
        if old is not None:
            old.close()
        beat = self._keepalive(conn)
        try:
            await self._send_snapshot(conn)
            for member in self._members():
                await self.send(conn, member)
            self.role.router_reached()
            if self.refusing:
                await self.send(conn, m.Drain())
            while True:
                frame = await conn.next_frame()
                try:
                    body = m.from_router(frame)
                except m.BadMessage as e:
                    await self.send(conn, m.Error(str(e), m.rid_of(frame)))
                    continue
                await self._on_router(conn, router_id, body)
        finally:
            beat.cancel()
            if self.routers.get(router_id) is conn:
                del self.routers[router_id]
                self.role.router_lost(router_id)

    async def _on_router(self, conn: FramedConnection, router_id: str, body: m.FromRouter) -> None:
        """What the node answers itself (the cache, members, a drain, a full instance's
        refusal); the rest is its role's."""
        match body:
            case m.CacheUpdate():  # the router lost track: resend all
                self.spawn(self._send_snapshot(conn))
            case m.Member():
                self._learn(body, router_id)
            case m.Drain():
                self.drain()
            case m.Submit() if self.full() or self.refusing:
                why = f"takes no new work: {self.refusing}" if self.refusing else "holds its limit of requests"
                await self.send(conn, m.Error(f"{self.spec.name} {why}", body.rid, busy=True))
            case m.Submit() | m.Abort() | m.Handoff():
                await self.role.on_router(router_id, body)
            case _:
                assert_never(body)

    async def _serve_peer(self, conn: FramedConnection, name: str, channel: str) -> None:
        """One of a peer's connections (see `pdd.instance.peers`). Its control connection
        carries the heartbeats; when that one goes, the peer's KV connections go too,
        since a silent line would otherwise leave them open forever."""
        conns = self._peer_conns.setdefault(name, set())
        conns.add(conn)
        beat = self._keepalive(conn) if channel == "control" else None
        try:
            while True:
                frame = await self.regions.on_frame(conn, await conn.next_frame())
                if frame is not None:
                    await self.role.on_peer(conn, name, frame)
        except m.BadMessage as e:  # KV placed wrong: what else the connection carries cannot be trusted
            log.warning("dropping %s's connection: %s", name, e)
            conn.abort()
        finally:
            self.regions.forget(conn)
            conns.discard(conn)
            if beat is not None:
                beat.cancel()
                for other in list(conns):
                    other.abort()
            self.role.peer_lost(name)
