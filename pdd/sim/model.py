"""The served model, as the simulator needs it: how much arithmetic a token costs,
how many bytes its weights and its KV take."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    total_params: float
    active_params: float  # per token (MoE: the routed experts plus the shared part)
    weight_bytes_per_param: float
    layers: int
    attn_flops_per_pair: float  # one query token against one context token, all layers
    kv_bytes_per_token: float
    max_context: int
    note: str = ""

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.weight_bytes_per_param

    @property
    def active_weight_bytes(self) -> float:
        return self.active_params * self.weight_bytes_per_param

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _mla_pair_flops(layers: int, heads: int, qk_dim: int, v_dim: int) -> float:
    return 2.0 * layers * heads * (qk_dim + v_dim)


MODELS: dict[str, ModelSpec] = {
    # The spec's "1T-parameter model, ~50 KB of KV per token": Kimi-K2-like (61 layers,
    # 64 MLA heads, 32B active of 1.04T, INT4 weights as that model ships).
    "paper-1t": ModelSpec("paper-1t", total_params=1.04e12, active_params=32e9, weight_bytes_per_param=0.5,
                          layers=61, attn_flops_per_pair=_mla_pair_flops(61, 64, 192, 128),
                          kv_bytes_per_token=50e3, max_context=131072,
                          note="1T MoE, 32B active, INT4 weights, 50 KB KV/token (the spec's figure)"),
    # The spec's compressed-KV case: ~23 GB of KV for 80 concurrent 64K requests.
    "deepseek-v4-pro-like": ModelSpec("deepseek-v4-pro-like", total_params=671e9, active_params=37e9,
                                      weight_bytes_per_param=1.0, layers=61,
                                      attn_flops_per_pair=_mla_pair_flops(61, 128, 192, 128),
                                      kv_bytes_per_token=23e9 / (80 * 65536), max_context=131072,
                                      note="671B MoE, 37B active, FP8, compressed KV: 23 GB per 80 x 64K"),
}


def tiny_spec(layers: int = 4, hidden: int = 256, heads: int = 4, kv_heads: int = 2, intermediate: int = 768,
              vocab: int = 4096, dtype_bytes: int = 4, max_context: int = 4096) -> ModelSpec:
    """The embedded tiny model (what `pdd demo` serves)."""
    head_dim = hidden // heads
    per_layer = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden + 3 * hidden * intermediate
    params = layers * per_layer + 2 * vocab * hidden
    return ModelSpec("tiny", total_params=params, active_params=params, weight_bytes_per_param=dtype_bytes,
                     layers=layers, attn_flops_per_pair=4.0 * layers * heads * head_dim,
                     kv_bytes_per_token=2 * layers * kv_heads * head_dim * dtype_bytes, max_context=max_context,
                     note="the embedded tiny model, fp32")
