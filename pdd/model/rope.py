"""RoPE settings as either generation of transformers writes them, and their frequencies.

transformers 4.x writes a top-level `rope_theta` and an optional `rope_scaling` table
(`type` or `rope_type`, plus its parameters); 5.x writes one `rope_parameters` table
with `rope_theta` and `rope_type` inside. `read_rope` reads both the way transformers
5 does (a 4.x `rope_scaling` wins, then the table's own `rope_theta`, then the
top-level one, then 10000) and refuses, by field name, every type or parameter it
cannot compute exactly. The formulas follow transformers' `modeling_rope_utils` in
float32, because an ulp of difference in a frequency grows with position.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# rope types whose frequencies are fixed for a model: what cached KV needs
SUPPORTED_TYPES = ("default", "linear", "llama3", "yarn")
_WHY_NOT = {
    "dynamic": "its frequencies change with the sequence length, which KV computed earlier cannot follow",
    "longrope": "not implemented (Phi-3 style per-frequency factors)",
}
# the parameters each type reads; transformers ignores any other key, and so do we
_REQUIRED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}
_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedCheckpoint(ValueError):
    """A checkpoint field that changes the model's math in a way pdd does not compute."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"config.json field `{field}`: {message}")
        self.field = field


def read_rope(cfg: dict[str, Any], max_position: int) -> dict[str, Any]:
    """The RoPE parameters of an HF config: `rope_type`, `rope_theta` and what the type needs."""
    where = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    table = cfg.get(where) or {}
    if not isinstance(table, dict):
        raise UnsupportedCheckpoint(where, f"expected a table, got {table!r}")
    if any(key in _LAYER_TYPES for key in table):
        raise UnsupportedCheckpoint(where, "RoPE settings per layer type are not implemented")
    rope = dict(table)
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.setdefault("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        field = f"{where}.partial_rotary_factor" if "partial_rotary_factor" in rope else "partial_rotary_factor"
        raise UnsupportedCheckpoint(field, f"{partial!r}: RoPE on part of each head is not implemented")
    if rope_type not in SUPPORTED_TYPES:
        why = _WHY_NOT.get(rope_type, "unknown to pdd")
        raise UnsupportedCheckpoint(f"{where}.rope_type", f"{rope_type!r}: {why}; supported: {SUPPORTED_TYPES}")
    if rope_type in ("llama3", "yarn"):
        # a top-level value wins, as transformers does for Phi-3-style configs
        original = cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = original or max_position
    missing = [key for key in _REQUIRED.get(rope_type, ()) if rope.get(key) is None]
    if missing:
        raise UnsupportedCheckpoint(f"{where}.{missing[0]}", f"rope_type {rope_type!r} needs it")
    return {key: rope[key] for key in rope if key != "type"}


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
