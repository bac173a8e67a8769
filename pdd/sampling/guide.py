"""Constrained decoding: a request's output held to a grammar (JSON Schema, a regex, a
choice of strings, a Lark grammar), by llguidance.

Why llguidance: it runs on the tokenizer.json pdd already reads (no transformers), has
no dependency of its own, and vLLM 0.32 ships it, so one version serves both engines.
Measured on this machine (BENCHMARKS.md, "What the sampler's extras cost").

A guide's state is a function of the output tokens so far and nothing else: every
producer of a position (P's first token, a relay's, MD's after a handoff) builds its
matcher from the request's grammar and advances it over the output it holds, given
tokens included, without reparsing the prompt. A catch-up advances it in rounds, at
the next token sampled. The mask leaves only the tokens the grammar allows (EOS once
it is complete), so greedy and seeded draws alike stay inside it. (No torch at import:
the HTTP front end checks a request's grammar with it before any engine sees it.)
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pdd.sampling.params import GUIDE_KINDS

if TYPE_CHECKING:
    import torch


class GuideError(ValueError):
    """A grammar that cannot be compiled (named in the request's 400)."""


def grammar_of(kind: str, spec: str) -> str:
    """llguidance's grammar for a guide (`kind`, `spec`): `json_schema` a JSON Schema
    (text), `json_object` any JSON object, `regex` a regular expression, `choice` a JSON
    list of strings (exactly one of them), `grammar` a Lark grammar."""
    import llguidance

    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_regex("|".join(_regex_escape(s) for s in json.loads(spec)))
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(spec)
    raise GuideError(f"unknown guide kind {kind!r}; one of {', '.join(GUIDE_KINDS)}")


def _regex_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in r"\.^$|?*+()[]{}/" else c for c in text)


@functools.lru_cache(maxsize=8)
def _tokenizer(tokenizer_json: str, vocab: int, eos: tuple[int, ...]):
    import llguidance

    return llguidance.LLTokenizer(Path(tokenizer_json).read_text(), n_vocab=vocab, eos_token=list(eos) or None)


class Guides:
    """The guides of one model: its tokenizer (`tokenizer.json`), vocabulary and EOS tokens
    (none given: the tokenizer's own)."""

    def __init__(self, tokenizer_json: str | Path, vocab: int, eos_ids: Sequence[int]) -> None:
        self._args = (str(tokenizer_json), vocab, tuple(sorted(eos_ids)))

    def check(self, kind: str, spec: str) -> None:
        """GuideError when the guide's grammar does not compile."""
        import llguidance

        try:
            grammar = grammar_of(kind, spec)
        except (ValueError, TypeError) as e:
            raise GuideError(str(e)) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, _tokenizer(*self._args))
        if error and not error.startswith("WARNING"):
            raise GuideError(error)

    def start(self, kind: str, spec: str) -> Guide:
        """A request's matcher; GuideError when its grammar does not compile."""
        try:
            grammar = grammar_of(kind, spec)
        except (ValueError, TypeError) as e:
            raise GuideError(str(e)) from None
        return Guide(_tokenizer(*self._args), grammar)


class Guide:
    """One request's matcher: `advance` over output tokens, `mask` a row of logits."""

    def __init__(self, tokenizer, grammar: str) -> None:
        import llguidance
        import llguidance.torch

        self._matcher = llguidance.LLMatcher(tokenizer, grammar)
        if self._matcher.is_error():
            raise GuideError(self._matcher.get_error())
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
        self.consumed = 0  # output tokens the matcher has taken

    def advance(self, output: Sequence[int]) -> None:
        """Take the output tokens it has not seen (the producer's own, or given ones);
        past the grammar's end only EOS can come (`ignore_eos`), which changes nothing."""
        for token in output[self.consumed :]:
            if self._matcher.is_stopped():
                break
            if not self._matcher.consume_token(token):
                raise GuideError(f"the output left the grammar: {self._matcher.get_error()}")
        self.consumed = len(output)

    def mask(self, row: torch.Tensor) -> None:
        """Leave only the tokens the grammar allows next in `row` [vocab] (in place)."""
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        allowed = _unpack(self._bitmask[0], row.shape[0]).to(row.device)
        row.masked_fill_(~allowed, float("-inf"))


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """An int32 bitmask (bit j of word i: token 32 i + j) as [vocab] booleans."""
    import torch

    bits = (bitmask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.flatten().bool()
    if allowed.shape[0] >= vocab:
        return allowed[:vocab]
    return torch.cat([allowed, torch.zeros(vocab - allowed.shape[0], dtype=torch.bool)])
