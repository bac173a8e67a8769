"""Model hyper-parameters, read from a Hugging Face `config.json`.

Llama, Qwen2 and Qwen3 share one decoder shape; they differ only in a few switches
(biases, RMSNorm on q and k, explicit head_dim), so one dataclass covers them.

The rule for every field: compute what transformers computes for the same file, or
refuse it by name. transformers 4.x and 5.x write some fields differently (RoPE above
all: see `read_rope`), and a field read wrong or ignored does not fail, it
generates garbage. So each field the Llama, Qwen2 and Qwen3 modelling code of
transformers reads is either implemented here or refused with `UnsupportedCheckpoint`;
a missing one takes transformers' default for that model type; fields transformers
ignores are ignored here too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd.errors import Mistake

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")
# transformers 5's defaults where config.json says nothing (the same as 4.x for these)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": None},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_ACTIVATIONS = ("silu", "swish")  # the same function in transformers' ACT2FN
# rope types whose frequencies are fixed for a model: what cached KV needs
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_WHY_NOT = {
    "dynamic": "its frequencies change with the sequence length, which KV computed earlier cannot follow",
    "longrope": "not implemented (Phi-3 style per-frequency factors)",
}
# the parameters each type reads; transformers ignores any other key, and so do we
_ROPE_PARAMETERS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
}
_LAYER_TYPES = ("full_attention", "sliding_attention")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")  # Mixtral's, Qwen-MoE's, DeepSeek's


@dataclass(frozen=True)
class Declared:
    """What any checkpoint's config.json declares, whatever its model type, for the parts
    of pdd that never run it (the router, the demo's fitting, vLLM's arguments): the
    engine that serves it reads the rest itself. Each is 0 where the file does not say."""

    vocab_size: int
    max_position: int
    num_layers: int
    kv_values_per_token: int  # K and V of every layer (MLA: one latent vector a layer)
    experts: int = 0  # routed experts a MoE layer chooses among (0: a dense model)
    latent: bool = False  # multi-head latent attention (MLA): one latent vector a token, no heads

    @classmethod
    def from_dir(cls, path: str | Path) -> Declared:
        source = Path(path) / "config.json"
        with open(source, encoding="utf-8") as f:
            raw = json.load(f)
        cfg = raw.get("text_config") or raw  # (a multimodal checkpoint's language model)
        if not isinstance(cfg, dict):
            raise UnsupportedCheckpoint("text_config", "not a table", str(source))
        vocab = cfg.get("vocab_size", raw.get("vocab_size"))
        positions = [cfg.get(k) for k in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")]
        layers = cfg.get("num_hidden_layers") or 0
        if cfg.get("kv_lora_rank"):  # multi-head latent attention: a latent and a rope key, shared by the heads
            per_layer = cfg["kv_lora_rank"] + cfg.get("qk_rope_head_dim", 0)
        else:
            heads = cfg.get("num_attention_heads") or 0
            kv_heads = cfg.get("num_key_value_heads") or heads
            head_dim = cfg.get("head_dim") or (cfg.get("hidden_size", 0) // heads if heads else 0)
            per_layer = 2 * kv_heads * head_dim
        return cls(
            vocab_size=vocab if isinstance(vocab, int) else 0,
            max_position=next((p for p in positions if isinstance(p, int) and p > 0), 0),
            num_layers=layers,
            kv_values_per_token=layers * per_layer,
            experts=next((n for k in _EXPERTS if isinstance(n := cfg.get(k), int) and n > 0), 0),
            latent=bool(cfg.get("kv_lora_rank")),
        )


class UnsupportedCheckpoint(Mistake, ValueError):
    """A checkpoint field that changes the model's math in a way pdd does not compute."""

    def __init__(self, field: str, message: str, source: str = "config.json") -> None:
        super().__init__(f"{source} field `{field}`: {message}")
        self.field, self.message = field, message


def read_rope(cfg: dict[str, Any], max_position: int) -> dict[str, Any]:
    """The RoPE parameters of an HF config: `rope_type`, `rope_theta` and what the type needs.

    transformers 4.x writes a top-level `rope_theta` and an optional `rope_scaling` table
    (`type` or `rope_type`, plus its parameters); 5.x writes one `rope_parameters` table
    with `rope_theta` and `rope_type` inside. Both are read the way transformers 5 does:
    a 4.x `rope_scaling` wins, then the table's own `rope_theta`, then the top-level one,
    then 10000. A type or parameter `pdd.engines.embedded.rope` cannot compute exactly is refused.
    """
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
        name = f"{where}.partial_rotary_factor" if "partial_rotary_factor" in rope else "partial_rotary_factor"
        raise UnsupportedCheckpoint(name, f"{partial!r}: RoPE on part of each head is not implemented")
    if rope_type not in ROPE_TYPES:
        why = _WHY_NOT.get(rope_type, "unknown to pdd")
        raise UnsupportedCheckpoint(f"{where}.rope_type", f"{rope_type!r}: {why}; supported: {ROPE_TYPES}")
    if rope_type in ("llama3", "yarn"):
        # a top-level value wins, as transformers does for Phi-3-style configs
        original = cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = original or max_position
    missing = [key for key in _ROPE_PARAMETERS.get(rope_type, ()) if rope.get(key) is None]
    if missing:
        raise UnsupportedCheckpoint(f"{where}.{missing[0]}", f"rope_type {rope_type!r} needs it")
    return {key: rope[key] for key in rope if key != "type"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    o_bias: bool = False
    mlp_bias: bool = False
    # normalised RoPE parameters (`read_rope`); left out of the hash, so the config stays hashable
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}, hash=False)

    @property
    def rope_theta(self) -> float:
        return float(self.rope["rope_theta"])

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read `cfg`; UnsupportedCheckpoint names the first field pdd cannot compute."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise UnsupportedCheckpoint("model_type", f"{model_type!r} is not supported; supported: {SUPPORTED_TYPES}")
        _refuse_unsupported(cfg)
        for key in _REQUIRED:
            if not isinstance(cfg.get(key), int):
                raise UnsupportedCheckpoint(key, f"missing or not an integer ({cfg.get(key)!r})")
        given = {**_DEFAULTS[model_type], **cfg}
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        kv_heads = int(given["num_key_value_heads"] or heads)
        head_dim = int(given["head_dim"] or hidden // heads)
        if heads % kv_heads:
            raise UnsupportedCheckpoint("num_key_value_heads", f"{kv_heads} does not divide {heads} attention heads")
        if head_dim % 2 or head_dim < 2:
            raise UnsupportedCheckpoint("head_dim", f"{head_dim}: rotary embeddings need an even head size")
        max_position = int(given["max_position_embeddings"])
        _refuse_sliding_windows(cfg, model_type)
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=max_position,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and never an o bias; its code ignores attention_bias
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=False if model_type == "qwen2" else bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            rope=read_rope(cfg, max_position),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        source = Path(path) / "config.json"
        with open(source, encoding="utf-8") as f:
            raw = json.load(f)
        try:
            return cls.from_hf(raw)
        except UnsupportedCheckpoint as e:  # say which file
            raise UnsupportedCheckpoint(e.field, e.message, str(source)) from None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _refuse_unsupported(cfg: dict[str, Any]) -> None:
    quantization = cfg.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise UnsupportedCheckpoint("quantization_config", f"quantized weights ({method}) are not implemented")
    act = cfg.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise UnsupportedCheckpoint("hidden_act", f"{act!r}: only SiLU (SwiGLU) MLPs are implemented")
    auto_map = cfg.get("auto_map") or {}
    if isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map:
        raise UnsupportedCheckpoint(
            "auto_map",
            f"the checkpoint ships its own modelling code ({auto_map['AutoModelForCausalLM']}), which pdd does not run",
        )


def _refuse_sliding_windows(cfg: dict[str, Any], model_type: str) -> None:
    """Qwen2/Qwen3 layers with sliding-window attention (Llama's code has none): the
    layer types transformers derives, from `layer_types` or the older three fields."""
    if model_type == "llama":
        return
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    layer_types = cfg.get("layer_types")
    where = "layer_types"
    if layer_types is None:
        first = cfg.get("max_window_layers", 28)
        layer_types = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
        where = "use_sliding_window"
    odd = sorted({t for t in layer_types if t != "full_attention"})
    if odd:
        raise UnsupportedCheckpoint(
            where, f"layers of type {odd} (sliding_window={window}) are not implemented; only full attention is"
        )
