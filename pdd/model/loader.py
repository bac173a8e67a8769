"""Load Hugging Face-layout checkpoints (one or many safetensors shards)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from pdd.model.config import ModelConfig
from pdd.model.llama import CausalLM, Rotary


def load_model(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    cfg = ModelConfig.from_dir(path)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    with torch.device("meta"):
        model = CausalLM(cfg)
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:  # the head is the embedding; a stored copy is ignored
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = expected - set(state)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    state = {k: v.to(dtype) for k, v in state.items() if k in expected}
    model.load_state_dict(state, assign=True, strict=False)
    model.rotary = Rotary(cfg)  # its buffer is derived, not stored in checkpoints
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval()
