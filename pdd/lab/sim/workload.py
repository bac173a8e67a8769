"""Requests as the simulator sees them: lengths and prefix-block keys, no token IDs.

The same generators `pdd bench` replays: the agentic sessions (`plan_session_shapes`,
which draws exactly what `plan_sessions` draws) and the Mooncake trace (its own
`hash_ids`, at full size: the simulator runs at cluster scale). A prompt is a sequence
of block keys; equal leading keys are a shared prefix.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pdd.lab.workload.agentic import AgenticConfig, plan_session_shapes
from pdd.lab.workload.mooncake import TRACE_BLOCK_TOKENS, TraceRecord

KEY_STRIDE = 1 << 32  # more blocks than any context has


@dataclass(frozen=True)
class SimTurn:
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class SimSession:
    """Turns that run one after another (each waits for the previous answer), the first
    at `start_s`. `keys(n)` are the cache keys of the first n // block tokens of its
    context; the answer of turn k is part of turn k + 1's prompt."""

    id: int
    start_s: float
    turns: tuple[SimTurn, ...]
    shared_tokens: int  # leading tokens shared with every session (the system prompt)
    anomalous: bool = False
    trace_keys: tuple[Hashable, ...] = ()  # a trace request's own block keys
    warm_tokens: int = 0  # context its earlier turns left cached (a session resumed by a warm start)

    def keys(self, tokens: int, block: int) -> list[Hashable]:
        n = tokens // block
        if self.trace_keys:
            return list(self.trace_keys[:n]) + [(self.id, i) for i in range(len(self.trace_keys), n)]
        # Plain ints (a tuple's hash is computed at every look-up, and caches look these
        # up by the hundred per request): the shared prefix's block i is -1 - i, a
        # session's own block i is id * KEY_STRIDE + i.
        shared = min(n, self.shared_tokens // block)
        own = self.id * KEY_STRIDE
        keys: list[Hashable] = [-1 - i for i in range(shared)]
        return keys + list(range(own + shared, own + n))


def agentic_sessions(config: AgenticConfig, requests: int, rate: float) -> list[SimSession]:
    """The sessions `pdd bench` would replay for this config, as shapes."""
    sessions = []
    for shape in plan_session_shapes(config, requests, rate):
        context, turns = 0, []
        for turn in shape.turns:
            prompt = context + turn.append_tokens
            turns.append(SimTurn(prompt, turn.max_tokens))
            context = prompt + turn.max_tokens
        shared = 0 if shape.anomalous else config.system_prompt_tokens
        sessions.append(SimSession(shape.id, shape.start_s, tuple(turns), shared, shape.anomalous))
    return sessions


def trace_sessions(
    records: Sequence[TraceRecord],
    time_scale: float = 1.0,
    block: int = TRACE_BLOCK_TOKENS,
    max_context: int | None = None,
) -> list[SimSession]:
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
        sessions.append(
            SimSession(i, (r.timestamp_ms - origin) / 1000 / time_scale, (SimTurn(prompt, output),), 0, trace_keys=keys)
        )
    return sessions
