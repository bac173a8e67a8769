"""Which instance gets a request: prefix affinity against load.

Pure functions over plain data, called by the router for live requests and by the
simulator for simulated ones, so both make the same choice.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    name: str
    predicted_hit_tokens: int  # prompt tokens this instance is expected to hold already
    queued_tokens: int  # tokens of work already assigned and not finished
    healthy: bool = True


def pick(
    candidates: list[Candidate], prompt_tokens: int, affinity_weight: float = 1.0, load_weight: float = 1.0
) -> Candidate:
    """The healthy candidate with the least expected work: what it must compute for this
    prompt (the uncached part) plus what is already queued there. Ties go to the first."""
    healthy = [c for c in candidates if c.healthy]
    if not healthy:
        raise LookupError("no healthy instance for this role")

    def cost(c: Candidate) -> float:
        return load_weight * c.queued_tokens - affinity_weight * min(c.predicted_hit_tokens, prompt_tokens)

    return min(healthy, key=cost)
