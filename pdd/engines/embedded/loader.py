"""Load Hugging Face-layout checkpoints (one or many safetensors shards).

Every stored tensor must be one the model uses, with the shape config.json implies:
a tensor left over (a bias the config does not declare, an extra layer) or a shape that
differs (a head_dim read wrong) means pdd would compute another model than the one
saved, so it is refused by name instead of dropped.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from pdd.engines.embedded.llama import CausalLM
from pdd.errors import ModelNotFound
from pdd.model.config import ModelConfig

# derived buffers some exporters store; the model recomputes them from config.json
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
    """The checkpoint in `path`, on `device`, in `dtype`; ValueError names what does not fit."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"{path} has no config.json: not a Hugging Face model directory")
    cfg = ModelConfig.from_dir(path)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    with torch.device("meta"):
        model = CausalLM(cfg)
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if cfg.tie_word_embeddings:  # the head is the embedding; a stored copy is ignored, as transformers does
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight")
    state = {k: v for k, v in state.items() if not k.endswith(_DERIVED_SUFFIXES)}
    _check_tensors(path, state, expected)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True, strict=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval()


def _check_tensors(path: Path, state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    missing = sorted(set(expected) - set(state))
    if missing:
        hint = " (tie_word_embeddings is false: the head is not the embedding)" if missing == ["lm_head.weight"] else ""
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}{hint}")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise ValueError(
            f"{path}: the checkpoint has {len(extra)} tensors config.json does not account for "
            f"(biases? more layers?), e.g. {extra[:3]}; pdd would compute without them"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(
                f"{path}: {name} has shape {tuple(state[name].shape)} but config.json (hidden_size, "
                f"num_attention_heads, num_key_value_heads, head_dim, ...) implies {shape}"
            )
