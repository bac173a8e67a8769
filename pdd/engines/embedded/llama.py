"""A Llama-family decoder (Llama, Qwen2, Qwen3) that knows nothing about KV storage.

The model computes projections over a flat list of new tokens and hands q/k/v to an
`Attention` object per layer. The engine's paged KV pool lives behind that interface,
so prefill, extend and decode are one forward path with different token counts —
which keeps their numerics as alike as possible (the greedy oracle depends on it).
Module names match Hugging Face's so checkpoints load without renaming.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from pdd.engines.embedded.rope import inv_freq_and_scale
from pdd.model.config import ModelConfig


class Attention(Protocol):
    """Stores this step's k/v and returns attention output for the flat new tokens."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    inv_freq: torch.Tensor  # a buffer: registered below, typed here (nn.Module's attributes are untyped)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # on the CPU whatever device is current: on the loader's meta device this arithmetic
        # would import torch's compiler (seconds of every process's start); the buffer moves with the model
        with torch.device("cpu"):
            inv_freq, self.scale = inv_freq_and_scale(cfg.rope, cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # scaled always, as the reference does (YaRN's attention factor; 1.0 is exact)
        return (emb.cos() * self.scale)[:, None, :], (emb.sin() * self.scale)[:, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, attn: Attention
    ) -> torch.Tensor:
        t, hd = x.shape[0], self.cfg.head_dim
        q = self.q_proj(x).view(t, self.cfg.num_heads, hd)
        k = self.k_proj(x).view(t, self.cfg.num_kv_heads, hd)
        v = self.v_proj(x).view(t, self.cfg.num_kv_heads, hd)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.o_proj(attn(layer, q, k, v).reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # given its weight, the embedding skips its random init: the checkpoint's replaces it, and a
        # normal_ on the loader's meta device imports torch's compiler (seconds of every process's start)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.rotary = Rotary(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        """Hidden states (after the final norm) of the flat new tokens."""
        cos, sin = self.rotary.cos_sin(positions)
        h = self.model.embed_tokens(input_ids)
        # nn.ModuleList yields plain Modules to the checker; these are the DecoderLayers built above
        for i, layer in enumerate(cast(list[DecoderLayer], self.model.layers)):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, i, attn)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(h)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
