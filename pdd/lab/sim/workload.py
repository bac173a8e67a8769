"""Requests as the simulator sees them: the sessions `pdd bench` replays
(`pdd.lab.workload.types.Session`), as shapes without token IDs, and their prefix-block keys.

The same generators `pdd bench` replays: the agentic sessions (`plan_session_shapes`,
which draws exactly what `plan_sessions` draws) and the Mooncake trace (its own
`hash_ids`, at full size: the simulator runs at cluster scale). A prompt is a sequence
of block keys; equal leading keys are a shared prefix.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from pdd.lab.workload.mooncake import TRACE_BLOCK_TOKENS, TraceRecord
from pdd.lab.workload.types import Session, Turn

KEY_STRIDE = 1 << 32  # more blocks than any context has


def session_keys(s: Session, tokens: int, block: int) -> list[Hashable]:
    """The cache keys of the first `tokens` // `block` blocks of a session's context (the
    answer of turn k is part of turn k + 1's prompt)."""
    n = tokens // block
    if s.trace_keys:
        return list(s.trace_keys[:n]) + [(s.id, i) for i in range(len(s.trace_keys), n)]
    # Plain ints (a tuple's hash is computed at every look-up, and caches look these
    # up by the hundred per request): the shared prefix's block i is -1 - i, a
    # session's own block i is id * KEY_STRIDE + i.
    shared = min(n, s.shared_tokens // block)
    own = s.id * KEY_STRIDE
    keys: list[Hashable] = [-1 - i for i in range(shared)]
    return keys + list(range(own + shared, own + n))


def trace_sessions(
    records: Sequence[TraceRecord],
    time_scale: float = 1.0,
    block: int = TRACE_BLOCK_TOKENS,
    max_context: int | None = None,
) -> list[Session]:
    """One single-turn session per trace record, at its timestamp. Blocks keep the
    trace's 512 tokens unless the simulated cache pages differ: keys are per trace block,
    so `block` must be the trace's."""
    if block != TRACE_BLOCK_TOKENS:
        raise ValueError(f"trace prefixes are in blocks of {TRACE_BLOCK_TOKENS} tokens")
    origin = records[0].timestamp_ms if records else 0
    sessions = []
    for i, r in enumerate(records):
        prompt, output = r.input_length, r.output_length
        if max_context is not None and prompt + output > max_context:
            output = max(1, min(output, max_context // 8))
            prompt = max_context - output
        keys = tuple(("trace", h) for h in r.hash_ids[: math.ceil(prompt / block)])
        start_s = (r.timestamp_ms - origin) / 1000 / time_scale
        sessions.append(Session(i, (Turn(prompt, output),), start_s, trace_keys=keys))
    return sessions
