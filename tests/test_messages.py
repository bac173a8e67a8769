"""Typed frame bodies: every message round-trips, and bad bodies are refused in one place."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.sampling import SamplingParams
from pdd.transfer import messages as m
from pdd.transfer.wire import Frame, MsgType, encode_json

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
]


def _frame(body) -> Frame:
    return Frame(body.TYPE, 0, encode_json(m.to_dict(body)))


def test_every_body_round_trips():
    assert {type(b) for b in SAMPLES} == set(typing.get_args(m.Body))
    for body in SAMPLES:
        assert m.decode(_frame(body)) == body


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


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from([f.name for f in dataclasses.fields(m.Handoff)] + ["x"]),
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
