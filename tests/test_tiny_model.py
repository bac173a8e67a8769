"""The tiny model, its tokenizer and `pdd model init`: what the rest of pdd builds on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import torch
from safetensors import safe_open

from pdd.cli import main
from pdd.model.tiny import make_tiny, parameter_count
from pdd.model.tokenizer import IncrementalDetokenizer, Tokenizer

MIXED_TEXT = (
    "Plain ASCII, numbers 12345 and code: x = f(y) + 1;\n"
    "\tTabs, déjà vu, Grüße, naïve café. Привет мир! Γειά σου.\n"
    "日本語のテキスト, 中文 你好, 한국어, مرحبا, שלום, नमस्ते.\n"
    "Emoji 😀🚀, ZWJ 👩‍💻, flag 🇯🇵, skin tone 👍🏽, symbols ½ π ∑ → ∞ €.  "
)

LLAMA2_STYLE_TEMPLATE = """{% if messages[0]['role'] == 'system' %}
    {% set loop_messages = messages[1:] %}
    {% set system_message = messages[0]['content'] %}
{% else %}
    {% set loop_messages = messages %}
    {% set system_message = false %}
{% endif %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if loop.index0 == 0 and system_message != false %}
        {% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}
    {% else %}
        {% set content = message['content'] %}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}
    {% elif message['role'] == 'assistant' %}
        {{ ' ' + content.strip() + ' ' + eos_token }}
    {% endif %}
{% endfor %}"""

QWEN_STYLE_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {%- continue %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content }}
    {%- if message.role == 'user' %}
        {{- '\\n' + {'chars': message.content | length} | tojson }}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Héllo 🤖, what is 日本?"},
    {"role": "assistant", "content": "  A country.  "},
    {"role": "user", "content": "Thanks!"},
]


def test_two_processes_write_byte_identical_models(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Instances on different hosts rebuild the model instead of copying it."""
    # Another thread count and torch's generic (non-AVX) CPU kernels stand in for
    # another machine.
    env = dict(os.environ, RAYON_NUM_THREADS="1", ATEN_CPU_CAPABILITY="default")
    build = "import sys; from pdd.model.tiny import make_tiny; make_tiny(sys.argv[1])"
    subprocess.run(
        [sys.executable, "-c", build, str(tmp_path)], check=True, env=env, capture_output=True
    )
    names = sorted(p.name for p in tiny_model_dir.iterdir())
    assert names == sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    ]
    for name in names:
        assert (tiny_model_dir / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_config_and_weights_have_the_hugging_face_llama_layout(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert {k: config[k] for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
    )} == {
        "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "max_position_embeddings": 4096, "vocab_size": 4096,
    }
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 10000.0
    assert config["tie_word_embeddings"] is False and config["attention_bias"] is False
    assert config["torch_dtype"] == "float32" and config["hidden_act"] == "silu"
    tok = Tokenizer.from_dir(tiny_model_dir)
    assert config["bos_token_id"] == tok.bos_token_id
    assert config["eos_token_id"] in tok.eos_token_ids

    expected = {
        "model.embed_tokens.weight": (4096, 256),
        "model.norm.weight": (256,),
        "lm_head.weight": (4096, 256),
    }
    for i in range(4):
        p = f"model.layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (256, 256),
            p + "self_attn.k_proj.weight": (128, 256),
            p + "self_attn.v_proj.weight": (128, 256),
            p + "self_attn.o_proj.weight": (256, 256),
            p + "mlp.gate_proj.weight": (768, 256),
            p + "mlp.up_proj.weight": (768, 256),
            p + "mlp.down_proj.weight": (256, 768),
            p + "input_layernorm.weight": (256,),
            p + "post_attention_layernorm.weight": (256,),
        }
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        assert {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()} == expected
        assert all(f.get_tensor(name).dtype == torch.float32 for name in f.keys())
    assert parameter_count(tiny_model_dir) == 5_245_184


def test_tokenizer_round_trips_mixed_text(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    assert tok.vocab_size == 4096
    ids = tok.encode(MIXED_TEXT)
    assert tok.decode(ids) == MIXED_TEXT
    assert tok.encode(MIXED_TEXT, add_special_tokens=True) == [tok.bos_token_id, *ids]

    # Chat markup in text becomes the special ids, which decode drops unless asked.
    im_start, im_end = tok.encode("<|im_start|>"), tok.encode("<|im_end|>")
    assert len(im_start) == len(im_end) == 1
    assert tok.eos_token_ids == {tok.encode("<|end_of_text|>")[0], im_end[0]}
    marked = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert marked[0] == im_start[0] and marked[-1] == im_end[0]
    assert tok.decode(marked) == "user\nhi"
    assert tok.decode(marked, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_chat_template_renders_a_conversation_with_generation_prompt(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    messages = CONVERSATION[:2]
    prompt = tok.apply_chat_template(messages)
    assert prompt == (
        "<|begin_of_text|><|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHéllo 🤖, what is 日本?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == prompt.removesuffix(
        "<|im_start|>assistant\n"
    )
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
    assert tok.encode(prompt) == hf(prompt, add_special_tokens=False).input_ids


@pytest.mark.parametrize("style", ["llama2-config", "qwen-jinja-file"])
def test_other_models_templates_render_like_transformers(
    style: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Real model directories keep templates in different places and use HF's helpers."""
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    tok_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if style == "llama2-config":
        tok_config["chat_template"] = LLAMA2_STYLE_TEMPLATE
        tok_config["eos_token"] = {"content": "<|end_of_text|>", "__type": "AddedToken"}
        messages = CONVERSATION
    else:
        del tok_config["chat_template"]
        (tmp_path / "chat_template.jinja").write_text(QWEN_STYLE_TEMPLATE)
        messages = CONVERSATION[1:]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_config))

    ours = Tokenizer.from_dir(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for gen_prompt in (True, False):
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen_prompt
        )
        assert ours.apply_chat_template(messages, add_generation_prompt=gen_prompt) == expected
    if style == "llama2-config":
        assert "[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHéllo" in expected
        with pytest.raises(jinja2.TemplateError, match="must alternate"):
            ours.apply_chat_template([CONVERSATION[1], CONVERSATION[1]])
    else:
        assert '{"chars": 20}' in expected and "You are a helpful assistant." in expected


def test_incremental_detokenizer_streams_exactly_the_decoded_text(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    ids = tok.encode(MIXED_TEXT)
    # The case that matters: characters whose bytes are split over several tokens.
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.feed(i) for i in ids]
    assert "".join(pieces) + detok.flush() == MIXED_TEXT
    assert not any("\ufffd" in piece for piece in pieces)

    # Arbitrary id streams (invalid UTF-8, special tokens) still add up to decode(ids).
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        length = int(torch.randint(1, 40, (1,), generator=gen))
        stream = torch.randint(0, tok.vocab_size, (length,), generator=gen).tolist()
        detok = IncrementalDetokenizer(tok)
        assert "".join(detok.feed(i) for i in stream) + detok.flush() == tok.decode(stream)

    # A stream cut inside a character: held back, then flushed as U+FFFD.
    emoji = tok.encode("ok 🚀")
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.feed(i) for i in emoji[:-1]) == "ok"
    assert detok.flush() == tok.decode(emoji[:-1])[2:]


def test_greedy_decoding_is_decisive_varied_and_path_independent(tiny_model_dir: Path) -> None:
    """Serving tests compare greedy tokens across paths whose fp32 rounding differs.

    Measured fp32 differences between such paths (one-token decode, N-token extend,
    chunked prefill) in top1 - top2 were at most 9.6e-3 over 24k decisions, so a gap of
    1.0 leaves a factor of more than 100. The full measurement is in pdd/model/tiny.py.
    """
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    gaps: list[float] = []
    continuations: list[list[int]] = []
    with torch.no_grad():
        for _ in range(5):
            length = int(torch.randint(20, 301, (1,), generator=gen))
            prompt = torch.randint(5, 4096, (1, length), generator=gen)
            out = model.generate(
                prompt, max_new_tokens=24, do_sample=False, output_logits=True,
                return_dict_in_generate=True,
            )
            logits = torch.cat(out.logits)  # one row per token-by-token decode step
            assert logits.abs().max() < 100
            top = logits.topk(2, dim=-1).values
            gaps += (top[:, 0] - top[:, 1]).tolist()
            tokens = out.sequences[0, length:].tolist()
            assert tokens == logits.argmax(-1).tolist()
            continuations.append(tokens)
            # One forward pass over prompt + output (an "extend") picks the same tokens.
            extended = model(out.sequences).logits[0]
            assert extended[length - 1 : -1].argmax(-1).tolist() == tokens

    assert min(gaps) > 1.0
    assert sorted(gaps)[len(gaps) // 2] > 5.0
    assert len({tuple(c) for c in continuations}) == 5
    assert all(len(set(c)) >= 8 for c in continuations)


def test_cli_model_init_writes_the_requested_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m"
    args = ["model", "init", str(out), "--layers", "1", "--hidden", "64", "--heads", "2",
            "--kv-heads", "1", "--intermediate", "128", "--vocab-size", "512",
            "--max-position", "256", "--seed", "3"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and f"{parameter_count(out):,} parameters" in printed
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"],
            config["max_position_embeddings"]) == (1, 64, 2, 1, 128, 512, 256)
    assert Tokenizer.from_dir(out).vocab_size == 512
    assert (out / "model.safetensors").read_bytes() != (
        make_tiny(tmp_path / "seed0", layers=1, hidden=64, heads=2, kv_heads=1, intermediate=128,
                  vocab_size=512, max_position=256) / "model.safetensors"
    ).read_bytes()


def test_tokens_past_a_stop_string_are_not_counted(tiny_model_dir):
    """Several tokens handed at once (the router merges a relay's and MD's): the text
    stops at the stop string, and only the tokens through the one that completed it count."""
    from pdd.api.text import TextStream

    tok = Tokenizer.from_dir(tiny_model_dir)
    ids = tok.encode("the cat sat on the mat today", add_special_tokens=False)
    pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    stop_at = next(i for i, text in enumerate(pieces) if "sat" in text)
    stream = TextStream(tok, ["sat"])
    text, kept = stream.feed_all(ids)
    assert stream.stopped and kept == stop_at + 1 < len(ids)
    assert text + stream.flush() == pieces[-1][: pieces[-1].index("sat")]


def test_chat_template_kwargs_reach_the_template_and_may_not_replace_its_inputs(tiny_model_dir, tmp_path):
    """A request's chat_template_kwargs are the template's own variables (Qwen3's
    enable_thinking); one that would replace what pdd renders is refused by name."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(model)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == "hi"
    assert tok.apply_chat_template(messages, kwargs={"enable_thinking": False}) == "hi<think></think>"
    for clash in ("messages", "add_generation_prompt"):
        with pytest.raises(ValueError, match=f"chat_template_kwargs may not set {clash}"):
            tok.apply_chat_template(messages, kwargs={clash: []})


def test_reasoning_parsers_split_thinking_whole_and_in_any_pieces():
    """qwen3 and deepseek_r1 (as the pinned vLLM's): the output starts inside the thinking,
    a <think> in it is no text. The same split whatever the pieces (a tag cut anywhere)."""
    from pdd.api.reasoning import splitter

    def split(name: str, text: str, size: int) -> tuple[str, str]:
        s, out = splitter(name), ("", "")
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            r, c = s.feed(piece, final=i == len(pieces) - 1)
            out = (out[0] + r, out[1] + c)
        return out

    for size in range(1, 9):
        assert split("qwen3", "<think>a b</think>c d", size) == ("a b", "c d")
        assert split("qwen3", "c <think> d", size) == ("c  d", "")
        assert split("deepseek_r1", "a b</think>c d", size) == ("a b", "c d")
        assert split("deepseek_r1", "<think>a b</think>c", size) == ("a b", "c")
        assert split("deepseek_r1", "a b", size) == ("a b", "")
