"""Reasoning parsers: a chat completion's thinking text moved out of `content` into
`reasoning_content`, as vLLM's `--reasoning-parser` does, whole and streamed.

Named as vLLM names them (`vllm/reasoning/`), chosen by `[model] reasoning_parser` or
`pdd serve --reasoning-parser`:
- `qwen3`: the output may open with `<think>`; what follows up to `</think>` is
  reasoning. An output that does not open with it (Qwen3 with `enable_thinking: false`
  in `chat_template_kwargs`) is all content.
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the output starts
  inside it (a repeated `<think>` is dropped): reasoning up to `</think>`, content after.
  An output that never closes it is all reasoning.

The split runs on the text the client is sent (stop strings already cut), piece by
piece: a tag split across pieces is held back until it is whole.
"""

from __future__ import annotations

from pdd.names import REASONING_PARSERS

OPEN, CLOSE = "<think>", "</think>"


class ThinkSplitter:
    """One choice's text, split into (reasoning, content) deltas as it comes."""

    def __init__(self, starts_inside: bool) -> None:
        self._state = "inside" if starts_inside else "start"  # start -> inside -> after; or start -> after
        self._strip_open = starts_inside  # (deepseek_r1: a `<think>` the model repeats is no text)
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the content `text` adds (with `final`: nothing held back)."""
        text, self._held = self._held + text, ""
        reasoning, content = [], []
        while text:
            if self._state == "after":
                content.append(text)
                break
            if self._state == "start":
                stripped = text.lstrip()
                if OPEN.startswith(stripped) and not final:  # could still open: wait and see
                    self._held = text
                    break
                if stripped.startswith(OPEN):
                    self._state, text = "inside", stripped[len(OPEN) :]
                else:
                    self._state = "after"
                continue
            if self._strip_open:
                stripped = text.lstrip()
                if OPEN.startswith(stripped) and stripped and not final:
                    self._held = text
                    break
                self._strip_open = False
                if stripped.startswith(OPEN):
                    text = stripped[len(OPEN) :]
                    continue
            end = text.find(CLOSE)
            if end >= 0:
                reasoning.append(text[:end])
                self._state, text = "after", text[end + len(CLOSE) :]
                continue
            keep = 0 if final else partial_suffix(text, CLOSE)
            reasoning.append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            break
        return "".join(reasoning), "".join(content)


def partial_suffix(text: str, tag: str) -> int:
    """How many of `text`'s last characters could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# vLLM's names -> whether the output starts inside the thinking
STARTS_INSIDE: dict[str, bool] = {"qwen3": False, "deepseek_r1": True}
assert set(STARTS_INSIDE) == set(REASONING_PARSERS)


def splitter(name: str) -> ThinkSplitter:
    return ThinkSplitter(STARTS_INSIDE[name])
