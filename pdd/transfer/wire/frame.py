"""Frames: the one framed binary format spoken between pdd instances.

Reservations, KV pages, token IDs and cache events all cross the line in these frames,
so the format is strict: a fixed header (magic, version, type, flags, sequence number,
payload length, checksum), the payload, and — on authenticated connections — a tag over
header and payload: HMAC-SHA256 during the handshake (under the connection key, shared by
every connection) and in protocol 4; from protocol 5, once the connection has its own
session keys, AES-256-GCM's GMAC, with the sequence number as its nonce (unique under a
key used by one connection in one direction), at about 7 GB/s where HMAC-SHA256 runs
at 1.6 GB/s on one core (AES-NI and SHA-NI both; BENCHMARKS.md), and no CRC32 (the tag
covers the frame; 3.7 GB/s saved twice). Keyless frames (inside a trusted site) carry
a CRC32 of the payload, from protocol 6 the Castagnoli polynomial's (CRC32C), which
SSE4.2 computes at about 24 GB/s where zlib's CRC32 runs at 3.7: with it a keyless
4 MiB frame crosses loopback at about 0.9x raw TCP where it managed 0.36x. The length is checked against a limit
*before* the payload is read, so a hostile or broken peer cannot make us buffer
gigabytes. The sequence number sits inside the MAC'd header and must be exactly the
next one expected, so replayed, reordered or dropped frames are refused as well.
Payloads are raw bytes or JSON objects; nothing received is ever unpickled or
evaluated. Any violation raises a specific `FrameError` subclass.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from crc32c import crc32c
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"PD"
# 2: typed bodies with token positions, the relay tier; 3: HKDF-SHA256 connection and session keys;
# 4: a cache snapshot carries the instance's KV pages and context (engines that size themselves);
# 5: the version is negotiated in HELLO, which says the software's release (`Hello.software`);
#    frames under session keys carry a GMAC tag, no CRC32
# 6: the checksum of frames without a tag is CRC32C (hardware), not zlib's CRC32; KV pages
#    may cross in int8 or zstd (`[line] lossy_kv`, `compress_kv`; `pdd.kv.codec`): an older
#    peer is sent them as they are
# 7: a request may ask for its prompt's logprobs (`SamplingParams.prompt_logprobs`), which P
#    sends with its first token (`KVDone`, `Tokens`); an instance of 6 is not planned one
PROTOCOL_VERSION = 7
GMAC_SINCE = 5
CRC32C_SINCE = 6
LOSSY_KV_SINCE = 6  # (and compressed KV)
# The oldest version still spoken, to a peer not yet upgraded: at least one release back,
# so one site can be upgraded before the other (docs/deployment.md, "Rolling upgrades").
OLDEST_PROTOCOL = 4
PROTOCOL_ENV = "PDD_PROTOCOL"


def offered_protocol() -> int:
    """The newest version this process speaks: PROTOCOL_VERSION, or lower where
    `PDD_PROTOCOL` pins it (to hold a deployment on the old version while its hosts
    are upgraded, or to play an old peer in a test). ValueError when out of range."""
    raw = os.environ.get(PROTOCOL_ENV, "")
    if not raw:
        return PROTOCOL_VERSION
    if not raw.isdigit() or not OLDEST_PROTOCOL <= int(raw) <= PROTOCOL_VERSION:
        raise ValueError(f"{PROTOCOL_ENV}={raw!r}: this release speaks protocols {OLDEST_PROTOCOL}-{PROTOCOL_VERSION}")
    return int(raw)


FLAG_AUTH = 0x01
_KNOWN_FLAGS = FLAG_AUTH
# magic, version, type, flags, sequence, payload length, checksum of payload (`_checksum`)
HEADER = struct.Struct("!2sBBBQII")
TAG_SIZE = hashlib.sha256().digest_size  # HMAC-SHA256's
GMAC_TAG_SIZE = 16
# a frame up to this size is tagged in one call of its key's `AESGCM`, made once a key
# (0.6 us here, where a `Cipher` made for it costs 5.4 us: most of a small frame's tag);
# a larger one streams its parts through a `Cipher`, uncopied (the same tag)
ONE_CALL_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD = 64 * 1024 * 1024
# Until the HELLO exchange has proven the peer holds the key, a frame may carry no more
# than a HELLO needs: an unauthenticated peer must not make us buffer megabytes.
HANDSHAKE_MAX_PAYLOAD = 4096
MAX_JSON_BYTES = 16 * 1024 * 1024


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
    KV_REGION_ASK = 24  # P -> decode side in its site, on a KV connection: a region for the transfer engine
    KV_REGION = 25  # decode side -> P: the registered region (session, address, slots), or why not
    KV_PLACED = 26  # P -> decode side: a KV frame's bytes are in this slot (length, tag)
    KV_SLOT_FREE = 27  # decode side -> P: that slot may be written again


Buffer = bytes | bytearray | memoryview
# A payload: one buffer, or its parts in order (a KV frame's header and its tensors' own
# memory: framed, authenticated and written without being joined into one copy first)
Payload = Buffer | list[Buffer]


def parts_of(payload: Payload) -> list[Buffer]:
    return payload if isinstance(payload, list) else [payload]


def payload_len(payload: Payload) -> int:
    return sum(len(p) for p in parts_of(payload))


class ByteSource(Protocol):
    """Where frames are read from: an `asyncio.StreamReader`, or a `FrameStream`."""

    async def readexactly(self, n: int) -> Buffer: ...


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

    Not a `FrameError`: a peer going away, or a line drop, is a network event and
    must not be counted as a rejected (possibly hostile) frame.
    """


@dataclass(frozen=True)
class Frame:
    type: MsgType
    seq: int
    payload: Buffer  # (a large one: a view of the buffer the kernel read it into)
    version: int = PROTOCOL_VERSION  # the protocol version in its header


class FrameCodec:
    """Encodes and decodes frames for one connection, one counter per direction.

    With a key, every frame sent is authenticated and every frame received must be;
    without one, authenticated frames are refused too (a key mismatch between peers
    should fail loudly, not be silently ignored).
    """

    def __init__(
        self, key: bytes | None, max_payload: int = DEFAULT_MAX_PAYLOAD, version: int | None = PROTOCOL_VERSION
    ) -> None:
        """`version`: the protocol version frames are sent and received in; None (a
        server's end) adopts the version of the first frame received (the client's
        HELLO), if this process speaks it."""
        if key is not None and not key:
            raise ValueError("an authentication key must not be empty")
        self._key = key  # the long-lived connection key; frames use the per-direction keys below
        self._send_key = key
        self._recv_key = key
        self.max_payload = max_payload
        self._read_limit = HANDSHAKE_MAX_PAYLOAD if key else max_payload
        self.authenticated = False  # the handshake has switched to session keys
        self._gmac = False  # its frames carry GMAC tags (under session keys, from protocol 5)
        self._send_aead: AESGCM | None = None  # (the session keys', for small frames' tags)
        self._recv_aead: AESGCM | None = None
        self.version = version
        self.send_seq = 0
        self.recv_seq = 0

    @property
    def key(self) -> bytes | None:
        return self._key

    def subkey(self, label: bytes, sending: bool) -> bytes | None:
        """A key for `label` from this connection's session key of one direction (what it
        sends, or what it receives: the peer derives the same from its other one); None
        before the handshake or without a key."""
        base = self._send_key if sending else self._recv_key
        if not self.authenticated or base is None:
            return None
        return HKDF(SHA256(), 32, salt=None, info=b"pdd/" + label).derive(base)

    def rekey(self, send_key: bytes, recv_key: bytes) -> None:
        """Switch to this connection's session keys (see `client_handshake`): the peer
        has proven it holds the connection key, so full-size frames are accepted from now on."""
        self._send_key, self._recv_key = send_key, recv_key
        self._read_limit = self.max_payload
        self.authenticated = True
        # both ends of a connection rekey after the same two HELLOs, in the version it speaks
        self._gmac = (self.version or 0) >= GMAC_SINCE
        if self._gmac:
            self._send_aead, self._recv_aead = AESGCM(send_key), AESGCM(recv_key)

    @property
    def _tag_size(self) -> int:
        return GMAC_TAG_SIZE if self._gmac else TAG_SIZE

    @property
    def overhead(self) -> int:
        """Bytes a frame adds to its payload on this connection."""
        return HEADER.size + (self._tag_size if self._key else 0)

    def encode_parts(self, msg_type: MsgType, payload: Payload) -> list[Buffer]:
        """The frame as separate buffers (the payload's parts as they are), so a large KV
        payload is never copied."""
        msg_type = MsgType(msg_type)
        parts, length = parts_of(payload), payload_len(payload)
        if length > self.max_payload:
            raise TooLarge(f"payload of {length} bytes exceeds the limit of {self.max_payload}")
        if self.version is None:
            raise RuntimeError("no protocol version yet: a server's end sends after the client's HELLO")
        flags = FLAG_AUTH if self._key else 0
        crc = 0 if self._gmac else _checksum(self.version, parts)  # (a GMAC tag covers the frame)
        seq = self.send_seq
        header = HEADER.pack(MAGIC, self.version, msg_type, flags, seq, length, crc)
        self.send_seq += 1
        if not self._send_key:  # set exactly when the connection has a key (the connection key, then the session's)
            return [header, *parts]
        if self._gmac:
            aead = self._send_aead if length <= ONE_CALL_BYTES else None
            return [header, *parts, _gmac(self._send_key, seq, [header, *parts], aead)]
        return [header, *parts, _mac(self._send_key, [header, *parts])]

    def encode(self, msg_type: MsgType, payload: Payload) -> bytes:
        return b"".join(self.encode_parts(msg_type, payload))

    async def read(self, reader: ByteSource) -> Frame:
        """Read exactly one frame, validating everything before returning it.

        Only what is needed to delimit the frame (magic, version, length, whether a
        tag follows) is checked before the MAC; everything else is checked after it,
        so on an authenticated connection any tampering there shows up as `BadMac`.
        """
        header = await _read_exactly(reader, HEADER.size, at_boundary=True)
        magic, version, raw_type, flags, seq, length, crc = HEADER.unpack(header)
        if magic != MAGIC:
            raise BadMagic(f"bad magic {magic!r}")
        if self.version is None:  # a server's end, at the client's HELLO: adopt its version if spoken here
            newest = offered_protocol()
            if not OLDEST_PROTOCOL <= version <= newest:
                raise BadVersion(f"protocol version {version}, this process speaks {OLDEST_PROTOCOL}-{newest}")
            self.version = version
        elif version != self.version:
            raise BadVersion(f"protocol version {version}, the connection speaks {self.version}")
        if length > self._read_limit:
            raise TooLarge(
                f"frame announces {length} bytes, the limit is {self._read_limit}"
                + ("" if self.authenticated or not self._key else " before the handshake")
            )
        authenticated = bool(flags & FLAG_AUTH)
        if self._key and not authenticated:
            raise BadMac("unauthenticated frame on a connection that requires authentication")
        if authenticated and not self._key:
            raise BadMac("authenticated frame on a connection without a key")
        payload = await _read_exactly(reader, length, at_boundary=False)
        if self._recv_key:  # set exactly when the connection has a key
            tag = bytes(await _read_exactly(reader, self._tag_size, at_boundary=False))
            if self._gmac:  # (seq checked below, after the tag)
                _check_gmac(
                    self._recv_key, seq, header, payload, tag, self._recv_aead if length <= ONE_CALL_BYTES else None
                )
            elif not hmac.compare_digest(tag, _mac(self._recv_key, [header, payload])):
                raise BadMac("message authentication code does not match")
        if flags & ~_KNOWN_FLAGS:
            raise BadFlags(f"unknown flag bits {flags:#04x}")
        try:
            msg_type = MsgType(raw_type)
        except ValueError:
            raise UnknownType(f"unknown message type {raw_type}") from None
        if seq != self.recv_seq:
            raise BadSequence(f"sequence number {seq}, expected {self.recv_seq}")
        if not self._gmac and _checksum(version, [payload]) != crc:
            raise BadChecksum("payload checksum does not match")
        self.recv_seq += 1
        return Frame(msg_type, seq, payload, version)


def _checksum(version: int, parts: list[Buffer]) -> int:
    """The CRC a frame without a GMAC tag carries over its payload's `parts`: CRC32C from
    protocol 6, CRC32 before."""
    crc, step = 0, crc32c if version >= CRC32C_SINCE else zlib.crc32
    for part in parts:
        crc = step(part, crc)
    return crc


def _mac(key: bytes, parts: list[Buffer]) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


def _nonce(seq: int) -> bytes:
    """GCM's 96-bit nonce: the frame's sequence number, never repeated under a session key."""
    return bytes(4) + seq.to_bytes(8, "big")


def gmac(key: bytes, nonce: int, data: Payload) -> bytes:
    """AES-256-GCM's tag over `data` (no plaintext) under a 96-bit `nonce` never reused with `key`."""
    return _gmac(key, nonce, parts_of(data), None)


def _gmac(key: bytes, seq: int, parts: list[Buffer], aead: AESGCM | None) -> bytes:
    """AES-256-GCM over no plaintext, `parts` (in order) as associated data: their tag; in
    one call of `aead` where given (a small frame: `key`'s, joined), else streamed."""
    if aead is not None:
        return aead.encrypt(_nonce(seq), b"", b"".join(parts))
    enc = Cipher(algorithms.AES(key), modes.GCM(_nonce(seq))).encryptor()
    for part in parts:
        enc.authenticate_additional_data(part)
    enc.finalize()
    return enc.tag


def _check_gmac(key: bytes, seq: int, header: Buffer, payload: Buffer, tag: bytes, aead: AESGCM | None) -> None:
    """BadMac unless `tag` is the frame's; in one call of `aead` where given (a small frame)."""
    try:
        if aead is not None:
            aead.decrypt(_nonce(seq), tag, b"".join([header, payload]))
            return
        dec = Cipher(algorithms.AES(key), modes.GCM(_nonce(seq), tag)).decryptor()
        dec.authenticate_additional_data(header)
        dec.authenticate_additional_data(payload)
        dec.finalize()
    except InvalidTag:
        raise BadMac("message authentication code does not match") from None


async def _read_exactly(reader: ByteSource, n: int, *, at_boundary: bool) -> Buffer:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as err:
        if at_boundary and not err.partial:
            raise ConnectionClosed("peer closed the connection") from None
        raise ConnectionClosed("peer closed the connection in the middle of a frame") from None
