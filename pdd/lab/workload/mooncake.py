"""Mooncake trace replay: real arrival times and prefix structure, at CPU scale.

The trace has no text, only lengths and `hash_ids` (one id per 512-token prefix block;
equal leading ids mean a shared, reusable prefix). Each hash id becomes a fixed block of
token IDs, drawn from an RNG keyed by (seed, hash id), so the same id yields the same
tokens in every request and shared prefixes stay shared for the server's prefix cache.
Dividing lengths by `scale` shrinks blocks (512 -> 32 tokens at scale 16) without
touching that structure.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pdd.lab.workload.types import Session, Turn

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRecord:
    """One line of the trace, as published."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class MooncakeConfig:
    """How the trace is shrunk to what the model under test can run."""

    scale: int = 16
    # Output lengths are divided by output_scale (default: scale), then kept within
    # [1, max_output_tokens].
    output_scale: int | None = None
    max_output_tokens: int = 64
    # Arrival times are divided by time_scale: 2.0 replays the hour in half an hour.
    time_scale: float = 1.0
    # When set, prompts are cut so prompt + max_tokens fits; cutting the tail keeps the
    # leading blocks, and with them the shared prefixes.
    max_context: int | None = None
    seed: int = 0
    vocab_size: int = 4096
    low_id: int = 16

    def __post_init__(self) -> None:
        if self.scale < 1 or (self.output_scale is not None and self.output_scale < 1):
            raise ValueError("scale and output_scale must be >= 1")
        if self.max_output_tokens < 1:
            raise ValueError("max_output_tokens must be >= 1")
        if not self.time_scale > 0:
            raise ValueError("time_scale must be > 0")
        if self.max_context is not None and self.max_context <= self.max_output_tokens:
            raise ValueError("max_context must exceed max_output_tokens")
        if not 0 <= self.low_id < self.vocab_size:
            raise ValueError(f"need 0 <= low_id < vocab_size, got {self.low_id}, {self.vocab_size}")

    @property
    def block_tokens(self) -> int:
        return max(1, round(TRACE_BLOCK_TOKENS / self.scale))


def _field(obj: dict, name: str, where: str) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: field {name!r} must be an integer, got {value!r}")
    return value


def parse_record(line: str, where: str) -> TraceRecord:
    """Parse and validate one JSONL line; `where` ("path:line") prefixes any error."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    timestamp = _field(obj, "timestamp", where)
    input_length = _field(obj, "input_length", where)
    output_length = _field(obj, "output_length", where)
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
    ):
        raise ValueError(f"{where}: field 'hash_ids' must be a list of non-negative integers")
    if timestamp < 0 or input_length < 1 or output_length < 1:
        raise ValueError(f"{where}: need timestamp >= 0 and positive lengths")
    blocks = math.ceil(input_length / TRACE_BLOCK_TOKENS)
    if len(hash_ids) != blocks:
        raise ValueError(
            f"{where}: input_length {input_length} needs {blocks} hash_ids "
            f"of {TRACE_BLOCK_TOKENS} tokens, got {len(hash_ids)}"
        )
    return TraceRecord(timestamp, input_length, output_length, tuple(hash_ids))


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """Read the first `limit` records (all when None); blank lines are skipped.

    Raises ValueError naming the file and line of the first bad record, so a broken
    trace fails before any request is sent rather than halfway through a run.
    """
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if limit is not None and len(records) >= limit:
                break
            if line.strip():
                records.append(parse_record(line, f"{path}:{number}"))
    return records


def _block(config: MooncakeConfig, hash_id: int) -> list[int]:
    rng = np.random.default_rng(np.random.SeedSequence(config.seed, spawn_key=(hash_id,)))
    return rng.integers(config.low_id, config.vocab_size, size=config.block_tokens).tolist()


def scaled_lengths(record: TraceRecord, config: MooncakeConfig) -> tuple[int, int]:
    """(prompt tokens, max_tokens) of a record after scaling.

    The prompt length stays within its last block, so every hash id still contributes
    at least one token and the scaled request keeps the trace's prefix structure.
    """
    block = config.block_tokens
    blocks = len(record.hash_ids)
    prompt = min(max(math.ceil(record.input_length / config.scale), (blocks - 1) * block + 1), blocks * block)
    output_scale = config.output_scale or config.scale
    output = min(config.max_output_tokens, max(1, round(record.output_length / output_scale)))
    if config.max_context is not None:
        prompt = min(prompt, config.max_context - output)
    return prompt, output


def fit_to_context(records: Sequence[TraceRecord], config: MooncakeConfig, context: int) -> tuple[MooncakeConfig, str]:
    """The scale (from `config.scale` up) at which every record's prompt and output fit
    a `context`-token model, and a note saying what was done. Lengths shrink together,
    so the trace keeps its shape (and its prefix blocks); a request that still would not
    fit is cut at its tail."""
    room = context - config.max_output_tokens
    if room < 1:
        raise ValueError(f"a {context}-token context leaves no room for {config.max_output_tokens} output tokens")
    longest = max((r.input_length for r in records), default=0)
    scale = max(config.scale, math.ceil(longest / room))
    fitted = replace(config, scale=scale, max_context=context)
    cut = sum(
        sum(scaled_lengths(r, fitted)) < sum(scaled_lengths(r, replace(fitted, max_context=None))) for r in records
    )
    note = (
        f"mooncake lengths / {scale} to fit the served {context}-token context (longest input {longest:,} "
        f"tokens -> {math.ceil(longest / scale):,}; blocks of {fitted.block_tokens} tokens)"
        + (f"; {cut} requests cut at the tail" if cut else "")
    )
    return fitted, note


def trace_sessions(records: Sequence[TraceRecord], config: MooncakeConfig) -> list[Session]:
    """One single-turn session per record, starting at its (time-scaled) timestamp,
    measured from the first record's."""
    blocks: dict[int, list[int]] = {}
    sessions: list[Session] = []
    origin = records[0].timestamp_ms if records else 0
    for index, record in enumerate(records):
        prompt_tokens, max_tokens = scaled_lengths(record, config)
        for hash_id in record.hash_ids:
            if hash_id not in blocks:
                blocks[hash_id] = _block(config, hash_id)
        ids = itertools.chain.from_iterable(blocks[h] for h in record.hash_ids)
        prompt = tuple(itertools.islice(ids, prompt_tokens))
        start = (record.timestamp_ms - origin) / 1000.0 / config.time_scale
        sessions.append(Session(index, (Turn.of(prompt, max_tokens),), start_s=start))
    return sessions
