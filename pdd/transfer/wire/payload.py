"""A frame's payload as JSON: a body (`encode_json`, `decode_json`: bounded, UTF-8, no
NaN), or a JSON header in front of a blob (`with_header`: how binary frames, KV,
describe themselves, its parts not joined; `split_with_header` reads both back as views).
"""

from __future__ import annotations

import json
import struct
from typing import Any

from pdd.transfer.wire.frame import MAX_JSON_BYTES, BadPayload, Buffer, Payload, parts_of

_HEADER_LEN = struct.Struct("!I")
ALIGN = 16  # the header's padding (a KV blob pads its own to `codec.ALIGN`, the same)


def encode_json(obj: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON of a dict; NaN/Infinity are refused since JSON has none."""
    if not isinstance(obj, dict):
        raise TypeError(f"a JSON payload must be an object, not {type(obj).__name__}")
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _reject_constant(name: str) -> Any:
    raise BadPayload(f"JSON constant {name} is not allowed")


def decode_json(payload: Buffer, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
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


def with_header(header: dict[str, Any], blob: Payload) -> list[Buffer]:
    """u32 header length + JSON header + raw bytes: how binary frames (KV) describe
    themselves, as parts (the blob's own, not copied). The header is padded with spaces
    to a multiple of `ALIGN` bytes, so a blob aligned in itself is aligned in the frame's
    buffer, which its receiver reads in place."""
    encoded = encode_json(header)
    encoded += b" " * (-(_HEADER_LEN.size + len(encoded)) % ALIGN)
    return [_HEADER_LEN.pack(len(encoded)) + encoded, *parts_of(blob)]


def pack_with_header(header: dict[str, Any], blob: Payload) -> bytes:
    """`with_header`'s parts joined."""
    return b"".join(with_header(header, blob))


def split_with_header(payload: Buffer) -> tuple[memoryview, memoryview]:
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
