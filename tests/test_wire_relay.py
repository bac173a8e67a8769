"""The framed protocol attacked from the path: a relay between a real client and a real
server (TCP on loopback, the deployment's connection key) that tampers with what the client
sends, frame by frame, as a man in the middle on the line could.

- It closes the newest version's HELLO, or rewrites its version byte: the client falls back
  to the version before, and the server's authenticated answer says it speaks the newest,
  so the client refuses (`wire.Downgrade`) instead of settling on the older protocol. With
  no relay the pair speaks the newest; a server that truly speaks only the older one is
  still reached in it.
- It replays, reorders or truncates a frame after the handshake: the server refuses the
  replayed and the reordered one (its sequence number is not the next) and takes nothing
  of the truncated one; what came before each arrives whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from pdd.transfer import wire
from pdd.transfer.wire.frame import FLAG_AUTH, GMAC_SINCE, GMAC_TAG_SIZE, HEADER, TAG_SIZE

KEY = wire.connection_key("relay-test-secret", "instances")
NEWEST = wire.PROTOCOL_VERSION
Tamper = Callable[[int, bytes], list[bytes] | None]  # (index, frame) -> what goes on (None: close)


async def _frames(reader: asyncio.StreamReader):
    """The client's frames, each whole (header, payload, tag), as the wire carries them: the
    HELLO under the connection key's HMAC, the frames after it under the session's GMAC (from 5)."""
    hello = True
    while True:
        try:
            head = await reader.readexactly(HEADER.size)
        except asyncio.IncompleteReadError:
            return
        _, version, _, flags, _, length, _ = HEADER.unpack(head)
        tag = (GMAC_TAG_SIZE if version >= GMAC_SINCE and not hello else TAG_SIZE) if flags & FLAG_AUTH else 0
        hello = False
        yield head + await reader.readexactly(length + tag)


async def _relay(target: int, tamper: Tamper) -> asyncio.Server:
    """A TCP relay to `target`: the server's bytes pass untouched, the client's pass through
    `tamper` frame by frame."""

    async def on_accept(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", target)

        async def back() -> None:
            while data := await s_reader.read(65536):
                c_writer.write(data)
                await c_writer.drain()
            c_writer.close()

        answering = asyncio.ensure_future(back())
        try:
            i = 0
            async for frame in _frames(c_reader):
                out = tamper(i, frame)
                i += 1
                if out is None:
                    break
                for chunk in out:
                    s_writer.write(chunk)
                await s_writer.drain()
        finally:
            s_writer.close()
            c_writer.close()
            answering.cancel()

    return await asyncio.start_server(on_accept, "127.0.0.1", 0)


class Server:
    """A frame server doing what an instance does first (the HELLO exchange), then keeping
    every frame it accepts, and the error that ended the connection."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.got: list[bytes] = []
        self.ended: list[Exception] = []

    async def handler(self, conn: wire.FramedConnection) -> None:
        await wire.server_handshake(conn)
        self.versions.append(conn.version)
        try:
            while True:
                self.got.append((await conn.recv()).payload)
        except Exception as e:
            self.ended.append(e)
            raise


async def _through(tamper: Tamper | None, then: Callable) -> tuple[Server, object]:
    server = Server()
    real = await wire.serve(server.handler, "127.0.0.1", 0, KEY)
    port = real.sockets[0].getsockname()[1]
    relay = await _relay(port, tamper) if tamper else None
    try:
        out = await then(relay.sockets[0].getsockname()[1] if relay else port, server)
        return server, out
    finally:
        for s in (relay, real):
            if s is not None:
                s.close()
                await s.wait_closed()


async def _hello(port: int, server: Server):
    try:
        conn, _ = await wire.connect("127.0.0.1", port, KEY, lambda v: {"role": "router", "router_id": "r"})
    except wire.FrameError as e:
        return e
    conn.close()
    return conn.version


def _newest_hello_closed(i: int, frame: bytes) -> list[bytes] | None:
    return None if i == 0 and frame[2] == NEWEST else [frame]


def _newest_hello_rewritten(i: int, frame: bytes) -> list[bytes] | None:
    if i == 0 and frame[2] == NEWEST:
        return [frame[:2] + bytes([NEWEST - 1]) + frame[3:]]
    return [frame]


def test_without_a_relay_the_pair_speaks_the_newest():
    server, version = asyncio.run(_through(None, _hello))
    assert version == NEWEST and server.versions == [NEWEST]


@pytest.mark.parametrize("tamper", [_newest_hello_closed, _newest_hello_rewritten], ids=["closed", "rewritten"])
def test_a_relay_cannot_step_the_pair_down(tamper):
    server, refused = asyncio.run(_through(tamper, _hello))
    assert isinstance(refused, wire.Downgrade), refused
    assert f"speaks protocol {NEWEST}" in str(refused)
    assert server.versions == [NEWEST - 1]  # the server answered the older HELLO: its answer said so


def test_a_server_that_speaks_only_the_older_version_is_still_reached(monkeypatch):
    monkeypatch.setenv(wire.PROTOCOL_ENV, str(NEWEST - 1))  # what the server's end speaks
    monkeypatch.setattr("pdd.transfer.wire.handshake.offered_protocol", lambda: NEWEST)  # the client's
    server, version = asyncio.run(_through(None, _hello))
    assert version == NEWEST - 1 and server.versions == [NEWEST - 1]


async def _send_three(port: int, server: Server) -> list[bytes]:
    conn, _ = await wire.connect("127.0.0.1", port, KEY, lambda v: {"role": "router", "router_id": "r"})
    try:
        for payload in (b"one", b"two", b"three"):
            await conn.send(wire.MsgType.PING, payload)
        for _ in range(200):
            if server.ended:
                break
            await asyncio.sleep(0.01)
    finally:
        conn.close()
    return server.got


def _after_hello(change: Callable[[list[bytes]], list[bytes] | None]) -> Tamper:
    """A tamper that passes the HELLO and hands the frames after it to `change` as they come:
    `held` is what it kept back."""
    held: list[bytes] = []

    def tamper(i: int, frame: bytes) -> list[bytes] | None:
        return [frame] if i == 0 else change([*held, frame] if held else [frame], held, i)

    return tamper


def _replay(frames, held, i):
    return frames * 2 if i == 1 else frames  # "one" twice


def _reorder(frames, held, i):
    if i == 1:
        held.append(frames[0])
        return []
    out = frames[::-1] if i == 2 else frames  # "two" before "one"
    held.clear()
    return out


def _truncate(frames, held, i):
    return [frames[0][: len(frames[0]) // 2]] if i == 2 else (None if i > 2 else frames)  # half of "two", then gone


@pytest.mark.parametrize(("tamper", "kept", "error"), [
    (_replay, [b"one"], wire.BadSequence),
    (_reorder, [], wire.BadSequence),
    (_truncate, [b"one"], wire.ConnectionClosed),
], ids=["replayed", "reordered", "truncated"])
def test_a_replayed_reordered_or_truncated_frame_is_refused(tamper, kept, error):
    before = wire.REJECTS.snapshot()
    server, got = asyncio.run(_through(_after_hello(tamper), _send_three))
    assert got == kept
    assert len(server.ended) == 1 and isinstance(server.ended[0], error), server.ended
    if error is wire.BadSequence:
        after = wire.REJECTS.snapshot()
        assert sum(after.values()) > sum(before.values()), (before, after)
