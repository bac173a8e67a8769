"""Next-token choice: greedy for the oracle, seeded temperature/top-k/top-p otherwise.

A sampled token is the inverse CDF of the filtered distribution at `uniform(seed,
position)`, so the same position draws the same token on every instance.
"""

from __future__ import annotations

import torch

from pdd.sampling import SamplingParams, uniform


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> list[int]:
    """One token per row of `logits` [N, vocab] (float32); row i is output position
    `positions[i]` of a request seeded `seeds[i]` (unused when greedy)."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i].double() / p.temperature
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
        cdf = probs.cumsum(0)
        target = uniform(seeds[i], positions[i]) * float(cdf[-1])
        index = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True)[0])
        out[i] = min(index, len(cdf) - 1)
        while probs[out[i]] == 0:  # a zero-mass token can sit at a boundary after filtering
            out[i] -= 1
    return out
