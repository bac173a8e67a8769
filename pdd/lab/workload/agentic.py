"""Agentic multi-turn sessions with the prefix-hit skew PDD is built for.

An agent task is many turns, each re-sending the whole context plus a new tool output,
so most turns hit the prefix cache almost entirely (PDD_SPEC: 70-80 % of requests hit
more than 95 %). A minority hits little: the first turn of a task (only the shared system
prompt is cached) and turns that append a large tool output. A few percent are
anomalous: a long fresh input with a very short output, which PDD keeps on RLD.

Everything is drawn from seeded RNGs keyed by (seed, what, index), so a session's
content does not depend on how many sessions are generated or how they are scheduled:
two runs with the same seed send the same requests whatever the mode under test.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pdd.lab.workload.types import Session, Turn

_NORMAL, _ANOMALOUS, _SCHEDULE, _SYSTEM, _TOOL_TIME = range(5)


@dataclass(frozen=True)
class AgenticConfig:
    """Shape of the agentic workload; the defaults suit a tiny model on a CPU.

    Token counts are ranges `(low, high)`, inclusive. Small tool outputs are drawn
    log-uniformly (most are short, a few are not), everything else uniformly.
    """

    seed: int = 0
    vocab_size: int = 4096
    low_id: int = 16
    # Every session starts with the same system prompt, as agents of one framework do;
    # it is the only part of a new session's first prompt that another session cached.
    system_prompt_tokens: int = 128
    task_tokens: tuple[int, int] = (192, 768)
    turns: tuple[int, int] = (4, 40)
    tool_output_tokens: tuple[int, int] = (4, 96)
    large_tool_output_prob: float = 0.06
    large_tool_output_tokens: tuple[int, int] = (300, 1000)
    output_tokens: tuple[int, int] = (8, 48)
    # prompt + max_tokens of any request stays within this; a session whose next turn
    # would not fit ends there.
    max_context: int = 2500
    anomalous_fraction: float = 0.03
    # An anomalous input fills this share of max_context: "long" relative to the model.
    anomalous_input_share: tuple[float, float] = (0.6, 0.95)
    anomalous_output_tokens: tuple[int, int] = (1, 4)
    # Seconds a tool runs between a turn's answer and the next turn, drawn uniformly: the
    # session's KV then sits idle in the decode side's cache. (0, 0): turns follow at once.
    tool_time_s: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        for name in (
            "task_tokens",
            "turns",
            "tool_output_tokens",
            "large_tool_output_tokens",
            "output_tokens",
            "anomalous_output_tokens",
        ):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must satisfy 1 <= low <= high, got {(low, high)}")
        low_share, high_share = self.anomalous_input_share
        if not 0.0 < low_share <= high_share <= 1.0:
            raise ValueError(f"anomalous_input_share must lie in (0, 1], got {(low_share, high_share)}")
        if not 0 <= self.low_id < self.vocab_size:
            raise ValueError(f"need 0 <= low_id < vocab_size, got {self.low_id}, {self.vocab_size}")
        if self.system_prompt_tokens < 0:
            raise ValueError("system_prompt_tokens must be >= 0")
        if not 0.0 <= self.large_tool_output_prob <= 1.0:
            raise ValueError("large_tool_output_prob must lie in [0, 1]")
        if not 0.0 <= self.anomalous_fraction < 1.0:
            raise ValueError("anomalous_fraction must lie in [0, 1)")
        first_turn = self.system_prompt_tokens + self.task_tokens[1] + self.output_tokens[1]
        if first_turn > self.max_context:
            raise ValueError(
                f"max_context {self.max_context} cannot hold a first turn of up to {first_turn} "
                "tokens (system prompt + longest task + longest output)"
            )
        if _anomalous_input_range(self)[1] < 1:
            raise ValueError("max_context too small for anomalous requests")
        if not 0.0 <= self.tool_time_s[0] <= self.tool_time_s[1]:
            raise ValueError(f"tool_time_s must satisfy 0 <= low <= high, got {self.tool_time_s}")


def _anomalous_input_range(config: AgenticConfig) -> tuple[int, int]:
    room = config.max_context - config.anomalous_output_tokens[1]
    low_share, high_share = config.anomalous_input_share
    return max(1, int(room * low_share)), max(1, int(room * high_share))


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def _ids(rng: np.random.Generator, config: AgenticConfig, n: int) -> tuple[int, ...]:
    return tuple(rng.integers(config.low_id, config.vocab_size, size=n).tolist())


def _count(rng: np.random.Generator, config: AgenticConfig, n: int) -> int:
    """Draw the IDs (so every later draw is what `_ids` would see) but keep their number."""
    rng.integers(config.low_id, config.vocab_size, size=n)
    return n


# What a turn appends: its token IDs (`_ids`) for a server, their number (`_count`) for
# the simulator, which needs only the shape. Both see the same RNG draws.
Draw = Callable[[np.random.Generator, AgenticConfig, int], Any]


def _uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _log_uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    value = math.exp(rng.uniform(math.log(bounds[0]), math.log(bounds[1] + 1)))
    return min(bounds[1], int(value))


def _normal_session(config: AgenticConfig, system: Any, index: int, draw: Draw) -> list[tuple[Any, int]]:
    rng = _rng(config.seed, _NORMAL, index)
    task = _uniform(rng, config.task_tokens)
    first = (system + draw(rng, config, task), _uniform(rng, config.output_tokens))
    turns = [first]
    context = config.system_prompt_tokens + task + first[1]
    for _ in range(_uniform(rng, config.turns) - 1):
        if rng.random() < config.large_tool_output_prob:
            tool = _uniform(rng, config.large_tool_output_tokens)
        else:
            tool = _log_uniform(rng, config.tool_output_tokens)
        output = _uniform(rng, config.output_tokens)
        if context + tool + output > config.max_context:
            break
        turns.append((draw(rng, config, tool), output))
        context += tool + output
    return turns


def _anomalous_session(config: AgenticConfig, index: int, draw: Draw) -> list[tuple[Any, int]]:
    rng = _rng(config.seed, _ANOMALOUS, index)
    prompt = draw(rng, config, _uniform(rng, _anomalous_input_range(config)))
    return [(prompt, _uniform(rng, config.anomalous_output_tokens))]


def _stream(config: AgenticConfig, draw: Draw) -> Iterator[tuple[int, list[tuple[Any, int]], bool]]:
    """(id, turns, anomalous) without end. Anomalous one-turn sessions are interleaved
    so that, in every prefix of the stream, they make up `anomalous_fraction` of the
    turns (rounded), rather than arriving by chance in clumps that would make short
    runs unrepresentative."""
    system = draw(_rng(config.seed, _SYSTEM), config, config.system_prompt_tokens)
    ratio = config.anomalous_fraction / (1.0 - config.anomalous_fraction)
    ids = itertools.count()
    normal_turns = anomalous = 0
    for index in itertools.count():
        turns = _normal_session(config, system, index, draw)
        yield next(ids), turns, False
        normal_turns += len(turns)
        while anomalous + 1 <= ratio * normal_turns + 0.5:
            yield next(ids), _anomalous_session(config, anomalous, draw), True
            anomalous += 1


def _sessions(config: AgenticConfig, draw: Draw, turn: Callable[[Any, int], Turn]) -> Iterator[Session]:
    """The stream as sessions, each turn made by `turn` of what `draw` drew; every session
    but an anomalous one shares the system prompt. A later turn waits for its tool
    (`tool_time_s`, drawn from an RNG of its own: without tool time every other draw is
    the same)."""
    low, high = config.tool_time_s
    for sid, turns, anomalous in _stream(config, draw):
        shared = 0 if anomalous else config.system_prompt_tokens
        made = [turn(a, n) for a, n in turns]
        if high > 0 and len(made) > 1:
            pauses = _rng(config.seed, _TOOL_TIME, sid).uniform(low, high, len(made) - 1)
            made[1:] = [replace(t, pause_s=float(p)) for t, p in zip(made[1:], pauses, strict=True)]
        yield Session(sid, tuple(made), anomalous=anomalous, shared_tokens=shared)


def iter_sessions(config: AgenticConfig) -> Iterator[Session]:
    """Yield sessions without end, ids 0, 1, 2, ..."""
    return _sessions(config, _ids, Turn.of)


def iter_session_shapes(config: AgenticConfig) -> Iterator[Session]:
    """`iter_sessions` without the token IDs: each turn's appended length (the first
    turn's includes the shared system prompt), for the simulator."""
    return _sessions(config, _count, Turn)


def _timed(config: AgenticConfig, sessions: Iterator[Session], rate: float) -> Iterator[Session]:
    """`sessions` with their start times: a Poisson process of `rate` sessions a second,
    the first at 0 (with an infinite rate, all at 0)."""
    gaps = _rng(config.seed, _SCHEDULE)
    start = 0.0
    for session in sessions:
        yield replace(session, start_s=start)
        if math.isfinite(rate):
            start += float(gaps.exponential(1.0 / rate))


def session_shape_stream(config: AgenticConfig, rate: float) -> Iterator[Session]:
    """`plan_session_shapes`' sessions without end: every plan of it is this stream's
    head, its last session cut to the requests left, so a caller that needs sessions
    until a time rather than a count of requests draws only those."""
    return _timed(config, iter_session_shapes(config), rate)


def _plan(config: AgenticConfig, sessions: Iterator[Session], requests: int, rate: float) -> list[Session]:
    if requests < 1:
        raise ValueError("requests must be >= 1")
    if not rate > 0:
        raise ValueError("rate must be > 0 (use math.inf to start all sessions at once)")
    planned: list[Session] = []
    left = requests
    for session in _timed(config, sessions, rate):
        cut = len(session.turns) > left
        planned.append(replace(session, turns=session.turns[:left]) if cut else session)
        left -= len(planned[-1].turns)
        if left == 0:
            return planned
    raise AssertionError("the session stream is endless")


def plan_sessions(config: AgenticConfig, requests: int, rate: float = math.inf) -> list[Session]:
    """The sessions of a run of exactly `requests` turns, with their start times.

    Sessions are taken in stream order until their turns add up to `requests` (the last
    one cut short). Starts follow a Poisson process of `rate` sessions per second, the
    first at 0; with an infinite rate every session starts at once. The plan depends only
    on the arguments, so every mode under comparison replays the same requests.
    """
    return _plan(config, iter_sessions(config), requests, rate)


def plan_session_shapes(config: AgenticConfig, requests: int, rate: float = math.inf) -> list[Session]:
    """`plan_sessions`, as shapes: the same sessions, turns and start times."""
    return _plan(config, iter_session_shapes(config), requests, rate)


@dataclass(frozen=True)
class TurnEstimate:
    """Expected prefix-cache hit of one turn, assuming outputs of exactly max_tokens."""

    session: int
    turn: int
    prompt_tokens: int
    hit_tokens: int
    anomalous: bool

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens


def estimate_hits(config: AgenticConfig, requests: int) -> list[TurnEstimate]:
    """Expected hit of each turn of a `requests`-turn plan, without a server.

    A turn's hit is what the previous turn left in the cache (its prompt and output)
    over its prompt length; a session's first turn hits the shared system prompt once
    any earlier session has sent it. Real hits are lower by at most one cache block per
    request (caches hold whole blocks) and by evictions.
    """
    estimates: list[TurnEstimate] = []
    system_cached = False
    for session in plan_sessions(config, requests):
        context = 0
        for k, turn in enumerate(session.turns):
            prompt = context + turn.append_tokens
            if k > 0:
                hit = context
            elif session.anomalous or not system_cached:
                hit = 0
            else:
                hit = config.system_prompt_tokens
            estimates.append(TurnEstimate(session.id, k, prompt, hit, session.anomalous))
            context = prompt + turn.max_tokens
        system_cached = system_cached or not session.anomalous
    return estimates
