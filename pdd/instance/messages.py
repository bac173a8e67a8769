"""The JSON bodies of control frames, checked field by field on arrival.

Frames are authenticated, but a peer can still be buggy or of another version: every
field is type-checked here so a bad message becomes an ERROR reply, not a crash.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pdd.engine.sequence import SamplingParams

MAX_PROMPT = 1 << 20


class BadMessage(ValueError):
    pass


def params_to_wire(p: SamplingParams) -> dict[str, Any]:
    return asdict(p)


def params_from_wire(raw: Any) -> SamplingParams:
    if not isinstance(raw, dict):
        raise BadMessage("params must be an object")
    try:
        raw = dict(raw)
        stops = raw.get("stop_token_ids", ())
        if not isinstance(stops, (list, tuple)):
            raise BadMessage("stop_token_ids must be a list")
        raw["stop_token_ids"] = tuple(stops)
        return SamplingParams(**raw)
    except (TypeError, ValueError) as e:
        raise BadMessage(f"bad sampling params: {e}") from None


def rid_of(msg: dict) -> str:
    rid = msg.get("rid")
    if not isinstance(rid, str) or not 0 < len(rid) <= 128:
        raise BadMessage("rid must be a non-empty string")
    return rid


def tokens_of(msg: dict, key: str) -> list[int]:
    toks = msg.get(key)
    if not isinstance(toks, list) or len(toks) > MAX_PROMPT or not all(isinstance(t, int) and t >= 0 for t in toks):
        raise BadMessage(f"{key} must be a list of token ids")
    return toks


def int_of(msg: dict, key: str) -> int:
    v = msg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise BadMessage(f"{key} must be a non-negative integer")
    return v
