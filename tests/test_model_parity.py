"""Our Llama/Qwen2/Qwen3 forward equals Hugging Face transformers' on the same weights."""

from __future__ import annotations

import pytest
import torch

from pdd.engine_port import EngineConfig
from pdd.engine.engine import Engine
from pdd.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


def _our_logits(model_dir, prompt: list[int], page_size: int = 16) -> torch.Tensor:
    engine = Engine(model_dir, EngineConfig(page_size=page_size, num_pages=64))
    seq = engine.add_request("x", prompt, SamplingParams(max_tokens=1), hold=True)
    seq.want_logits = True
    engine.step()
    engine.release("x")
    return seq.step_logits


def _hf_logits(model_dir, prompt: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def test_tiny_llama_matches_transformers(tiny_model_dir):
    prompt = list(range(100, 400, 3))
    ours, ref = _our_logits(tiny_model_dir, prompt), _hf_logits(tiny_model_dir, prompt)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


def _small(kind: str, tmp_path):
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.Qwen3Config(**common, head_dim=24, tie_word_embeddings=False)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():  # non-trivial biases and norms, so a missed term shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_layouts_match_transformers(kind, tmp_path):
    model_dir = _small(kind, tmp_path)
    prompt = list(range(5, 290, 7))
    ours, ref = _our_logits(model_dir, prompt, page_size=8), _hf_logits(model_dir, prompt)
    assert (ours - ref).abs().max().item() < 1e-4
