"""RoPE frequencies of each supported type, from the parameters `pdd.model.config` reads.

The formulas follow transformers' `modeling_rope_utils` op for op in float32, because an
ulp of difference in a frequency grows with position.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_freq_and_scale(rope: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies (float32) and the factor cos and sin are scaled by."""
    base = float(rope["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope["rope_type"]
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / rope["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv, rope), 1.0
    return _yarn(rope, head_dim)


def _llama3(inv: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: stretch low frequencies, keep high ones, interpolate between.
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_ctx = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
    return torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def _yarn(rope: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (static, as Qwen2.5 and Qwen3 enable it for long contexts): interpolate
    low frequencies, extrapolate high ones, ramp between, and scale attention."""
    base = float(rope["rope_theta"])
    original = rope["original_max_position_embeddings"]
    factor = rope["factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention)
