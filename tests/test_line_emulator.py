"""The line emulator, measured from the outside: rate, delay, faults, counters, admin, CLI.

Timing assertions use bounds the relay guarantees by construction (a delay is never
shorter, a line never faster) plus generous slack on the other side, so a busy
machine can only make them pass more slowly, not fail.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdd.addresses import parse_addr
from pdd.lab.line import EmulatedLine, LineRelay, LineSettings, Route, run_line
from pdd.process import identity

REPO = Path(__file__).resolve().parents[1]
MBIT = 1e6


def run(coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def blob(size: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(size)


class Echo:
    """An echo server that remembers what it got and how many peers went away."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.closed = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(1 << 16):
                self.received += chunk
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            self.closed += 1
            writer.close()


async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads to EOF, then answers `sha256 nbytes arrival-time-of-last-byte`."""
    digest, nbytes, last = hashlib.sha256(), 0, 0.0
    try:
        while chunk := await reader.read(1 << 16):
            last = time.monotonic()
            digest.update(chunk)
            nbytes += len(chunk)
        writer.write(f"{digest.hexdigest()} {nbytes} {last!r}\n".encode())
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@asynccontextmanager
async def tcp_server(handler: Callable[..., Coroutine[Any, Any, None]]) -> AsyncIterator[int]:
    """A target server on 127.0.0.1; on exit it waits for its handlers to see their peers go."""
    handlers: set[asyncio.Future[Any]] = set()

    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.add(asyncio.ensure_future(handler(reader, writer)))

    server = await asyncio.start_server(tracked, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        if handlers:
            await asyncio.wait(handlers, timeout=10)
        await server.wait_closed()


@asynccontextmanager
async def emulated(target_port: int, bandwidth_mbps: float = 100, delay_ms: float = 1,
              **kw: Any) -> AsyncIterator[tuple[EmulatedLine, int]]:
    line = EmulatedLine(bandwidth_mbps, delay_ms, **kw)
    relay = LineRelay(line, [Route("127.0.0.1", 0, "127.0.0.1", target_port)])
    await relay.start()
    try:
        yield line, relay.listen_ports[0]
    finally:
        await relay.stop()


async def push(port: int, data: bytes) -> tuple[float, str, int, float]:
    """Send `data` to a sink; returns (start, sha256 it saw, bytes it saw, last byte's arrival)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        start = time.monotonic()
        writer.write(data)
        await writer.drain()
        writer.write_eof()
        digest, nbytes, last = (await reader.readline()).decode().split()
        return start, digest, int(nbytes), float(last)
    finally:
        writer.close()


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """True once the peer has closed or reset the connection (no data expected)."""
    try:
        return await reader.read(1 << 16) == b""
    except ConnectionError:
        return True


async def ping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, msg: bytes = b"p") -> float:
    start = time.monotonic()
    writer.write(msg)
    assert await reader.readexactly(len(msg)) == msg
    return time.monotonic() - start


def test_route_and_address_parsing() -> None:
    assert Route.parse("127.0.0.1:0=10.0.0.2:7000") == Route("127.0.0.1", 0, "10.0.0.2", 7000)
    assert parse_addr("[::1]:80") == ("::1", 80)
    for bad in ("127.0.0.1:0", "a:1=b", "a:x=b:1", "a:1=b:70000"):
        with pytest.raises(ValueError):
            Route.parse(bad)
    for bad_line in ({"bandwidth_mbps": 0}, {"delay_ms": -1}, {"jitter_ms": float("nan")}, {"jitter_dist": "pareto"}):
        with pytest.raises(ValueError):
            LineSettings(**bad_line)


def test_bulk_transfer_runs_at_line_rate_and_intact() -> None:
    data = blob(10 * 1024 * 1024)

    async def go() -> float:
        async with tcp_server(sink) as target, emulated(target, bandwidth_mbps=100, delay_ms=10) as (line, port):
            start, digest, nbytes, last = await push(port, data)
            assert (digest, nbytes) == (hashlib.sha256(data).hexdigest(), len(data))
            assert line.bytes_a_to_b == len(data)
            assert line.bytes_b_to_a == len(f"{digest} {nbytes} {last!r}\n")
            return nbytes * 8 / (last - start) / MBIT

    mbps = run(go())
    print(f"\nsingle stream through a 100 Mbit/s line: {mbps:.1f} Mbit/s")  # the rate reached: a benchmark, printed
    assert mbps <= 100  # never faster than the line (slower only says this machine was busy)


def test_concurrent_connections_share_the_line() -> None:
    """Three connections over two routes of one line: the line's rate is their sum."""
    parts = [blob(3 * 1024 * 1024, seed) for seed in range(3)]

    async def go() -> tuple[float, list[float]]:
        async with tcp_server(sink) as target_1, tcp_server(sink) as target_2:
            routes = [Route("127.0.0.1", 0, "127.0.0.1", target_1), Route("127.0.0.1", 0, "127.0.0.1", target_2)]
            line = EmulatedLine(100, 10)
            relay = LineRelay(line, routes)
            await relay.start()
            try:
                ports = [relay.listen_ports[0], relay.listen_ports[0], relay.listen_ports[1]]
                results = await asyncio.gather(*(push(port, p) for port, p in zip(ports, parts, strict=True)))
            finally:
                await relay.stop()
            assert line.bytes_a_to_b == sum(map(len, parts)) and line.connections_total == 3
            for part, (_, digest, nbytes, _) in zip(parts, results, strict=True):
                assert (digest, nbytes) == (hashlib.sha256(part).hexdigest(), len(part))
            start = min(r[0] for r in results)
            total = sum(r[2] for r in results) * 8 / (max(r[3] for r in results) - start) / MBIT
            return total, [r[2] * 8 / (r[3] - start) / MBIT for r in results]

    total, each = run(go())
    print(f"\n3 streams (2 routes) through a 100 Mbit/s line: {total:.1f} Mbit/s total, "
          f"each {[round(x, 1) for x in each]}")
    assert total <= 100  # the streams share one line's rate (how close they get is printed: a benchmark)
    assert min(each) >= max(each) / 3  # none is starved: a busy machine slows them all alike


def test_one_way_delay_shows_in_round_trip() -> None:
    async def go() -> list[float]:
        async with tcp_server(Echo().handle) as target, emulated(target, delay_ms=20) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return [await ping(reader, writer) for _ in range(10)]
            finally:
                writer.close()

    rtts = run(go())
    print(f"\nRTT over a 20 ms one-way line: min {min(rtts) * 1e3:.1f} ms, "
          f"median {statistics.median(rtts) * 1e3:.1f} ms")
    assert min(rtts) >= 0.040
    assert statistics.median(rtts) < 0.200


@pytest.mark.parametrize("dist", ["uniform", "normal"])
def test_jitter_never_reorders_a_stream(dist: str) -> None:
    messages = [f"message {i:04d};".encode() for i in range(300)]

    async def go() -> tuple[bytes, list[float]]:
        echo = Echo()
        line_kw = {"delay_ms": 10, "jitter_ms": 8, "jitter_dist": dist, "seed": 7}
        async with tcp_server(echo.handle) as target, emulated(target, **line_kw) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                rtts = [await ping(reader, writer) for _ in range(5)]
                for msg in messages:  # separate writes, so they cross the line as separate chunks
                    writer.write(msg)
                    await asyncio.sleep(0.0005)
                expected = sum(map(len, messages))
                return await asyncio.wait_for(reader.readexactly(expected), 30), rtts
            finally:
                writer.close()

    echoed, rtts = run(go())
    assert echoed == b"".join(messages)
    assert min(rtts) >= 0.004  # each way is at least delay - jitter = 2 ms


def test_stall_holds_traffic_then_delivers_it_intact() -> None:
    data = blob(256 * 1024)

    async def go() -> None:
        async with tcp_server(sink) as target, emulated(target) as (line, port):
            stalled_at = time.monotonic()
            line.stall(1.0)
            task = asyncio.create_task(push(port, data))
            checked = 0
            while True:  # while the stall lasts, nothing passes (bytes read before the clock, so no race)
                passed, elapsed = line.bytes_a_to_b, time.monotonic() - stalled_at
                if elapsed >= 0.9:
                    break
                assert passed == 0 and not task.done()
                checked += 1
                await asyncio.sleep(0.05)
            assert checked  # (it was looked at during the stall)
            _, digest, nbytes, last = await asyncio.wait_for(task, 30)
            assert (digest, nbytes) == (hashlib.sha256(data).hexdigest(), len(data))
            assert last - stalled_at >= 1.0

    run(go())


def test_drop_all_resets_connections_and_new_ones_work() -> None:
    async def go() -> None:
        echo = Echo()
        async with tcp_server(echo.handle) as target, emulated(target) as (line, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                await ping(reader, writer)
                assert line.connections == 1
                assert line.drop_all() == 1
                assert await asyncio.wait_for(closed_by_peer(reader), 10)
            finally:
                writer.close()
            for _ in range(200):  # the target side sees the drop too
                if echo.closed == 1 and line.connections == 0:
                    break
                await asyncio.sleep(0.05)
            assert (echo.closed, line.connections, line.drops) == (1, 0, 1)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                await ping(reader, writer, b"still here")
            finally:
                writer.close()
            assert line.connections_total == 2

    run(go())


def test_blackhole_swallows_traffic_silently() -> None:
    async def go() -> None:
        echo = Echo()
        async with tcp_server(echo.handle) as target, emulated(target) as (line, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                await ping(reader, writer, b"before")
                line.blackhole(True)
                writer.write(b"into the void")
                with pytest.raises(asyncio.TimeoutError):  # the peer hangs: no reply, no reset
                    await asyncio.wait_for(reader.read(100), 0.7)
                assert bytes(echo.received) == b"before" and line.bytes_blackholed == len(b"into the void")
                line.blackhole(False)  # the stream lost bytes: it is reset, not resumed corrupted
                assert await asyncio.wait_for(closed_by_peer(reader), 10)
            finally:
                writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                await ping(reader, writer, b"after")
            finally:
                writer.close()
            assert line.drops == 1

    run(go())


def test_byte_counters_match_both_ways() -> None:
    data = blob(300_000)

    async def go() -> None:
        async with tcp_server(Echo().handle) as target, emulated(target, bandwidth_mbps=200) as (line, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(data)
                assert await asyncio.wait_for(reader.readexactly(len(data)), 30) == data
            finally:
                writer.close()
            assert line.bytes_a_to_b == line.bytes_b_to_a == len(data)
            assert line.connections_total == 1

    run(go())


def test_admin_api_changes_the_line_and_reports_stats() -> None:
    data = blob(1_000_000)

    async def go() -> None:
        ready: asyncio.Future[tuple[LineRelay, str]] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        async with tcp_server(sink) as target:
            routes = [Route("127.0.0.1", 0, "127.0.0.1", target)]
            task = asyncio.create_task(
                run_line(routes, LineSettings(200, 1), ("127.0.0.1", 0), lambda r, u: ready.set_result((r, u)), stop)
            )
            try:
                relay, url = await asyncio.wait_for(ready, 30)
                port = relay.listen_ports[0]
                async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=10) as http:
                    # (the relay runs in this process: it says this process's identity)
                    assert (await http.get("/health")).json() == {"status": "ok", **identity()}
                    r = await http.post("/line", json={"bandwidth_mbps": 20, "delay_ms": 10, "jitter_ms": 1})
                    assert r.status_code == 200
                    assert (r.json()["bandwidth_mbps"], r.json()["delay_ms"], r.json()["jitter_ms"]) == (20, 10, 1)
                    for bad in ({"bandwidth_mbps": 0}, {"delay_ms": -5}, {"speed": 1}):
                        assert (await http.post("/line", json=bad)).status_code == 422
                    start, _, nbytes, last = await push(port, data)
                    # the new rate is in force (the delay, 10 ± 1 ms, exceeds the 5 ms burst)
                    assert last - start >= nbytes * 8 / (20 * MBIT)
                    stats = (await http.get("/stats")).json()
                    assert stats["bytes_a_to_b"] == len(data) and stats["connections_total"] == 1
                    assert stats["routes"] == [{"listen": f"127.0.0.1:{port}", "target": f"127.0.0.1:{target}"}]
                    assert (await http.post("/fault", json={"stall_s": 5})).json()["stalled_for_s"] > 4
                    assert (await http.post("/fault", json={"stall_s": 0})).json()["stalled_for_s"] == 0
                    assert (await http.post("/fault", json={"blackhole": True})).json()["blackhole"] is True
                    assert (await http.post("/fault", json={"blackhole": False})).json()["blackhole"] is False
                    assert (await http.post("/fault", json={"drop": True})).status_code == 200
                    for bad in ({}, {"stall_s": -1}, {"explode": True}):
                        assert (await http.post("/fault", json=bad)).status_code == 422
            finally:
                stop.set()
                await asyncio.wait_for(task, 30)

    run(go())


def _cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_cli_relays_and_stops_on_sigterm() -> None:
    data = blob(2 * 1024 * 1024)

    async def go() -> None:
        async with tcp_server(sink) as target:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "pdd.cli", "line",
                "--route", f"127.0.0.1:0=127.0.0.1:{target}", "--admin", "127.0.0.1:0",
                "--bandwidth-mbps", "200", "--delay-ms", "2", "--seed", "3",
                cwd=REPO, env=_cli_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            try:
                assert proc.stdout is not None
                route_line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
                admin_line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
                assert route_line.startswith("line: 127.0.0.1:") and route_line.endswith(f" -> 127.0.0.1:{target}\n")
                assert admin_line.startswith("line admin: http://127.0.0.1:")
                port = int(route_line.split()[1].rsplit(":", 1)[1])
                _, digest, nbytes, _ = await push(port, data)
                assert (digest, nbytes) == (hashlib.sha256(data).hexdigest(), len(data))
                async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
                    stats = (await http.get(admin_line.split()[2] + "/stats")).json()
                assert stats["bytes_a_to_b"] == len(data) and stats["bandwidth_mbps"] == 200
                proc.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(proc.wait(), 30) == 0
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()

    run(go(), timeout=120)


def test_cli_rejects_a_bad_route() -> None:
    async def go() -> tuple[int, bytes]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pdd.cli", "line", "--route", "nowhere",
            cwd=REPO, env=_cli_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            return proc.returncode or 0, err
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    code, err = run(go(), timeout=90)
    assert code == 2 and b"not LISTEN_HOST:PORT=TARGET_HOST:PORT" in err
