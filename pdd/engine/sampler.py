"""Next-token choice: greedy for the oracle, seeded temperature/top-k/top-p otherwise."""

from __future__ import annotations

import torch

from pdd.engine.sequence import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits` [N, vocab] (float32)."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
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
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
