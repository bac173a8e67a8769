"""Reasoning parsers: a chat completion's thinking text moved out of `content` into
`reasoning`, as the pinned vLLM's `--reasoning-parser` does, whole and streamed; pdd's
own, for installs without vLLM (with it, `pdd.api.parsers` runs vLLM's own classes).

Named as vLLM names them, chosen by `[model] reasoning_parser` or `pdd serve
--reasoning-parser`, and splitting as vLLM 0.32's do (tests/test_parsers.py holds them
to it): the output starts inside the thinking (the chat template opens it in the
prompt); a `<think>` inside it is no text; the first `</think>` ends it and what follows
is content; an output that never closes it is all thinking. `qwen3` with
`enable_thinking: false` in `chat_template_kwargs` (the template then closes the
thinking in the prompt) is all content; `deepseek_r1` has no such switch.

The split runs on the text the client is sent (stop strings already cut), piece by
piece: a tag split across pieces is held back until it is whole.
"""

from __future__ import annotations

from typing import Any

from pdd.names import REASONING_PARSERS

OPEN, CLOSE = "<think>", "</think>"


class ThinkSplitter:
    """One choice's text, split into (reasoning, content) deltas as it comes."""

    def __init__(self, starts_inside: bool = True) -> None:
        self._after = not starts_inside
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the content `text` adds (with `final`: nothing held back)."""
        text, self._held = self._held + text, ""
        if self._after:
            return "", text
        end = text.find(CLOSE)
        if end >= 0:
            self._after = True
            return text[:end].replace(OPEN, ""), text[end + len(CLOSE) :]
        keep = 0 if final else max(partial_suffix(text, CLOSE), partial_suffix(text, OPEN))
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep].replace(OPEN, ""), ""


def partial_suffix(text: str, tag: str) -> int:
    """How many of `text`'s last characters could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# vLLM's names -> whether `enable_thinking: false` in chat_template_kwargs turns the thinking off
SWITCHED: dict[str, bool] = {"qwen3": True, "deepseek_r1": False}
assert set(SWITCHED) == set(REASONING_PARSERS)


def splitter(name: str, kwargs: dict[str, Any] | None = None) -> ThinkSplitter:
    """Parser `name`'s splitter for a request with these chat_template_kwargs."""
    off = SWITCHED[name] and (kwargs or {}).get("enable_thinking") is False
    return ThinkSplitter(starts_inside=not off)
