"""Next-token choice: greedy for the oracle, seeded temperature/top-k/top-p otherwise.

A sampled token wins an exponential race: the argmax of `p_j / E_j` over the filtered
distribution `p`, where `E_j ~ Exp(1)` is a hash of (seed, position, token j). That is
an exact draw from `p` (vLLM samples the same way), and the same position draws the
same token on every instance.

Why a race and not an inverse CDF: two producers of a position compute its logits by
different paths (a 1-token decode, an N-token extend after a handoff), equal to about
1e-3. An inverse CDF moves its pick whenever any earlier token's mass moves across the
random number, and top-p's cut among near-equal tokens moves the whole tail; a race
changes winner only when the two best scores tie within that difference. Under the
same perturbation of the tiny model's hot (temperature 25, top-p 0.95) logits, the
race changed 1 draw in 2,000 where the inverse CDF changed 240
(`tests/test_engine.py::test_a_seeded_draw_survives_a_float_difference_in_the_logits`).
"""

from __future__ import annotations

import numpy as np
import torch

from pdd.sampling import SamplingParams, draw_key

# splitmix64's constants: one well-mixed 64-bit word per (key, token)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def exponentials(seed: int, position: int, n: int) -> torch.Tensor:
    """`n` Exp(1) numbers (float64), one per token, for output position `position` of a
    request seeded `seed`: the same on every machine (integer arithmetic, no generator)."""
    x = np.uint64(draw_key(seed, position)) + np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN  # wraps mod 2**64
    z = (x ^ (x >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z ^= z >> np.uint64(31)
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)  # in (0, 1), never 0
    return torch.from_numpy(-np.log(u))


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> list[int]:
    """One token per row of `logits` [N, vocab] (float32); row i is output position
    `positions[i]` of a request seeded `seeds[i]` (unused when greedy)."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i].double().cpu() / p.temperature
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always the top token)
            drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        # a filtered token has no mass, so it scores 0 and never wins
        out[i] = int(torch.argmax(probs / exponentials(seeds[i], positions[i], probs.numel())))
    return out
