"""The framed wire protocol: what gets through, what is refused, and how a server copes."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
import zlib
from collections.abc import Coroutine
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdd
from pdd.transfer import wire
from pdd.transfer.wire import (
    GMAC_TAG_SIZE,
    HEADER,
    PROTOCOL_VERSION,
    REJECTS,
    TAG_SIZE,
    BadChecksum,
    BadMac,
    BadMagic,
    BadPayload,
    BadSequence,
    BadVersion,
    ConnectionClosed,
    Frame,
    FrameCodec,
    FramedConnection,
    FrameError,
    MsgType,
    TooLarge,
    UnknownType,
    connection_key,
    decode_json,
    encode_json,
    open_connection,
    pack_with_header,
    serve,
    unpack_with_header,
)

KEY = connection_key("correct horse battery staple", "dc-a/p0->dc-b/md0")
OTHER_KEY = connection_key("correct horse battery staple", "dc-a/p0->dc-b/md1")
FIELDS = {  # byte offsets of the header fields
    "magic": range(0, 2),
    "version": range(2, 3),
    "type": range(3, 4),
    "flags": range(4, 5),
    "seq": range(5, 13),
    "length": range(13, 17),
    "crc": range(17, 21),
}


def run(coro: Coroutine[Any, Any, Any], timeout: float = 20.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def decode_stream(codec: FrameCodec, data: bytes) -> list[Frame]:
    """Every frame in `data`, read as a connection would; errors (incl. truncation) propagate."""

    async def go() -> list[Frame]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        frames = []
        while not reader.at_eof():
            frames.append(await codec.read(reader))
        return frames

    return run(go(), timeout=10)


def one_frame(key: bytes | None, payload: bytes = b'{"request":"r1"}', msg_type: MsgType = MsgType.TOKENS) -> bytes:
    return FrameCodec(key).encode(msg_type, payload)


def flipped(data: bytes, index: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[index] ^= mask
    return bytes(out)


@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "auth"])
def test_every_message_type_round_trips(key: bytes | None) -> None:
    sender = FrameCodec(key)
    payloads = {t: f"payload of {t.name}".encode() * (t.value % 3) for t in MsgType}
    stream = b"".join(sender.encode(t, p) for t, p in payloads.items())
    frames = decode_stream(FrameCodec(key), stream)
    assert [(f.type, f.payload) for f in frames] == list(payloads.items())
    assert [f.seq for f in frames] == list(range(len(MsgType)))


def test_message_numbers_are_stable() -> None:
    assert {t.name: t.value for t in MsgType} == {
        "HELLO": 1, "RESERVE": 2, "RESERVE_ACK": 3, "KV_LAYER": 4, "KV_DONE": 5, "TOKENS": 6,
        "CACHE_EVENT": 7, "ABORT": 8, "ERROR": 9, "PING": 10, "PONG": 11, "RELEASE": 12, "RESULT": 13, "SUBMIT": 14,
        "PIPELINE": 15, "KV_ACK": 16, "READY": 17, "HANDOFF": 18, "HANDOFF_ACK": 19, "HANDED_OFF": 20,
        "MEMBER": 21, "DRAIN": 22, "PROGRESS": 23, "KV_REGION_ASK": 24, "KV_REGION": 25, "KV_PLACED": 26,
        "KV_SLOT_FREE": 27,
    }  # fmt: skip


def test_frame_sizes() -> None:
    payload = b"x" * 1000
    assert len(one_frame(None, payload)) == HEADER.size + 1000
    assert len(one_frame(KEY, payload)) == HEADER.size + 1000 + TAG_SIZE


def _session(version: int) -> tuple[FrameCodec, FrameCodec]:
    """Two ends of one connection after its handshake, in `version`: (sender, receiver)."""
    c2s, s2c = b"c" * 32, b"s" * 32
    sender, receiver = FrameCodec(KEY, version=version), FrameCodec(KEY, version=version)
    sender.rekey(send_key=c2s, recv_key=s2c)
    receiver.rekey(send_key=s2c, recv_key=c2s)
    return sender, receiver


@pytest.mark.parametrize("version", [4, 5, 6, 7])
@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "session"])
def test_a_payload_in_parts_is_the_frame_of_its_parts_joined(version: int, keyed: bool) -> None:
    """A KV payload goes out as its parts (header, K, V: not joined first); its frame is byte
    for byte the joined payload's, whatever checks it (CRC32, CRC32C, HMAC, GMAC)."""
    parts = [b"head", memoryview(bytes(range(256)) * 3), b"", bytearray(b"tail" * 5)]
    if keyed:
        (one, _), (other, _) = _session(version), _session(version)
    else:
        one, other = FrameCodec(None, version=version), FrameCodec(None, version=version)
    assert one.encode(MsgType.KV_LAYER, parts) == other.encode(MsgType.KV_LAYER, b"".join(parts))


def test_session_frames_carry_a_gmac_tag_from_protocol_5_and_hmac_before() -> None:
    """Under session keys, a protocol-5 frame ends in a 16-byte GMAC tag and carries no
    CRC32 (the tag covers it); protocol 4's carry HMAC-SHA256 and the CRC. Each decodes
    only with its own end's keys, in order; a flipped bit of what the tag covers is a bad MAC."""
    payload = bytes(range(256)) * 8
    for version, tag, crc in ((5, GMAC_TAG_SIZE, 0), (4, TAG_SIZE, zlib.crc32(payload))):
        sender, receiver = _session(version)
        frames = [sender.encode(MsgType.KV_LAYER, payload) for _ in range(2)]
        assert len(frames[0]) == HEADER.size + len(payload) + tag
        assert int.from_bytes(frames[0][FIELDS["crc"].start:FIELDS["crc"].stop], "big") == crc
        assert frames[0][-tag:] != frames[1][-tag:]  # the same payload: another sequence number, another tag
        assert [f.payload for f in decode_stream(receiver, b"".join(frames))] == [payload, payload]
        _, fresh = _session(version)
        covered = [i for f in ("type", "flags", "seq", "crc") for i in FIELDS[f]]  # (framing: its own errors)
        for index in [*covered, HEADER.size, HEADER.size + 1000, len(frames[0]) - 1]:
            with pytest.raises(BadMac):
                decode_stream(_session(version)[1], flipped(frames[0], index))
        with pytest.raises(BadSequence):  # replayed: its tag is good, its place is not
            decode_stream(fresh, frames[0] + frames[0])
        reflected, _ = _session(version)  # sent back to its sender: the other direction's key
        with pytest.raises(BadMac):
            decode_stream(reflected, frames[0])


@pytest.mark.parametrize("size", [0, 100, 64 * 1024, 64 * 1024 + 1, 300_000])
def test_a_small_frames_one_call_tag_is_the_gmac_its_parts_stream_to(size: int, monkeypatch) -> None:
    """A frame of up to `ONE_CALL_BYTES` is tagged (and checked) in one call of its key's
    `AESGCM`, a larger one by streaming its parts through a `Cipher`: the same tag either
    way, so each end may take either path; a flipped bit fails both."""
    from pdd.transfer.wire import frame as frame_module

    payload = (bytes(range(256)) * (size // 256 + 1))[:size]
    one_call, default = _session(7)[0].encode(MsgType.KV_LAYER, payload), frame_module.ONE_CALL_BYTES
    monkeypatch.setattr(frame_module, "ONE_CALL_BYTES", -1)
    streamed = _session(7)[0].encode(MsgType.KV_LAYER, payload)
    assert one_call == streamed
    for calls in (-1, default, 1 << 20):
        monkeypatch.setattr(frame_module, "ONE_CALL_BYTES", calls)
        assert [f.payload for f in decode_stream(_session(7)[1], one_call)] == [payload]
        with pytest.raises(BadMac):
            decode_stream(_session(7)[1], flipped(one_call, len(one_call) - 1 - size // 2))


@pytest.mark.parametrize("field", ["type", "flags", "seq", "crc"])
def test_tampered_header_field_is_bad_mac(field: str) -> None:
    frame = one_frame(KEY)
    for index in FIELDS[field]:
        for mask in (0x01, 0x80):
            with pytest.raises(BadMac):
                decode_stream(FrameCodec(KEY), flipped(frame, index, mask))


def test_tampered_payload_or_tag_is_bad_mac() -> None:
    frame = one_frame(KEY)
    for index in range(HEADER.size, len(frame)):
        with pytest.raises(BadMac):
            decode_stream(FrameCodec(KEY), flipped(frame, index))


def test_tampered_framing_fields_are_refused() -> None:
    frame = one_frame(KEY)
    with pytest.raises(BadMagic):
        decode_stream(FrameCodec(KEY), flipped(frame, 0))
    with pytest.raises(BadVersion):
        decode_stream(FrameCodec(KEY), flipped(frame, 2))
    for index in FIELDS["length"]:
        # a shorter length misplaces the tag (BadMac); a longer one runs past the end of
        # the stream or over the limit: never a frame
        with pytest.raises((FrameError, ConnectionClosed)):
            decode_stream(FrameCodec(KEY), flipped(frame, index))
    length = len(frame) - HEADER.size - TAG_SIZE
    shorter = frame[:13] + struct.pack("!I", length - 1) + frame[17:]
    with pytest.raises(BadMac):
        decode_stream(FrameCodec(KEY), shorter)


def test_wrong_key_is_bad_mac() -> None:
    with pytest.raises(BadMac):
        decode_stream(FrameCodec(OTHER_KEY), one_frame(KEY))


def test_auth_mismatch_either_way_is_bad_mac() -> None:
    with pytest.raises(BadMac, match="requires authentication"):
        decode_stream(FrameCodec(KEY), one_frame(None))
    with pytest.raises(BadMac, match="without a key"):
        decode_stream(FrameCodec(None), one_frame(KEY))


def test_bad_magic_version_and_garbage() -> None:
    frame = one_frame(None)
    with pytest.raises(BadMagic):
        decode_stream(FrameCodec(None), b"XX" + frame[2:])
    with pytest.raises(BadVersion):
        decode_stream(FrameCodec(None), frame[:2] + bytes([PROTOCOL_VERSION + 1]) + frame[3:])
    with pytest.raises(BadMagic):
        decode_stream(FrameCodec(KEY), b"GET / HTTP/1.1\r\nHost: example\r\n\r\n")


def test_unknown_type() -> None:
    header = HEADER.pack(b"PD", PROTOCOL_VERSION, 200, 0, 0, 2, zlib.crc32(b"{}"))
    with pytest.raises(UnknownType):
        decode_stream(FrameCodec(None), header + b"{}")


def test_unknown_type_with_valid_mac() -> None:
    header = HEADER.pack(b"PD", PROTOCOL_VERSION, 0, 1, 0, 2, zlib.crc32(b"{}"))
    tag = hmac.new(KEY, header + b"{}", hashlib.sha256).digest()
    with pytest.raises(UnknownType):
        decode_stream(FrameCodec(KEY), header + b"{}" + tag)


def test_crc_mismatch_without_auth() -> None:
    frame = one_frame(None)
    with pytest.raises(BadChecksum):
        decode_stream(FrameCodec(None), flipped(frame, len(frame) - 1))


def test_keyless_frames_carry_crc32c_from_protocol_6_and_crc32_before() -> None:
    """A keyless frame's checksum is CRC32C (hardware: the 0.36x -> ~0.9x of raw TCP in
    BENCHMARKS.md) from protocol 6 and zlib's CRC32 in 4 and 5; each end checks the one
    its version names, so a frame with the other's is refused."""
    from crc32c import crc32c

    payload = bytes(range(256)) * 64
    for version, crc in ((6, crc32c(payload)), (5, zlib.crc32(payload)), (4, zlib.crc32(payload))):
        frame = FrameCodec(None, version=version).encode(MsgType.KV_LAYER, payload)
        assert int.from_bytes(frame[FIELDS["crc"].start:FIELDS["crc"].stop], "big") == crc
        assert decode_stream(FrameCodec(None, version=version), frame)[0].payload == payload
        for index in (HEADER.size, len(frame) - 1):
            with pytest.raises(BadChecksum):
                decode_stream(FrameCodec(None, version=version), flipped(frame, index))
    assert crc32c(payload) != zlib.crc32(payload)
    other = HEADER.pack(b"PD", 6, MsgType.KV_LAYER, 0, 0, len(payload), zlib.crc32(payload)) + payload
    with pytest.raises(BadChecksum):
        decode_stream(FrameCodec(None, version=6), other)


def test_oversized_frame_is_refused_before_its_payload_arrives() -> None:
    """The limit check must not wait for (or buffer) the announced payload."""

    async def go() -> None:
        reader = asyncio.StreamReader()
        # a header and nothing more, no EOF
        reader.feed_data(HEADER.pack(b"PD", PROTOCOL_VERSION, MsgType.KV_LAYER, 0, 0, 2**31, 0))
        with pytest.raises(TooLarge):
            await asyncio.wait_for(FrameCodec(None, max_payload=1 << 20).read(reader), 5)

    run(go())


def test_sender_refuses_oversized_payload() -> None:
    codec = FrameCodec(KEY, max_payload=100)
    with pytest.raises(TooLarge):
        codec.encode(MsgType.KV_LAYER, b"x" * 101)
    assert codec.send_seq == 0  # nothing was consumed
    assert decode_stream(FrameCodec(KEY, max_payload=100), codec.encode(MsgType.KV_LAYER, b"x" * 100))


def test_replayed_frame_is_bad_sequence() -> None:
    frame = one_frame(KEY)
    with pytest.raises(BadSequence):
        decode_stream(FrameCodec(KEY), frame + frame)


def test_reordered_and_dropped_frames_are_bad_sequence() -> None:
    sender = FrameCodec(KEY)
    f0, f1, f2 = (sender.encode(MsgType.TOKENS, bytes([i])) for i in range(3))
    with pytest.raises(BadSequence):
        decode_stream(FrameCodec(KEY), f1 + f0)
    with pytest.raises(BadSequence):
        decode_stream(FrameCodec(KEY), f0 + f2)


def test_truncated_stream_is_a_closed_connection_not_a_frame() -> None:
    frame = one_frame(KEY)
    with pytest.raises(ConnectionClosed, match="middle of a frame"):
        decode_stream(FrameCodec(KEY), frame[:-1])
    assert decode_stream(FrameCodec(KEY), b"") == []

    async def clean_close() -> None:
        reader = asyncio.StreamReader()
        reader.feed_eof()
        with pytest.raises(ConnectionClosed, match="closed the connection$"):
            await FrameCodec(KEY).read(reader)

    run(clean_close())


def test_json_helpers() -> None:
    obj = {"request": "r-1", "tokens": [1, 2, 3], "text": "ünïcode", "nested": {"ok": True, "x": None}}
    assert decode_json(encode_json(obj)) == obj
    for bad in (b"[1, 2]", b'"str"', b"\xff\xfe", b"{not json", b'{"x": NaN}', b'{"x": Infinity}', b"[" * 100_000):
        with pytest.raises(BadPayload):
            decode_json(bad)
    with pytest.raises(BadPayload):
        decode_json(b'{"x": "' + b"a" * 2000 + b'"}', max_bytes=1000)
    with pytest.raises(TypeError):
        encode_json([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        encode_json({"x": float("nan")})


def test_pack_with_header_round_trip_and_bounds() -> None:
    blob = bytes(range(256)) * 40
    header, view = unpack_with_header(pack_with_header({"layer": 3, "tokens": [0, 16]}, memoryview(blob)))
    assert header == {"layer": 3, "tokens": [0, 16]}
    assert isinstance(view, memoryview) and view.tobytes() == blob
    packed = pack_with_header({"layer": 3}, b"")
    assert unpack_with_header(packed)[1].tobytes() == b""
    for bad in (b"", b"\x00\x00", struct.pack("!I", 100) + b"{}", struct.pack("!I", 2) + b"[]", packed[:-1]):
        with pytest.raises(BadPayload):
            unpack_with_header(bad)


def _rfc5869(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """HKDF-SHA256 as RFC 5869 writes it, from hmac alone: what the keys must be."""
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
    return out[:length]


def test_keys_are_hkdf_sha256_of_the_version_labels() -> None:
    """The derivations are on the wire: changing one is a new PROTOCOL_VERSION (and the
    versions still spoken, 4 to 7, use these)."""
    assert (wire.OLDEST_PROTOCOL, PROTOCOL_VERSION) == (4, 7)
    assert KEY == _rfc5869(b"correct horse battery staple", b"", b"pdd/link-key/v2\x00dc-a/p0->dc-b/md0", 32)
    c, s = b"c" * wire.NONCE_BYTES, b"s" * wire.NONCE_BYTES
    both = _rfc5869(KEY, c + s, b"pdd/session/v2", 64)
    assert wire.session_keys(KEY, c, s) == (both[:32], both[32:])
    assert wire.session_keys(KEY, s, c) != wire.session_keys(KEY, c, s)


def test_connection_key_derivation() -> None:
    assert len(KEY) == 32
    assert KEY == connection_key("correct horse battery staple", "dc-a/p0->dc-b/md0")
    assert KEY != OTHER_KEY
    assert KEY != connection_key("another secret", "dc-a/p0->dc-b/md0")
    with pytest.raises(ValueError):
        connection_key("", "x")


async def _pong_handler(conn: FramedConnection) -> None:
    while True:
        frame = await conn.recv()
        if frame.type == MsgType.PING:
            await conn.send(MsgType.PONG, frame.payload)


async def _read_until_closed(reader: asyncio.StreamReader) -> None:
    """Returns when the server has dropped us (EOF or reset)."""
    try:
        while await reader.read(65536):
            pass
    except ConnectionError:
        pass


def test_server_drops_bad_peers_and_keeps_serving() -> None:
    async def go() -> None:
        server = await serve(_pong_handler, "127.0.0.1", 0, KEY)
        port = server.sockets[0].getsockname()[1]
        before = REJECTS.snapshot()
        try:
            # 1. garbage bytes
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"\x00garbage that is not a frame" * 10)
            await asyncio.wait_for(_read_until_closed(reader), 10)
            writer.close()
            # 2. a well-formed frame under the wrong key
            bad = await open_connection("127.0.0.1", port, OTHER_KEY)
            await bad.send(MsgType.PING, b"hello")
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(bad.recv(), 10)
            bad.close()
            # 3. an honest peer still gets its PONG
            good = await open_connection("127.0.0.1", port, KEY)
            try:
                for i in range(3):
                    await good.send(MsgType.PING, f"ping {i}".encode())
                    pong = await asyncio.wait_for(good.recv(), 10)
                    assert (pong.type, pong.payload, pong.seq) == (MsgType.PONG, f"ping {i}".encode(), i)
                assert good.frames_sent == good.frames_received == 3
                assert good.bytes_sent == good.bytes_received == sum(HEADER.size + 6 + TAG_SIZE for _ in range(3))
            finally:
                good.close()
                await good.wait_closed()
        finally:
            server.close()
            await server.wait_closed()
        after = REJECTS.snapshot()
        assert after.get("BadMagic", 0) - before.get("BadMagic", 0) == 1
        assert after.get("BadMac", 0) - before.get("BadMac", 0) == 1

    run(go())


def test_json_messages_over_a_real_connection() -> None:
    async def handler(conn: FramedConnection) -> None:
        frame = await conn.recv()
        req = decode_json(frame.payload)
        await conn.send_json(MsgType.RESERVE_ACK, {"request": req["request"], "hit_tokens": len(req["blocks"]) * 16})

    async def go() -> None:
        server = await serve(handler, "127.0.0.1", 0, KEY)
        conn = await open_connection("127.0.0.1", server.sockets[0].getsockname()[1], KEY)
        try:
            await conn.send_json(MsgType.RESERVE, {"request": "r7", "blocks": [11, 12, 13]})
            ack = await asyncio.wait_for(conn.recv(), 10)
            assert ack.type == MsgType.RESERVE_ACK and decode_json(ack.payload) == {"request": "r7", "hit_tokens": 48}
            with pytest.raises(ConnectionClosed):  # the handler returned: the server closes
                await asyncio.wait_for(conn.recv(), 10)
            # an authentic frame whose payload is not JSON is rejected too
            before = REJECTS.snapshot().get("BadPayload", 0)
            bad = await open_connection("127.0.0.1", server.sockets[0].getsockname()[1], KEY)
            try:
                await bad.send(MsgType.RESERVE, b"\x80 not json")
                with pytest.raises(ConnectionClosed):
                    await asyncio.wait_for(bad.recv(), 10)
            finally:
                bad.close()
            assert REJECTS.snapshot().get("BadPayload", 0) == before + 1
        finally:
            conn.close()
            server.close()
            await server.wait_closed()

    run(go())


def test_frames_of_every_size_cross_a_real_connection_whole_with_a_slow_reader() -> None:
    """`FrameStream` stages headers and small payloads and reads large ones straight into
    their own buffers: frames at each side of that line, and of the staging buffer's, in
    both directions of a real connection, with a reader that falls behind (so the
    transport pauses and resumes, and large buffers fill before their reader wakes),
    arrive whole and in order; so does a PING answered while frames are still in."""
    from pdd.transfer.wire.stream import DIRECT_MIN_BYTES, STAGING_BYTES

    sizes = [0, 1, 23, DIRECT_MIN_BYTES - 1, DIRECT_MIN_BYTES, DIRECT_MIN_BYTES + 1, STAGING_BYTES + 7, 3 << 20]
    payloads = [bytes((i * 131 + j) % 251 for j in range(n)) for i, n in enumerate(sizes * 3)]
    echoed: list[bytes] = []

    async def echo(conn: FramedConnection) -> None:
        for i in range(len(payloads)):
            frame = await conn.recv()
            if i % 4 == 0:
                await asyncio.sleep(0.05)  # behind: what the sender writes piles up
            await conn.send(MsgType.KV_LAYER, frame.payload)

    async def go() -> None:
        server = await serve(echo, "127.0.0.1", 0, None)  # (with a key: a handshake first)
        conn = await open_connection("127.0.0.1", server.sockets[0].getsockname()[1], None)
        try:
            sender = asyncio.ensure_future(_send_all(conn, payloads))
            for _ in payloads:
                echoed.append(bytes((await asyncio.wait_for(conn.recv(), 30)).payload))
            await sender
        finally:
            conn.close()
            server.close()
            await server.wait_closed()

    run(go())
    assert [len(p) for p in echoed] == [len(p) for p in payloads]
    assert echoed == payloads


def test_a_large_payload_buffer_is_reused_only_once_nobody_holds_it() -> None:
    """Large reads reuse the stream's earlier buffers (no zeroing, warm memory), but never
    one its reader still holds, by the payload itself or by a view of it (a tensor over
    the KV, say): those keep their bytes while later frames of the same size arrive."""
    n = 256 * 1024
    payloads = [bytes([i]) * n for i in range(12)]
    held: dict[int, Any] = {}
    seen: list[int] = []

    async def keep(conn: FramedConnection) -> None:
        for i in range(len(payloads)):
            frame = await conn.recv()
            seen.append(id(frame.payload))
            if i % 3 == 0:
                held[i] = frame.payload  # the payload itself
            elif i % 3 == 1:
                held[i] = memoryview(frame.payload)[10:]  # only a view of it
            del frame  # (i % 3 == 2: dropped: its buffer may serve a later frame)

    _one_frame_at_a_time(keep, payloads, lambda: len(seen) == len(payloads))
    for i, kept in held.items():
        want = payloads[i] if i % 3 == 0 else payloads[i][10:]
        assert bytes(kept) == want, f"frame {i}'s bytes were overwritten by a later frame"
    assert len(seen) == len(payloads)


def test_large_payloads_of_slightly_different_sizes_share_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KV frame's header grows with its chunk's block hashes, so no two frames of a
    prompt are the same size: a buffer kept for reuse must serve frames a few bytes apart
    (a fresh buffer a frame is zeroed and cold). Twelve frames read one at a time and
    dropped take at most two buffers, and each frame's bytes are its own."""
    from pdd.transfer.wire import stream

    made: list[int] = []

    class Counted(bytearray):
        def __init__(self, size: int) -> None:
            super().__init__(size)
            made.append(size)

    monkeypatch.setattr(stream, "bytearray", Counted, raising=False)
    payloads = [bytes([i]) * (300_000 + 97 * i) for i in range(12)]
    echoed: list[bytes] = []

    async def read(conn: FramedConnection) -> None:
        for _ in payloads:
            echoed.append(bytes((await conn.recv()).payload))  # (the payload is dropped at once)

    _one_frame_at_a_time(read, payloads, lambda: len(echoed) == len(payloads))
    assert echoed == payloads
    large = [n for n in made if n >= min(map(len, payloads))]
    assert 1 <= len(large) <= 2, f"{len(large)} buffers for {len(payloads)} frames"


def _one_frame_at_a_time(reader: Any, payloads: list[bytes], finished: Any) -> None:
    """`payloads` to a server running `reader`, a frame at a time (the reader is done with
    each before the next), until `finished()` says it has read them."""

    async def go() -> None:
        server = await serve(reader, "127.0.0.1", 0, None)
        conn = await open_connection("127.0.0.1", server.sockets[0].getsockname()[1], None)
        try:
            for p in payloads:
                await conn.send(MsgType.KV_LAYER, p)
                await asyncio.sleep(0.01)
            for _ in range(500):
                if finished():
                    break
                await asyncio.sleep(0.01)
        finally:
            conn.close()
            server.close()
            await server.wait_closed()

    run(go())


async def _send_all(conn: FramedConnection, payloads: list[bytes]) -> None:
    for p in payloads:
        await conn.send(MsgType.KV_LAYER, p)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(
    frames=st.lists(st.tuples(st.sampled_from(list(MsgType)), st.binary(max_size=2048)), min_size=1, max_size=5),
    auth=st.booleans(),
)
def test_random_payloads_round_trip(frames: list[tuple[MsgType, bytes]], auth: bool) -> None:
    key = KEY if auth else None
    sender = FrameCodec(key)
    decoded = decode_stream(FrameCodec(key), b"".join(sender.encode(t, p) for t, p in frames))
    assert [(f.type, f.payload) for f in decoded] == frames


@FUZZ
@given(payload=st.binary(max_size=512), data=st.data())
def test_random_byte_flips_never_decode_under_auth(payload: bytes, data: st.DataObject) -> None:
    frame = bytearray(FrameCodec(KEY).encode(MsgType.KV_LAYER, payload))
    flips = data.draw(st.dictionaries(st.integers(0, len(frame) - 1), st.integers(1, 255), min_size=1, max_size=4))
    for index, mask in flips.items():
        frame[index] ^= mask
    with pytest.raises((FrameError, ConnectionClosed)):
        decode_stream(FrameCodec(KEY), bytes(frame))


def test_a_recorded_session_cannot_be_replayed_on_a_new_connection():
    """Both ends add a fresh nonce: frames captured from one connection fail on another."""
    key = wire.connection_key("secret", "instances")

    async def scenario() -> None:
        seen: list[dict] = []

        async def handler(conn: wire.FramedConnection) -> None:
            seen.append(await wire.server_handshake(conn))
            seen.append(decode_json((await conn.recv()).payload))

        server = await wire.serve(handler, "127.0.0.1", 0, key)
        port = server.sockets[0].getsockname()[1]
        try:
            # an honest client, whose bytes an eavesdropper records
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            tap = wire.FramedConnection(reader, _Recorder(writer), wire.FrameCodec(key))
            await wire.client_handshake(tap, {"role": "router"})
            await tap.send_json(wire.MsgType.SUBMIT, {"rid": "r1"})
            for _ in range(200):  # wait for the frame to arrive, not for a guessed time
                if seen and seen[-1] == {"rid": "r1"}:
                    break
                await asyncio.sleep(0.025)
            assert seen[-1] == {"rid": "r1"}
            writer.close()
            # the replay: the same bytes, on a new connection
            rejects = wire.REJECTS.total()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"".join(tap._writer.sent))
            await writer.drain()
            await asyncio.wait_for(reader.read(), 5)  # the server answers HELLO, then drops us
            writer.close()
            assert wire.REJECTS.total() == rejects + 1
            assert seen.count({"rid": "r1"}) == 1
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


class _Recorder:
    """A StreamWriter stand-in that keeps a copy of everything written."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer, self.sent = writer, []

    def writelines(self, parts) -> None:
        parts = [bytes(p) for p in parts]
        self.sent.extend(parts)
        self._writer.writelines(parts)

    def get_extra_info(self, name: str, default=None):
        # no socket: the connection writes through `writelines`, not to the descriptor itself
        return None if name == "socket" else self._writer.get_extra_info(name, default)

    def __getattr__(self, name: str):
        return getattr(self._writer, name)


def test_before_the_handshake_only_a_hello_sized_frame_is_read() -> None:
    """An unauthenticated peer cannot make us buffer megabytes: past HELLO size, the
    frame is refused at its header; once the handshake has rekeyed the codec, the
    connection's full limit applies."""

    async def announced(codec: FrameCodec, length: int) -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(HEADER.pack(b"PD", PROTOCOL_VERSION, MsgType.HELLO, wire.FLAG_AUTH, 0, length, 0))
        await asyncio.wait_for(codec.read(reader), 2)

    fresh = FrameCodec(KEY)
    with pytest.raises(TooLarge, match="before the handshake"):
        run(announced(fresh, wire.HANDSHAKE_MAX_PAYLOAD + 1))
    rekeyed = FrameCodec(KEY)
    rekeyed.rekey(KEY, KEY)
    with pytest.raises(asyncio.TimeoutError):  # within the limit: it waits for the payload
        run(announced(rekeyed, 60 * 1024 * 1024))


def test_silent_unauthenticated_connections_are_capped() -> None:
    async def go() -> None:
        server = await serve(_pong_handler, "127.0.0.1", 0, KEY)
        port = server.sockets[0].getsockname()[1]
        silent = []
        try:
            for _ in range(wire.MAX_UNAUTHENTICATED):
                silent.append(await asyncio.open_connection("127.0.0.1", port))
            await asyncio.sleep(0)  # (each accept runs on the server's loop, which is this one)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await asyncio.wait_for(reader.read(1), 5) == b""  # closed at once
            writer.close()
            for _, w in silent:
                w.close()
            assert await _pong_once(port) == b"still serving"  # once the server sees them gone
        finally:
            server.close()
            await server.wait_closed()

    run(go())


async def _pong_once(port: int, deadline_s: float = 5.0) -> bytes:
    """PING an honest client's way in, retrying while the server is still full."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        good = await open_connection("127.0.0.1", port, KEY)
        try:
            await good.send(MsgType.PING, b"still serving")
            return (await asyncio.wait_for(good.recv(), 5)).payload
        except ConnectionError:
            if loop.time() > end:
                raise
            await asyncio.sleep(0.05)
        finally:
            good.close()


@pytest.mark.parametrize("server_speaks", [5, 4])
def test_the_version_is_settled_in_hello(server_speaks, monkeypatch) -> None:
    """A server answers in the client's version if it speaks it (with its release from 5
    on); a server pinned to the version before (`PDD_PROTOCOL`: on the wire, the release
    before) closes on a newer HELLO, and `connect` says it again in the older one. A
    client pinned so speaks its own to either."""
    key = wire.connection_key("secret", "instances")
    monkeypatch.setenv(wire.PROTOCOL_ENV, str(server_speaks))  # what the server's end reads

    async def scenario() -> list[tuple[int, dict, tuple]]:
        seen: list[tuple] = []

        async def handler(conn: wire.FramedConnection) -> None:
            hello = await wire.server_handshake(conn)
            seen.append((conn.version, hello, decode_json((await conn.recv()).payload)))

        server = await wire.serve(handler, "127.0.0.1", 0, key)
        port = server.sockets[0].getsockname()[1]
        out = []
        try:
            for client_speaks in (5, 4):
                monkeypatch.setattr("pdd.transfer.wire.handshake.offered_protocol", lambda v=client_speaks: v)
                conn, reply = await wire.connect("127.0.0.1", port, key, lambda v: {"role": "router", "said": v})
                await conn.send_json(wire.MsgType.SUBMIT, {"rid": "r1"})
                for _ in range(200):
                    if len(seen) > len(out):
                        break
                    await asyncio.sleep(0.025)
                out.append((conn.version, reply, seen[-1]))
                conn.close()
        finally:
            server.close()
            await server.wait_closed()
        return out

    newest_client, oldest_client = asyncio.run(asyncio.wait_for(scenario(), 30))
    for version, reply, (server_version, hello, body) in (newest_client, oldest_client):
        assert version == server_version == hello["said"] and body == {"rid": "r1"}
        assert reply.get("software") == (pdd.__version__ if version >= 5 else None)
    assert (newest_client[0], oldest_client[0]) == (server_speaks, 4)


def test_a_pinned_version_must_be_one_spoken(monkeypatch) -> None:
    for bad in ("3", "8", "five", "-4"):
        monkeypatch.setenv(wire.PROTOCOL_ENV, bad)
        with pytest.raises(ValueError, match="speaks protocols 4-7"):
            wire.offered_protocol()
    monkeypatch.setenv(wire.PROTOCOL_ENV, "4")
    assert wire.offered_protocol() == 4
    frame = FrameCodec(None, version=5).encode(MsgType.PING, b"")
    with pytest.raises(BadVersion, match="this process speaks 4-4"):
        decode_stream(FrameCodec(None, version=None), frame)
    with pytest.raises(BadVersion, match="the connection speaks 4"):
        decode_stream(FrameCodec(None, version=4), frame)
