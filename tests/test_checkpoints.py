"""Checkpoints as transformers 4.x and 5.x write them: pdd computes what transformers
computes for the same file (logits and greedy tokens), or refuses the field by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import edit_config, hf_greedy, hf_model, rewrite_as_4x, save_random

from pdd.engines.embedded.engine import Engine
from pdd.engines.embedded.loader import load_model
from pdd.engines.port import EngineConfig
from pdd.model.config import ModelConfig, UnsupportedCheckpoint
from pdd.sampling.params import SamplingParams

PROMPT = [(7 * i + 3) % 290 + 5 for i in range(150)]  # past every original_max_position below
STEPS = 12
DEFAULT = {"rope_type": "default", "rope_theta": 100000.0}  # not the 10000 a missed key falls back to

CASES = {
    "llama-gqa-tied": ("llama", DEFAULT, {"tie_word_embeddings": True}),
    "llama-biases-head-dim": ("llama", DEFAULT, {"attention_bias": True, "mlp_bias": True, "head_dim": 24}),
    "llama-linear": ("llama", {"rope_type": "linear", "rope_theta": 50000.0, "factor": 4.0}, {}),
    "llama-llama3": ("llama", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, {}),
    "qwen2-tied": ("qwen2", {**DEFAULT, "rope_theta": 1000000.0}, {"tie_word_embeddings": True}),
    "qwen2-yarn": ("qwen2", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64}, {}),
    "qwen3-head-dim": ("qwen3", DEFAULT, {"head_dim": 24}),
    "qwen3-bias": ("qwen3", {"rope_type": "yarn", "rope_theta": 20000.0, "factor": 2.0, "beta_fast": 16,
                             "original_max_position_embeddings": 100}, {"attention_bias": True, "head_dim": 16}),
}


def test_tiny_model_matches_transformers(tiny_model_dir: Path) -> None:
    ref_tokens, ref_logits, _ = hf_greedy(hf_model(tiny_model_dir), PROMPT, STEPS)
    tokens, logits = _ours(tiny_model_dir)
    assert (logits - ref_logits).abs().max().item() < 1e-4 and tokens == ref_tokens


def _ours(model_dir: Path) -> tuple[list[int], torch.Tensor]:
    """pdd's greedy continuation (paged KV, one decode step per token) and prompt logits."""
    engine = Engine(model_dir, EngineConfig(page_size=8, num_pages=64))
    seq = engine.add_request("x", PROMPT, SamplingParams(max_tokens=1), hold=True)
    seq.want_logits = True
    engine.step()
    engine.release("x")
    (tokens,) = engine.generate([PROMPT], SamplingParams(max_tokens=STEPS, ignore_eos=True))
    return tokens, seq.step_logits


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_matches_transformers(case: str, tmp_path: Path) -> None:
    """The file as 5.x saves it, then rewritten the 4.x way: transformers reads both as one
    model, and pdd's logits over the whole prompt and its greedy tokens equal transformers'."""
    model_type, rope, extra = CASES[case]
    model_dir = save_random(tmp_path, model_type, rope, **extra)
    written = json.loads((model_dir / "config.json").read_text())
    assert "rope_parameters" in written and "rope_theta" not in written  # what 5.x writes
    ref_tokens, ref_logits, min_gap = hf_greedy(hf_model(model_dir), PROMPT, STEPS)
    for style in ("5.x", "4.x"):
        if style == "4.x":
            rewrite_as_4x(model_dir)
            with torch.no_grad():
                assert torch.equal(hf_model(model_dir)(torch.tensor([PROMPT])).logits[0], ref_logits)
        tokens, logits = _ours(model_dir)
        err = (logits - ref_logits).abs().max().item()
        print(f"\n{case} {style}: max |logit diff| {err:.2e} over {tuple(logits.shape)}, "
              f"smallest greedy top1-top2 gap {min_gap:.2e}")
        assert err < 1e-4
        assert tokens == ref_tokens


def test_the_rope_base_is_read_from_both_places(tmp_path: Path) -> None:
    new = save_random(tmp_path / "new", "llama", DEFAULT)
    old = rewrite_as_4x(save_random(tmp_path / "old", "llama", DEFAULT))
    assert ModelConfig.from_dir(new).rope == ModelConfig.from_dir(old).rope == DEFAULT
    # a 4.x rope_scaling takes its base from the top level, as transformers does
    rewrite = json.loads((old / "config.json").read_text())
    rewrite["rope_scaling"] = {"type": "linear", "factor": 2.0}
    assert ModelConfig.from_hf(rewrite).rope == {"rope_type": "linear", "rope_theta": 100000.0, "factor": 2.0}


def _base(model_type: str = "qwen2") -> dict:
    return {"model_type": model_type, "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


REFUSED = {
    "model_type": ({"model_type": "mistral"}, "model_type"),
    "no model_type": ({"model_type": None}, "model_type"),
    "missing size": ({"hidden_size": None}, "hidden_size"),
    "sliding (4.x fields)": ({"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 2},
                             "use_sliding_window"),
    "sliding (layer_types)": ({"layer_types": ["full_attention"] * 3 + ["sliding_attention"]}, "layer_types"),
    "other attention kind": ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
    "rope type (5.x)": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
                        "rope_parameters.rope_type"),
    "rope type (4.x)": ({"rope_theta": 1e4, "rope_parameters": None, "rope_scaling": {"type": "longrope"}},
                        "rope_scaling.rope_type"),
    "unknown rope type": ({"rope_parameters": {"rope_type": "spiral", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    "llama3 without its factors": ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
                                   "rope_parameters.low_freq_factor"),
    "rope per layer type": ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "rope_parameters"),
    "partial rotary": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "quantized": ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    "activation": ({"hidden_act": "gelu"}, "hidden_act"),
    "odd head_dim": ({"head_dim": 15}, "head_dim"),
    "kv heads": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "remote code": ({"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}, "auto_map"),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_a_field_that_changes_the_math_is_refused_by_name(what: str) -> None:
    changes, field = REFUSED[what]
    cfg = {k: v for k, v in {**_base(), **changes}.items() if v is not None}
    with pytest.raises(UnsupportedCheckpoint) as err:
        ModelConfig.from_hf(cfg)
    assert err.value.field == field and f"`{field}`" in str(err.value)


def test_fields_that_do_not_apply_are_not_refused() -> None:
    # a window that is off, and sliding_window on Llama, whose code has none (as transformers)
    assert ModelConfig.from_hf({**_base(), "use_sliding_window": False, "sliding_window": 128}).num_layers == 4
    assert ModelConfig.from_hf({**_base("llama"), "sliding_window": 128}).rope["rope_theta"] == 10000.0
    # Qwen2's code always has q/k/v biases, whatever attention_bias says
    assert ModelConfig.from_hf({**_base(), "attention_bias": False}).qkv_bias


def test_defaults_are_those_of_transformers_for_the_model_type() -> None:
    bare = {k: v for k, v in _base("qwen3").items() if k not in ("num_key_value_heads", "rope_parameters")}
    bare["num_attention_heads"] = 32
    cfg = ModelConfig.from_hf(bare)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.max_position, cfg.rope_theta) == (128, 32, 32768, 10000.0)
    cfg = ModelConfig.from_hf({**bare, "model_type": "llama"})
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.max_position) == (2, 32, 2048)


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path: Path) -> None:
    model_dir = save_random(tmp_path, "llama", DEFAULT, attention_bias=True)
    edit_config(model_dir, attention_bias=False)  # the stored biases would be dropped
    with pytest.raises(ValueError, match=r"o_proj\.bias"):
        load_model(model_dir)
    edit_config(model_dir, attention_bias=True, head_dim=8)
    with pytest.raises(ValueError, match=r"q_proj\.weight has shape \(64, 64\).*head_dim.*\(32, 64\)"):
        load_model(model_dir)
    assert load_model(edit_config(model_dir, head_dim=None)).cfg.head_dim == 16
    tied = save_random(tmp_path / "tied", "llama", DEFAULT, tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"lm_head\.weight.*tie_word_embeddings is false"):
        load_model(edit_config(tied, tie_word_embeddings=False))


def test_loading_a_model_does_not_import_torchs_compiler(tiny_model_dir: Path) -> None:
    """The loader builds the model on the meta device, where a random init or arithmetic runs
    through `torch._refs` and imports `torch._dynamo`: seconds of CPU at every instance's start."""
    code = (f"import sys; from pdd.engines.embedded.loader import load_model; load_model({str(tiny_model_dir)!r}); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-1] == "False", out.stdout
