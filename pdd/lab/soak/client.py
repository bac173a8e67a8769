"""Send one soak request and say how it ended: completed, failed, or lost.

The line between failed and lost is what the client was told. An HTTP error status or
an SSE error event is a failure the client can act on (retry, report). Lost is
everything else that is not a full answer: no end within a generous timeout, a
connection that breaks without an error event, a stream that stops without a
`finish_reason`, or one that "finishes" short of the tokens asked for (the requests
are greedy with `ignore_eos`, so a full answer has exactly `max_tokens` tokens).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from pdd.lab.bench.sse import SseParser
from pdd.lab.soak.workload import SoakRequest

COMPLETED, FAILED, LOST = "completed", "failed", "lost"
OUTCOMES = (COMPLETED, FAILED, LOST)
BACKOFF_S = 0.5  # a client's pause after an error without Retry-After
MAX_BACKOFF_S = 2.0


@dataclass
class SoakOutcome:
    """One request as the client saw it; times are seconds since the run started."""

    index: int
    kind: str
    start: float
    end: float
    outcome: str
    tokens: int
    max_tokens: int
    status: int | None = None
    rid: str | None = None  # the router's id, from the first chunk (for its logs)
    detail: str | None = None  # the error, or why the request counts as lost
    pipeline: str | None = None
    fallbacks: list[str] = field(default_factory=list)
    retry_after_s: float = BACKOFF_S  # how long the client waits before its next request, after a failure

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Stream:
    """What one SSE response delivered."""

    def __init__(self) -> None:
        self.tokens = 0
        self.finish: str | None = None
        self.error: str | None = None
        self.done = False
        self.record: dict[str, Any] = {}
        self.rid: str | None = None

    def feed(self, chunk: dict[str, Any]) -> None:
        self.rid = self.rid or chunk.get("id")
        if "error" in chunk:
            self.error = _message(chunk)
            return
        for choice in chunk.get("choices") or []:
            self.tokens += len(choice.get("token_ids") or [])
            self.finish = choice.get("finish_reason") or self.finish
        if isinstance(chunk.get("pdd"), dict):
            self.record = chunk["pdd"]


def _message(payload: Any) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))[:200]
    return str(payload)[:200]


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(MAX_BACKOFF_S, float(response.headers.get("retry-after", BACKOFF_S)))
    except ValueError:
        return BACKOFF_S


async def send(
    client: httpx.AsyncClient, url: str, model: str, req: SoakRequest, timeout_s: float, t0: float
) -> SoakOutcome:
    """Stream `req` through the router at `url` and classify how it ended."""
    body = {
        "model": model,
        "prompt": list(req.prompt),
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.monotonic()
    out = SoakOutcome(req.index, req.kind, start - t0, 0.0, LOST, 0, req.max_tokens)
    stream = _Stream()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                out.status = response.status_code
                if response.status_code != 200:
                    payload = await response.aread()
                    out.outcome, out.retry_after_s = FAILED, _retry_after(response)
                    out.detail = f"HTTP {response.status_code}: {_message(_json(payload))}"
                else:
                    parser = SseParser()
                    async for line in response.aiter_lines():
                        if (chunk := parser.line(line)) is not None:
                            stream.feed(chunk[1])
                    stream.done = parser.done
                    _classify(out, stream)
    except TimeoutError:
        out.outcome, out.detail = _broken(out, stream, f"no end within {timeout_s:g} s")
    except httpx.HTTPError as exc:
        out.outcome, out.detail = _broken(out, stream, f"connection broke without an error event: {type(exc).__name__}")
    except ValueError as exc:  # a data line that is not JSON
        out.outcome, out.detail = LOST, f"malformed stream: {exc}"
    out.end = time.monotonic() - t0
    out.tokens, out.rid = stream.tokens, stream.rid
    out.pipeline, out.fallbacks = stream.record.get("pipeline"), stream.record.get("fallbacks") or []
    return out


def _json(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        return payload.decode(errors="replace")


def _classify(out: SoakOutcome, stream: _Stream) -> None:
    """A stream that ended on its own: an error event, a full answer, or lost."""
    if stream.error is not None:
        out.outcome, out.detail = FAILED, f"error event: {stream.error}"
    elif stream.finish is None:
        out.outcome, out.detail = LOST, f"stream ended without finish_reason or error ({stream.tokens} tokens)"
    elif stream.tokens != out.max_tokens:
        out.outcome = LOST
        out.detail = f"finish_reason {stream.finish} after {stream.tokens} of {out.max_tokens} tokens"
    else:
        out.outcome = COMPLETED


def _broken(out: SoakOutcome, stream: _Stream, why: str) -> tuple[str, str | None]:
    """A stream cut off by the client's timeout or a broken connection: failed if the
    server had already said why, complete if every token and the finish had arrived."""
    if stream.error is not None:
        return FAILED, f"error event: {stream.error}"
    if stream.finish is not None and stream.tokens == out.max_tokens:
        return COMPLETED, None
    return LOST, why
