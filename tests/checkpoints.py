"""Checkpoints written by transformers itself, in its 5.x layout or rewritten the 4.x way,
and transformers' own greedy decoding of them: the references the model tests compare with."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import transformers

CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def save_random(out: Path, model_type: str, rope: dict[str, Any], seed: int = 0, **config: Any) -> Path:
    """A random-weight model saved by `save_pretrained` (the 5.x layout: `rope_parameters`).

    Weights are drawn at fan-in scale, with q and k larger, so attention is sharp and
    position-dependent: a RoPE frequency read wrong moves the logits far past the
    tolerance (transformers' own 0.02 init leaves attention almost uniform). Biases and
    norm weights are non-trivial, so a term left out shows.
    """
    config_cls, model_cls = CLASSES[model_type]
    cfg = config_cls(**{**SMALL, **config}, rope_parameters=dict(rope))
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_()
            else:
                gain = 2.0 if ("q_proj" in name or "k_proj" in name) else 1.0
                p.normal_(std=gain / math.sqrt(p.shape[1]))
    model.save_pretrained(out)
    return out


def rewrite_as_4x(model_dir: Path) -> Path:
    """config.json as transformers 4.x wrote it: a top-level `rope_theta`, `rope_scaling`
    (null for plain RoPE; `type` in older files, `rope_type` in later ones), no
    `layer_types`, `torch_dtype`."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {("type" if kind == "linear" else "rope_type"): kind, **rope}
    cfg.pop("layer_types", None)
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    cfg["transformers_version"] = "4.46.3"
    path.write_text(json.dumps(cfg, indent=2))
    return model_dir


def edit_config(model_dir: Path, **changes: Any) -> Path:
    """Set (or, with None, remove) config.json keys."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg, indent=2))
    return model_dir


def hf_model(model_dir: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor, float]:
    """transformers' greedy continuation (a full forward per token: no cache in the way,
    no EOS stopping), the prompt's logits, and the smallest top1 - top2 gap it decided on."""
    ids = list(prompt)
    gaps = []
    with torch.no_grad():
        prompt_logits = model(torch.tensor([ids])).logits[0]
        for step in range(steps):
            last = prompt_logits[-1] if step == 0 else model(torch.tensor([ids])).logits[0, -1]
            top = torch.topk(last, 2).values
            gaps.append(float(top[0] - top[1]))
            ids.append(int(last.argmax()))
    return ids[len(prompt):], prompt_logits, min(gaps)
