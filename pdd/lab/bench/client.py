"""Replay sessions against a live OpenAI-compatible server and measure each request.

Prompts are sent as token IDs and the next turn is built from the token IDs the server
returned (the `token_ids` extension of each stream chunk): re-tokenizing text would
shift token boundaries at the seams and break the prefix-cache hits the benchmark is
meant to measure. Requests are greedy with `ignore_eos`, so output lengths are exactly
the planned ones in every mode under comparison.

A failed request (HTTP error, error event, malformed stream, timeout) becomes a record
with `error` set; the run goes on. The later turns of its session cannot be built
without its output, so they are recorded as failed without being sent.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from rich.console import Console

from pdd.lab.bench.sse import SseError, chunks
from pdd.lab.workload.types import Session
from pdd.progress import progress_bar
from pdd.record import RequestRecord


class BenchError(RuntimeError):
    """The run cannot start (e.g. no model id could be found)."""


class _RequestFailed(Exception):
    """The server answered, but not with a complete, well-formed completion."""


@dataclass(frozen=True)
class Target:
    """The server under test."""

    url: str
    model: str
    timeout_s: float


@dataclass
class BenchRun:
    """A finished replay: one record per planned turn, by session and turn."""

    records: list[RequestRecord]
    model: str
    # Delta of the server's /pdd/stats counter over the run; None when it has none.
    line_bytes: int | None


def base_url(url: str) -> str:
    """Accept both `http://host:port` and an OpenAI-style `.../v1` base URL."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _error_message(body: bytes) -> str:
    try:
        payload = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:200]
    if isinstance(payload, dict):
        error = payload.get("error", payload.get("detail"))
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if error is not None:
            return str(error)
    return str(payload)[:200]


async def fetch_model(client: httpx.AsyncClient, url: str) -> str:
    """The first model id the server lists, for runs where the user named none."""
    try:
        response = await client.get(f"{url}/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"cannot read a model id from {url}/v1/models: {exc}") from exc


KV_SETTLE_S = 60.0  # the longest a run waits for KV copies still crossing after its last token


async def fetch_line_bytes(client: httpx.AsyncClient, url: str, settle_s: float = 0.0) -> int | None:
    """The server's line byte counter, or None where it keeps none (a plain server). With
    `settle_s`, first wait (that long at most) for the KV transfers still open: a request
    the relay finished has its copy to MD crossing after its last token, and P counts the
    bytes when the copy is over."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            response = await client.get(f"{url}/pdd/stats")
            if response.status_code != 200:
                return None
            stats = response.json()
            value = stats.get("line_bytes")
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        if not stats.get("kv_open") or time.monotonic() >= deadline:
            return value if isinstance(value, int) else None
        await asyncio.sleep(0.2)


@dataclass
class _Stream:
    """What one streamed completion delivered, gathered chunk by chunk."""

    started: float
    first_token: float | None = None
    last_token: float | None = None
    max_gap: float | None = None
    output_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    pdd: dict[str, Any] | None = None

    def on_chunk(self, chunk: Any, now: float) -> None:
        if not isinstance(chunk, dict):
            raise _RequestFailed(f"stream chunk is not an object: {chunk!r:.200}")
        if chunk.get("error") is not None:
            raise _RequestFailed(f"error event: {_error_message(json.dumps(chunk).encode())}")
        for choice in chunk.get("choices") or []:
            ids = choice.get("token_ids")
            if not (ids or choice.get("text")):
                continue
            if self.last_token is None:
                self.first_token = now
                self.output_ids = []
            else:
                self.max_gap = max(self.max_gap or 0.0, now - self.last_token)
            self.last_token = now
            if self.output_ids is not None:
                # Text without IDs: the exact continuation is unknown from here on.
                self.output_ids = self.output_ids + list(ids) if ids else None
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("pdd"), dict):
            self.pdd = chunk["pdd"]


async def _read_stream(response: httpx.Response, stream: _Stream) -> None:
    if response.status_code != 200:
        raise _RequestFailed(f"HTTP {response.status_code}: {_error_message(await response.aread())}")
    try:
        async for event, chunk in chunks(response):
            if event == "error":
                raise _RequestFailed(f"error event: {json.dumps(chunk)[:200]}")
            stream.on_chunk(chunk, time.perf_counter())
    except SseError as e:
        raise _RequestFailed(str(e)) from None


def _fill(record: RequestRecord, stream: _Stream, ended: float) -> None:
    record.e2e_ms = (ended - stream.started) * 1000.0
    if stream.first_token is None:
        raise _RequestFailed("stream finished without any token")
    usage = stream.usage or {}
    record.prompt_tokens = int(usage.get("prompt_tokens", record.prompt_tokens))
    counted = len(stream.output_ids) if stream.output_ids is not None else 0
    record.output_tokens = int(usage.get("completion_tokens", counted))
    record.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    record.ttft_ms = (stream.first_token - stream.started) * 1000.0
    if record.output_tokens > 1:
        record.tpot_ms = (record.e2e_ms - record.ttft_ms) / (record.output_tokens - 1)
    record.max_itl_ms = None if stream.max_gap is None else stream.max_gap * 1000.0
    if stream.pdd is None:  # a server without pdd's record (vLLM, say): its cache is both sides'
        record.p_hit_tokens = record.d_hit_tokens = record.cached_tokens
        return
    record.apply_served(stream.pdd)


async def send_completion(
    client: httpx.AsyncClient,
    target: Target,
    record: RequestRecord,
    prompt: list[int],
    max_tokens: int,
    run_start: float,
) -> list[int] | None:
    """Send one streamed completion, fill `record` in, return the output token IDs.

    Returns None when the output IDs are unknown: the request failed (`record.error`
    says why) or the server sent text without `token_ids`.
    """
    body = {
        "model": target.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "return_token_ids": True,  # pdd always returns token ids, vLLM when asked
    }
    started = time.perf_counter()
    record.start_s = started - run_start
    stream = _Stream(started)
    try:
        async with asyncio.timeout(target.timeout_s):
            async with client.stream("POST", f"{target.url}/v1/completions", json=body) as response:
                await _read_stream(response, stream)
        _fill(record, stream, time.perf_counter())
    except TimeoutError:
        record.error = f"timeout after {target.timeout_s:g} s"
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    except _RequestFailed as exc:
        record.error = str(exc)
    except (ValueError, TypeError, AttributeError) as exc:
        # A field of the wrong type somewhere in the stream.
        record.error = f"malformed response: {exc}"
    if record.error is not None:
        record.e2e_ms = (time.perf_counter() - started) * 1000.0
        return None
    return stream.output_ids


async def _run_session(
    client: httpx.AsyncClient, target: Target, session: Session, run_start: float, emit: Callable[[RequestRecord], None]
) -> None:
    await asyncio.sleep(max(0.0, run_start + session.start_s - time.perf_counter()))
    context: list[int] = []
    broken: str | None = None
    for k, turn in enumerate(session.turns):
        record = RequestRecord(
            id=f"{session.id}-{k}",
            session=session.id,
            turn=k,
            start_s=None,
            prompt_tokens=0,
            planned_anomalous=session.anomalous,
        )
        if broken is not None:
            record.error = f"not sent: {broken}"
            emit(record)
            continue
        if turn.pause_s:  # its tool runs
            await asyncio.sleep(turn.pause_s)
        prompt = context + list(turn.append_ids)
        record.prompt_tokens = len(prompt)
        output = await send_completion(client, target, record, prompt, turn.max_tokens, run_start)
        emit(record)
        if record.error is not None:
            broken = f"turn {k} failed"
        elif output is None:
            broken = f"turn {k} returned no token_ids"
        else:
            context = prompt + output


async def replay(
    url: str,
    sessions: Sequence[Session],
    *,
    model: str | None = None,
    timeout_s: float = 120.0,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> BenchRun:
    """Run every session concurrently, each at its start time, its turns in order.

    `on_record` sees each record as it completes (for progress display). The server's
    line byte counter is read before and after so the run reports the bytes it caused.
    """
    url = base_url(url)
    records: list[RequestRecord] = []

    def emit(record: RequestRecord) -> None:
        records.append(record)
        if on_record is not None:
            on_record(record)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False) as client:
        model = model or await fetch_model(client, url)
        target = Target(url, model, timeout_s)
        line_before = await fetch_line_bytes(client, url)
        run_start = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for session in sessions:
                group.create_task(_run_session(client, target, session, run_start, emit))
        line_after = await fetch_line_bytes(client, url, KV_SETTLE_S)
    records.sort(key=lambda r: (r.session, r.turn))
    line_bytes = line_after - line_before if line_before is not None and line_after is not None else None
    return BenchRun(records, model, line_bytes)


def run_bench(
    url: str, sessions: Sequence[Session], *, model: str | None = None, timeout_s: float = 120.0, quiet: bool = False
) -> BenchRun:
    """`replay` with a progress bar on stderr (hidden when quiet or not a terminal)."""
    console = Console(stderr=True)
    total = sum(len(s.turns) for s in sessions)
    failed = 0
    with progress_bar(console, quiet) as progress:
        task = progress.add_task("requests", total=total)

        def advance(record: RequestRecord) -> None:
            nonlocal failed
            failed += record.error is not None
            progress.update(task, advance=1, description=f"requests ({failed} failed)" if failed else "requests")

        return asyncio.run(replay(url, sessions, model=model, timeout_s=timeout_s, on_record=advance))
