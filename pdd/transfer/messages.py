"""Control frames' bodies off and onto the wire, checked on arrival.

Frames are authenticated, but a peer can still be buggy or of another version, so
`decode` checks every field against its declared type (and bounds) here, in one place:
a bad body becomes a `BadMessage` the receiver answers, never a crash deeper in; a body
on a connection that does not carry it (`from_router`, `from_instance`) is one too. The
router, the instances and the tests all speak through the classes of
`pdd.transfer.bodies`, read through this module (`m.Submit`); nobody reads or writes a
raw JSON dict for a control frame.

Versions: towards a peer that speaks an older protocol the fields it lacks are left out
(`to_dict`, `send`); from such a peer they are refused, as it would refuse them itself
(`decode`).
"""

from __future__ import annotations

from typing import Any, TypeVar, cast, get_args

import msgspec

from pdd.transfer.bodies import (
    MAX_DICT,
    MAX_NAME,
    MAX_TEXT,
    MAX_TOKENS,
    ROLES_ON_WIRE,
    Abort,
    BadMessage,
    BetweenInstances,
    Body,
    CacheUpdate,
    Drain,
    Error,
    ForRequest,
    FromRouter,
    HandedOff,
    Handoff,
    HandoffAck,
    Hello,
    KVAck,
    KVDone,
    KVLayer,
    KVPlaced,
    KVRegion,
    KVRegionAsk,
    KVSlotFree,
    Member,
    Message,
    PipelineChosen,
    Progress,
    Ready,
    Reserve,
    ReserveAck,
    Result,
    Submit,
    Tokens,
    ToRouter,
)
from pdd.transfer.wire import (
    MAX_JSON_BYTES,
    PROTOCOL_VERSION,
    BadPayload,
    Buffer,
    Frame,
    FramedConnection,
    MsgType,
    Payload,
    encode_json,
    split_with_header,
    with_header,
)

# the bodies (`pdd.transfer.bodies`) are read through this module, as `m.Submit`
__all__ = [
    "Abort",
    "BadMessage",
    "BadPayload",
    "between_instances",
    "BetweenInstances",
    "Body",
    "CacheUpdate",
    "decode",
    "decode_as",
    "decode_kv",
    "Drain",
    "encode_body",
    "Error",
    "from_dict",
    "from_router",
    "ForRequest",
    "FromRouter",
    "HandedOff",
    "Handoff",
    "HandoffAck",
    "Hello",
    "kv_payload",
    "KVAck",
    "KVDone",
    "KVLayer",
    "KVPlaced",
    "KVRegion",
    "KVRegionAsk",
    "KVSlotFree",
    "MAX_DICT",
    "MAX_NAME",
    "MAX_TEXT",
    "MAX_TOKENS",
    "Member",
    "Message",
    "MsgType",
    "PipelineChosen",
    "Progress",
    "Ready",
    "Reserve",
    "ReserveAck",
    "Result",
    "rid_of",
    "ROLES_ON_WIRE",
    "send",
    "Submit",
    "to_dict",
    "to_router",
    "Tokens",
    "ToRouter",
]

# One decoder per type, built once. Measured (issue 13) decoding a TOKENS body of one token,
# one of 4,096 tokens, and a KV_LAYER header in front of a 2 MiB blob, in us per decode
# (best of 7 runs): the hand-written checker this replaced 13.5 / 534 / 11.3, pydantic
# (strict BaseModel, extra="forbid") 2.6 / 387 / 2.4, msgspec 0.16 / 145 / 1.0.
_DECODERS: dict[MsgType, msgspec.json.Decoder[Any]] = {
    cls.TYPE: msgspec.json.Decoder(cls) for cls in (*get_args(Body), KVLayer)
}
_ENCODER = msgspec.json.Encoder()


def _decode(msg_type: MsgType, payload: Buffer) -> Any:
    """The body of type `msg_type` in a JSON payload. A payload that is no JSON at all is
    `BadPayload` (the stream cannot be trusted: the connection is dropped); JSON of the
    wrong shape is `BadMessage` naming the field (answered with an ERROR)."""
    if len(payload) > MAX_JSON_BYTES:
        raise BadPayload(f"JSON payload of {len(payload)} bytes exceeds {MAX_JSON_BYTES}")
    try:
        return _DECODERS[msg_type].decode(payload)
    except msgspec.ValidationError as e:
        raise BadMessage(f"{msg_type.name}: {e}") from None
    except msgspec.DecodeError as e:
        raise BadPayload(f"invalid JSON payload: {e}") from None


_DEFAULTS: dict[type, dict[str, Any]] = {}


def _defaults(cls: type[Message]) -> dict[str, Any]:
    if cls not in _DEFAULTS:
        _DEFAULTS[cls] = {f.name: f.default for f in msgspec.structs.fields(cls)}
    return _DEFAULTS[cls]


def _of_version(body: Any, version: int) -> Any:
    """`body`, refused if it carries a field newer than `version` (which a peer speaking
    `version` neither sends nor reads)."""
    for field, since in body.SINCE.items():
        if since > version and getattr(body, field) != _defaults(type(body))[field]:
            raise BadMessage(f"{body.TYPE.name}: {field} is protocol {since}'s, the connection speaks {version}")
    return body


def from_dict(cls: type[Message], raw: dict[str, Any], version: int = PROTOCOL_VERSION) -> Any:
    """A body from a JSON object already parsed (a HELLO's) on a connection speaking
    `version`: checked exactly as off the wire, so what JSON cannot carry (NaN, a lone
    surrogate) is refused here too."""
    try:
        payload = encode_json(raw)
    except (TypeError, ValueError) as e:
        raise BadMessage(f"{cls.TYPE.name}: {e}") from None
    return _of_version(_decode(cls.TYPE, payload), version)


def to_dict(body: Message, version: int = PROTOCOL_VERSION) -> dict[str, Any]:
    """`body` as JSON-ready builtins for a peer speaking `version`: without its fields
    of later versions."""
    out: dict[str, Any] = msgspec.to_builtins(body)
    for field, since in body.SINCE.items():
        if since > version:
            out.pop(field, None)
    return out


def decode(frame: Frame) -> Body:
    """The typed body of a control frame (not KV_LAYER, which `decode_kv` reads)."""
    if frame.type not in _DECODERS or frame.type == MsgType.KV_LAYER:
        raise BadMessage(f"{frame.type.name} frames have no JSON body")
    body: Body = _of_version(_decode(frame.type, frame.payload), frame.version)
    return body


B = TypeVar("B", bound=Message)
_FROM_ROUTER, _TO_ROUTER, _BETWEEN = (get_args(u) for u in (FromRouter, ToRouter, BetweenInstances))


def decode_as(frame: Frame, cls: type[B]) -> B:
    """A body that must be a `cls` (where the exchange says what comes next); any other
    is a `BadMessage`."""
    body = decode(frame)
    if not isinstance(body, cls):
        raise BadMessage(f"{frame.type.name} where {cls.TYPE.name} was due")
    return body


def _carried(frame: Frame, kinds: tuple[type, ...], where: str) -> Body:
    """The frame's body if the connection it came on carries its kind; else a `BadMessage`."""
    body = decode(frame)
    if not isinstance(body, kinds):
        raise BadMessage(f"{frame.type.name} {where}")
    return body


def from_router(frame: Frame) -> FromRouter:
    """A body an instance reads from a router; any other is a `BadMessage`."""
    return cast(FromRouter, _carried(frame, _FROM_ROUTER, "does not come from a router"))


def to_router(frame: Frame) -> ToRouter:
    """A body a router reads from an instance; any other is a `BadMessage`."""
    return cast(ToRouter, _carried(frame, _TO_ROUTER, "is not for a router"))


def between_instances(frame: Frame) -> BetweenInstances:
    """A body one instance reads from another; any other is a `BadMessage`."""
    return cast(BetweenInstances, _carried(frame, _BETWEEN, "does not pass between instances"))


def decode_kv(frame: Frame) -> tuple[KVLayer, memoryview]:
    header, blob = split_with_header(frame.payload)
    return _decode(MsgType.KV_LAYER, header), blob


def rid_of(frame: Frame) -> str | None:
    """The request a frame names, when it can be read (to answer a bad one)."""
    try:
        body = decode_kv(frame)[0] if frame.type == MsgType.KV_LAYER else decode(frame)
    except (BadMessage, ValueError):
        return None
    return getattr(body, "rid", None)


def encode_body(body: Message, version: int) -> bytes:
    """`body`'s frame payload in protocol `version`."""
    if any(since > version for since in body.SINCE.values()):
        return encode_json(to_dict(body, version))
    return _ENCODER.encode(body)


async def send(conn: FramedConnection, body: Message) -> None:
    """Send `body` in the protocol version `conn` speaks."""
    await conn.send(body.TYPE, encode_body(body, conn.version))


def kv_payload(rid: str, blob: Payload) -> list[Buffer]:
    """A KV_LAYER frame's payload: its header, then the encoded KV blob (its parts as they are)."""
    return with_header(to_dict(KVLayer(rid)), blob)
