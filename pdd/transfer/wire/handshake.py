"""The HELLO exchange: the protocol version it settles and the keys it switches a
connection to.

Version: the client's HELLO goes out in the newest version it offers; a server adopts
it if it speaks it (`FrameCodec`), and answers in it. A server of the release before,
which speaks only its own, closes the connection on a newer version's frame; `connect`
then says HELLO again in the version before, down to `OLDEST_PROTOCOL`. So a site
upgraded first goes on talking to the other (docs/deployment.md, "Rolling upgrades").

A relay on the path cannot step a pair down this way: the fallback is started by a
closed connection, which anyone on the path can cause, so a server that speaks newer
than the HELLO it answers says so in its nonce (`DOWNGRADE_MARK` and its newest version
in the last bytes, as TLS 1.3's server random does), inside the HELLO frame the connection key
authenticates. A client that fell back and reads there that the server speaks newer
refuses the connection (`Downgrade`): the versions both ends speak are bound into the
authenticated handshake. A release before this one sends random bytes there, and a
client of one never falls back past what it offered.

Each kind of connection has its own key, derived from the deployment's shared secret; the HELLO
exchange then switches each connection to its own per-direction session keys (from
nonces of both ends), so frames recorded on one connection fail on any other. Both
derivations are HKDF-SHA256 (RFC 5869, from `cryptography`); changing either changes
the wire, so it bumps `PROTOCOL_VERSION`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

import pdd
from pdd.transfer.wire.connection import FramedConnection, open_connection
from pdd.transfer.wire.frame import (
    DEFAULT_MAX_PAYLOAD,
    OLDEST_PROTOCOL,
    BadPayload,
    ConnectionClosed,
    Frame,
    MsgType,
    offered_protocol,
)
from pdd.transfer.wire.frame import offered_protocol as spoken_protocol  # (the server's side: see `_server_nonce`)
from pdd.transfer.wire.payload import decode_json

log = logging.getLogger(__name__)

KEY_BYTES = 32
NONCE_BYTES = 16
# the last bytes of a server's nonce when it answers an older HELLO than it speaks: the
# mark, then its newest version (a random nonce matches the mark with chance 2**-56)
DOWNGRADE_MARK = b"pdd\x00dng"
SOFTWARE_SINCE = 5  # a HELLO says the sender's release from this version on (`messages.Hello.SINCE`)


def session_keys(key: bytes, client_nonce: bytes, server_nonce: bytes) -> tuple[bytes, bytes]:
    """(client-to-server, server-to-client) keys of one connection.

    Sequence numbers alone stop replay within a connection; fresh nonces from both
    ends make a recorded connection worthless on any other, and one key per direction
    stops a frame from being reflected back to its sender.
    """
    both = HKDF(SHA256(), 2 * KEY_BYTES, salt=client_nonce + server_nonce, info=b"pdd/session/v2").derive(key)
    return both[:KEY_BYTES], both[KEY_BYTES:]


def _nonce_of(frame: Frame) -> tuple[dict[str, Any], bytes]:
    if frame.type != MsgType.HELLO:
        raise BadPayload(f"expected HELLO, got {frame.type.name}")
    msg = decode_json(frame.payload)
    try:
        nonce = bytes.fromhex(msg.get("nonce", ""))
    except (TypeError, ValueError):
        nonce = b""
    if len(nonce) != NONCE_BYTES:
        raise BadPayload("HELLO carries no valid nonce")
    return msg, nonce


class Downgrade(BadPayload):
    """A server that speaks a newer protocol than the one a client fell back to: something
    on the path closed the newer HELLO. The connection is refused, not stepped down."""


def _server_nonce(answered: int) -> bytes:
    """A fresh nonce; marked with this process's newest version when that is newer than
    the HELLO it answers (`DOWNGRADE_MARK`)."""
    newest = spoken_protocol()
    if answered >= newest:
        return secrets.token_bytes(NONCE_BYTES)
    return secrets.token_bytes(NONCE_BYTES - len(DOWNGRADE_MARK) - 1) + DOWNGRADE_MARK + bytes([newest])


def _check_not_downgraded(server_nonce: bytes, version: int, offered: int) -> None:
    mark = server_nonce[-len(DOWNGRADE_MARK) - 1 : -1]
    if version < offered and mark == DOWNGRADE_MARK and server_nonce[-1] > version:
        raise Downgrade(
            f"the server speaks protocol {server_nonce[-1]} but its answer to {offered}'s HELLO never came: "
            f"refusing {version} (something on the path closed the newer HELLO)"
        )


async def client_handshake(conn: FramedConnection, hello: dict[str, Any], offered: int = 0) -> dict[str, Any]:
    """Send HELLO with a fresh nonce, read the server's, switch to session keys. `offered`:
    the newest version this client tried first (above the connection's when it fell back)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    await conn.send_json(MsgType.HELLO, {**hello, "nonce": nonce.hex()})
    reply, server_nonce = _nonce_of(await conn.recv())
    _check_not_downgraded(server_nonce, conn.version, offered)
    if conn.codec.key:
        c2s, s2c = session_keys(conn.codec.key, nonce, server_nonce)
        conn.codec.rekey(send_key=c2s, recv_key=s2c)
    return reply


async def server_handshake(conn: FramedConnection) -> dict[str, Any]:
    """Read the client's HELLO (adopting its protocol version), answer with a fresh
    nonce (and, from version 5, this release), switch to session keys."""
    frame = await conn.recv()
    try:
        hello, client_nonce = _nonce_of(frame)
    except BadPayload as err:
        conn.reject(err)
        raise
    nonce = _server_nonce(frame.version)
    release = {"software": pdd.__version__} if frame.version >= SOFTWARE_SINCE else {}
    await conn.send_json(MsgType.HELLO, {"nonce": nonce.hex(), **release})
    if conn.codec.key:
        c2s, s2c = session_keys(conn.codec.key, client_nonce, nonce)
        conn.codec.rekey(send_key=s2c, recv_key=c2s)
    return hello


async def connect(
    host: str,
    port: int,
    key: bytes | None,
    hello: Callable[[int], dict[str, Any]],
    *,
    tls: ssl.SSLContext | None = None,
    connect_timeout: float = 10.0,
    hello_timeout: float = 10.0,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
) -> tuple[FramedConnection, dict[str, Any]]:
    """A connection to a frame server, its HELLO exchanged, and the server's answer.
    `hello(version)` is the HELLO body for a peer speaking `version`. A server that
    closes the connection on the HELLO is asked again one version lower (a server not
    yet upgraded speaks only its own), down to `OLDEST_PROTOCOL`."""
    version = offered = offered_protocol()
    while True:
        conn = await open_connection(
            host, port, key, max_payload=max_payload, connect_timeout=connect_timeout, tls=tls, version=version
        )
        try:
            return conn, await asyncio.wait_for(client_handshake(conn, hello(version), offered), hello_timeout)
        except ConnectionClosed:
            conn.close()
            if version <= OLDEST_PROTOCOL:
                raise
            log.warning("%s:%s closed on protocol %d's HELLO: trying %d", host, port, version, version - 1)
            version -= 1
        except BaseException:
            conn.close()
            raise


def connection_key(secret: str, kind: str) -> bytes:
    """The key of one kind of connection (`"instances"`: between instances; a router's
    own), derived from the deployment's shared secret: a key leaked from one kind's ends
    does not authenticate traffic of another."""
    if not secret:
        raise ValueError("the shared secret must not be empty")
    info = b"pdd/link-key/v2\x00" + kind.encode("utf-8")  # (the protocol's label: never renamed)
    return HKDF(SHA256(), KEY_BYTES, salt=None, info=info).derive(secret.encode("utf-8"))
