"""Server-sent events of JSON chunks (OpenAI's streams), read one way by every lab client:
the benchmark, the soak, the flood and the engine bench.

A blank line ends an event; `event:` names it (an `error` event); each `data:` line holds
one JSON object, and `data: [DONE]` ends the stream. A data line that is not a JSON
object is an `SseError`, and so is a stream that ends before `[DONE]` (`chunks`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

Chunk = tuple[str | None, dict[str, Any]]  # (the event's name, None for a plain chunk; its JSON object)


class SseError(ValueError):
    """A stream that is not what an OpenAI server sends."""


class SseParser:
    """One stream's lines, in order: `line` gives the chunk a line completes (or None)."""

    def __init__(self) -> None:
        self.event: str | None = None
        self.done = False  # `[DONE]` arrived

    def line(self, line: str) -> Chunk | None:
        if not line:
            self.event = None  # a blank line ends an event
        elif line.startswith("event:"):
            self.event = line[len("event:") :].strip()
        elif line.startswith("data:"):
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                self.done = True
                return None
            try:
                chunk = json.loads(data)
            except ValueError:
                raise SseError(f"a stream chunk is not JSON: {data[:200]}") from None
            if not isinstance(chunk, dict):
                raise SseError(f"a stream chunk is not an object: {data[:200]}")
            return self.event, chunk
        return None  # a comment (":") or a field pdd does not send


async def chunks(response: httpx.Response) -> AsyncIterator[Chunk]:
    """The chunks of a streamed response, until `[DONE]` (SseError if it never comes)."""
    parser = SseParser()
    async for line in response.aiter_lines():
        if (chunk := parser.line(line)) is not None:
            yield chunk
        if parser.done:
            return
    raise SseError("the stream ended before [DONE]")


def chunks_of(text: str) -> Iterator[Chunk]:
    """The chunks of a whole stream's text, until `[DONE]` (SseError if it never comes)."""
    parser = SseParser()
    for line in text.splitlines():
        if (chunk := parser.line(line)) is not None:
            yield chunk
        if parser.done:
            return
    raise SseError("the stream ended before [DONE]")
