"""Fuzzing what crosses a trust boundary: frames and KV from peers, JSON from HTTP clients.

Whatever arrives — random bytes, a valid stream with bits flipped, a length field
rewritten, a frame replayed, a body with a 5,000-digit number or a lone surrogate —
must be refused with the receiving module's own error (`FrameError`, `BadMessage`,
`KVFormatError`, `RequestError`, an OpenAI 4xx), never crash a process, never be taken
for a different valid frame, and never make us buffer what a peer merely announces.

- frames (`pdd.transfer.wire`) through `FramedConnection.recv`, on plain and
  authenticated connections;
- control bodies (`pdd.transfer.messages.decode`);
- the KV importer as the decode side runs it: KV_LAYER payload -> `decode_kv` ->
  `codec.decode` -> `join_layers` -> `Engine.import_kv`;
- the OpenAI API of a real `pdd serve` process, from its OpenAPI schema (schemathesis)
  and from hostile JSON text (hypothesis).

Every test is derandomized (the same examples on every run, for CI) and bounded by
`max_examples`; generations are capped at a few tokens so the file runs in seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
import struct
import tracemalloc
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from procs import standalone
from schemathesis import GenerationMode
from test_messages import SAMPLES
from test_wire import FIELDS, KEY, OTHER_KEY

from pdd.engines.embedded.engine import Engine
from pdd.engines.port import EngineConfig, RequestError
from pdd.kv import codec
from pdd.kv.blocks import block_hashes
from pdd.kv.reassembly import Reassembly
from pdd.sampling.params import SamplingParams
from pdd.transfer import messages as m
from pdd.transfer.wire import (
    FLAG_AUTH,
    GMAC_TAG_SIZE,
    HANDSHAKE_MAX_PAYLOAD,
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    REJECTS,
    TAG_SIZE,
    BadChecksum,
    ConnectionClosed,
    Frame,
    FrameCodec,
    FramedConnection,
    FrameError,
    MsgType,
    TooLarge,
    encode_json,
    pack_with_header,
)


def fuzz(examples: int) -> settings:
    """Reproducible and bounded: derandomized, no example database, no per-example deadline."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.large_base_example])


# ---- JSON as a hostile peer or client writes it ---------------------------------------------
# Raw JSON text, so that what no Python value stands for survives: integers past CPython's
# 4,300-digit limit, 1e400, NaN, nesting past the recursion limit. (`json.dumps` escapes a
# lone surrogate as "\ud800", which every JSON parser accepts.)
HOSTILE_NUMBERS = ["1" + "0" * 400, "-" + "9" * 5000, "1e400", "-1e400", "5e-324", "-0", "0", "-1", "1.5",
                   "18446744073709551616", "9223372036854775808", "NaN", "Infinity", "-Infinity"]
HOSTILE_STRINGS = ['"\\ud800"', '"a\\udfffb"', '"\\udc80\\ud83d"', '"\\u0000"', '""', json.dumps("x" * 5000)]
HOSTILE_JSON = HOSTILE_NUMBERS + HOSTILE_STRINGS + [
    "[" * 3000 + "]" * 3000, '{"a":' * 3000 + "1" + "}" * 3000, "[]", "{}", "null", "true", "false"]
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                         st.text(max_size=8), st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                                                      min_size=1, max_size=2))  # lone surrogates
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
RAW_JSON = st.one_of(JSON_VALUES.map(json.dumps), st.sampled_from(HOSTILE_JSON))


def object_text(fields: dict[str, str]) -> str:
    """A JSON object from already-encoded values (so hostile raw text survives)."""
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in fields.items()) + "}"


@st.composite
def hostile_value(draw: st.DrawFn, current: Any) -> str:
    """Raw JSON to put where `current` was: junk of any type, or a near miss of its own
    type (a number no float or int64 holds, a lone surrogate, a list with one bad item)."""
    if isinstance(current, (int, float)) and not isinstance(current, bool):
        near = st.sampled_from(HOSTILE_NUMBERS)
    elif isinstance(current, str):
        near = st.sampled_from(HOSTILE_STRINGS)
    elif isinstance(current, list):
        items = [json.dumps(x) for x in current] or ["0"]
        i = draw(st.integers(0, len(items) - 1))
        near = RAW_JSON.map(lambda bad: "[" + ",".join(items[:i] + [bad] + items[i + 1:]) + "]")
    else:
        near = RAW_JSON
    return draw(near | RAW_JSON)


@st.composite
def mutated_fields(draw: st.DrawFn, base: dict[str, Any], extra_keys: tuple[str, ...] = ()) -> dict[str, str]:
    """`base` encoded field by field, then 1-3 edits: a field set to hostile JSON, dropped,
    or added (an unknown name, or one of `extra_keys`); a nested object may be edited inside."""
    fields = {k: json.dumps(v) for k, v in base.items()}
    for _ in range(draw(st.integers(1, 3))):
        edit = draw(st.sampled_from(["set", "set", "set", "drop", "add", "nested"]))
        if edit == "add" or not fields:
            names = st.sampled_from(extra_keys) | st.text(max_size=6) if extra_keys else st.text(max_size=6)
            fields[draw(names)] = draw(RAW_JSON)
            continue
        key = draw(st.sampled_from(sorted(fields)))
        value = base.get(key)
        if edit == "drop":
            del fields[key]
        elif edit == "nested" and isinstance(value, dict):
            fields[key] = object_text(draw(mutated_fields(value)))
        elif edit == "nested" and isinstance(value, list) and value and isinstance(value[0], dict):
            fields[key] = "[" + object_text(draw(mutated_fields(value[0]))) + "]"  # e.g. a chat message
        else:
            fields[key] = draw(hostile_value(value))
    return fields


# ---- frames ---------------------------------------------------------------------------------
class _ReadOnlyWriter:
    """Just enough of a StreamWriter for a `FramedConnection` that only receives."""

    def __init__(self) -> None:
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("fuzz", 0) if name == "peername" else default

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


@dataclass
class Received:
    frames: list[Frame]
    error: FrameError | ConnectionClosed
    dropped: bool  # the connection closed itself
    rejects: int  # how many rejections REJECTS counted meanwhile


def receive(key: bytes | None, stream: bytes) -> Received:
    """Every frame `FramedConnection.recv` accepts from `stream` (then EOF), and the error
    that ends it. Any other exception, or a hang, propagates and fails the test."""

    async def go() -> Received:
        reader = asyncio.StreamReader()
        reader.feed_data(stream)
        reader.feed_eof()
        codec_ = session(key)  # past the handshake: the full-size limit and the session's tags apply
        writer = _ReadOnlyWriter()
        conn = FramedConnection(reader, writer, codec_)  # type: ignore[arg-type]
        frames: list[Frame] = []
        before = REJECTS.total()
        while True:
            try:
                frames.append(await asyncio.wait_for(conn.recv(), 5))
            except (FrameError, ConnectionClosed) as err:
                return Received(frames, err, writer.closed, REJECTS.total() - before)

    result = asyncio.run(go())
    if isinstance(result.error, FrameError):  # a bad frame is counted once and drops the connection
        assert result.rejects == 1 and result.dropped, result
    else:  # a peer going away is not a rejection
        assert result.rejects == 0, result
    return result


def clean_close(err: BaseException) -> bool:
    """The stream ended at a frame boundary (not inside a frame)."""
    return isinstance(err, ConnectionClosed) and "middle" not in str(err)


def session(key: bytes | None) -> FrameCodec:
    """A connection's codec past its handshake (under session keys: GMAC tags, no CRC)."""
    codec_ = FrameCodec(key)
    if key:
        codec_.rekey(key, key)
    return codec_


def encoded(key: bytes | None, frames: list[tuple[MsgType, bytes]]) -> list[bytes]:
    sender = session(key)
    return [sender.encode(t, p) for t, p in frames]


def tag(key: bytes, header_and_payload: bytes) -> bytes:
    return hmac.new(key, header_and_payload, hashlib.sha256).digest()


def session_tag(key: bytes, seq: int, msg_type: MsgType, payload: bytes) -> bytes:
    """The tag a holder of `key` puts on frame `seq` of a session."""
    sender = session(key)
    sender.send_seq = seq
    return sender.encode(msg_type, payload)[-GMAC_TAG_SIZE:]


FRAMES = st.lists(st.tuples(st.sampled_from(list(MsgType)), st.binary(max_size=200)), min_size=1, max_size=4)
MUTATIONS = ["flip", "truncate", "length", "seq", "mac", "insert", "delete", "replay", "swap"]


def mutate(data: st.DataObject, key: bytes | None, frames: list[tuple[MsgType, bytes]], wire: list[bytes]) -> bytes:
    """The stream of `wire` frames with one mutation, as a broken line or an attacker
    without the key could make it (a wrong sequence number is re-sent by a key holder)."""
    kind = data.draw(st.sampled_from(MUTATIONS), label="mutation")
    stream = b"".join(wire)
    k = data.draw(st.integers(0, len(wire) - 1), label="frame")
    before, frame, after = b"".join(wire[:k]), wire[k], b"".join(wire[k + 1:])
    if kind == "flip":
        out = bytearray(stream)
        out[data.draw(st.integers(0, len(out) - 1))] ^= data.draw(st.integers(1, 255))
        return bytes(out)
    if kind == "truncate":
        return stream[: data.draw(st.integers(0, len(stream) - 1))]
    if kind == "length":
        at = FIELDS["length"]
        new = data.draw(st.integers(0, 2**32 - 1).filter(lambda n: n != len(frames[k][1])))
        return before + frame[: at.start] + struct.pack("!I", new) + frame[at.stop:] + after
    if kind == "seq":
        sender = session(key)
        sender.send_seq = data.draw(st.integers(0, 2**64 - 1).filter(lambda s: s != k))
        return before + sender.encode(*frames[k]) + after
    if kind == "mac":
        header, payload = frame[: HEADER.size], frame[HEADER.size: len(frame) - (GMAC_TAG_SIZE if key else 0)]
        how = data.draw(st.sampled_from(["other key", "random tag", "auth flag flipped"]))
        if how == "auth flag flipped":  # an unauthenticated frame on an authenticated line, or the reverse
            flags = FIELDS["flags"].start
            header = header[:flags] + bytes([header[flags] ^ FLAG_AUTH]) + header[flags + 1:]
            return before + header + payload + (b"" if key else tag(KEY, header + payload)) + after
        forged = session_tag(OTHER_KEY, k, frames[k][0], frames[k][1]) if how == "other key" else \
            data.draw(st.binary(min_size=GMAC_TAG_SIZE, max_size=GMAC_TAG_SIZE))
        return before + header + payload + forged + after
    if kind == "insert":
        i = data.draw(st.integers(0, len(stream)))
        return stream[:i] + data.draw(st.binary(min_size=1, max_size=40)) + stream[i:]
    if kind == "delete":
        i = data.draw(st.integers(0, len(stream) - 1))
        return stream[:i] + stream[i + data.draw(st.integers(1, 40)):]
    if kind == "swap" and len(wire) > 1:
        j = data.draw(st.integers(0, len(wire) - 2))
        j += j >= k  # any other frame
        order = list(wire)
        order[j], order[k] = order[k], order[j]
        return b"".join(order)
    j = data.draw(st.integers(0, len(wire)))
    return b"".join(wire[:j] + [frame] + wire[j:])  # a replay, at a frame boundary


@fuzz(400)
@given(frames=FRAMES, auth=st.booleans(), data=st.data())
def test_a_mutated_stream_is_refused_and_never_read_as_other_frames(frames: list[tuple[MsgType, bytes]], auth: bool,
                                                                     data: st.DataObject) -> None:
    """Frames before the first damaged byte still arrive; from there on, an authenticated
    line accepts nothing it was not sent, and a plain line's CRC catches damaged payloads."""
    key = KEY if auth else None
    wire = encoded(key, frames)
    stream, originals = b"".join(wire), [(t, i, p) for i, (t, p) in enumerate(frames)]
    mutated = mutate(data, key, frames, wire)
    if mutated == stream:
        return
    got = receive(key, mutated)
    decoded = [(f.type, f.seq, f.payload) for f in got.frames]
    first_change = next((i for i, (a, b) in enumerate(zip(stream, mutated, strict=False)) if a != b),
                        min(len(stream), len(mutated)))
    ends = [sum(map(len, wire[: i + 1])) for i in range(len(wire))]
    intact = sum(end <= first_change for end in ends)  # frames wholly before the damage
    assert len(decoded) >= intact and decoded[:intact] == originals[:intact]
    if auth:
        assert decoded == originals[: len(decoded)], "an authenticated line accepted a frame it was not sent"
        if clean_close(got.error):  # whatever the damage, it did not pass as the end of the stream
            assert mutated == b"".join(wire[: len(decoded)])
    elif len(mutated) == len(stream) and sum(a != b for a, b in zip(stream, mutated, strict=True)) == 1:
        # one byte changed in place: inside a payload or its CRC, the CRC catches it
        k = intact
        if first_change - (ends[k] - len(wire[k])) >= FIELDS["crc"].start:
            assert len(decoded) == k and isinstance(got.error, BadChecksum), got.error


@st.composite
def headed_junk(draw: st.DrawFn) -> bytes:
    """Bytes behind a header that is often plausible (right magic, version, CRC), so
    random input gets past the first checks and exercises the later ones."""
    payload = draw(st.binary(max_size=64))
    header = HEADER.pack(
        draw(st.sampled_from([MAGIC, b"PX"])), draw(st.sampled_from([PROTOCOL_VERSION, 1, 255])),
        draw(st.integers(0, 255)), draw(st.sampled_from([0, FLAG_AUTH, 0x80])),
        draw(st.sampled_from([0, 1, 2**64 - 1])),
        draw(st.sampled_from([len(payload), 0, len(payload) + 1, 2**32 - 1])),
        draw(st.sampled_from([zlib.crc32(payload), 0])))
    return header + payload + draw(st.binary(max_size=TAG_SIZE + 8)) + draw(st.binary(max_size=8))


@fuzz(300)
@given(stream=st.one_of(st.binary(max_size=200), headed_junk(), st.lists(headed_junk(), max_size=3).map(b"".join)),
       auth=st.booleans())
def test_random_bytes_are_refused_without_a_crash(stream: bytes, auth: bool) -> None:
    """Only the wire errors escape; an authenticated line takes nothing from random bytes,
    and a plain line only byte-exact canonical frames (right seq, CRC, known flags)."""
    key = KEY if auth else None
    got = receive(key, stream)
    canonical = b"".join(encoded(key, [(f.type, f.payload) for f in got.frames]))
    if auth:
        assert got.frames == []
    assert stream.startswith(canonical)
    if clean_close(got.error):
        assert stream == canonical


@fuzz(120)
@given(line=st.sampled_from(["plain", "before handshake", "authenticated"]), limit=st.integers(0, 1 << 20),
       tail=st.binary(max_size=64), data=st.data())
def test_an_announced_length_over_the_limit_is_refused_at_the_header(line: str, limit: int, tail: bytes,
                                                                      data: st.DataObject) -> None:
    """No payload byte is read and nothing of the announced size is allocated: the
    reader still holds every byte after the header, and the read's memory peak is small."""
    key = None if line == "plain" else KEY
    codec_ = FrameCodec(key, max_payload=limit)
    if line == "authenticated":
        codec_.rekey(KEY, KEY)
    read_limit = HANDSHAKE_MAX_PAYLOAD if line == "before handshake" else limit
    length = data.draw(st.integers(read_limit + 1, 2**32 - 1))
    header = HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.KV_LAYER, FLAG_AUTH if key else 0, 0, length, 0)

    async def go() -> tuple[int, bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(header + tail)  # and no EOF: reading the payload would wait, not fail
        tracemalloc.start()
        try:
            with pytest.raises(TooLarge):
                await asyncio.wait_for(codec_.read(reader), 5)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        reader.feed_eof()
        return peak, await reader.read()

    peak, left = asyncio.run(go())
    assert left == tail
    assert peak < 256 * 1024, f"reading a refused {length}-byte frame peaked at {peak} bytes"


# ---- control bodies -------------------------------------------------------------------------
def check_body(frame: Frame) -> Any:
    """Decode a control frame as a receiver does. A bad body is BadMessage/BadPayload (and
    `rid_of`, which answers it, never fails); a good one can be sent on: it re-encodes
    to itself (no lone surrogate, no infinity), and its sampling numbers are floats."""
    assert m.rid_of(frame) is None or isinstance(m.rid_of(frame), str)
    try:
        body = m.decode(frame)
    except (m.BadMessage, FrameError):
        return None
    assert m.decode(Frame(frame.type, 0, encode_json(m.to_dict(body)))) == body
    params = getattr(body, "params", None)
    if isinstance(params, SamplingParams):
        assert math.isfinite(float(params.temperature)) and math.isfinite(float(params.top_p))
    return body


@fuzz(500)
@given(sample=st.sampled_from(SAMPLES), damage=st.integers(0, 5), data=st.data())
def test_control_bodies_refuse_hostile_json(sample: Any, damage: int, data: st.DataObject) -> None:
    """Every message type, with fields set to hostile JSON, dropped or unknown; now and
    then cut short or replaced by random bytes."""
    payload = object_text(data.draw(mutated_fields(m.to_dict(sample)))).encode()
    if damage == 0:
        payload = data.draw(st.binary(max_size=64))
    elif damage == 1:
        payload = payload[: data.draw(st.integers(0, len(payload) - 1))]
    check_body(Frame(sample.TYPE, 0, payload))


@fuzz(300)
@given(sample=st.sampled_from([s for s in SAMPLES if hasattr(s, "params")]), data=st.data())
def test_sampling_params_from_the_wire_are_refused_or_usable(sample: Any, data: st.DataObject) -> None:
    """SUBMIT and RESERVE carry sampling parameters a sampler divides by: one no float
    holds (1e400, 10**400) must be refused here, not fail a whole batch's step later."""
    fields = {k: json.dumps(v) for k, v in m.to_dict(sample).items()}
    fields["params"] = object_text(data.draw(mutated_fields(m.to_dict(sample)["params"])))
    check_body(Frame(sample.TYPE, 0, object_text(fields).encode()))


# ---- the KV importer ------------------------------------------------------------------------
SMALL_KV = {"num_layers": 2, "layer_start": 0, "layer_end": 2, "kv_heads": 1, "head_dim": 2, "dtype": "float16",
            "page_size": 4, "token_start": 0, "token_end": 3, "block_size": 2, "block_hashes": [7]}
SIZE_FIELDS = ("num_layers", "layer_start", "layer_end", "kv_heads", "head_dim", "token_start", "token_end")


def payload_size(header: Any) -> int | None:
    """Bytes the header's tensors take, when the header is sane enough to say (and small)."""
    try:
        h = codec.KVHeader(**header)
    except TypeError:
        return None
    if not all(type(getattr(h, f)) is int for f in SIZE_FIELDS) or \
            not (isinstance(h.dtype, str) and h.dtype in codec.DTYPES):
        return None  # (checked before multiplying: 3 * "x" is a string)
    size = h.payload_bytes
    return size if 0 <= size <= 1 << 16 else None


@st.composite
def kv_blobs(draw: st.DrawFn) -> bytes:
    """A small valid KV blob with one or two kinds of damage: a header field set to
    hostile JSON, sizes changed (the body follows them half the time, so odd but
    consistent layouts are decoded too), a field dropped or added, the whole header
    replaced, the prefix (magic, version, header length) or the body size wrong."""
    fields = {k: json.dumps(v) for k, v in SMALL_KV.items()}
    magic, version, hlen_error, body_error, raw_header = codec.MAGIC, codec.VERSION, 0, 0, None
    for damage in draw(st.lists(st.sampled_from(["field"] * 3 + ["sizes", "fields", "header", "prefix", "body"]),
                                min_size=1, max_size=2)):
        if damage == "field":
            name = draw(st.sampled_from(sorted(SMALL_KV)))
            fields[name] = draw(hostile_value(SMALL_KV[name]))
        elif damage == "sizes":
            for name in draw(st.lists(st.sampled_from(SIZE_FIELDS), min_size=1, max_size=2)):
                fields[name] = str(draw(st.integers(-2, 6)))
        elif damage == "fields":
            fields = draw(mutated_fields(SMALL_KV, tuple(SMALL_KV)))
        elif damage == "header":
            raw_header = draw(RAW_JSON)
        elif damage == "prefix":
            magic = draw(st.sampled_from([codec.MAGIC, b"PDKX", b"\0\0\0\0"]))
            version = draw(st.sampled_from([codec.VERSION, codec.VERSION + 1, 0, 65535]))
            hlen_error = draw(st.sampled_from([0, 1, -1, 1 << 20, 2**32]))
        else:
            body_error = draw(st.integers(-3, 3))
    text = (raw_header or object_text(fields)).encode()
    try:
        size = payload_size(json.loads(text))
    except (ValueError, RecursionError):
        size = None
    if size is None or draw(st.booleans()):
        size = draw(st.integers(0, 64))
    hlen = min(max(len(text) + hlen_error, 0), 2**32 - 1)
    body = draw(st.binary(min_size=max(size + body_error, 0), max_size=max(size + body_error, 0)))
    return struct.pack("!4sHI", magic, version, hlen) + text + body


def same_blob(a: codec.KVBlob, b: codec.KVBlob) -> bool:
    raw = [t.contiguous().view(torch.uint8) for t in (a.k, a.v, b.k, b.v)]
    return a.header == b.header and torch.equal(raw[0], raw[2]) and torch.equal(raw[1], raw[3])


@fuzz(500)
@given(blob=st.one_of(st.binary(max_size=128), kv_blobs()))
def test_the_kv_decoder_refuses_malformed_blobs(blob: bytes) -> None:
    """Only KVFormatError escapes; an accepted blob is consistent with its header and round-trips."""
    try:
        kv = codec.decode(blob)
    except codec.KVFormatError:
        return
    h = kv.header
    assert kv.k.shape == kv.v.shape == (h.layer_end - h.layer_start, h.num_tokens, h.kv_heads, h.head_dim)
    assert kv.k.dtype == codec.DTYPES[h.dtype] and all(type(x) is int for x in h.block_hashes)
    assert same_blob(codec.decode(codec.encode(kv)), kv)


PAGE = 16
PROMPT = list(range(100, 140))  # 40 tokens: pages 0-2
IMPORT_ERRORS = (FrameError, m.BadMessage, codec.KVFormatError, RequestError)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Any) -> Engine:
    return Engine(tiny_model_dir, EngineConfig(page_size=PAGE, num_pages=32))


def honest_layers(engine: Engine, end: int, dtype: str) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """The per-layer KV_LAYER contents P would send for prompt tokens [0, end), and their K
    (V is -K) as [layers, tokens, kv_heads, head_dim]."""
    cfg = engine.model_cfg
    header = codec.KVHeader(num_layers=cfg.num_layers, layer_start=0, layer_end=cfg.num_layers,
                            kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype, page_size=PAGE,
                            token_start=0, token_end=end, block_size=PAGE,
                            block_hashes=block_hashes(PROMPT[:end], PAGE))
    shape = (cfg.num_layers, end, cfg.num_kv_heads, cfg.head_dim)
    k = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape).to(codec.DTYPES[dtype]) / 1000
    parts = codec.split_layers(codec.KVBlob(header, k, -k))
    return [{"rid": "fz", "header": json.dumps(vars(p.header)), "body": codec.encode(p)[-p.header.payload_bytes:]}
            for p in parts], k


def parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def layer_payload(layer: dict[str, Any], data: st.DataObject) -> bytes:
    """One KV_LAYER payload; a tampered header gets a body of its new size half the time,
    so it reaches the checks past the codec (join_layers, the engine)."""
    text = layer["header"].encode()
    body = layer["body"]
    header = parsed(layer["header"])
    size = payload_size(header) if isinstance(header, dict) else None
    if size is not None and size != len(body) and data.draw(st.booleans(), label="resize body"):
        body = (body * (size // max(len(body), 1) + 1))[:size]
    blob = struct.pack("!4sHI", codec.MAGIC, codec.VERSION, len(text)) + text + body
    return pack_with_header({"rid": layer["rid"]}, blob)


def import_like_the_receiver(engine: Engine, payloads: list[bytes], imported: list[codec.KVHeader]) -> None:
    """What `DecodeSide.on_peer` does with KV_LAYER frames: put each chunk's layers
    together (`Reassembly`), import whole chunks in token order; the headers of the chunks
    imported go to `imported`."""
    arriving = Reassembly(0, len(PROMPT))
    for payload in payloads:
        head, blob = m.decode_kv(Frame(MsgType.KV_LAYER, 0, payload))
        for whole in arriving.add(codec.decode(blob)):
            engine.import_kv(head.rid, whole)
            imported.append(whole.header)


@fuzz(150)
@given(end=st.integers(1, len(PROMPT)), dtype=st.sampled_from(sorted(codec.DTYPES)), data=st.data())
def test_the_kv_importer_refuses_malformed_layers(engine: Engine, end: int, dtype: str, data: st.DataObject) -> None:
    """Tampered headers, bodies, frame headers, dropped/reordered/repeated layers: each is
    refused with the importer's own errors, and what is imported is KV of this prompt
    for the model's whole shape (any dtype: it is converted)."""
    layers, k = honest_layers(engine, end, dtype)
    edits = data.draw(st.integers(0, 3), label="edits")
    for _ in range(edits):
        edit = data.draw(st.sampled_from(["header", "rid", "drop", "repeat", "swap"]))
        i = data.draw(st.integers(0, len(layers) - 1))
        if edit == "header":
            base = parsed(layers[i]["header"])
            layers[i]["header"] = object_text(data.draw(mutated_fields(base))) if isinstance(base, dict) \
                else data.draw(RAW_JSON)
        elif edit == "rid":
            layers[i]["rid"] = data.draw(st.sampled_from(["other", ""]) | JSON_VALUES)
        elif edit == "drop" and len(layers) > 1:
            layers.pop(i)
        elif edit == "repeat":
            layers.insert(i, dict(layers[i]))
        elif edit == "swap":
            j = data.draw(st.integers(0, len(layers) - 1))
            layers[i], layers[j] = layers[j], layers[i]
    payloads = []
    for layer in layers:
        try:
            payloads.append(layer_payload(layer, data))
        except (TypeError, ValueError, RecursionError):  # the tampered header is not even JSON we can write
            payloads.append(b"\x00\x00\x00\x02{}" + b"junk")
    damaged = data.draw(st.booleans(), label="damage bytes")
    if damaged:
        i = data.draw(st.integers(0, len(payloads) - 1))
        raw = bytearray(payloads[i])
        cut = data.draw(st.integers(0, len(raw)))
        raw[cut:cut + 1] = data.draw(st.binary(max_size=2))
        payloads[i] = bytes(raw)
    engine.reserve("fz", PROMPT, SamplingParams(max_tokens=1), use_cache=False)
    imported: list[codec.KVHeader] = []
    try:
        import_like_the_receiver(engine, payloads, imported)
    except IMPORT_ERRORS:
        pass
    finally:
        computed = engine.seqs["fz"].num_computed
        landed = engine.export_kv("fz", 0, computed) if computed else None
        engine.abort("fz")
        engine.flush_cache()
    assert engine.pool.free_pages == engine.pool.num_pages, "pages leaked"
    event("honest" if not edits and not damaged else "imported" if imported else "refused")
    cfg, start = engine.model_cfg, 0
    for header in imported:  # chunks continue each other from token 0
        assert (header.num_layers, header.layer_start, header.layer_end) == (cfg.num_layers, 0, cfg.num_layers)
        assert (header.kv_heads, header.head_dim, header.token_start) == (cfg.num_kv_heads, cfg.head_dim, start)
        assert header.token_end <= len(PROMPT)
        assert header.block_hashes == block_hashes(PROMPT[: header.token_end], header.block_size)
        start = header.token_end
    assert computed == start
    if not edits and not damaged:  # what P sent unharmed is imported, into the right slots
        assert computed == end and landed is not None
        assert torch.equal(landed.k, k.to(landed.k.dtype)) and torch.equal(landed.v, -k.to(landed.v.dtype))


# ---- the HTTP API of a real server ----------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir: Any) -> Iterator[str]:
    with standalone(tiny_model_dir) as url:
        yield url


MAX_TOKENS_KEYS = ("max_tokens", "max_completion_tokens")
CONTEXT = 4096  # the tiny model's


def short_generation(body: dict[str, Any]) -> None:
    """Ask for at most 4 tokens: a valid count over 4 becomes 1-4, and a chat request
    that would default to 1,024 gets 4. Out-of-range and mistyped counts are kept:
    refusing them is what is tested."""
    for key in MAX_TOKENS_KEYS:
        value = body.get(key)
        if type(value) is int and 4 < value <= CONTEXT:
            body[key] = 1 + value % 4
    if "messages" in body and all(body.get(key) is None for key in MAX_TOKENS_KEYS):
        body["max_tokens"] = 4


def check_response(status: int, content_type: str, text: str) -> None:
    """Never a 5xx; a 4xx in OpenAI's error shape; a stream ends with [DONE], error-free."""
    assert status < 500, f"{status}: {text[:300]}"
    if status >= 400:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), text[:300]
    elif "event-stream" in content_type:
        assert text.rstrip().endswith("data: [DONE]") and "server_error" not in text, text[-300:]


@pytest.mark.parametrize("method, path, mode, examples", [
    ("POST", "/v1/completions", GenerationMode.POSITIVE, 60),
    ("POST", "/v1/completions", GenerationMode.NEGATIVE, 40),
    ("POST", "/v1/chat/completions", GenerationMode.POSITIVE, 60),
    ("POST", "/v1/chat/completions", GenerationMode.NEGATIVE, 40),
    ("GET", "/v1/models", GenerationMode.POSITIVE, 3),
    ("GET", "/health", GenerationMode.POSITIVE, 3),
    ("GET", "/metrics", GenerationMode.POSITIVE, 3),
    ("GET", "/pdd/stats", GenerationMode.POSITIVE, 3),
])
def test_the_openapi_schema_fuzzed_never_gets_a_server_error(server: str, method: str, path: str,
                                                             mode: GenerationMode, examples: int) -> None:
    """Schemathesis generates requests from the app's own OpenAPI schema: valid-shaped
    (positive) and violating it (negative, raw bytes included); half name the served model."""
    operation = schemathesis.openapi.from_url(f"{server}/openapi.json")[path][method]

    @fuzz(examples)
    @given(case=operation.as_strategy(generation_mode=mode), served=st.booleans())
    def run(case: schemathesis.Case, served: bool) -> None:
        if isinstance(case.body, dict):
            if served:
                case.body["model"] = "tiny"
            short_generation(case.body)
        response = case.call(timeout=60)
        content_type = next((v[0] for k, v in response.headers.items() if k.lower() == "content-type"), "")
        if not getattr(response, "stream_cut_short", False):  # (schemathesis may stop reading a long stream)
            check_response(response.status_code, content_type, response.content.decode("utf-8", "replace"))
        else:
            assert response.status_code < 500

    run()


@pytest.fixture(scope="module")
def client(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


EXTREME_INTS = st.integers() | st.sampled_from([0, 1, -1, 2**63, 2**64, 10**400, -(10**400)])
HUGE_INTS = st.integers(min_value=0) | st.sampled_from([2**63, 2**64, 10**400])
ODD_TEXT = st.one_of(st.text(max_size=10), st.sampled_from(["", "x" * 5000]),
                     st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2))
SAMPLING = {  # each field well-typed; mostly valid extremes (seeds past int64, lone surrogates), now and then not
    "max_tokens": st.integers(1, 4) | EXTREME_INTS, "temperature": st.floats(0, 1e308) | st.sampled_from([2, 10**400]),
    "top_p": st.floats(5e-324, 1.0) | st.sampled_from([1, 1, 0, 10**400]), "top_k": HUGE_INTS | st.just(-1),
    "seed": st.none() | EXTREME_INTS, "stop": st.none() | ODD_TEXT | st.lists(ODD_TEXT, max_size=3),
    "stop_token_ids": st.lists(EXTREME_INTS, max_size=3), "ignore_eos": st.booleans(),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.sampled_from([1] * 6 + [0, 2]), "logprobs": st.sampled_from([None, False, 0] * 2 + [True, 5]),
    "user": st.none() | ODD_TEXT,
}
PROMPTS = st.one_of(ODD_TEXT, st.lists(st.integers(-1, 4200), min_size=1, max_size=8),
                    st.lists(ODD_TEXT, min_size=1, max_size=1) | st.lists(ODD_TEXT, min_size=2, max_size=2),
                    st.lists(st.lists(st.integers(0, 4095), min_size=1, max_size=4), min_size=1, max_size=2))
MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
    "content": st.none() | ODD_TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": ODD_TEXT}),
                                               max_size=2)}), min_size=1, max_size=3)
WELL_TYPED = {
    "/v1/completions": st.fixed_dictionaries({"model": st.just("tiny"), "prompt": PROMPTS, "stream": st.booleans()},
                                             optional={**SAMPLING, "echo": st.sampled_from([False] * 3 + [True])}),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"model": st.just("tiny"), "messages": MESSAGES, "stream": st.booleans()},
        optional={**SAMPLING, "max_completion_tokens": EXTREME_INTS}),
}


@fuzz(150)
@given(path=st.sampled_from(sorted(WELL_TYPED)), data=st.data())
def test_well_typed_bodies_with_extreme_values_never_get_a_server_error(client: httpx.Client, path: str,
                                                                        data: st.DataObject) -> None:
    """Bodies of the right shape whose values are extreme: integers past int64 or any float,
    lone surrogates in prompts, messages and stop strings, token ids outside the
    vocabulary, streamed or not. Served (a 200, a clean stream) or refused with a 4xx."""
    body = data.draw(WELL_TYPED[path])
    short_generation(body)
    response = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    check_response(response.status_code, response.headers.get("content-type", ""), response.text)


HTTP_BASES = {
    "/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0.5, "seed": 1},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                             "top_p": 0.9, "stop": ["x"]},
}
REQUEST_KEYS = ("prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
                "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options", "n", "logprobs", "echo", "user")


@fuzz(150)
@given(path=st.sampled_from(sorted(HTTP_BASES)), data=st.data())
def test_hostile_json_bodies_get_a_client_error_not_a_server_error(client: httpx.Client, path: str,
                                                                   data: st.DataObject) -> None:
    """What the schema cannot express: numbers no float holds, 5,000-digit integers, lone
    surrogates, nesting past the recursion limit, NaN, broken UTF-8, wrong content types."""
    fields = data.draw(mutated_fields(HTTP_BASES[path], REQUEST_KEYS))
    for key in MAX_TOKENS_KEYS:  # keep generations short (see short_generation), on the raw text
        try:
            value = json.loads(fields[key])
        except (KeyError, ValueError, RecursionError):
            continue
        if type(value) is int and 4 < value <= CONTEXT:
            fields[key] = "4"
    if "messages" in fields and all(fields.get(key, "null") == "null" for key in MAX_TOKENS_KEYS):
        fields["max_tokens"] = "4"
    body = object_text(fields).encode()
    if data.draw(st.integers(0, 4), label="damage") == 0:
        cut = data.draw(st.integers(0, len(body)))
        body = body[:cut] + data.draw(st.binary(max_size=3)) + body[cut + 1:]
    content_type = data.draw(st.sampled_from(["application/json"] * 4 + ["text/plain", ""]))
    response = client.post(path, content=body, headers={"content-type": content_type} if content_type else {})
    check_response(response.status_code, response.headers.get("content-type", ""), response.text)
