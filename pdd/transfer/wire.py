"""The one framed binary protocol spoken between pdd instances.

Reservations, KV pages, token IDs and cache events all cross the WAN in these frames,
so the format is strict: a fixed header (magic, version, type, flags, sequence number,
payload length, CRC32), the payload, and — on authenticated connections — an
HMAC-SHA256 tag over header and payload. The length is checked against a limit
*before* the payload is read, so a hostile or broken peer cannot make us buffer
gigabytes. The sequence number sits inside the MAC'd header and must be exactly the
next one expected, so replayed, reordered or dropped frames are refused as well; and
the HELLO exchange switches each connection to its own per-direction session keys
(from nonces of both ends), so frames recorded on one connection fail on any other.
Payloads are raw bytes or JSON objects; nothing received is ever unpickled or
evaluated.

Any violation raises a specific `FrameError` subclass; `FramedConnection.reject` (called
by `recv`, and by `serve` for a payload the handler could not parse) counts it in the
process-wide `REJECTS` and closes the connection, since a byte stream that has lost
its framing cannot be trusted again.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import ssl
import struct
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

log = logging.getLogger(__name__)

MAGIC = b"PD"
PROTOCOL_VERSION = 2  # 2: typed bodies with token positions, the relay tier
FLAG_AUTH = 0x01
_KNOWN_FLAGS = FLAG_AUTH
# magic, version, type, flags, sequence, payload length, CRC32 of payload
HEADER = struct.Struct("!2sBBBQII")
TAG_SIZE = hashlib.sha256().digest_size
DEFAULT_MAX_PAYLOAD = 64 * 1024 * 1024
# Until the HELLO exchange has proven the peer holds the key, a frame may carry no more
# than a HELLO needs: an unauthenticated peer must not make us buffer megabytes.
HANDSHAKE_MAX_PAYLOAD = 4096
MAX_UNAUTHENTICATED = 32  # connections a server holds that have not completed the handshake
MAX_JSON_BYTES = 16 * 1024 * 1024
_HEADER_LEN = struct.Struct("!I")


class MsgType(IntEnum):
    """Message types. The numbers are on the wire: never renumber, only append."""

    HELLO = 1  # first frame of a connection: who is speaking, which role
    RESERVE = 2  # router/P -> MD: lock the longest cached prefix of a prompt
    RESERVE_ACK = 3  # MD -> P: the authoritative hit length
    KV_LAYER = 4  # P -> RLD/MD: KV pages of one layer (pack_with_header payload)
    KV_DONE = 5  # P -> RLD/MD: all KV of a request has been sent
    TOKENS = 6  # produced token IDs with their output position
    CACHE_EVENT = 7  # decode-side radix cache stored/removed events
    ABORT = 8  # cancel a request and free what it holds
    ERROR = 9  # the peer could not do what was asked
    PING = 10  # liveness and round-trip probe
    PONG = 11  # answer to PING, echoing its payload
    RELEASE = 12  # (protocol 1: drop a reservation; protocol 2 drops with ABORT)
    RESULT = 13  # final outcome of a request (finish reason, counts)
    SUBMIT = 14  # router -> P or standalone: run this request
    PIPELINE = 15  # P -> router: the pipeline chosen from the reserved hit
    KV_ACK = 16  # decode side -> P: KV imported so far
    READY = 17  # P -> RLD: MD holds the prompt's KV, hand off
    HANDOFF = 18  # RLD (or router) -> MD: output token IDs to extend and take over
    HANDOFF_ACK = 19  # MD -> RLD: catch-up tokens computed so far
    HANDED_OFF = 20  # RLD -> router: it stopped, MD produces from here
    MEMBER = 21  # router -> instance: an instance joined (or left) the deployment
    DRAIN = 22  # router -> instance: no new work comes; finish what you hold, then exit
    PROGRESS = 23  # instance -> router: a request moved forward without producing a token


class FrameError(ValueError):
    """A frame that must not be accepted; the connection carrying it is dropped."""


class BadMagic(FrameError):
    pass


class BadVersion(FrameError):
    pass


class BadFlags(FrameError):
    pass


class UnknownType(FrameError):
    pass


class TooLarge(FrameError):
    pass


class BadChecksum(FrameError):
    pass


class BadMac(FrameError):
    pass


class BadSequence(FrameError):
    pass


class BadPayload(FrameError):
    pass


class ConnectionClosed(ConnectionError):
    """The peer closed the stream (at a frame boundary or mid-frame).

    Not a `FrameError`: a peer going away, or a WAN drop, is a network event and
    must not be counted as a rejected (possibly hostile) frame.
    """


class RejectStats:
    """Process-wide count of rejected frames per error class, for metrics.

    Thread-safe because several event loops (one per thread) may share a process.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def record(self, err: FrameError) -> None:
        name = type(err).__name__
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + 1

    def snapshot(self) -> dict[str, int]:
        """A copy of the counts, e.g. for a Prometheus collector."""
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


REJECTS = RejectStats()


@dataclass(frozen=True)
class Frame:
    type: MsgType
    seq: int
    payload: bytes

    def json(self) -> dict[str, Any]:
        """The payload decoded as a JSON object (raises `BadPayload` otherwise)."""
        return decode_json(self.payload)


class FrameCodec:
    """Encodes and decodes frames for one connection, one counter per direction.

    With a key, every frame sent is authenticated and every frame received must be;
    without one, authenticated frames are refused too (a key mismatch between peers
    should fail loudly, not be silently ignored).
    """

    def __init__(self, key: bytes | None, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        if key is not None and not key:
            raise ValueError("an authentication key must not be empty")
        self._key = key  # the long-lived link key; frames use the per-direction keys below
        self._send_key = key
        self._recv_key = key
        self.max_payload = max_payload
        self._read_limit = HANDSHAKE_MAX_PAYLOAD if key else max_payload
        self.authenticated = False  # the handshake has switched to session keys
        self.send_seq = 0
        self.recv_seq = 0

    @property
    def key(self) -> bytes | None:
        return self._key

    def rekey(self, send_key: bytes, recv_key: bytes) -> None:
        """Switch to this connection's session keys (see `client_handshake`): the peer
        has proven it holds the link key, so full-size frames are accepted from now on."""
        self._send_key, self._recv_key = send_key, recv_key
        self._read_limit = self.max_payload
        self.authenticated = True

    @property
    def overhead(self) -> int:
        """Bytes a frame adds to its payload on this connection."""
        return HEADER.size + (TAG_SIZE if self._key else 0)

    def encode_parts(self, msg_type: MsgType, payload: bytes | memoryview) -> list[bytes | memoryview]:
        """The frame as separate buffers, so a large KV payload is never copied."""
        msg_type = MsgType(msg_type)
        if len(payload) > self.max_payload:
            raise TooLarge(f"payload of {len(payload)} bytes exceeds the limit of {self.max_payload}")
        flags = FLAG_AUTH if self._key else 0
        header = HEADER.pack(
            MAGIC, PROTOCOL_VERSION, msg_type, flags, self.send_seq, len(payload), zlib.crc32(payload)
        )
        self.send_seq += 1
        if not self._key:
            return [header, payload]
        return [header, payload, _mac(self._send_key, header, payload)]

    def encode(self, msg_type: MsgType, payload: bytes | memoryview) -> bytes:
        return b"".join(self.encode_parts(msg_type, payload))

    async def read(self, reader: asyncio.StreamReader) -> Frame:
        """Read exactly one frame, validating everything before returning it.

        Only what is needed to delimit the frame (magic, version, length, whether a
        tag follows) is checked before the MAC; everything else is checked after it,
        so on an authenticated connection any tampering there shows up as `BadMac`.
        """
        header = await _read_exactly(reader, HEADER.size, at_boundary=True)
        magic, version, raw_type, flags, seq, length, crc = HEADER.unpack(header)
        if magic != MAGIC:
            raise BadMagic(f"bad magic {magic!r}")
        if version != PROTOCOL_VERSION:
            raise BadVersion(f"protocol version {version}, expected {PROTOCOL_VERSION}")
        if length > self._read_limit:
            raise TooLarge(f"frame announces {length} bytes, the limit is {self._read_limit}"
                           + ("" if self.authenticated or not self._key else " before the handshake"))
        authenticated = bool(flags & FLAG_AUTH)
        if self._key and not authenticated:
            raise BadMac("unauthenticated frame on a connection that requires authentication")
        if authenticated and not self._key:
            raise BadMac("authenticated frame on a connection without a key")
        payload = await _read_exactly(reader, length, at_boundary=False)
        if self._key:
            tag = await _read_exactly(reader, TAG_SIZE, at_boundary=False)
            if not hmac.compare_digest(tag, _mac(self._recv_key, header, payload)):
                raise BadMac("message authentication code does not match")
        if flags & ~_KNOWN_FLAGS:
            raise BadFlags(f"unknown flag bits {flags:#04x}")
        try:
            msg_type = MsgType(raw_type)
        except ValueError:
            raise UnknownType(f"unknown message type {raw_type}") from None
        if seq != self.recv_seq:
            raise BadSequence(f"sequence number {seq}, expected {self.recv_seq}")
        if zlib.crc32(payload) != crc:
            raise BadChecksum("payload CRC32 does not match")
        self.recv_seq += 1
        return Frame(msg_type, seq, payload)


def _mac(key: bytes, header: bytes, payload: bytes | memoryview) -> bytes:
    mac = hmac.new(key, header, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


async def _read_exactly(reader: asyncio.StreamReader, n: int, *, at_boundary: bool) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as err:
        if at_boundary and not err.partial:
            raise ConnectionClosed("peer closed the connection") from None
        raise ConnectionClosed("peer closed the connection in the middle of a frame") from None


class FramedConnection:
    """One TCP connection speaking frames, with traffic counters.

    Sends may come from several tasks at once (a frame is written in one piece, so
    frames never interleave); receives must come from a single task.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, codec: FrameCodec) -> None:
        self._reader = reader
        self._writer = writer
        self._codec = codec
        self.peer: Any = writer.get_extra_info("peername")
        self.bytes_sent = 0
        self.bytes_received = 0
        self.frames_sent = 0
        self.frames_received = 0
        self.rejected: FrameError | None = None
        self.last_heard = time.monotonic()  # when the last whole frame arrived
        self.silent_for: float | None = None  # set when `keepalive` gave up on a silent peer

    async def send(self, msg_type: MsgType, payload: bytes | memoryview = b"") -> None:
        """Write one frame whole (concurrent senders never interleave), then wait for
        the socket buffer to drain, so a slow line pushes back on the producer."""
        self._write(msg_type, payload)
        await self._writer.drain()

    async def send_json(self, msg_type: MsgType, obj: dict[str, Any]) -> None:
        await self.send(msg_type, encode_json(obj))

    async def recv(self) -> Frame:
        """The next frame; on a bad one, reject it (count, drop the connection) and raise."""
        try:
            frame = await self._codec.read(self._reader)
        except FrameError as err:
            self.reject(err)
            raise
        self.bytes_received += len(frame.payload) + self._codec.overhead
        self.frames_received += 1
        self.last_heard = time.monotonic()
        return frame

    async def next_frame(self) -> Frame:
        """The next frame that is not liveness traffic: PINGs are answered here and
        PONGs only count as having heard from the peer."""
        while True:
            frame = await self.recv()
            if frame.type == MsgType.PING:
                self._write(MsgType.PONG, frame.payload)
            elif frame.type != MsgType.PONG:
                return frame

    def _write(self, msg_type: MsgType, payload: bytes | memoryview = b"") -> None:
        """Queue one frame whole without waiting for the buffer to drain (a liveness
        probe must not wait behind a slow line's backlog)."""
        parts = self._codec.encode_parts(msg_type, payload)
        self._writer.writelines(parts)
        self.bytes_sent += sum(len(p) for p in parts)
        self.frames_sent += 1

    async def keepalive(self, interval_s: float, dead_after_s: float) -> None:
        """PING the peer every `interval_s`; if nothing at all has arrived for
        `dead_after_s`, drop the connection, so its reader ends and its owner treats the
        peer as lost. A blackholed line keeps a TCP connection open and silent: without
        this, a dead peer would look healthy until every request on it timed out. The
        peer's reader must use `next_frame` (which answers PINGs)."""
        while not self.closed:
            await asyncio.sleep(interval_s)
            silent = time.monotonic() - self.last_heard
            if silent > dead_after_s:
                self.silent_for = silent
                log.warning("%s silent for %.1f s: dropping the connection", self.peer, silent)
                self.abort()
                return
            self._write(MsgType.PING)

    @property
    def socket(self) -> Any:
        """The underlying socket (for buffer sizes), if any."""
        return self._writer.get_extra_info("socket")

    @property
    def codec(self) -> FrameCodec:
        return self._codec

    def reject(self, err: FrameError) -> None:
        """Count a bad frame (or payload) and drop the connection, whose stream is no longer trusted.

        Callers use it too when a payload fails to parse (`BadPayload`); rejecting
        the same error twice counts it once.
        """
        if self.rejected is err:
            return
        self.rejected = err
        REJECTS.record(err)
        log.warning("rejected frame from %s: %s: %s", self.peer, type(err).__name__, err)
        self.close()

    def close(self) -> None:
        self._writer.close()

    def abort(self) -> None:
        """Close at once, dropping unsent data (a flush would wait on a dead line)."""
        self._writer.transport.abort()

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    async def wait_closed(self) -> None:
        """Wait until the socket is closed; a reset while closing is not an error."""
        try:
            await self._writer.wait_closed()
        except ConnectionError:
            pass


async def open_connection(
    host: str,
    port: int,
    key: bytes | None,
    *,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    connect_timeout: float | None = 10.0,
    tls: ssl.SSLContext | None = None,
) -> FramedConnection:
    """Connect to a frame server (over TLS with `tls`); the timeout, which covers the TLS
    handshake too, keeps a silent WAN from hanging us."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=tls), connect_timeout)
    return FramedConnection(reader, writer, FrameCodec(key, max_payload))


Handler = Callable[[FramedConnection], Awaitable[None]]


async def serve(
    handler: Handler,
    host: str,
    port: int,
    key: bytes | None,
    *,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    tls: ssl.SSLContext | None = None,
) -> asyncio.Server:
    """Start a TCP server that hands every accepted connection to `handler`.

    A connection whose handler fails — bad frame, peer gone, or a bug — is closed
    and logged; the server keeps serving everyone else.
    """

    pending: set[FramedConnection] = set()  # accepted, not yet authenticated

    async def on_accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = FramedConnection(reader, writer, FrameCodec(key, max_payload))
        pending.difference_update([c for c in pending if c.codec.authenticated or c.closed])
        if key and len(pending) >= MAX_UNAUTHENTICATED:
            log.warning("refused a connection from %s: %d others have not completed the handshake", conn.peer,
                        len(pending))
            conn.close()
            await conn.wait_closed()
            return
        pending.add(conn)
        try:
            await handler(conn)
        except FrameError as err:
            conn.reject(err)  # a no-op when recv() already rejected it
        except ConnectionError as err:
            log.debug("connection from %s ended: %s", conn.peer, err)
        except asyncio.TimeoutError:
            log.warning("connection from %s dropped: no complete handshake in time", conn.peer)
        except Exception:
            log.exception("handler for %s failed", conn.peer)
        finally:
            pending.discard(conn)
            conn.close()
            await conn.wait_closed()

    return await asyncio.start_server(on_accept, host, port, ssl=tls)


def encode_json(obj: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON of a dict; NaN/Infinity are refused since JSON has none."""
    if not isinstance(obj, dict):
        raise TypeError(f"a JSON payload must be an object, not {type(obj).__name__}")
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _reject_constant(name: str) -> Any:
    raise BadPayload(f"JSON constant {name} is not allowed")


def decode_json(payload: bytes | memoryview, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """Parse a JSON-object payload, refusing anything oversized, non-UTF-8 or odd."""
    if len(payload) > max_bytes:
        raise BadPayload(f"JSON payload of {len(payload)} bytes exceeds {max_bytes}")
    try:
        obj = json.loads(bytes(payload).decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:  # ValueError: also an integer of over 4300 digits
        raise BadPayload(f"invalid JSON payload: {err}") from None
    if not isinstance(obj, dict):
        raise BadPayload(f"JSON payload must be an object, got {type(obj).__name__}")
    return obj


def pack_with_header(header: dict[str, Any], blob: bytes | memoryview) -> bytes:
    """u32 header length + JSON header + raw bytes: how binary frames (KV) describe themselves."""
    encoded = encode_json(header)
    return b"".join([_HEADER_LEN.pack(len(encoded)), encoded, blob])


def split_with_header(payload: bytes | memoryview) -> tuple[memoryview, memoryview]:
    """The JSON header's bytes and the blob of a `pack_with_header` payload, both zero-copy
    views (so a typed decoder reads the header without a dict in between)."""
    view = memoryview(payload).cast("B")
    if len(view) < _HEADER_LEN.size:
        raise BadPayload("payload too short for a header length")
    (n,) = _HEADER_LEN.unpack_from(view)
    if n > len(view) - _HEADER_LEN.size:
        raise BadPayload(f"header length {n} exceeds the {len(view) - _HEADER_LEN.size} bytes present")
    end = _HEADER_LEN.size + n
    return view[_HEADER_LEN.size : end], view[end:]


def unpack_with_header(payload: bytes | memoryview) -> tuple[dict[str, Any], memoryview]:
    """Split a `pack_with_header` payload; the blob is a zero-copy view."""
    header, blob = split_with_header(payload)
    return decode_json(header), blob


NONCE_BYTES = 16


def session_keys(key: bytes, client_nonce: bytes, server_nonce: bytes) -> tuple[bytes, bytes]:
    """(client-to-server, server-to-client) keys of one connection.

    Sequence numbers alone stop replay within a connection; fresh nonces from both
    ends make a recorded connection worthless on any other, and one key per direction
    stops a frame from being reflected back to its sender.
    """
    def derive(label: bytes) -> bytes:
        return hmac.new(key, b"pdd/session/v1\x00" + label + client_nonce + server_nonce, hashlib.sha256).digest()

    return derive(b"c2s"), derive(b"s2c")


def _nonce_of(frame: Frame) -> tuple[dict[str, Any], bytes]:
    if frame.type != MsgType.HELLO:
        raise BadPayload(f"expected HELLO, got {frame.type.name}")
    msg = frame.json()
    try:
        nonce = bytes.fromhex(msg.get("nonce", ""))
    except (TypeError, ValueError):
        nonce = b""
    if len(nonce) != NONCE_BYTES:
        raise BadPayload("HELLO carries no valid nonce")
    return msg, nonce


async def client_handshake(conn: FramedConnection, hello: dict[str, Any]) -> dict[str, Any]:
    """Send HELLO with a fresh nonce, read the server's, switch to session keys."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    await conn.send_json(MsgType.HELLO, {**hello, "nonce": nonce.hex()})
    reply, server_nonce = _nonce_of(await conn.recv())
    if conn.codec.key:
        c2s, s2c = session_keys(conn.codec.key, nonce, server_nonce)
        conn.codec.rekey(send_key=c2s, recv_key=s2c)
    return reply


async def server_handshake(conn: FramedConnection) -> dict[str, Any]:
    """Read the client's HELLO, answer with a fresh nonce, switch to session keys."""
    frame = await conn.recv()
    try:
        hello, client_nonce = _nonce_of(frame)
    except BadPayload as err:
        conn.reject(err)
        raise
    nonce = secrets.token_bytes(NONCE_BYTES)
    await conn.send_json(MsgType.HELLO, {"nonce": nonce.hex()})
    if conn.codec.key:
        c2s, s2c = session_keys(conn.codec.key, client_nonce, nonce)
        conn.codec.rekey(send_key=s2c, recv_key=c2s)
    return hello


def link_key(secret: str, link_name: str) -> bytes:
    """Derive a per-link key from the deployment's shared secret (HKDF-expand style).

    Each link gets its own key, so a key leaked from one link's endpoints does not
    authenticate traffic on another.
    """
    if not secret:
        raise ValueError("the shared secret must not be empty")
    info = b"pdd/link-key/v1\x00" + link_name.encode("utf-8")
    return hmac.new(secret.encode("utf-8"), info, hashlib.sha256).digest()
