"""One engine's sizes and numerics (no torch import: deployment files are parsed
by processes that never load a model)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16  # tokens per KV page
    num_pages: int = 2048  # KV pool size
    max_batch_tokens: int = 2048  # token budget of one step (chunked prefill above it)
    max_running: int = 64  # most sequences computed at once
    device: str = "cpu"
    dtype: str = "float32"
    kv_dtype: str = ""  # KV pool dtype; empty: same as dtype
    # most requests an instance holds at once (computing, queued, or moving KV); past
    # this it refuses new ones as busy, and the router answers 429
    max_requests: int = 256

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "max_batch_tokens", "max_running", "max_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine {name} must be at least 1")
