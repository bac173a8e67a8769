"""The body of every control frame: one dataclass per message type, checked on arrival.

Frames are authenticated, but a peer can still be buggy or of another version, so
`decode` checks every field against its declared type (and bounds) here, in one place:
a bad body becomes a `BadMessage` the receiver answers, never a crash deeper in. The
router, the instances and the tests all speak through these classes; nobody reads or
writes a raw JSON dict for a control frame.

Token positions: a TOKENS frame says the output position of its first token, so the
router can merge tokens from two producers (a relay and a main decode instance) into
one ordered stream, whoever produced each position.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from pdd.names import PDD_PIPELINES, HandoffMode, RoleName
from pdd.sampling import SamplingParams
from pdd.transfer.wire import Frame, FramedConnection, MsgType, decode_json, encode_json, pack_with_header, unpack_with_header

MAX_TOKENS = 1 << 20  # longest token list in one body (a prompt)
MAX_TEXT = 4096
MAX_NAME = 128
MAX_DICT = 64  # entries of a string table in one body (a member's addresses, one per datacenter)

ROLES_ON_WIRE = ("router", *RoleName)


class BadMessage(ValueError):
    pass


@dataclass(frozen=True)
class Hello:
    TYPE: ClassVar[MsgType] = MsgType.HELLO
    role: str
    name: str = ""
    router_id: str = ""  # a router's identity: instances send its requests' tokens to it alone
    channel: str = ""  # an instance's connection: "control" (heartbeats), "urgent" or "background" (KV)


@dataclass(frozen=True)
class Submit:
    """Router -> P (or a standalone instance): run this request on the planned instances."""

    TYPE: ClassVar[MsgType] = MsgType.SUBMIT
    rid: str
    prompt: list[int]
    params: SamplingParams
    router_id: str = ""
    main: str | None = None  # the main decode instance (P/D modes)
    relay: str | None = None  # the relay instance (PDD mode)
    use_cache: bool = True  # decode side may reuse its cached prefix


@dataclass(frozen=True)
class Reserve:
    """P -> a decode-side instance: lock the cached prefix of this prompt, take pages for the rest."""

    TYPE: ClassVar[MsgType] = MsgType.RESERVE
    rid: str
    prompt: list[int]
    params: SamplingParams
    router_id: str = ""
    use_cache: bool = True
    main: str | None = None  # to a relay: the main decode instance it hands off to


@dataclass(frozen=True)
class ReserveAck:
    TYPE: ClassVar[MsgType] = MsgType.RESERVE_ACK
    rid: str
    hit: int = 0  # tokens of the prompt already held (the authoritative decode-side hit)
    error: str | None = None
    busy: bool = False  # with `error`: a relay too loaded to take an optional request (not a failure)


@dataclass(frozen=True)
class KVLayer:
    """The JSON header of a KV_LAYER frame; the encoded KV blob follows it."""

    TYPE: ClassVar[MsgType] = MsgType.KV_LAYER
    rid: str


@dataclass(frozen=True)
class KVAck:
    """Decode side -> P: KV imported up to `token_end`; `done` once KV_DONE is in."""

    TYPE: ClassVar[MsgType] = MsgType.KV_ACK
    rid: str
    token_end: int
    done: bool = False


@dataclass(frozen=True)
class KVDone:
    """P -> decode side: all KV is sent. With `emit`, start decoding and stream from
    position 0 (P's first token); without, wait for a handoff."""

    TYPE: ClassVar[MsgType] = MsgType.KV_DONE
    rid: str
    first_token: int
    emit: bool = True


@dataclass(frozen=True)
class Ready:
    """P -> relay: the main decode instance holds the prompt's KV; hand off."""

    TYPE: ClassVar[MsgType] = MsgType.READY
    rid: str


@dataclass(frozen=True)
class Tokens:
    """Produced tokens for output positions [pos, pos + len(tokens))."""

    TYPE: ClassVar[MsgType] = MsgType.TOKENS
    rid: str
    pos: int
    tokens: list[int]
    finish_reason: str | None = None
    cached_tokens: int = 0
    stall_ms: float | None = None  # the first token after a handoff: the main instance's extend stall


@dataclass(frozen=True)
class PipelineChosen:
    """P -> router: the pipeline P chose from the reserved hit, and the hits."""

    TYPE: ClassVar[MsgType] = MsgType.PIPELINE
    rid: str
    pipeline: str
    p_hit: int = 0
    d_hit: int = 0
    predicted_ms: float | None = None  # when the decode-side delta was predicted to reach MD
    fallback: str | None = None  # why P ran a pipeline other than the plan (e.g. MD refused)


@dataclass(frozen=True)
class Result:
    """P -> router: KV transfers are over (or given up)."""

    TYPE: ClassVar[MsgType] = MsgType.RESULT
    rid: str
    kv_bytes: int = 0
    wan_bytes: int = 0
    d_hit: int | None = None  # MD's reserved hit, when it answered after the pipeline was chosen


@dataclass(frozen=True)
class Handoff:
    """Relay (or router) -> main: output tokens [start, start + len(tokens)).

    Not final: a catch-up chunk to compute in the shadow. Final: compute the rest and
    take over; the router already has positions below `emit_from`, so the main
    instance streams every position from there on. Fill: the relay finished the
    request itself; compute the tokens in the shadow and keep prompt and output in
    the prefix cache, so the session's next turn finds them.
    """

    TYPE: ClassVar[MsgType] = MsgType.HANDOFF
    rid: str
    start: int
    tokens: list[int]
    final: bool
    emit_from: int = 0
    step_cap: int = 0  # catch-up and fill: most handed-over tokens computed in one step (0: all)
    fill: bool = False


@dataclass(frozen=True)
class HandoffAck:
    """Main -> relay: it computed output positions below `computed`."""

    TYPE: ClassVar[MsgType] = MsgType.HANDOFF_ACK
    rid: str
    computed: int


@dataclass(frozen=True)
class HandedOff:
    """Relay -> router: it stopped; the main instance produces from `upto` on."""

    TYPE: ClassVar[MsgType] = MsgType.HANDED_OFF
    rid: str
    mode: str
    upto: int
    chunks: int = 1


@dataclass(frozen=True)
class Progress:
    """Instance -> router: the request moved forward without a token (its KV is
    crossing the line, or the line of reservations ahead of it moved), so the router's
    no-progress timeouts do not take a slow request for a stuck one."""

    TYPE: ClassVar[MsgType] = MsgType.PROGRESS
    rid: str
    what: str = ""  # "kv": KV acknowledged; "queued": waiting for pages, the line ahead moved


@dataclass(frozen=True)
class Abort:
    TYPE: ClassVar[MsgType] = MsgType.ABORT
    rid: str


@dataclass(frozen=True)
class Member:
    """Router -> every instance: where a member of the deployment is, so P and the
    relays can reach a decode instance that joined after their config was written.
    (Departures need no frame: the router plans no work onto a member that left.)"""

    TYPE: ClassVar[MsgType] = MsgType.MEMBER
    name: str
    role: str
    dc: str
    host: str
    kv_port: int
    advertise: dict[str, str] = field(default_factory=dict)  # datacenter -> "HOST:PORT" (`InstanceSpec`)


@dataclass(frozen=True)
class Drain:
    """Router -> instance: the router sends it no new work; finish, then exit."""

    TYPE: ClassVar[MsgType] = MsgType.DRAIN


@dataclass(frozen=True)
class Error:
    TYPE: ClassVar[MsgType] = MsgType.ERROR
    message: str
    rid: str | None = None
    lost: bool = False  # the instance (or the link to it) is gone, not the request's fault
    busy: bool = False  # the instance holds all the requests it may: try again later


@dataclass(frozen=True)
class CacheUpdate:
    """An instance's radix cache changed (stored / removed / snapshot); a router asks
    for a fresh snapshot with kind "snapshot_request"."""

    TYPE: ClassVar[MsgType] = MsgType.CACHE_EVENT
    kind: str
    seq: int = 0
    hashes: list[int] = field(default_factory=list)
    page_size: int = 0


Body = Union[Hello, Submit, Reserve, ReserveAck, KVAck, KVDone, Ready, Tokens, PipelineChosen, Result, Handoff,
             HandoffAck, HandedOff, Progress, Abort, Error, CacheUpdate, Member, Drain]
_BY_TYPE: dict[MsgType, type] = {cls.TYPE: cls for cls in typing.get_args(Body)}
_HINTS: dict[type, tuple[dict[str, Any], frozenset[str]]] = {}  # field types, required fields
_CHOICES = {"pipeline": PDD_PIPELINES, "mode": tuple(HandoffMode),
            "kind": ("stored", "removed", "snapshot", "snapshot_request"), "role": ROLES_ON_WIRE,
            "what": ("", "kv", "queued")}


def _hints(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    if cls not in _HINTS:
        hints, fields = typing.get_type_hints(cls), dataclasses.fields(cls)
        required = frozenset(f.name for f in fields
                             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        _HINTS[cls] = ({f.name: hints[f.name] for f in fields}, required)
    return _HINTS[cls]


def _check(name: str, value: Any, tp: Any) -> Any:
    """`value` as type `tp`, or BadMessage naming the field."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (Union, types.UnionType):  # X | None
        return None if value is None and type(None) in args else _check(name, value, args[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64:
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif tp is str:
        limit = MAX_TEXT if name in ("message", "finish_reason") else MAX_NAME
        if isinstance(value, str) and len(value) <= limit and value in _CHOICES.get(name, (value,)) \
                and _utf8(value):
            return value
    elif typing.get_origin(tp) is list:  # list[int]: token ids, cache hashes
        if isinstance(value, list) and len(value) <= MAX_TOKENS and \
                all(type(v) is int and 0 <= v < 1 << 64 for v in value):
            return value
    elif typing.get_origin(tp) is dict:  # dict[str, str]: a member's advertised addresses
        if isinstance(value, dict) and len(value) <= MAX_DICT and \
                all(type(k) is str and type(v) is str and _short(k) and _short(v) for k, v in value.items()):
            return value
    elif tp is SamplingParams:
        return _params(value)
    raise BadMessage(f"field {name!r} must be {getattr(tp, '__name__', tp)}, got {str(value)[:80]!r}")


def _short(text: str) -> bool:
    return len(text) <= MAX_NAME and _utf8(text)


def _utf8(text: str) -> bool:
    """JSON can carry a lone surrogate ("\\ud800"), which no frame can carry back out
    (`encode_json` would fail answering the request it names)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _params(raw: Any) -> SamplingParams:
    if not isinstance(raw, dict):
        raise BadMessage("params must be an object")
    raw = dict(raw)
    stops = raw.get("stop_token_ids", [])
    if not isinstance(stops, list):
        raise BadMessage("stop_token_ids must be a list")
    raw["stop_token_ids"] = tuple(stops)
    try:
        return SamplingParams(**raw)
    except (TypeError, ValueError) as e:
        raise BadMessage(f"bad sampling params: {e}") from None


def from_dict(cls: type, raw: dict[str, Any]) -> Any:
    """A body from its JSON object: unknown, missing or mistyped fields are refused."""
    hints, required = _hints(cls)
    if set(raw) - set(hints) or required - set(raw):
        raise BadMessage(f"{cls.__name__}: unknown fields {sorted(set(raw) - set(hints))}, "
                         f"missing {sorted(required - set(raw))}")
    values = {name: _check(name, value, hints[name]) for name, value in raw.items()}
    if values.get("rid") == "":
        raise BadMessage("rid must not be empty")
    return cls(**values)


def to_dict(body: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(body):
        value = getattr(body, f.name)
        if isinstance(value, SamplingParams):
            value = {**dataclasses.asdict(value), "stop_token_ids": list(value.stop_token_ids)}
        out[f.name] = value
    return out


def decode(frame: Frame) -> Any:
    """The typed body of a control frame (not KV_LAYER, which `decode_kv` reads)."""
    cls = _BY_TYPE.get(frame.type)
    if cls is None:
        raise BadMessage(f"{frame.type.name} frames have no JSON body")
    return from_dict(cls, decode_json(frame.payload))


def decode_kv(frame: Frame) -> tuple[KVLayer, memoryview]:
    header, blob = unpack_with_header(frame.payload)
    return from_dict(KVLayer, header), blob


def rid_of(frame: Frame) -> str | None:
    """The request a frame names, when it can be read (to answer a bad one)."""
    try:
        body = decode_kv(frame)[0] if frame.type == MsgType.KV_LAYER else decode(frame)
    except (BadMessage, ValueError):
        return None
    return getattr(body, "rid", None)


async def send(conn: FramedConnection, body: Any) -> None:
    await conn.send(body.TYPE, encode_json(to_dict(body)))


async def send_kv(conn: FramedConnection, rid: str, blob: bytes) -> int:
    """Send one KV_LAYER frame; the payload bytes it put on the connection."""
    payload = pack_with_header(to_dict(KVLayer(rid)), blob)
    await conn.send(MsgType.KV_LAYER, payload)
    return len(payload)
