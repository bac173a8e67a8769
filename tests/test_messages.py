"""Typed frame bodies: every message round-trips, and bad bodies are refused in one place."""

from __future__ import annotations

import asyncio
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.sampling.params import SamplingParams
from pdd.transfer import messages as m
from pdd.transfer.wire import BadPayload, Frame, MsgType, encode_json

PARAMS = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=2**70, stop_token_ids=(3, 4))
SAMPLES = [
    m.Hello("router", router_id="r1"),
    m.Submit("a.0", [1, 2, 3], PARAMS, "r1", "md0", "rld0", False),
    m.Reserve("a.0", [1, 2, 3], PARAMS, "r1", True, "md0"),
    m.ReserveAck("a.0", 32), m.ReserveAck("a.0", error="full", busy=True), m.Progress("a.0", "kv"),
    m.KVAck("a.0", 64, True), m.KVDone("a.0", 7, False), m.Ready("a.0"),
    m.Tokens("a.0", 5, [9, 8], "length", 16, 12.5),
    m.PipelineChosen("a.0", "P-RLD-MD", 10, 20, 1234.5, None),
    m.Result("a.0", 100, 100, 64),
    m.Handoff("a.0", 0, [1, 2], False, 0, 7, True), m.HandoffAck("a.0", 2), m.HandedOff("a.0", "catch_up", 40, 3),
    m.Abort("a.0"), m.Error("boom", "a.0", True),
    m.CacheUpdate("snapshot", 3, [2**64 - 1, 0], 16),
    m.Member("md1", "main", "B", "127.0.0.1", 9001, {"A": "127.0.0.1:9002"}), m.Drain(),
    m.KVRegionAsk("mooncake"), m.KVRegion("127.0.0.1:15001", 2**40, 4 << 20, 8), m.KVRegion(error="not installed"),
    m.KVPlaced(3, 1 << 20, 7, "ab" * 16), m.KVSlotFree(3),
]


def _frame(body) -> Frame:
    return Frame(body.TYPE, 0, encode_json(m.to_dict(body)))


def test_every_body_round_trips():
    assert {type(b) for b in SAMPLES} == set(typing.get_args(m.Body))
    for body in SAMPLES:
        assert m.decode(_frame(body)) == body


def test_each_connection_reads_only_the_bodies_it_carries():
    """A router's connection, an instance's to the router, and the instances' own: each
    body is carried by one at least (HELLO only opens them), and a body read off a
    connection that does not carry it is a BadMessage, never handed to a handler."""
    readers = {m.from_router: m.FromRouter, m.to_router: m.ToRouter, m.between_instances: m.BetweenInstances}
    carried = set().union(*(typing.get_args(u) for u in readers.values()))
    assert carried == set(typing.get_args(m.Body)) - {m.Hello}
    for body in SAMPLES:
        for read, union in readers.items():
            if isinstance(body, typing.get_args(union)):
                assert read(_frame(body)) == body
            else:
                with pytest.raises(m.BadMessage):
                    read(_frame(body))
        assert m.decode_as(_frame(body), type(body)) == body
        with pytest.raises(m.BadMessage, match="was due"):
            m.decode_as(_frame(body), m.KVSlotFree if not isinstance(body, m.KVSlotFree) else m.Abort)


@pytest.mark.parametrize("body, field, value", [
    (m.Tokens("a", 0, [1]), "pos", -1),
    (m.Tokens("a", 0, [1]), "tokens", [1, "2"]),
    (m.Tokens("a", 0, [1]), "tokens", [True]),
    (m.Submit("a", [1], PARAMS), "params", {"max_tokens": 0}),
    (m.Submit("a", [1], PARAMS), "params", [1]),
    (m.Submit("a", [1], PARAMS), "rid", ""),
    (m.Submit("a", [1], PARAMS), "rid", "x" * 200),
    (m.PipelineChosen("a", "P-MD"), "pipeline", "P-RLD-X"),
    (m.HandedOff("a", "one_shot", 1), "mode", "sideways"),
    (m.KVDone("a", 1), "emit", 1),
    (m.Tokens("a", 0, [1]), "stall_ms", float("nan")),
    (m.Member("md1", "main", "B", "h", 1), "role", "king"),
    (m.Member("md1", "main", "B", "h", 1), "advertise", {"A": 9002}),
    (m.Member("md1", "main", "B", "h", 1), "advertise", ["A", "h:1"]),
    (m.Member("md1", "main", "B", "h", 1), "advertise", {f"dc{i}": "h:1" for i in range(65)}),
    (m.Submit("a", [1], PARAMS), "params", {"max_tokens": 3, "beam_width": 4}),
    (m.Submit("a", [1], PARAMS), "params", {"temperature": float("inf")}),
    (m.CacheUpdate("stored", 1, [1]), "hashes", [2**64]),
    (m.CacheUpdate("stored", 1, [1]), "kind", "lost"),
    (m.Tokens("a", 0, [1]), "pos", 2**63),
    (m.Tokens("a", 0, [1]), "rid", "a\ud800"),
    (m.Tokens("a", 0, [1]), "finish_reason", "x" * 5000),
    (m.Hello("router"), "role", "king"),
    (m.PipelineChosen("a", "P-MD"), "pipeline", "colocated"),
    (m.PipelineChosen("a", "P-MD"), "fallback", "whim"),
    (m.Progress("a"), "what", "later"),
])

def test_bad_fields_are_refused(body, field, value):
    raw = {**m.to_dict(body), field: value}
    with pytest.raises(m.BadMessage):
        m.from_dict(type(body), raw)


def test_unknown_and_missing_fields_are_refused():
    raw = m.to_dict(m.Tokens("a", 0, [1]))
    with pytest.raises(m.BadMessage, match="unknown"):
        m.from_dict(m.Tokens, {**raw, "extra": 1})
    with pytest.raises(m.BadMessage, match="missing"):
        m.from_dict(m.Tokens, {k: v for k, v in raw.items() if k != "pos"})
    with pytest.raises(m.BadMessage):
        m.decode(Frame(MsgType.KV_LAYER, 0, b"{}"))  # KV frames are not JSON bodies


def test_a_payload_that_is_no_json_is_a_frame_error_and_a_bad_field_is_named():
    """Broken JSON (a lone surrogate, NaN) drops the connection; a body of the wrong shape is answered."""
    for payload in (b'{"rid":"a\\ud800","pos":0,"tokens":[]}', b'{"rid":"a","pos":NaN,"tokens":[]}', b"{"):
        with pytest.raises(BadPayload):
            m.decode(Frame(MsgType.TOKENS, 0, payload))
    with pytest.raises(m.BadMessage, match=r"\$\.tokens\[1\]"):
        m.decode(Frame(MsgType.TOKENS, 0, b'{"rid":"a","pos":0,"tokens":[1,-2]}'))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(list(m.Handoff.__struct_fields__) + ["x"]),
                       st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5),
                                 st.lists(st.integers(), max_size=4))))
def test_arbitrary_json_never_gets_past_validation_wrongly(raw):
    try:
        body = m.from_dict(m.Handoff, raw)
    except m.BadMessage:
        return
    # whatever was accepted is well-typed
    assert isinstance(body.rid, str) and body.rid and isinstance(body.final, bool)
    assert all(type(t) is int and t >= 0 for t in body.tokens) and body.start >= 0


def test_a_field_of_a_later_version_is_left_out_towards_an_older_peer_and_refused_from_one():
    hello = m.Hello("prefill", "p0", channel="control", software="0.2.0")
    assert m.Hello.SINCE == {"software": 5}
    assert m.to_dict(hello, 4) == {"role": "prefill", "name": "p0", "router_id": "", "channel": "control"}
    as_v4 = Frame(MsgType.HELLO, 0, encode_json(m.to_dict(hello, 4)), version=4)
    assert m.decode(as_v4) == m.Hello("prefill", "p0", channel="control")  # what an old peer says
    assert m.decode(Frame(MsgType.HELLO, 0, encode_json(m.to_dict(hello)), version=5)) == hello
    with pytest.raises(m.BadMessage, match="software is protocol 5's, the connection speaks 4"):
        m.decode(Frame(MsgType.HELLO, 0, encode_json(m.to_dict(hello)), version=4))
    with pytest.raises(m.BadMessage, match="software is protocol 5's"):
        m.from_dict(m.Hello, m.to_dict(hello), 4)


def test_send_speaks_the_connections_version():
    class Conn:  # what `send` uses of a FramedConnection
        def __init__(self, version: int) -> None:
            self.version, self.sent = version, []

        async def send(self, msg_type, payload) -> None:
            self.sent.append(Frame(msg_type, 0, bytes(payload), self.version))

    hello = m.Hello("router", router_id="r1", software="0.2.0")
    for version, said in ((4, m.Hello("router", router_id="r1")), (5, hello)):
        conn = Conn(version)
        asyncio.run(m.send(conn, hello))
        assert m.decode(conn.sent[0]) == said


OLD_FIELD = "wan_bytes"  # RESULT's field under its retired name, which the wire keeps


def test_results_line_bytes_keep_the_field_name_peers_of_the_release_before_speak():
    """The code says `line_bytes`; a P or a router of the release before sends and reads
    the field under its old name, so the frame keeps it: a rename is no protocol change."""
    assert m.to_dict(m.Result("a.0", 100, 60))[OLD_FIELD] == 60
    assert m.from_dict(m.Result, {"rid": "a.0", "kv_bytes": 100, OLD_FIELD: 60}).line_bytes == 60
    assert m.decode(_frame(m.Result("a.0", 100, 60))) == m.Result("a.0", 100, 60)
