"""Text <-> token ids for a Hugging Face model directory, without `transformers`.

The router tokenizes prompts and renders chat templates; every instance detokenizes
streamed output. Both need exactly what `transformers` would produce for the same model
directory (so cache hits and token counts agree with other tools), but `transformers` is
a test-only dependency here. `tokenizers` does the encoding; this module adds what HF
keeps in its JSON side files: special token ids, EOS sets and the Jinja chat template.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

_REPLACEMENT_CHAR = "\ufffd"
# generation_config.json's sampling values that pdd applies where a request says nothing
# (vLLM's OpenAI layer reads the same file; its AsyncLLM does not, so pdd must, on every
# engine); max_new_tokens is the default max_tokens. The agent-API issue adds the rest.
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "max_new_tokens")


class Tokenizer:
    """A model directory's tokenizer, special tokens and chat template."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        eos_token_ids: frozenset[int],
        bos_token_id: int | None,
        special_tokens: dict[str, str],
        chat_template: str | None,
        generation_defaults: dict[str, float | int] | None = None,
        source: Path | None = None,
    ) -> None:
        # Serving never pads or truncates inside the tokenizer; lengths are the engine's call.
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._special_tokens = special_tokens
        # the checkpoint's generation_config.json sampling values: a request's defaults, as
        # vLLM's OpenAI server applies them (`GENERATION_DEFAULTS`)
        self.generation_defaults = generation_defaults or {}
        self.source = source  # its tokenizer.json, where it was read from one
        self.chat_template = chat_template  # its source (a tool parser is chosen by what it teaches)
        self._template = _compile_template(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` plus the side files HF models ship next to it."""
        root = Path(path)
        tok_config = _read_json(root / "tokenizer_config.json")
        model_config = _read_json(root / "config.json")
        gen_config = _read_json(root / "generation_config.json")
        tokenizer = _HFTokenizer.from_file(str(root / "tokenizer.json"))

        special_tokens = {
            key: text
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (text := _token_text(tok_config.get(key))) is not None
        }
        eos_ids = _ids(model_config.get("eos_token_id")) | _ids(gen_config.get("eos_token_id"))
        if "eos_token" in special_tokens:
            eos_ids |= _ids(tokenizer.token_to_id(special_tokens["eos_token"]))
        bos_id = None
        if "bos_token" in special_tokens:
            bos_id = tokenizer.token_to_id(special_tokens["bos_token"])
        return cls(
            tokenizer,
            eos_token_ids=frozenset(eos_ids),
            bos_token_id=bos_id,
            special_tokens=special_tokens,
            chat_template=_find_chat_template(root, tok_config),
            source=root / "tokenizer.json",
            generation_defaults={
                k: v
                for k in GENERATION_DEFAULTS
                if isinstance(v := gen_config.get(k), int | float) and not isinstance(v, bool)
            },
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token markup in the text (chat tags) is honoured.

        `add_special_tokens` applies the model's post-processor (e.g. a leading BOS). It
        defaults to off because chat templates already write their own BOS.
        """
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters one token can cover: a text longer than this times N
        tokens cannot fit in N tokens, which lets a server refuse it without tokenizing."""
        return max(len(t) for t in self._tok.get_vocab(with_added_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 at the end decodes to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        kwargs: Mapping[str, Any] = {},
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render the model's chat template exactly as `transformers` does; `tools` in its
        shape (`{"type": "function", "function": {...}}`), None without; `kwargs` are the
        template's own variables (a request's `chat_template_kwargs`, e.g. Qwen3's
        `enable_thinking`), never one of those set here (ValueError)."""
        if self._template is None:
            raise ValueError("this model has no chat_template; use a plain completion prompt")
        given = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            "documents": None,
        }
        given |= self._special_tokens
        if clash := sorted(set(kwargs) & set(given)):
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")
        return self._template.render(**given, **kwargs)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces whose concatenation is `decode(ids)`.

    A token can end in the middle of a multi-byte character, and decoders such as
    SentencePiece's strip a leading space only at the start of the text, so a token's
    text cannot be decoded on its own. Like vLLM, this decodes a window that starts at
    the last point where all text was complete, once with and once without the unsent
    tokens, and emits the difference; text ending in U+FFFD (an unfinished character) is
    held back until more tokens finish it or the stream ends. The window keeps the cost
    per token constant instead of decoding the whole output again each time.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: the text before it is already sent
        self._read_offset = 0  # tokens before this are already sent

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes (often "", never a broken char)."""
        self._ids.append(token_id)
        sent, full = self._window_texts()
        if len(full) <= len(sent) or full.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(sent) :]

    def flush(self) -> str:
        """End of stream: return whatever was held back, unfinished characters included."""
        sent, full = self._window_texts()
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(sent) :]

    def _window_texts(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        window = self._ids[self._prefix_offset :]
        sent = decode(window[: self._read_offset - self._prefix_offset])
        return sent, decode(window)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandbox, options and helpers as `transformers`."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _find_chat_template(root: Path, tok_config: dict[str, Any]) -> str | None:
    """The template wherever HF versions keep it: a .jinja file, a .json file or the config."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(root / "chat_template.json").get("chat_template")
    if template is None:
        template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default")
    return template


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))
