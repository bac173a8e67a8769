"""The wire protocol between pdd instances: `frame` (the format, its errors, JSON payloads),
`connection` (a framed TCP connection, its ends, the count of rejected frames) and
`handshake` (HELLO and the link and session keys). Import the names from here."""

from pdd.transfer.wire.connection import (
    MAX_UNAUTHENTICATED,
    REJECTS,
    FramedConnection,
    Handler,
    RejectCounter,
    open_connection,
    serve,
)
from pdd.transfer.wire.frame import (
    DEFAULT_MAX_PAYLOAD,
    FLAG_AUTH,
    HANDSHAKE_MAX_PAYLOAD,
    HEADER,
    MAGIC,
    MAX_JSON_BYTES,
    PROTOCOL_VERSION,
    TAG_SIZE,
    BadChecksum,
    BadFlags,
    BadMac,
    BadMagic,
    BadPayload,
    BadSequence,
    BadVersion,
    ConnectionClosed,
    Frame,
    FrameCodec,
    FrameError,
    MsgType,
    TooLarge,
    UnknownType,
    decode_json,
    encode_json,
    pack_with_header,
    split_with_header,
    unpack_with_header,
)
from pdd.transfer.wire.handshake import NONCE_BYTES, client_handshake, link_key, server_handshake, session_keys

__all__ = [
    "REJECTS", "FramedConnection", "Handler", "RejectCounter", "open_connection", "serve", "DEFAULT_MAX_PAYLOAD",
    "FLAG_AUTH", "HANDSHAKE_MAX_PAYLOAD", "HEADER", "MAGIC", "MAX_JSON_BYTES", "MAX_UNAUTHENTICATED",
    "PROTOCOL_VERSION", "TAG_SIZE", "BadChecksum", "BadFlags", "BadMac", "BadMagic", "BadPayload", "BadSequence",
    "BadVersion", "ConnectionClosed", "Frame", "FrameCodec", "FrameError", "MsgType", "TooLarge", "UnknownType",
    "decode_json", "encode_json", "pack_with_header", "split_with_header", "unpack_with_header", "NONCE_BYTES",
    "client_handshake", "link_key", "server_handshake", "session_keys",
]
