"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` (a token, its
log-probability, its UTF-8 bytes, the likeliest tokens beside it) and completions'
parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

Each token's figures were computed where the token was produced (P, a relay, MD) and
merged by position with the token IDs (`pdd.router.merge`); a position whose producer
did not carry them (a takeover's re-sent tokens whose first copy was lost) says null."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdd.model.tokenizer import Tokenizer
from pdd.sampling.params import Logprob


class LogprobFormatter:
    """One request's logprobs, piece by piece (a completion's text offsets run on)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool) -> None:
        self._tokenizer, self._chat = tokenizer, chat
        self._offset = 0

    def _text(self, token: int) -> str:
        return self._tokenizer.decode([token], skip_special_tokens=False)

    def piece(self, ids: Sequence[int], lps: Sequence[Logprob | None]) -> dict[str, Any]:
        """The `logprobs` object of a choice (or a chunk's choice) holding these tokens."""
        if self._chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in zip(ids, lps, strict=True)], "refusal": None}
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in zip(ids, lps, strict=True):
            text = self._text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp[0])
            out["top_logprobs"].append(None if lp is None else {self._text(t): v for t, v in lp[1]})
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out

    def _chat_entry(self, token: int, lp: Logprob | None) -> dict[str, Any]:
        top = [] if lp is None else [self._named(t, v) for t, v in lp[1]]
        return {**self._named(token, None if lp is None else lp[0]), "top_logprobs": top}

    def _named(self, token: int, value: float | None) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    def prompt(self, ids: Sequence[int], lps: Sequence[Logprob | None] | None) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: for each prompt token (the first has none) its own and
        the top tokens', by token id. Ranks are known for the top tokens; a prompt token
        outside them has none (null)."""
        out: list[dict[str, Any] | None] = []
        for token, lp in zip(ids, lps or [None] * len(ids), strict=True):
            if lp is None:
                out.append(None)
                continue
            entry = {
                t: {"logprob": v, "rank": rank, "decoded_token": self._text(t)} for rank, (t, v) in enumerate(lp[1], 1)
            }
            if token not in entry:
                entry[token] = {"logprob": lp[0], "rank": None, "decoded_token": self._text(token)}
            out.append({str(t): e for t, e in entry.items()})
        return out

    @staticmethod
    def merge(pieces: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
        """The pieces of one choice as one `logprobs` object (a whole response's)."""
        if chat:
            return {"content": [e for p in pieces for e in p["content"]], "refusal": None}
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {k: [v for p in pieces for v in p[k]] for k in keys}
