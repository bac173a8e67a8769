"""A deterministic tiny Llama model, made locally, for tests and the one-machine demo.

There are no model hubs here, so `make_tiny` writes a complete Hugging Face-layout
model directory itself: `config.json`, `generation_config.json`, `model.safetensors`
(fp32), a byte-level BPE `tokenizer.json` trained on `pdd.model.corpus`, and a
`tokenizer_config.json` with a ChatML template. The same arguments give byte-identical
files in any process on any machine (given the same torch and tokenizers versions), so
instances that build the model apart still serve one model.

Why the weights are not plain random: serving tests compare greedy tokens across
computation paths that differ in float rounding (batched vs unbatched, 1-token decode vs
N-token extend, chunked prefill, imported KV). A randomly initialised model has flat
logits whose top-1/top-2 gap is exponentially distributed near zero, so such rounding
flips near-ties and the comparison becomes flaky. This model is built so that almost
every decision is clear:

* Layers 0..L-2 are ordinary random layers (soft attention, SwiGLU MLP) whose residual
  branches are scaled by `_BRANCH_SCALE`, so the token embedding still dominates every
  position's residual while the context perturbs it.
* The last layer's attention is sharp (score std `_SHARP_SCORE_STD`, 300), so each head
  attends almost entirely to one earlier position, chosen by the current token, the
  context (through the earlier layers) and the relative position (RoPE). Head 0's output
  projection is `_COPY_GAIN / _BRANCH_SCALE` (32x) larger than the other heads', so after
  the final norm the hidden state is essentially head 0's value vector of the attended
  token: a copy.
* `lm_head` row `j` is the (unit, `_LOGIT_SCALE`-scaled) copy vector of the token `s`
  whose successor is `j`, under a random bijection from tokens to non-special tokens
  (the few special tokens share a successor with a regular token). So the greedy next
  token is "the successor of the token at the position attended by the last layer": a
  clear winner with context-dependent, varied output. Special tokens, EOS included, are
  never a greedy choice, so greedy generations run to their token limit.

Near-ties remain only where the sharp head splits its attention between two positions.
Measured with `transformers.LlamaForCausalLM` in fp32 on the default model, top1 - top2
logit gap over greedy decoding:

* 30 random prompts of 20-300 tokens x 48 steps (1440 decisions): min 3.02, p1 12.1,
  p10 14.8, median 17.2, max 21.3; logits within [-26.9, 38.6]; all 30 continuations
  differ, with 20-44 distinct tokens in 48 (median 37).
* 150 such prompts (7200 decisions): min 0.47, three gaps below 1, p1 11.4, median 17.2.
* 30 ChatML prompts (system + user, corpus text): min 1.66, median 17.2.
* Changing one prompt token in the middle changes the 24-token greedy continuation in
  11 of 20 prompts, so wrong or misplaced KV shows in the tokens.

What a gap must beat is the rounding difference between paths. Full vs two-chunk prefill
over 24,596 decisions (300 prompts) moved top1 - top2 by median 1.9e-6, p99 2.6e-4, max
9.6e-3, the largest moves at split-attention decisions, where a sharper head magnifies
score rounding. So sharpness is a trade: a larger score std makes small gaps rarer (gaps
below 1: 337 at std 10, 25 at 100, 9 at 300; 5004 in a plain random model), while the
share of decisions whose gap is under 1000x their own path difference stays near 0.1% at
every std (24-38 of 24,596, the plain model included). No initialisation rules a flip
out: extrapolated, one lands in about a million decisions (none seen), and as the
computation is deterministic it lands on the same prompt every run. 300 gives the
clearest gaps with scores far from any fp32 limit.

Weights are drawn uniform (scaled to the stated std) from integer samples of
`torch.Generator().manual_seed(seed)`, so the bits do not depend on the CPU.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pdd.model.corpus import corpus

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END, PAD_TOKEN)

# ChatML; with tools, Hermes-style as Qwen2.5's: the tools in a system turn, an assistant's
# calls as <tool_call> blocks, a tool's result as a user turn. Without tools it renders
# what it rendered before it knew of them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions. Their signatures:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each call, write a JSON object with its name and arguments within "
    '<tool_call></tool_call> tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>\\n{\\\"name\\\": ' + (call['function']['name'] | tojson) + ', \\\"arguments\\\": ' "
    "+ (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Initialisation scales; the module docstring explains what each buys.
_BRANCH_SCALE = 0.25
_SOFT_SCORE_STD = 2.0
_SHARP_SCORE_STD = 300.0
_COPY_GAIN = 8.0
_LOGIT_SCALE = 40.0
_READOUT_GRID = float(1 << 12)

_MIN_VOCAB = 512


def make_tiny(
    out_dir: str | Path,
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 768,
    vocab_size: int = 4096,
    max_position: int = 4096,
    seed: int = 0,
) -> Path:
    """Write the tiny model into `out_dir` (created if missing) and return its path.

    Everything is a pure function of the arguments, so callers can rebuild the model
    anywhere instead of shipping it.
    """
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must be divisible by heads, and heads by kv_heads")
    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size must be at least {_MIN_VOCAB}")
    if layers < 1:
        raise ValueError("layers must be at least 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"pdd: building tiny model in {out}", file=sys.stderr)

    tokenizer = _train_tokenizer(vocab_size)
    special_ids = [_token_id(tokenizer, t) for t in SPECIAL_TOKENS]
    bos_id, eos_id, _, im_end_id, pad_id = special_ids
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_position,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
    }
    generation_config = {
        "bos_token_id": bos_id,
        "eos_token_id": [eos_id, im_end_id],
        "pad_token_id": pad_id,
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "model_max_length": max_position,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    weights = _init_weights(config, special_ids, torch.Generator().manual_seed(seed))

    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config)
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    tokenizer.save(str(out / "tokenizer.json"))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def parameter_count(model_dir: str | Path) -> int:
    """Number of weights in a model directory, read from the safetensors header only."""
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE: Llama 3 / GPT-2 style, so any text round-trips.

    BPE training is deterministic whatever the thread count (counts are sums, merge ties
    are broken by the pair itself); the tests check it across processes and threads.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the training corpus only supports {tokenizer.get_vocab_size()} tokens, not the {vocab_size} asked for"
        )
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of a special token the trainer was given (so it is in the vocabulary)."""
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{token!r} is not in the trained vocabulary")
    return token_id


def _init_weights(config: dict[str, Any], special_ids: list[int], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Draw the weights in a fixed order from `gen`; see the module docstring for why.

    Every op here is correctly rounded IEEE arithmetic (math.sqrt, not pow) on exact
    inputs, so the bits do not depend on the CPU or its libm; `_copy_readout` handles the one
    place that needs reductions.
    """
    d = config["hidden_size"]
    n_layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    head_dim = config["head_dim"]
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]

    def uniform(*shape: int, std: float) -> torch.Tensor:
        # 24-bit integers are exact in float32 and integer sampling is the same on every
        # CPU; torch.randn is not (its vectorised Box-Muller differs by instruction set).
        bits = torch.randint(0, 1 << 24, shape, generator=gen, dtype=torch.int32)
        return (bits.to(torch.float32) / float(1 << 23) - 1.0) * (std * math.sqrt(3))

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": uniform(vocab, d, std=1.0)}
    for i in range(n_layers):
        last = i == n_layers - 1
        # An entry std of sqrt(S / d) gives attention scores q.k/sqrt(head_dim) of std S
        # for unit-RMS inputs.
        qk_std = math.sqrt((_SHARP_SCORE_STD if last else _SOFT_SCORE_STD) / d)
        o_proj = uniform(d, heads * head_dim, std=_BRANCH_SCALE / math.sqrt(heads * head_dim))
        if last:
            o_proj[:, :head_dim] *= _COPY_GAIN / _BRANCH_SCALE
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = uniform(heads * head_dim, d, std=qk_std)
        w[p + "self_attn.k_proj.weight"] = uniform(kv_heads * head_dim, d, std=qk_std)
        w[p + "self_attn.v_proj.weight"] = uniform(kv_heads * head_dim, d, std=1 / math.sqrt(d))
        w[p + "self_attn.o_proj.weight"] = o_proj
        w[p + "mlp.gate_proj.weight"] = uniform(inter, d, std=1 / math.sqrt(d))
        w[p + "mlp.up_proj.weight"] = uniform(inter, d, std=1 / math.sqrt(d))
        w[p + "mlp.down_proj.weight"] = uniform(d, inter, std=_BRANCH_SCALE / math.sqrt(inter))
        w[p + "input_layernorm.weight"] = torch.ones(d)
        w[p + "post_attention_layernorm.weight"] = torch.ones(d)
    w["model.norm.weight"] = torch.ones(d)
    w["lm_head.weight"] = _copy_readout(w, n_layers - 1, head_dim, special_ids, gen)
    return w


def _copy_readout(
    w: dict[str, torch.Tensor],
    last: int,
    head_dim: int,
    special_ids: list[int],
    gen: torch.Generator,
) -> torch.Tensor:
    """lm_head whose row j reads the copy of the token whose successor is j.

    This needs matmuls and norms, whose float rounding depends on how a CPU vectorises
    them; computing in float64 and snapping to a 2**-12 grid (far below anything the
    logits notice) makes the stored float32 bits the same on every machine.
    """
    emb = w["model.embed_tokens.weight"].double()
    vocab, d = emb.shape
    normed = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
    v0 = w[f"model.layers.{last}.self_attn.v_proj.weight"][:head_dim].double()
    o0 = w[f"model.layers.{last}.self_attn.o_proj.weight"][:, :head_dim].double()
    copies = normed @ v0.T @ o0.T
    copies = copies / copies.norm(dim=-1, keepdim=True)

    is_special = torch.zeros(vocab, dtype=torch.bool)
    is_special[special_ids] = True
    regular = torch.nonzero(~is_special).flatten()
    successor = torch.empty(vocab, dtype=torch.long)
    successor[regular] = regular[torch.randperm(len(regular), generator=gen)]
    extra = torch.randperm(len(regular), generator=gen)[: len(special_ids)]
    successor[special_ids] = regular[extra]

    rows = torch.zeros(vocab, d, dtype=torch.float64).index_add_(0, successor, copies)
    rows[regular] = rows[regular] / rows[regular].norm(dim=-1, keepdim=True)
    rows = rows * (_LOGIT_SCALE / math.sqrt(d))
    return (torch.round(rows * _READOUT_GRID) / _READOUT_GRID).to(torch.float32)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
