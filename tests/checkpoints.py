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
    """transformers' greedy continuation (its own KV cache, no EOS stopping), the prompt's
    logits, and the smallest top1 - top2 logit gap it decided on."""
    ids, gaps = [], []
    threads = torch.get_num_threads()
    # one thread: these models are too small to split, and on a shared machine waiting for
    # busy cores made each decode step ten times slower
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            cache = transformers.DynamicCache(config=model.config)
            out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
            prompt_logits = out.logits[0]
            for _ in range(steps):
                top = torch.topk(out.logits[0, -1], 2)
                gaps.append(float(top.values[0] - top.values[1]))
                ids.append(int(top.indices[0]))
                out = model(torch.tensor([ids[-1:]]), past_key_values=cache, use_cache=True)
    finally:
        torch.set_num_threads(threads)
    return ids, prompt_logits, min(gaps)


def put_in_hub_cache(model_dir: Path, hub_cache: Path, repo_id: str, revision: str = "0" * 40) -> Path:
    """Lay `model_dir` out as `huggingface_hub` caches a download (no network involved):
    `models--ORG--NAME/blobs/<sha256>`, `snapshots/<revision>/<file>` linking to its blob,
    and `refs/main` naming the revision. Returns the snapshot directory."""
    import hashlib
    import os

    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in model_dir.iterdir() if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)  # no newline: the hub writes none, and reads it verbatim
    return snapshot


def save_decisive_llama(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A small Llama-architecture chat model written by transformers in its 5.x layout
    (3 layers, hidden 192, 6 query / 2 KV heads of head_dim 64, tied embeddings, RoPE
    base 100000 in `rope_parameters`, a 2,048-token context), with the tokenizer of
    `tokenizer_dir` re-saved by transformers (tokenizer.json, tokenizer_config.json,
    chat_template.jinja).

    Its weights make greedy choices decisive, as `pdd.model.tiny` does, with the head
    tied to the embedding: each embedding is [a_j | b_j | r_j] (64 dims each), a_j a
    random code, b_j the sum of the codes of the tokens whose successor j is (a random
    map onto regular tokens, so special tokens have b = 0 and are never chosen), r_j
    noise. Two soft random layers perturb the residual by the context; in the last,
    sharp attention picks one earlier position s and head 0 copies a_s into the b block
    8x over; the final norm keeps only the b block, so logit j ~ <b_j, a_s>: the
    successor of the attended token wins by about half the top logit.
    """
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab, d, k, heads, kv_heads, hd, inter, layers = len(tokenizer), 192, 64, 6, 2, 64, 384, 3
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=d, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    special = torch.tensor(tokenizer.all_special_ids)
    regular = torch.tensor([t for t in range(vocab) if t not in set(special.tolist())])
    successor = torch.empty(vocab, dtype=torch.long)
    successor[regular] = regular[torch.randperm(len(regular), generator=gen)]
    successor[special] = regular[torch.randint(len(regular), (len(special),), generator=gen)]
    codes = randn(vocab, k, std=1.0)
    b = torch.zeros(vocab, k).index_add_(0, successor, codes)
    b = b / b.norm(dim=-1, keepdim=True).clamp_min(1e-6) * math.sqrt(k)  # unit RMS; 0 for special tokens
    w = {"model.embed_tokens.weight": torch.cat([codes, b, randn(vocab, d - 2 * k, std=1.0)], dim=1)}
    branch = 0.25
    for i in range(layers):
        last = i == layers - 1
        qk_std = math.sqrt((300.0 if last else 2.0) / d)  # attention scores of std 300 (sharp) or 2 (soft)
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = randn(heads * hd, d, std=qk_std)
        w[p + "self_attn.k_proj.weight"] = randn(kv_heads * hd, d, std=qk_std)
        v = randn(kv_heads * hd, d, std=1 / math.sqrt(d))
        o = randn(d, heads * hd, std=branch / math.sqrt(heads * hd))
        if last:  # KV head 0 carries the code block; query head 0 writes it into the b block, 8x
            v[:hd] = 0
            v[:hd, :k] = torch.eye(k)
            o[:, :hd] = 0
            o[k:2 * k, :hd] = 8.0 * torch.eye(k)
        w[p + "self_attn.v_proj.weight"], w[p + "self_attn.o_proj.weight"] = v, o
        w[p + "mlp.gate_proj.weight"] = randn(inter, d, std=1 / math.sqrt(d))
        w[p + "mlp.up_proj.weight"] = randn(inter, d, std=1 / math.sqrt(d))
        w[p + "mlp.down_proj.weight"] = randn(d, inter, std=branch / math.sqrt(inter))
        w[p + "input_layernorm.weight"] = torch.ones(d)
        w[p + "post_attention_layernorm.weight"] = torch.ones(d)
    norm = torch.zeros(d)
    norm[k:2 * k] = 0.35  # logits of about [-20, 40]
    w["model.norm.weight"] = norm
    model = transformers.LlamaForCausalLM(cfg)
    model.load_state_dict(w, strict=False)
    missing = set(model.state_dict()) - set(w) - {"lm_head.weight"}
    assert not missing, missing
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_moe_of(tiny_dir: Path, out: Path, experts: int = 4, per_token: int = 2, seed: int = 0) -> Path:
    """A Mixtral (MoE) checkpoint written by transformers, made of the tiny model: its
    attention, norms, embeddings and head as they are; each layer's MLP copied into
    `experts` experts, each perturbed by 2 % noise of its own, behind a random router that
    picks `per_token` of them a token. The routing and the fused expert kernels run for
    real (a different pick gives different numbers), yet greedy choices stay as decisive
    as the tiny model's, so two engines agree token for token. The tokenizer and
    generation config are the tiny model's."""
    import shutil

    from safetensors.torch import load_file

    tiny = json.loads((tiny_dir / "config.json").read_text())
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id")
    cfg = transformers.MixtralConfig(**{k: tiny[k] for k in keep}, num_local_experts=experts,
                                     num_experts_per_tok=per_token, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": tiny["rope_theta"]})
    model = transformers.MixtralForCausalLM(cfg)
    weights = load_file(str(tiny_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)

    def noisy(t: torch.Tensor) -> torch.Tensor:
        return t * (1 + 0.02 * torch.randn(t.shape, generator=gen))

    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.gate.weight" in name:
                p.normal_(std=1 / math.sqrt(p.shape[1]), generator=gen)
            elif ".mlp.experts." in name:
                mlp = name.split(".experts.")[0]
                if name.endswith("gate_up_proj"):
                    dense = torch.cat([weights[f"{mlp}.gate_proj.weight"], weights[f"{mlp}.up_proj.weight"]])
                else:
                    dense = weights[f"{mlp}.down_proj.weight"]
                p.copy_(torch.stack([noisy(dense) for _ in range(experts)]))
            else:
                p.copy_(weights[name])
    model.save_pretrained(out)
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_dir / side, out / side)
    return out


def save_random_mla(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A DeepSeek-V2-style checkpoint (multi-head latent attention and routed experts)
    written by transformers: 2 layers, the first dense, then 4 experts (2 a token) and a
    shared one; a 512-wide KV latent with a 64-wide rope key, the one latent width vLLM's
    CPU MLA decodes. Random weights, the tokenizer of `tokenizer_dir`."""
    import shutil

    cfg = transformers.DeepseekV2Config(
        vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=64,
        qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    transformers.DeepseekV2ForCausalLM(cfg).save_pretrained(out)
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / side, out / side)
    return out
