"""The soak's requests: short, seeded, and shaped to reach every PDD path.

A soak needs many requests fast, not the paper's long agentic turns, yet its requests
must still take each path faults can break: a fresh prompt (low hit at MD: P -> RLD ->
MD), a follow-up that re-sends a context MD already holds (P -> MD), and the rare long
prompt with a tiny output (the anomaly filter keeps it on the relay). Request `i` is
drawn from (seed, i) alone, so a run replays the same requests whatever the
concurrency or the order in which workers take them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CONTEXTS = 16  # shared contexts follow-ups extend (MD's radix cache keeps them)
FRESH, FOLLOW_UP, ANOMALOUS = "fresh", "follow_up", "anomalous"
_LOW_ID = 16


@dataclass(frozen=True)
class SoakRequest:
    index: int
    kind: str
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class SoakWorkload:
    """Shape of the soak's requests (token counts inclusive); the defaults fit the tiny model."""

    seed: int = 0
    vocab_size: int = 4096
    fresh_tokens: tuple[int, int] = (16, 256)
    context_tokens: tuple[int, int] = (128, 512)
    follow_up_tokens: tuple[int, int] = (4, 64)
    output_tokens: tuple[int, int] = (4, 48)
    follow_up_share: float = 0.5
    anomalous_share: float = 0.02
    # over half the tiny model's 4,096-token context, under 31 tokens out: anomalous
    anomalous_tokens: tuple[int, int] = (2100, 3000)
    anomalous_output_tokens: tuple[int, int] = (1, 4)

    def _ids(self, rng: np.random.Generator, n: int) -> tuple[int, ...]:
        return tuple(rng.integers(_LOW_ID, self.vocab_size, size=n).tolist())

    def _context(self, k: int) -> tuple[int, ...]:
        rng = np.random.default_rng((self.seed, 0, k))
        return self._ids(rng, _between(rng, self.context_tokens))

    def request(self, index: int) -> SoakRequest:
        """Request `index` of this workload: the same for the same (seed, index)."""
        rng = np.random.default_rng((self.seed, 1, index))
        draw = rng.random()
        if draw < self.anomalous_share:
            prompt = self._ids(rng, _between(rng, self.anomalous_tokens))
            return SoakRequest(index, ANOMALOUS, prompt, _between(rng, self.anomalous_output_tokens))
        if draw < self.anomalous_share + self.follow_up_share:
            context = self._context(int(rng.integers(CONTEXTS)))
            prompt = context + self._ids(rng, _between(rng, self.follow_up_tokens))
            return SoakRequest(index, FOLLOW_UP, prompt, _between(rng, self.output_tokens))
        prompt = self._ids(rng, _between(rng, self.fresh_tokens))
        return SoakRequest(index, FRESH, prompt, _between(rng, self.output_tokens))


def _between(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))
