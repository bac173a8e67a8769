"""The tiny model with the marker tokens vLLM's parsers look up in the vocabulary (Llama 3's
`<|python_tag|>`, DeepSeek-R1's and Qwen's `<think>`/`</think>`, Hermes's `<tool_call>`),
which the tiny model's byte-level vocabulary spells out of pieces: each added to the BPE
vocabulary as a token of its own (no merge makes it, so a prompt never holds one; the
model may write it, and it decodes as its text, which is what the grammar reads), with
embedding and output rows drawn like the others'. Its chat template is the tiny model's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MARKERS = ("<|python_tag|>", "<think>", "</think>", "<tool_call>", "</tool_call>")


def marker_model(tiny: Path, into: Path) -> Path:
    """A copy of the tiny model at `into` with `MARKERS` in its vocabulary (made once)."""
    if (into / "model.safetensors").exists():
        return into
    shutil.copytree(tiny, into, dirs_exist_ok=True)
    tok = json.loads((tiny / "tokenizer.json").read_text())
    config = json.loads((tiny / "config.json").read_text())
    first = config["vocab_size"]
    for i, text in enumerate(MARKERS):  # (printable ASCII: its byte-level form is itself)
        tok["model"]["vocab"][text] = first + i
    config["vocab_size"] = first + len(MARKERS)
    weights = load_file(str(tiny / "model.safetensors"))
    generator = torch.Generator().manual_seed(43)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        old = weights[key]
        rows = torch.randn(len(MARKERS), old.shape[1], generator=generator, dtype=old.dtype) * old.std()
        weights[key] = torch.cat([old, rows]).contiguous()
    (into / "tokenizer.json").write_text(json.dumps(tok))
    (into / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(into / "model.safetensors"))
    return into
