"""`pdd wan`: a userspace TCP relay that behaves like a WAN line.

Kernel netem is not available where pdd is developed and demonstrated, yet the whole
point of PDD is what a slow, long line does to KV transfer. So every cross-datacenter
byte in tests and demos goes through this relay, which enforces what a real line
would:

* one bandwidth per direction shared by every connection crossing the line (a
  virtual-time token bucket whose burst is a few milliseconds of line time — not
  seconds, which would hide the line's rate — behind a short queue, as in a router);
* a one-way propagation delay plus bounded, seeded jitter that never reorders the
  bytes of a stream (a chunk is delivered no earlier than the one before it);
* faults injected at run time: stall, drop every connection, silent blackhole, and
  link changes — from Python, or over a small HTTP admin API.

"a→b" is client-to-server traffic (towards the route's target), "b→a" the replies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import random
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from pdd.config import parse_addr

log = logging.getLogger(__name__)

A_TO_B = "a_to_b"
B_TO_A = "b_to_a"
JITTER_DISTS = ("uniform", "normal")
BURST_S = 0.005  # idle credit of the token bucket: 5 ms of line time
QUEUE_S = 0.02  # how far ahead a stream may book line time (a router's queue)
CHUNK_S = 0.002  # forward in pieces of ~2 ms of line time so pacing stays smooth
MIN_CHUNK = 1024
MAX_CHUNK = 64 * 1024
MIN_INFLIGHT = 128 * 1024
# A line's far end accepts little more than what is on the line: without this, loopback
# TCP (which sees no delay) buffers megabytes in the kernel ahead of the line, and a
# sender's later frames (a reservation behind bulk KV) would wait seconds behind them.
RCVBUF_BYTES = 128 * 1024
POLL_S = 0.05  # how often a held chunk re-checks a stall that may have been lifted
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LinkSettings:
    """What a line is; validated on creation, so a bad value never reaches the relay."""

    bandwidth_mbps: float = 100.0  # per direction, shared by all connections
    delay_ms: float = 10.0  # one way
    jitter_ms: float = 0.0  # bound of the one-way jitter
    jitter_dist: str = "uniform"  # uniform in ±jitter, or normal (sigma jitter/2) clipped to ±jitter
    seed: int | None = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_mbps) and self.bandwidth_mbps > 0):
            raise ValueError("bandwidth_mbps must be a positive number")
        for name in ("delay_ms", "jitter_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a non-negative number")
        if self.jitter_dist not in JITTER_DISTS:
            raise ValueError(f"jitter_dist must be one of {', '.join(JITTER_DISTS)}")


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


class _Shaper:
    """Serializes one direction of the line (GCRA, i.e. a token bucket in virtual time).

    Every chunk books the next slice of line time; it has left the line when its slice
    ends. Idle time earns at most `BURST_S` of credit, which also absorbs the event
    loop oversleeping, so the long-run rate is the line rate and never more.
    """

    def __init__(self) -> None:
        self._busy_until = 0.0

    def book(self, nbytes: int, bytes_per_s: float, now: float) -> float:
        self._busy_until = max(self._busy_until, now - BURST_S) + nbytes / bytes_per_s
        return self._busy_until


class WanLine:
    """The shared medium: rate, delay, jitter, faults and counters of one line."""

    def __init__(
        self,
        bandwidth_mbps: float,
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        *,
        jitter_dist: str = "uniform",
        seed: int | None = 0,
    ) -> None:
        self.settings = LinkSettings(bandwidth_mbps, delay_ms, jitter_ms, jitter_dist, seed)
        self._rng = random.Random(seed)
        self._shapers = {A_TO_B: _Shaper(), B_TO_A: _Shaper()}
        self._stalled_until = 0.0
        self.blackholed = False
        self._conns: set[_RelayedConnection] = set()
        self.bytes_a_to_b = 0
        self.bytes_b_to_a = 0
        self.bytes_blackholed = 0
        self.connections_total = 0
        self.connect_errors = 0
        self.drops = 0

    @property
    def bandwidth_mbps(self) -> float:
        return self.settings.bandwidth_mbps

    @property
    def delay_ms(self) -> float:
        return self.settings.delay_ms

    @property
    def jitter_ms(self) -> float:
        return self.settings.jitter_ms

    # --- control -------------------------------------------------------------------

    def set_link(
        self, bandwidth_mbps: float | None = None, delay_ms: float | None = None, jitter_ms: float | None = None
    ) -> None:
        """Change the line at run time; data already on the line keeps its timing."""
        given = {"bandwidth_mbps": bandwidth_mbps, "delay_ms": delay_ms, "jitter_ms": jitter_ms}
        self.settings = replace(self.settings, **{k: float(v) for k, v in given.items() if v is not None})

    def stall(self, seconds: float) -> None:
        """Hold all traffic for `seconds` from now, losing nothing; `stall(0)` ends a stall."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError("stall seconds must be a non-negative number")
        self._stalled_until = time.monotonic() + seconds

    def drop_all(self) -> int:
        """Reset every connection crossing the line now; returns how many."""
        dropped = list(self._conns)
        for conn in dropped:
            conn.abort()
        self.drops += len(dropped)
        return len(dropped)

    def blackhole(self, on: bool) -> None:
        """Silently swallow all traffic (peers hang until their own timeouts).

        Lifting it resets the connections that lost bytes: their streams can no
        longer be delivered intact, and a corrupted stream is worse than a reset.
        """
        self.blackholed = bool(on)
        if not self.blackholed:
            poisoned = [conn for conn in self._conns if conn.poisoned]
            for conn in poisoned:
                conn.abort()
            self.drops += len(poisoned)

    @property
    def connections(self) -> int:
        return len(self._conns)

    def stats(self) -> dict[str, Any]:
        return {
            "bandwidth_mbps": self.bandwidth_mbps,
            "delay_ms": self.delay_ms,
            "jitter_ms": self.jitter_ms,
            "jitter_dist": self.settings.jitter_dist,
            "stalled_for_s": max(0.0, self._stalled_until - time.monotonic()),
            "blackhole": self.blackholed,
            "bytes_a_to_b": self.bytes_a_to_b,
            "bytes_b_to_a": self.bytes_b_to_a,
            "bytes_blackholed": self.bytes_blackholed,
            "connections": self.connections,
            "connections_total": self.connections_total,
            "connect_errors": self.connect_errors,
            "drops": self.drops,
        }

    # --- used by the relay ---------------------------------------------------------

    @property
    def _bytes_per_s(self) -> float:
        return self.bandwidth_mbps * 125_000

    def chunk_size(self) -> int:
        return max(MIN_CHUNK, min(MAX_CHUNK, int(self._bytes_per_s * CHUNK_S)))

    def inflight_limit(self) -> int:
        """Bytes one stream may have on the line: over twice the bandwidth-delay product."""
        one_way_s = (self.delay_ms + self.jitter_ms) / 1000 + BURST_S + QUEUE_S
        return max(MIN_INFLIGHT, int(2 * self._bytes_per_s * one_way_s) + 4 * self.chunk_size())

    async def transmit(self, direction: str, nbytes: int) -> float:
        """Put `nbytes` on the line (after any stall); returns when they reach the far end.

        A stream may book line time up to `QUEUE_S` ahead — the line's queue — so an
        event loop that wakes late wastes no line time; still, bytes never leave faster
        than the line rate, nor arrive sooner than one delay after leaving.
        """
        await self._wait_stall()
        now = time.monotonic()
        sent = max(now, self._shapers[direction].book(nbytes, self._bytes_per_s, now))
        await asyncio.sleep(max(0.0, sent - QUEUE_S - now))
        return sent + self._one_way_delay_s()

    async def hold(self, arrival: float) -> None:
        """Sleep until `arrival` and until any stall is over."""
        while (wait := max(arrival, self._stalled_until) - time.monotonic()) > 0:
            await asyncio.sleep(min(wait, POLL_S))

    def register(self, conn: _RelayedConnection) -> None:
        self._conns.add(conn)
        self.connections_total += 1

    def unregister(self, conn: _RelayedConnection) -> None:
        self._conns.discard(conn)

    def count_delivered(self, direction: str, nbytes: int) -> None:
        if direction == A_TO_B:
            self.bytes_a_to_b += nbytes
        else:
            self.bytes_b_to_a += nbytes

    async def _wait_stall(self) -> None:
        while (wait := self._stalled_until - time.monotonic()) > 0:
            await asyncio.sleep(min(wait, POLL_S))

    def _one_way_delay_s(self) -> float:
        jitter = self.jitter_ms
        if jitter == 0:
            sample = 0.0
        elif self.settings.jitter_dist == "uniform":
            sample = self._rng.uniform(-jitter, jitter)
        else:
            sample = max(-jitter, min(jitter, self._rng.gauss(0.0, jitter / 2)))
        return max(0.0, self.delay_ms + sample) / 1000


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
        line: WanLine,
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

    def __init__(self, line: WanLine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
                up_reader, self._upstream = await asyncio.wait_for(
                    asyncio.open_connection(target_host, target_port), CONNECT_TIMEOUT_S
                )
            except (OSError, asyncio.TimeoutError) as err:
                self._line.connect_errors += 1
                log.warning("wan: cannot reach %s:%d: %s", target_host, target_port, err)
                return
            if self._aborted:
                return
            pipes = (
                _Pipe(self._line, A_TO_B, client_reader, self._upstream, self),
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
        log.error("wan: relay task failed", exc_info=exc)


class WanRelay:
    """The listeners of a set of routes, all crossing one `WanLine`."""

    def __init__(self, line: WanLine, routes: Sequence[Route]) -> None:
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
        server = await asyncio.start_server(lambda r, w: self._on_accept(route, r, w),
                                            sock=_listening_socket(route.listen_host, route.listen_port))
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
            for r, port in zip(self.routes, self.listen_ports)
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


class _LinkUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bandwidth_mbps: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    delay_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    jitter_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class _NewRoute(BaseModel):
    model_config = ConfigDict(extra="forbid")
    route: str = Field(description="LISTEN_HOST:PORT=TARGET_HOST:PORT")


class _Fault(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stall_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    drop: bool | None = None
    blackhole: bool | None = None


def admin_app(relay: WanRelay) -> FastAPI:
    """The HTTP control surface, so benchmarks and chaos tests can drive the line."""
    app = FastAPI(title="pdd wan admin")
    line = relay.line

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/stats")
    def stats() -> dict[str, Any]:
        return relay.stats()

    @app.post("/link")
    def link(update: _LinkUpdate) -> dict[str, Any]:
        line.set_link(update.bandwidth_mbps, update.delay_ms, update.jitter_ms)
        return relay.stats()

    @app.post("/routes")
    async def add_route(req: _NewRoute) -> dict[str, Any]:
        try:
            route = Route.parse(req.route)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        try:
            await relay.add_route(route)
        except OSError as e:
            raise HTTPException(409, f"cannot listen on {route.listen_host}:{route.listen_port}: {e}") from None
        return relay.stats()

    @app.post("/fault")
    def fault(req: _Fault) -> dict[str, Any]:
        if req.stall_s is None and req.drop is None and req.blackhole is None:
            raise HTTPException(422, "give one of stall_s, drop, blackhole")
        if req.blackhole is not None:
            line.blackhole(req.blackhole)
        if req.drop:
            line.drop_all()
        if req.stall_s is not None:
            line.stall(req.stall_s)
        return relay.stats()

    return app


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn in our event loop; signals stay with whoever owns the loop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class AdminServer:
    """Runs `admin_app` with uvicorn inside the current event loop."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family)  # bound now: port 0 resolves, errors surface
        self.url = f"http://{f'[{host}]' if family == socket.AF_INET6 else host}:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2)
        self._server = _EmbeddedUvicorn(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("wan admin server stopped during startup")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None and not self._task.done():
            await self._task
        self._sock.close()


ReadyCallback = Callable[[WanRelay, str | None], None]


async def run_wan(
    routes: Sequence[Route],
    settings: LinkSettings,
    admin_addr: tuple[str, int] | None = None,
    ready_cb: ReadyCallback | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run a line with its routes (and admin API) until `stop` is set or the task is cancelled.

    `ready_cb(relay, admin_url)` is called once everything listens; the relay gives
    the bound ports and the line for in-process fault injection.
    """
    relay = WanRelay(WanLine(**asdict(settings)), routes)
    await relay.start()
    admin: AdminServer | None = None
    try:
        if admin_addr is not None:
            admin = AdminServer(admin_app(relay), *admin_addr)
            await admin.start()
        if ready_cb is not None:
            ready_cb(relay, admin.url if admin else None)
        await (stop or asyncio.Event()).wait()
    finally:
        if admin is not None:
            await admin.stop()
        await relay.stop()


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


def add_parser(sub: Any) -> None:
    """Register `pdd wan` on the top-level sub-command parsers."""
    p = sub.add_parser(
        "wan",
        help="run the WAN emulator (a TCP relay with bandwidth, delay, jitter and faults)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "--route", action="append", required=True, type=_arg(Route.parse),
        metavar="LISTEN_HOST:PORT=TARGET_HOST:PORT", help="relay a local port to a target (repeatable)",
    )  # fmt: skip
    defaults = LinkSettings()
    p.add_argument("--bandwidth-mbps", type=float, default=defaults.bandwidth_mbps, help="per direction, shared")
    p.add_argument("--delay-ms", type=float, default=defaults.delay_ms, help="one-way delay")
    p.add_argument("--jitter-ms", type=float, default=defaults.jitter_ms, help="bound of the one-way jitter")
    p.add_argument("--jitter-dist", choices=JITTER_DISTS, default=defaults.jitter_dist)
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed of the jitter")
    p.add_argument("--admin", type=_arg(parse_addr), metavar="HOST:PORT", help="serve the HTTP admin API here")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        settings = LinkSettings(args.bandwidth_mbps, args.delay_ms, args.jitter_ms, args.jitter_dist, args.seed)
    except ValueError as err:
        print(f"wan: {err}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve_until_signal(args.route, settings, args.admin))
    except OSError as err:
        print(f"wan: {err}", file=sys.stderr)
        return 1
    return 0


async def _serve_until_signal(routes: list[Route], settings: LinkSettings, admin: tuple[str, int] | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def announce(relay: WanRelay, admin_url: str | None) -> None:
        for route, port in zip(relay.routes, relay.listen_ports):
            print(f"wan: {route.listen_host}:{port} -> {route.target_host}:{route.target_port}")
        if admin_url:
            print(f"wan admin: {admin_url}")
        sys.stdout.flush()

    await run_wan(routes, settings, admin, announce, stop)
