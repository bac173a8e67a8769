"""Outbound connections from one instance to others: P to its decode side, RLD to MD.

Framed connections per peer (through the line emulator when the peer is in the other
datacenter), opened on first use: control, for small frames (reservations, handoffs,
aborts); urgent KV, on a request's critical path (P -> MD, the relay's copy); and
background KV (MD's copy behind a relay). Across the line each kind of KV has
`[line] kv_streams` connections (stripes): each frame goes to the first that has
drained, and the receiver reassembles a request's KV by its token and layer offsets. A
reservation never waits behind megabytes of KV, and background frames hold back while
urgent ones are being sent; the KV connections keep few unsent bytes in the kernel
(TCP_NOTSENT_LOWAT), so what waits, waits here, while their windows grow to the line's
bandwidth-delay product. Each connection's reader hands every body, typed, to the
owner; when one drops, the owner hears.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

import pdd
from pdd.config import Deployment, InstanceSpec
from pdd.instance.placement import Placements
from pdd.policy.transfer import Priority
from pdd.tasks import Tasks
from pdd.transfer import messages as m
from pdd.transfer import wire
from pdd.transfer.tls import client_context
from pdd.transfer.wire import FramedConnection, MsgType

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 10.0
# A KV connection's unsent bytes in the kernel, at most: what waits, waits in userspace,
# where background KV yields to urgent KV frame by frame. Not a cap on the send buffer,
# which would cap the bytes in flight a round trip too (tests/test_line_delay.py): bytes in
# flight grow with the window, as TCP grows it.
BULK_NOTSENT_LOWAT = 128 * 1024
URGENT_TAIL_POLL_S = 0.002  # how often background KV looks whether urgent KV has left the kernel
CHANNEL_NAMES = {Priority.CONTROL: "control", Priority.URGENT: "urgent", Priority.BACKGROUND: "background"}

OnBody = Callable[[str, m.BetweenInstances], Awaitable[None]]
OnLost = Callable[[str], None]


class _Yield:
    """Background frames wait while urgent ones are being sent to the same peer."""

    def __init__(self) -> None:
        self.urgent = 0
        self.quiet = asyncio.Event()
        self.quiet.set()


class _Stripes:
    """The KV connections of one priority to one peer: their indices that are free (have
    drained what was last written to them)."""

    def __init__(self, count: int) -> None:
        self.free: asyncio.Queue[int] = asyncio.Queue()
        for i in range(count):
            self.free.put_nowait(i)


class PeerPool:
    def __init__(
        self,
        spec: InstanceSpec,
        deployment: Callable[[], Deployment],
        key: bytes,
        on_body: OnBody,
        on_lost: OnLost,
        stripes: int | None = None,
    ) -> None:
        """`stripes`: KV connections per priority to a peer across the line (default:
        the deployment's `[line] kv_streams`); one to a peer in the same datacenter."""
        self._spec, self._deployment, self._key = spec, deployment, key  # (read at use: instances join)
        self._tls = client_context(deployment().tls)
        self._on_body, self._on_lost = on_body, on_lost
        self._stripe_count = stripes
        # keyed by (peer, Priority.CONTROL / Priority.URGENT / Priority.BACKGROUND, stripe)
        self._conns: dict[tuple[str, Priority, int], FramedConnection] = {}
        self._yields: dict[str, _Yield] = {}
        self._stripes: dict[tuple[str, Priority], _Stripes] = {}
        # a lock per connection being opened: no peer waits on another's handshake
        self._opening: dict[tuple[str, Priority, int], asyncio.Lock] = {}
        self._tasks = Tasks()  # readers and heartbeats
        self._drains = Tasks()  # stripes draining what was written to them
        # KV frames written, by (peer, priority, stripe): the striping as the sender did it
        self.frames_sent: Counter[tuple[str, Priority, int]] = Counter()
        # KV to a peer of this datacenter through a transfer engine, where `[line] intra_kv` says
        self._placements = Placements(spec, lambda name: not self.remote(name), lambda: deployment().line.intra_kv)

    def remote(self, name: str) -> bool:
        """Whether traffic to `name` crosses the line between datacenters."""
        return self._deployment().instance(name).dc != self._spec.dc

    def stripes(self, name: str, priority: Priority = Priority.URGENT) -> int:
        """KV connections of `priority` to `name`: across the line, urgent KV is striped;
        background KV keeps one, since what each holds in its kernel buffers and on the
        line is ahead of the next urgent frame: with four, 61 background frames arrived
        during 64 urgent ones through `pdd line` (tests/test_peers.py), with one, 11."""
        if not self.remote(name) or priority == Priority.BACKGROUND:
            return 1
        return self._stripe_count or self._deployment().line.kv_streams

    def connected(self) -> list[str]:
        """The peers whose control connection is open now."""
        return sorted(
            name for (name, channel, _), conn in self._conns.items() if channel == Priority.CONTROL and not conn.closed
        )

    def warm(self, names: Iterable[str]) -> None:
        """Open the control connection to each of `names` now, in the background, so no
        request pays its handshake (round trips of the line). One that cannot be reached
        is left to the first request that needs it. One whose connection has closed since (the
        peer restarted, or the line dropped it) is opened again."""
        for name in names:
            conn = self._conns.get((name, Priority.CONTROL, 0))
            if conn is None or conn.closed:
                self._tasks.spawn(self._warm(name))

    async def _warm(self, name: str) -> None:
        try:
            await self.get(name)
        except Exception as e:  # (best effort: the first request opens it, and says what failed)
            log.debug("no connection to %s ahead of its first request: %r", name, e)

    async def get(self, name: str, channel: Priority = Priority.CONTROL, stripe: int = 0) -> FramedConnection:
        async with self._opening.setdefault((name, channel, stripe), asyncio.Lock()):
            conn = self._conns.get((name, channel, stripe))
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
            self._conns[(name, channel, stripe)] = conn
            self._tasks.spawn(self._read(name, channel, stripe, conn))
            if channel == Priority.CONTROL:
                live = self._deployment().liveness
                self._tasks.spawn(conn.keepalive(live.heartbeat_s, live.dead_after_s))
            return conn

    async def send(self, name: str, body: m.BetweenInstances) -> None:
        await m.send(await self.get(name), body)

    async def send_bulk(
        self,
        name: str,
        priority: Priority,
        body: m.BetweenInstances | None = None,
        kv: tuple[str, wire.Payload] | None = None,
    ) -> int:
        """One frame on a Priority.URGENT or Priority.BACKGROUND connection: a KV layer
        `(rid, blob)` or a body; the payload bytes sent. Across the line each frame goes
        to the first of the priority's connections to have drained (the receiver puts a
        request's KV back in order, and takes KV_DONE once all of it is in); the call
        returns once the frame is written there, or, with one connection, has drained."""
        y = self._yields.setdefault(name, _Yield())
        if priority == Priority.BACKGROUND:
            # woken by the end of one urgent frame, it is no turn if the next has begun: a
            # transfer sends frame after frame, and a stale wake-up would slip one in between.
            # Nor while urgent bytes wait in the kernel or on the line: up to BULK_NOTSENT_LOWAT a stream
            # (its tail, four streams of it, shared the line with the background KV that
            # followed: 23-36 background frames of 64 KiB during 64 urgent ones through the
            # lab's 32 Mbit/s line, against 0-2 once the tail had left)
            while y.urgent or self._urgent_unsent(name):
                if y.urgent:
                    await y.quiet.wait()
                else:
                    await asyncio.sleep(URGENT_TAIL_POLL_S)
        else:
            y.urgent += 1
            y.quiet.clear()
        stripes = self._stripes.setdefault((name, priority), _Stripes(self.stripes(name, priority)))
        try:
            stripe = await stripes.free.get()
        except BaseException:  # (cancelled while every stripe was busy: the urgent count must not stay up)
            self._unyield(name, priority)
            raise
        try:
            conn = await self.get(name, priority, stripe)
            payload: wire.Payload
            if kv is not None:
                msg_type, payload = MsgType.KV_LAYER, m.kv_payload(*kv)
            else:
                assert body is not None  # (one or the other, every caller)
                msg_type, payload = body.TYPE, m.encode_body(body, conn.version)
            placement = await self._placements.of(name, conn)
            size = wire.payload_len(payload)
            if placement is not None and kv is not None and size <= placement.remote.slot_bytes:
                await placement.send(conn, payload)  # (written into the peer's memory: only where, on the connection)
            else:
                if placement is not None:  # whatever follows placed frames follows them on the connection too
                    await placement.flush()
                conn.post(msg_type, payload)
            self.frames_sent[(name, priority, stripe)] += kv is not None
        except BaseException:
            self._release(name, priority, stripe)
            raise
        drained = self._drain(name, priority, stripe, conn)
        if self.stripes(name, priority) > 1:
            self._drains.spawn(drained)
        else:
            await drained
        return size if kv is not None else 0

    async def _drain(self, name: str, priority: Priority, stripe: int, conn: FramedConnection) -> None:
        try:
            await conn.drain()
            await conn.writable()  # (the kernel holds at most BULK_NOTSENT_LOWAT unsent: the rest waits here)
        except ConnectionError as e:  # its reader hears of it too, and tells the owner
            log.debug("KV connection %d to %s lost while draining: %s", stripe, name, e)
        finally:
            self._release(name, priority, stripe)

    def _urgent_unsent(self, name: str) -> int:
        """Bytes on the urgent KV connections to `name` not yet delivered: unsent, or on the
        line unacknowledged. (Counting the unsent alone, a fresh stripe's initial window
        took a 64 KiB frame at once, background followed it onto the line, and 47-57
        background frames arrived during 64 urgent ones in two CI runs; 0-16 on a quiet
        machine.)"""
        return sum(
            c.unsent(unacked=True) for (n, ch, _), c in self._conns.items() if n == name and ch == Priority.URGENT
        )

    def _release(self, name: str, priority: Priority, stripe: int) -> None:
        self._stripes[(name, priority)].free.put_nowait(stripe)
        self._unyield(name, priority)

    def _unyield(self, name: str, priority: Priority) -> None:
        if priority != Priority.BACKGROUND:
            y = self._yields[name]
            y.urgent -= 1
            if not y.urgent:
                y.quiet.set()

    async def _read(self, name: str, channel: Priority, stripe: int, conn: FramedConnection) -> None:
        try:
            while True:
                frame = await conn.next_frame()
                try:
                    body = m.between_instances(frame)
                except m.BadMessage as e:  # a peer's bug, not a reason to drop the connection
                    log.warning("bad reply from %s: %s", name, e)
                    continue
                if not self._placements.answer(conn, body):  # (the transfer engine's own replies stop here)
                    await self._on_body(name, body)
        except (ConnectionError, wire.FrameError) as e:
            log.warning("connection to %s lost: %s", name, e)
        except Exception:
            log.exception("handling a frame from %s failed", name)
        finally:
            if self._conns.get((name, channel, stripe)) is conn:
                del self._conns[(name, channel, stripe)]
            self._placements.forget(conn)
            conn.close()
            if channel == Priority.CONTROL and conn.silent_for:  # the peer is gone: so are its KV connections
                for key in [k for k in self._conns if k[0] == name and k[1] != Priority.CONTROL]:
                    self._conns.pop(key).abort()
            self._on_lost(name)

    def close(self) -> None:
        self._tasks.cancel_all()
        self._drains.cancel_all()
        for conn in self._conns.values():
            conn.close()

    async def aclose(self) -> None:
        """Close once every frame written has drained into the kernel, and the
        connections have closed."""
        await self._drains.wait_all()
        conns = list(self._conns.values())
        self.close()
        for conn in conns:
            await conn.wait_closed()
