"""Timing an engine's steps through the engine port (`pdd.engines.port`), for any backend.

The simulator prices steps it never runs, so its step model has to come from steps
that did run. An engine behind the port is seen only through its requests' outputs, so
each step shape a deployment makes is timed from output timings:

- a decode batch: the gap between two tokens of one of its sequences (every sequence
  decodes once a step);
- a prefill alone, from empty or after a cached prefix: the wait for its first token;
- an extend alone (a handoff: `reserve` + `import_kv` + `start` -> the first token):
  that wait, from `start`;
- a prefill or an extend beside decoders: the decoders' gap during the step that
  produced the new sequence's first token.

A step's load is known from the outputs too: each sequence's prompt length and output
position say what it computed (`StepOutput.position`, `cached_tokens`). Outputs are
matched to decoder 0's in the same step by the engine's step number (`StepOutput.step`)
where the backend gives it. Where it does not, by arrival time, since tokens of one
step reach the caller together; but a loop late by half a step (a busy machine, a
collection) then matches the step before or after, so that is the fallback. The
engine runs with a step budget above the largest shape and a pool that holds every
group whole, so nothing is chunked or preempted behind the caller's back; a group in
which the engine preempted anyway is dropped. Runs of a shape are repeated and the
median kept: the machine is shared and noisy.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdd.engines.port import EngineConfig, EnginePort, StepOutput, open_engine
from pdd.lab.calibration.fit import Sample
from pdd.model.config import Declared
from pdd.perf.steps import EMPTY, StepLoad, add, chunk_load
from pdd.sampling.params import SamplingParams

_MIN_RUNS, _MAX_RUNS, _CHEAP_S = 3, 7, 0.05  # runs of a shape; cheap ones get more (a tick distorts them most)
_OWN_TOKENS = 16  # each decoder's prompt after the shared prefix: one page of its own
MIN_PAGES = 8192  # the pool the calibration asks for: every group whole, nothing preempted


@dataclass(frozen=True)
class Group:
    """Shapes sharing one setup: `decoders` sequences decoding at about `context` tokens
    (a shared, cached prefix plus a page of their own) and, per size n, a new sequence
    computing n tokens in the same step (0: the decode batch alone). The new one comes
    after that prefix when `cached` (beside decoders: an extend, as a handoff makes it;
    alone: a prefill of a cached tail), else from an empty context (a prefill)."""

    context: int
    decoders: int
    cached: bool
    sizes: tuple[int, ...]


# Cheap shapes first, and every kind in each round, so a short budget still sees all of
# them: prefill from empty, cached tail, decode alone, extend beside decoders, prefill
# beside decoders. Contexts are whole pages so a tail is exactly n.
PLAN = (
    Group(0, 0, False, (32, 100, 300)),
    Group(512, 0, True, (8, 64, 256, 1000)),
    Group(64, 1, True, (0, 1, 8, 32)),
    Group(256, 8, True, (0, 1, 8, 32, 128)),
    Group(256, 8, False, (64, 256, 1000)),
    Group(0, 0, False, (700, 1500)),
    Group(1504, 0, True, (8, 64, 256, 1000)),
    Group(1024, 4, True, (0, 1, 8, 32, 128)),
    Group(1024, 16, False, (0, 64, 256, 1000)),
    Group(2992, 48, True, (0, 1, 32, 128)),
    Group(0, 0, False, (2000, 3000)),
    Group(2992, 0, True, (8, 64, 256, 1000)),
    Group(2048, 1, True, (0, 1, 32, 128)),
    Group(1024, 48, True, (0, 8, 128)),
    Group(2992, 16, False, (0, 64, 256, 1000)),
    Group(512, 32, True, (0, 1, 32, 128)),
    Group(64, 48, False, (0, 64, 300)),
)


def calibration_config(config: EngineConfig, plan: Sequence[Group] = PLAN) -> EngineConfig:
    """`config` with a step budget that takes the largest shape in one step and a pool
    of at least `MIN_PAGES`."""
    largest = max(g.decoders + max(g.sizes) for g in plan)
    return replace(
        config,
        max_batch_tokens=max(config.max_batch_tokens, largest),
        max_running=max(config.max_running, max(g.decoders for g in plan) + 1),
        num_pages=max(config.num_pages, MIN_PAGES),
    )


@dataclass
class _Decoder:
    prompt_len: int
    max_tokens: int
    offset: int = 0  # its output position minus decoder 0's, in every step both decode


class _Batch:
    """The group's decoders: decoder 0's tokens with their steps and arrival times, and
    what each decoder computes in the step that gave decoder 0 its token at a position."""

    def __init__(self) -> None:
        self.decoders: list[_Decoder] = []
        self.positions: list[int] = []  # decoder 0's output positions, in order
        self.steps: list[int] = []  # ... the engine steps that made them (-1: not told)
        self.times: list[float] = []  # ... and when each arrived
        self.moved = asyncio.Event()

    def seen(self, out: StepOutput) -> None:
        self.positions.append(out.position)
        self.steps.append(out.step)
        self.times.append(time.perf_counter())
        self.moved.set()

    async def position_of(self, out: StepOutput, t: float) -> int:
        """Decoder 0's position in the step that made `out`, which reached the caller at
        `t` (decoder 0 decodes in every step of the group)."""
        if out.step < 0:
            await self.after(t)
            return self._position_at(t)
        while not self.steps or self.steps[-1] < out.step:
            await self._move()
        i = bisect.bisect_left(self.steps, out.step)
        if self.steps[i] != out.step:
            raise RuntimeError(f"decoder 0 did not decode in engine step {out.step}")
        return self.positions[i]

    def _position_at(self, t: float) -> int:
        """Decoder 0's position in the step whose outputs arrived nearest `t`."""
        i = bisect.bisect_left(self.times, t)
        near = min((j for j in (i - 1, i) if 0 <= j < len(self.times)), key=lambda j: abs(self.times[j] - t))
        return self.positions[near]

    def load_at(self, position: int) -> StepLoad:
        load = EMPTY
        for d in self.decoders:
            p = position + d.offset
            if 0 < p < d.max_tokens:
                load = add(load, chunk_load(d.prompt_len + p - 1, 1))  # it computes its last token's KV
        return load

    def gap_s(self, position: int) -> float:
        i = self.positions.index(position)
        return self.times[i] - self.times[i - 1]

    async def after(self, t: float) -> None:
        """Until decoder 0 has a token that arrived after `t`."""
        while not self.times or self.times[-1] <= t:
            await self._move()

    async def _move(self) -> None:
        self.moved.clear()
        await self.moved.wait()


class _Meter:
    def __init__(self, port: EnginePort, vocab: int, progress: Callable[[int, int], None] | None) -> None:
        self.port, self.vocab, self.progress = port, vocab, progress
        self.rng = random.Random(0)
        self.rids = 0
        self.runs: dict[tuple[int, int], list[Sample]] = {}

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(16, self.vocab) for _ in range(n)]  # random: no accidental prefix hits

    def _rid(self) -> str:
        self.rids += 1
        return f"calibrate-{self.rids}"

    def _params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def _first(
        self, prompt: list[int], max_tokens: int = 1, hold: bool = False
    ) -> tuple[StepOutput, float, float, AsyncIterator[StepOutput], str]:
        """A new request's first output, when it was sent and when the output came, its stream and id."""
        rid = self._rid()
        stream = self.port.generate(rid, prompt, self._params(max_tokens), hold)
        sent = time.perf_counter()
        out = await stream.__anext__()
        return out, sent, time.perf_counter(), stream, rid

    async def _whole(self, prompt: list[int], hold: bool = False) -> str:
        _, _, _, stream, rid = await self._first(prompt, 1, hold)
        async for _ in stream:
            pass
        return rid

    async def run(self, plan: Sequence[Group], budget_s: float) -> None:
        for n in (300, 40, 40):  # first steps pay for allocations serving never sees again
            await self._whole(self._tokens(n))
        deadline = time.perf_counter() + budget_s
        total, done = sum(len(g.sizes) for g in plan), 0
        for index, group in enumerate(plan):
            if self.runs and time.perf_counter() > deadline:
                break
            preempted = self.port.stats().get("preemptions", 0)
            runs = await self._group(group, deadline)
            if self.port.stats().get("preemptions", 0) != preempted:
                continue  # a preempted decoder recomputed: the loads are not what was computed
            for n, samples in runs.items():
                self.runs[(index, n)] = samples
                done += 1
                if self.progress:
                    self.progress(done, total)

    def samples(self) -> list[Sample]:
        """Per shape the run of median time, kept whole: a real step's load with its time."""
        return [sorted(runs, key=lambda s: s[1])[len(runs) // 2] for runs in self.runs.values()]

    async def _group(self, group: Group, deadline: float) -> dict[int, list[Sample]]:
        prefix = self._tokens(group.context)
        if prefix:
            await self._whole(prefix)  # finished, so its pages are in the prefix cache
        batch, streams, task = _Batch(), [], None
        try:
            for i in range(group.decoders):
                prompt = prefix + self._tokens(_OWN_TOKENS)
                out, _, at, stream, _ = await self._first(prompt, self.port.max_context - len(prompt))
                batch.decoders.append(_Decoder(len(prompt), self.port.max_context - len(prompt)))
                if i == 0:
                    batch.seen(out)
                    task = asyncio.ensure_future(_follow(stream, batch))
                else:  # the rest are not read on: their first token places them against decoder 0
                    streams.append(stream)
                    batch.decoders[-1].offset = out.position - await batch.position_of(out, at)
            blob = await self._blob(prefix) if group.cached and group.decoders else None
            runs: dict[int, list[Sample]] = {}
            for n in group.sizes:
                if runs and time.perf_counter() > deadline:
                    break
                runs[n] = [await self._run(batch, prefix if group.cached else [], n, blob) for _ in range(_MIN_RUNS)]
                while len(runs[n]) < _MAX_RUNS and sum(t for _, t in runs[n]) < _CHEAP_S:
                    runs[n].append(await self._run(batch, prefix if group.cached else [], n, blob))
            return runs
        finally:
            if task is not None:
                task.cancel()
            for stream in streams:
                await _leave(stream)

    async def _blob(self, prefix: list[int]) -> Any:
        """The prefix's KV, as P would send it: computed and held, exported, let go."""
        rid = await self._whole(prefix, hold=True)
        try:
            return await self.port.export_kv(rid, 0, len(prefix))
        finally:
            await self.port.release(rid)

    async def _run(self, batch: _Batch, prefix: list[int], n: int, blob: Any) -> Sample:
        if n == 0:  # the decode batch alone: its next gap
            start = batch.positions[-1]
            await batch.after(batch.times[-1])
            position = start + 1
            return batch.load_at(position), batch.gap_s(position)
        if blob is not None:
            out, started, first = await self._extend(prefix, n, blob)
            new = chunk_load(len(prefix), n)
        else:
            out, started, first, stream, _ = await self._first(prefix + self._tokens(n))
            async for _ in stream:
                pass
            new = chunk_load(out.cached_tokens, len(prefix) + n - out.cached_tokens)
        if not batch.decoders:
            return new, first - started
        position = await batch.position_of(out, first)
        return add(batch.load_at(position), new), batch.gap_s(position)

    async def _extend(self, prefix: list[int], n: int, blob: Any) -> tuple[StepOutput, float, float]:
        """A handoff's extend: MD reserved the prompt, its KV imported, then `n` tokens
        another instance produced are computed in one step and the next is sampled: that
        first output, when `start` was called and when the output came."""
        rid = self._rid()
        await self.port.reserve(rid, prefix, self._params(n + 1), use_cache=False)
        await self.port.import_kv(rid, blob)
        stream = self.port.watch(rid)
        try:
            started = time.perf_counter()
            await self.port.start(rid, self._tokens(n))
            async for out in stream:
                if out.token is not None:
                    return out, started, time.perf_counter()
            raise RuntimeError(f"extend {rid} ended without a token")
        finally:
            stream.close()
            self.port.abort(rid)


async def _follow(stream: AsyncIterator[StepOutput], batch: _Batch) -> None:
    try:
        async for out in stream:
            if out.token is not None:
                batch.seen(out)
    finally:
        await _leave(stream)


async def _leave(stream: AsyncIterator[StepOutput]) -> None:
    """Leave a generate stream early, which aborts its request (the port's streams are
    async generators: closing one runs its cleanup)."""
    assert isinstance(stream, AsyncGenerator), "EnginePort.generate streams are async generators"
    await stream.aclose()


@dataclass(frozen=True)
class Measured:
    samples: list[Sample]  # one (load, median seconds) per shape
    kv_bytes_per_token: int  # of the engine's KV, as it exports it
    max_context: int  # prompt + output tokens one request may hold there


def measure(
    model_dir: str,
    config: EngineConfig,
    threads: int = 1,
    budget_s: float = 60.0,
    progress: Callable[[int, int], None] | None = None,
    plan: Sequence[Group] = PLAN,
) -> Measured:
    """Time the engine `config.backend` names over `model_dir` in every step shape of
    `plan`. `budget_s` bounds the measuring (loading the model and warming up come on
    top); `progress(done, total)` is told of each finished shape."""
    vocab = Declared.from_dir(model_dir).vocab_size  # (config.json only: no weights, no torch; any engine's model)

    async def go() -> Measured:
        port = open_engine(model_dir, calibration_config(config, plan), threads)
        try:
            meter = _Meter(port, vocab, progress)
            await meter.run(plan, budget_s)
            return Measured(meter.samples(), port.kv_bytes_per_token, port.max_context)
        finally:
            port.close()

    return asyncio.run(go())
