"""`EnginePort`: everything an instance asks of the engine that computes for it.

The instance roles (prefill, relay, main decode, standalone) reach their engine only
through this interface, so another engine (vLLM on GPUs, through its KV connector and
prefix cache) can sit behind the same router, policies and wire protocol. The
embedded engine implements it in `pdd.instance.runtime.EngineRuntime`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdd.sampling import SamplingParams

if TYPE_CHECKING:
    from pdd.engine.engine import StepOutput
    from pdd.kv.codec import KVBlob

CacheListener = Callable[[int, str, list[int]], None]  # (sequence number, "stored"/"removed", block hashes)


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    max_running: int
    pages: int
    free_pages: int
    cached_pages: int  # held by the prefix cache only: evictable


class OutputStream(Protocol):
    """One request's step outputs (tokens, its finish, catch-up progress), in order."""

    def __aiter__(self) -> AsyncIterator[StepOutput]: ...

    def close(self) -> None: ...


class EnginePort(Protocol):
    page_size: int
    max_context: int  # prompt + output tokens one request may hold
    kv_bytes_per_token: int  # of this engine's KV, as exported

    def generate(self, rid: str, prompt: list[int], params: SamplingParams, hold: bool = False) -> AsyncIterator[StepOutput]:
        """Run a request; with `hold`, keep its KV after it finishes, for export, until `release`."""

    def watch(self, rid: str) -> OutputStream:
        """Subscribe to a request's outputs; call before `start`, so none is missed."""

    async def reserve(self, rid: str, prompt: list[int], params: SamplingParams, use_cache: bool = True) -> int:
        """Lock the longest cached prefix and take pages for the rest; the hit in tokens.
        Raises OutOfPages when the pool cannot hold the prompt now."""

    async def cached_prefix(self, tokens: list[int]) -> int:
        """Tokens of this prompt the prefix cache holds now (nothing is locked)."""

    async def import_kv(self, rid: str, blob: KVBlob) -> None:
        """KV of a reserved request, continuing exactly where it stands."""

    async def export_kv(self, rid: str, start: int, end: int) -> KVBlob:
        """KV of tokens [start, end) of an active or held request."""

    async def start(self, rid: str, tokens: list[int], shadow: bool = False, step_cap: int = 0) -> int:
        """Extend a reserved request by given output tokens and decode on (see
        `Engine.start`; `shadow` computes without sampling). Its cached prompt tokens."""

    async def cut(self, rid: str) -> list[int]:
        """Stop a request now; the output it produced."""

    async def release(self, rid: str) -> None:
        """Drop a request's hold or reservation; its KV stays in the prefix cache."""

    def abort(self, rid: str) -> None:
        """Stop a request from anywhere, without waiting; watchers see an "abort" finish."""

    async def cache_snapshot(self) -> tuple[int, list[int]]:
        """Every cached block hash, with the number of the last cache event included."""

    def set_cache_listener(self, listener: CacheListener) -> None: ...

    def load(self) -> EngineLoad: ...

    def stats(self) -> dict: ...
