"""A model's shape from its Hugging Face `config.json`: what `pdd plan --plan-file`
prices when the buyer names their own model rather than the catalog's.

Attention is MLA where the config has a `kv_lora_rank` (DeepSeek-V2/V3, Kimi K2: one
latent of `kv_lora_rank + qk_rope_head_dim` values a token and layer) and grouped-query
otherwise (`num_key_value_heads` heads of `head_dim`, a key and a value each). Experts
are read from `n_routed_experts` / `num_experts` / `num_local_experts` and
`num_experts_per_tok`; the dense FFN layers before the first MoE one from
`first_k_dense_replace`. Bytes a weight: the checkpoint's `torch_dtype`, or FP8 where its
`quantization_config` says so; KV in BF16 unless told otherwise. Every figure is
computed from the config, none fixed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdd.perf.model import BF16, FP8, INT4_GROUP32, ModelShape

DTYPE_BYTES = {"bf16": BF16, "bfloat16": BF16, "fp16": BF16, "float16": BF16, "fp8": FP8, "int4": INT4_GROUP32}


class ModelConfigError(ValueError):
    """A config.json pdd cannot price: the message names the key."""


def _int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise ModelConfigError(f"config.json: {key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelConfigError(f"config.json: {key} must be a whole number >= 0, got {value!r}")
    return value


def dtype_bytes(name: str, key: str) -> float:
    try:
        return DTYPE_BYTES[name.lower()]
    except (KeyError, AttributeError):
        raise ModelConfigError(f"{key}: expected one of {', '.join(DTYPE_BYTES)}, got {name!r}") from None


def _weights_bytes(config: dict[str, Any]) -> float:
    quant = config.get("quantization_config") or {}
    if str(quant.get("quant_method", "")).lower() == "fp8":
        return FP8
    return dtype_bytes(str(config.get("torch_dtype", "bfloat16")), "config.json: torch_dtype")


def _attention(config: dict[str, Any], hidden: int, heads: int) -> tuple[float, int, float, float]:
    """One layer's attention parameters, KV values a token and layer, and the FLOPs of one
    (query, context) pair a layer in prefill's form and in decode's (MLA absorbed)."""
    if config.get("kv_lora_rank"):
        kv_rank, rope = _int(config, "kv_lora_rank"), _int(config, "qk_rope_head_dim")
        nope, v = _int(config, "qk_nope_head_dim"), _int(config, "v_head_dim")
        q_rank = config.get("q_lora_rank")
        query = hidden * heads * (nope + rope) if not q_rank else hidden * q_rank + q_rank * heads * (nope + rope)
        params = query + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * hidden
        return params, kv_rank + rope, 2.0 * heads * (nope + rope + v), 2.0 * heads * (kv_rank + rope + kv_rank)
    head_dim = _int(config, "head_dim", hidden // heads if heads else None)
    kv_heads = _int(config, "num_key_value_heads", heads)
    params = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    return params, 2 * kv_heads * head_dim, 4.0 * heads * head_dim, 4.0 * heads * head_dim


def shape_from_config(
    config: dict[str, Any],
    name: str,
    expert_bytes: float | None = None,
    dense_bytes: float | None = None,
    kv_bytes: float = BF16,
) -> ModelShape:
    """`config` (a parsed config.json) as the step model prices it; the byte widths
    override the checkpoint's (`expert_bytes`: its routed experts', `dense_bytes`: the rest)."""
    hidden, layers = _int(config, "hidden_size"), _int(config, "num_hidden_layers")
    heads, vocab = _int(config, "num_attention_heads"), _int(config, "vocab_size")
    if min(hidden, layers, heads, vocab) == 0:
        raise ModelConfigError(
            "config.json: hidden_size, num_hidden_layers, num_attention_heads, vocab_size must be > 0"
        )
    attention, kv_values, prefill_pair, decode_pair = _attention(config, hidden, heads)
    experts = next((config[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if config.get(k)), 0)
    top_k = _int(config, "num_experts_per_tok", 0) if experts else 0
    if experts and not 0 < top_k <= experts:
        raise ModelConfigError(f"config.json: num_experts_per_tok must lie in 1..{experts}, got {top_k}")
    dense_ffn = 3 * hidden * _int(config, "intermediate_size")
    if experts:
        expert = 3 * hidden * _int(config, "moe_intermediate_size")
        dense_layers = min(layers, _int(config, "first_k_dense_replace", 0))
        shared = _int(config, "n_shared_experts", 0) * expert
    else:
        expert, dense_layers, shared = 0, layers, 0
    moe_layers = layers - dense_layers
    head = 0 if config.get("tie_word_embeddings") else vocab * hidden
    dense = layers * attention + moe_layers * shared + dense_layers * dense_ffn + head
    weights = _weights_bytes(config)
    expert_bytes = weights if expert_bytes is None else expert_bytes
    kind = "MLA" if config.get("kv_lora_rank") else "GQA"
    return ModelShape(
        name,
        layers=layers,
        moe_layers=moe_layers,
        experts=int(experts),
        top_k=top_k,
        expert_params=expert,
        dense_params=dense,
        embedding_params=vocab * hidden,
        hidden=hidden,
        expert_bytes_per_param=expert_bytes,
        dense_bytes_per_param=weights if dense_bytes is None else dense_bytes,
        expert_fp8=expert_bytes <= FP8,
        prefill_flops_per_pair=layers * prefill_pair,
        decode_flops_per_pair=layers * decode_pair,
        kv_bytes_per_token=layers * kv_values * kv_bytes,
        max_context=_int(config, "max_position_embeddings", 131072),
        kv_heads=1 if kind == "MLA" else _int(config, "num_key_value_heads", heads),
        note=f"{kind}, {experts} experts top {top_k}" if experts else f"{kind}, dense",
    )


def read_parsed(path: Path, parse: Callable[[str], Any], kind: str, error: type[ValueError]) -> Any:
    """`path`'s text as `parse` reads it, or `error` in one line naming the file."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise error(f"{path}: {exc.strerror}") from None
    except ValueError as exc:  # (JSON's and TOML's decode errors are ValueErrors)
        raise error(f"{path}: not {kind} ({exc})") from None


def load_model(path: Path, name: str | None = None, **widths: Any) -> ModelShape:
    """The shape of the config.json at `path` (its directory's name, unless `name`)."""
    config = read_parsed(path, json.loads, "JSON", ModelConfigError)
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    shape = shape_from_config(config, name or path.parent.name or path.stem, **widths)
    note = f"{shape.note}, {shape.total_params / 1e9:.0f}B, KV {shape.kv_bytes_per_token / 1e3:.0f} KB/token"
    return replace(shape, note=note)
