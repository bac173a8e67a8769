"""The body of every control frame: one struct per message type, and which kind of
connection carries which (`FromRouter`, `ToRouter`, `BetweenInstances`).

The classes are `msgspec.Struct`s: msgspec decodes JSON straight into them and checks
types, bounds, choices and unknown or missing fields as it goes (`pdd.transfer.messages`
decodes and encodes them; read them through it, as `m.Submit`).

Versions: a field added in protocol N is named in its class's `SINCE`, with a default.
Towards a peer that speaks N-1 it is left out; from such a peer it is refused, as N-1
itself would refuse it. A field is never removed or retyped within the versions spoken
(`wire.OLDEST_PROTOCOL` to `wire.PROTOCOL_VERSION`).

Token positions: a TOKENS frame says the output position of its first token, so the
router can merge tokens from two producers (a relay and a main decode instance) into
one ordered stream, whoever produced each position.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgspec
from msgspec import Meta

from pdd.names import PDD_PIPELINES, Fallback, HandoffMode, Pipeline, RoleName
from pdd.sampling.params import Logprob, SamplingParams
from pdd.transfer.wire import MsgType

MAX_TOKENS = 1 << 20  # longest token list in one body (a prompt)
MAX_TEXT = 4096
MAX_NAME = 128
MAX_DICT = 64  # entries of a string table in one body (a member's addresses, one per datacenter)
INT64_MAX = (1 << 63) - 1

ROLES_ON_WIRE = ("router", *RoleName)

# Field types. JSON's own limits do the rest: msgspec refuses NaN, 1e400 (no float holds
# it) and lone surrogates ("\ud800", which no frame could carry back out) as malformed.
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]  # positions, lengths, token ids, ports: what an int64 tensor holds
Hash = Annotated[int, Meta(ge=0)]  # a 64-bit block hash; msgspec bounds stop at int64, so `CacheUpdate` checks < 2**64
Name = Annotated[str, Meta(max_length=MAX_NAME)]
Rid = Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
TokenIds = Annotated[list[Count], Meta(max_length=MAX_TOKENS)]
# each prompt token's (the first's None), bounded further by `MAX_PROMPT_LOGPROB_ENTRIES`
PromptLogprobs = Annotated[list[Logprob | None], Meta(max_length=MAX_TOKENS)]


class BadMessage(ValueError):
    pass


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What every body is: immutable, and refused whole if it has a field too many or too few.

    msgspec passes both options on to subclasses; each body says `frozen=True` again for the
    type checker, which reads every class statement as a dataclass of its own."""

    TYPE: ClassVar[MsgType]
    SINCE: ClassVar[dict[str, int]] = {}  # field -> the protocol version that added it (after the oldest spoken)


class Hello(Message, frozen=True):
    TYPE: ClassVar[MsgType] = MsgType.HELLO
    SINCE: ClassVar[dict[str, int]] = {"software": 5}
    role: str
    name: Name = ""
    router_id: Name = ""  # a router's identity: instances send its requests' tokens to it alone
    channel: Name = ""  # an instance's connection: "control" (heartbeats), "urgent" or "background" (KV)
    software: Name = ""  # the sender's pdd release (`pdd.__version__`), shown per peer while upgrading

    def __post_init__(self) -> None:
        # a str and a check, not a type: msgspec cannot decode a union of "router" and the RoleName enum
        if self.role not in ROLES_ON_WIRE:
            raise ValueError(f"role must be one of {', '.join(ROLES_ON_WIRE)}, not {self.role[:MAX_NAME]!r}")


class Submit(Message, frozen=True):
    """Router -> P (or a standalone instance): run this request on the planned instances."""

    TYPE: ClassVar[MsgType] = MsgType.SUBMIT
    rid: Rid
    prompt: TokenIds
    params: SamplingParams
    router_id: Name = ""
    main: Name | None = None  # the main decode instance (P/D modes)
    relay: Name | None = None  # the relay instance (PDD mode)
    use_cache: bool = True  # decode side may reuse its cached prefix


class Reserve(Message, frozen=True):
    """P -> a decode-side instance: lock the cached prefix of this prompt, take pages for the rest."""

    TYPE: ClassVar[MsgType] = MsgType.RESERVE
    rid: Rid
    prompt: TokenIds
    params: SamplingParams
    router_id: Name = ""
    use_cache: bool = True
    main: Name | None = None  # to a relay: the main decode instance it hands off to


class ReserveAck(Message, frozen=True):
    TYPE: ClassVar[MsgType] = MsgType.RESERVE_ACK
    rid: Rid
    hit: Count = 0  # tokens of the prompt already held (the authoritative decode-side hit)
    error: Text | None = None
    busy: bool = False  # with `error`: a relay too loaded to take an optional request (not a failure)


class KVLayer(Message, frozen=True):
    """The JSON header of a KV_LAYER frame; the encoded KV blob follows it."""

    TYPE: ClassVar[MsgType] = MsgType.KV_LAYER
    rid: Rid


class KVAck(Message, frozen=True):
    """Decode side -> P: KV imported up to `token_end`; `done` once KV_DONE is in."""

    TYPE: ClassVar[MsgType] = MsgType.KV_ACK
    rid: Rid
    token_end: Count
    done: bool = False


class KVDone(Message, frozen=True):
    """P -> decode side: all KV is sent. With `emit`, start decoding and stream from
    position 0 (P's first token); without, wait for a handoff."""

    TYPE: ClassVar[MsgType] = MsgType.KV_DONE
    SINCE: ClassVar[dict[str, int]] = {"first_logprob": 6, "prompt_logprobs": 7}
    rid: Rid
    first_token: Count
    emit: bool = True
    first_logprob: Logprob | None = None  # the first token's, where the request asks for logprobs
    # P's, where asked, to every decode peer: position 0's emitter is the relay, or MD where a
    # relay hands over before its KV arrived (MD then streams from position 0)
    prompt_logprobs: PromptLogprobs | None = None


class Ready(Message, frozen=True):
    """P -> relay: the main decode instance holds the prompt's KV; hand off."""

    TYPE: ClassVar[MsgType] = MsgType.READY
    rid: Rid


class Tokens(Message, frozen=True):
    """Produced tokens for output positions [pos, pos + len(tokens))."""

    TYPE: ClassVar[MsgType] = MsgType.TOKENS
    SINCE: ClassVar[dict[str, int]] = {"logprobs": 6, "prompt_logprobs": 7}
    rid: Rid
    pos: Count
    tokens: TokenIds
    finish_reason: Text | None = None
    cached_tokens: Count = 0
    stall_ms: float | None = None  # the first token after a handoff: the main instance's extend stall
    logprobs: list[Logprob] | None = None  # each token's, where the request asks (as many as `tokens`)
    prompt_logprobs: PromptLogprobs | None = None  # with position 0, where asked: P's (`KVDone`)


class PipelineChosen(Message, frozen=True):
    """P -> router: the pipeline P chose from the reserved hit, and the hits."""

    TYPE: ClassVar[MsgType] = MsgType.PIPELINE
    rid: Rid
    pipeline: Pipeline
    p_hit: Count = 0
    d_hit: Count = 0
    predicted_ms: float | None = None  # when the decode-side delta was predicted to reach MD
    fallback: Fallback | None = None  # why P ran a pipeline other than the plan (e.g. MD refused)

    def __post_init__(self) -> None:
        if self.pipeline not in PDD_PIPELINES:
            raise ValueError(f"pipeline must be one of {', '.join(PDD_PIPELINES)}, not {self.pipeline!r}")


class Result(Message, frozen=True):
    """P -> router: KV transfers are over (or given up)."""

    TYPE: ClassVar[MsgType] = MsgType.RESULT
    rid: Rid
    kv_bytes: Count = 0
    # (peers of the release before send and read the field under the name it had)
    line_bytes: Count = msgspec.field(default=0, name="wan_bytes")  # its retired name, on the wire
    d_hit: Count | None = None  # MD's reserved hit, when it answered after the pipeline was chosen


class Handoff(Message, frozen=True):
    """Relay (or router) -> main: output tokens [start, start + len(tokens)).

    Not final: a catch-up chunk to compute in the shadow. Final: compute the rest and
    take over; the router already has positions below `emit_from`, so the main
    instance streams every position from there on. Fill: the relay finished the
    request itself; compute the tokens in the shadow and keep prompt and output in
    the prefix cache, so the session's next turn finds them.
    """

    TYPE: ClassVar[MsgType] = MsgType.HANDOFF
    rid: Rid
    start: Count
    tokens: TokenIds
    final: bool
    emit_from: Count = 0
    step_cap: Count = 0  # catch-up and fill: most handed-over tokens computed in one step (0: all)
    fill: bool = False


class HandoffAck(Message, frozen=True):
    """Main -> relay: it computed output positions below `computed`."""

    TYPE: ClassVar[MsgType] = MsgType.HANDOFF_ACK
    rid: Rid
    computed: Count


class HandedOff(Message, frozen=True):
    """Relay -> router: it stopped; the main instance produces from `upto` on."""

    TYPE: ClassVar[MsgType] = MsgType.HANDED_OFF
    rid: Rid
    mode: HandoffMode
    upto: Count
    chunks: Count = 1


class Progress(Message, frozen=True):
    """Instance -> router: the request moved forward without a token (its KV is
    crossing the line, or the line of reservations ahead of it moved), so the router's
    no-progress timeouts do not take a slow request for a stuck one."""

    TYPE: ClassVar[MsgType] = MsgType.PROGRESS
    rid: Rid
    what: Literal["", "kv", "queued"] = ""  # "kv": KV acknowledged; "queued": waiting for pages, the line moved


class Abort(Message, frozen=True):
    TYPE: ClassVar[MsgType] = MsgType.ABORT
    rid: Rid


class Member(Message, frozen=True):
    """Router -> every instance: where a member of the deployment is, so P and the
    relays can reach a decode instance that joined after their config was written.
    (Departures need no frame: the router plans no work onto a member that left.)"""

    TYPE: ClassVar[MsgType] = MsgType.MEMBER
    name: Name
    role: RoleName
    dc: Name
    host: Name
    kv_port: Count
    # datacenter -> "HOST:PORT" (`InstanceSpec`)
    advertise: Annotated[dict[Name, Name], Meta(max_length=MAX_DICT)] = msgspec.field(default_factory=dict)


class Drain(Message, frozen=True):
    """Router -> instance: the router sends it no new work; finish, then exit."""

    TYPE: ClassVar[MsgType] = MsgType.DRAIN


class Error(Message, frozen=True):
    TYPE: ClassVar[MsgType] = MsgType.ERROR
    message: Text
    rid: Rid | None = None
    lost: bool = False  # the instance (or the connection to it) is gone, not the request's fault
    busy: bool = False  # the instance holds all the requests it may: try again later


class CacheUpdate(Message, frozen=True):
    """An instance's radix cache changed (stored / removed / snapshot); a router asks
    for a fresh snapshot with kind "snapshot_request"."""

    TYPE: ClassVar[MsgType] = MsgType.CACHE_EVENT
    kind: Literal["stored", "removed", "snapshot", "snapshot_request"]
    seq: Count = 0
    hashes: Annotated[list[Hash], Meta(max_length=MAX_TOKENS)] = msgspec.field(default_factory=list)
    page_size: Count = 0
    # a snapshot's: the instance's KV pages and the context one request may hold, as its
    # engine sized them (vLLM sizes itself: the router plans with these, not the config's)
    pages: Count = 0
    max_context: Count = 0

    def __post_init__(self) -> None:
        if self.hashes and max(self.hashes) >> 64:
            raise ValueError("hashes must be below 2**64")


class KVRegionAsk(Message, frozen=True):
    """P -> a decode-side instance of its own datacenter, on a KV connection: a region of
    the transfer engine `engine` for this connection's KV (`pdd.transfer.mooncake`)."""

    TYPE: ClassVar[MsgType] = MsgType.KV_REGION_ASK
    engine: Literal["mooncake"]


class KVRegion(Message, frozen=True):
    """The answer to KV_REGION_ASK: where the sender may write (`session`, a registered
    `address` of `slots` slots of `slot_bytes`), or `error` (KV then stays on the connection)."""

    TYPE: ClassVar[MsgType] = MsgType.KV_REGION
    session: Name = ""
    address: Count = 0
    slot_bytes: Count = 0
    slots: Annotated[int, Meta(ge=0, le=1024)] = 0
    error: Text = ""


class KVPlaced(Message, frozen=True):
    """P -> decode side: a KV_LAYER frame's payload (its KVLayer header and blob) is in
    slot `slot` of this connection's region, `nbytes` long, the `n`th placed on it; `tag`
    (hex) is what the receiver checks its copy of the bytes against before it reads them:
    their GMAC under a key of the connection's session (a CRC32C on a connection without
    a key, whose frames are not authenticated either)."""

    TYPE: ClassVar[MsgType] = MsgType.KV_PLACED
    slot: Annotated[int, Meta(ge=0, lt=1024)]
    nbytes: Count
    n: Count
    tag: Annotated[str, Meta(pattern="^[0-9a-f]{8,32}$")]


class KVSlotFree(Message, frozen=True):
    """Decode side -> P: the bytes of slot `slot` are read; it may be written again."""

    TYPE: ClassVar[MsgType] = MsgType.KV_SLOT_FREE
    slot: Annotated[int, Meta(ge=0, lt=1024)]


Body = (
    Hello
    | Submit
    | Reserve
    | ReserveAck
    | KVAck
    | KVDone
    | Ready
    | Tokens
    | PipelineChosen
    | Result
    | Handoff
    | HandoffAck
    | HandedOff
    | Progress
    | Abort
    | Error
    | CacheUpdate
    | Member
    | Drain
    | KVRegionAsk
    | KVRegion
    | KVPlaced
    | KVSlotFree
)

# What each kind of connection carries; anything else on it is a `BadMessage`.
FromRouter = Submit | Abort | Handoff | CacheUpdate | Member | Drain
ForRequest = Tokens | PipelineChosen | Result | HandedOff | Progress | Error  # (the router hands it to the request)
ToRouter = ForRequest | CacheUpdate | Member | Drain
BetweenInstances = (
    Reserve
    | ReserveAck
    | KVAck
    | KVDone
    | Ready
    | Handoff
    | HandoffAck
    | Abort
    | Error
    | KVRegionAsk
    | KVRegion
    | KVPlaced
    | KVSlotFree
)
