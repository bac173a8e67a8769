"""A request's state inside one engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from pdd.engine.radix_cache import Node

MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ints = (self.max_tokens, self.top_k, *self.stop_token_ids) + (() if self.seed is None else (self.seed,))
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
            raise ValueError("max_tokens, top_k, seed and stop_token_ids must be integers")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (self.temperature, self.top_p)):
            raise ValueError("temperature and top_p must be numbers")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError("ignore_eos must be true or false")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        # below this, logits / temperature overflows float32: the top token is certain anyway
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


class Status(enum.Enum):
    RESERVED = "reserved"  # KV being imported; not yet schedulable
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"  # finished, pages kept for export until released
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    rid: str
    tokens: list[int]  # prompt followed by output
    prompt_len: int
    params: SamplingParams
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose KV is in `pages`
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_node: Node | None = None  # locked path in the radix cache
    finish_reason: str | None = None
    hold: bool = False  # keep pages after finishing (prefill side exports them)
    want_logits: bool = False  # keep the logits of every computed position of the next step
    step_logits: torch.Tensor | None = None
    generator: torch.Generator | None = None

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_pending(self) -> int:
        """Tokens whose KV still has to be computed."""
        return len(self.tokens) - self.num_computed
