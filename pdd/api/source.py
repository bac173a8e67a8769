"""What the OpenAI front end needs from whatever produces tokens.

A single instance and the cross-datacenter router both serve the same OpenAI API; they
differ only in how tokens are produced, which is this interface.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from pdd.record import RequestRecord
from pdd.sampling.params import Logprob, SamplingParams


class GenerationError(Exception):
    """Generation failed after it was accepted (an instance died, a connection broke, ...)."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class GenRequest:
    rid: str
    prompt: list[int]
    params: SamplingParams


@dataclass
class GenEvent:
    tokens: list[int]
    finish_reason: str | None = None
    cached_tokens: int = 0
    # Set on the last event: where the request ran (pipeline, hit tokens, line bytes, ...).
    record: RequestRecord | None = None
    # each token's, where the request asks for logprobs (None where a producer did not say)
    logprobs: list[Logprob | None] | None = None
    # with the first token, each prompt token's (the first's None), where the request asks
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass(frozen=True)
class Load:
    running: int
    waiting: int
    kv_usage: float  # fraction of KV pages running requests hold (0..1); cached pages are evictable, not in use
    cached_pages: int = 0
    free_pages: int = 0
    used_pages: int = 0


class TokenSource(Protocol):
    max_context: int

    def generate(self, req: GenRequest) -> AsyncGenerator[GenEvent, None]:
        """Stream tokens; closing the iterator early aborts the request."""

    def load(self) -> Load: ...

    async def stats(self) -> dict: ...

    def health(self) -> dict:
        """{"status": "ok"} while the process is alive and of use (an orchestrator's liveness
        probe); otherwise "unavailable" and why (an instance whose engine died): what /health
        answers (503 for the latter)."""

    def ready(self) -> dict:
        """{"status": "ok"} when new work may come here now; otherwise "unavailable" and why
        (shutting down, an engine that died, a role with no instance behind a router): what
        /ready answers (503 for the latter), an orchestrator's readiness probe."""
