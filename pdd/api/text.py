"""Token IDs to client text, with stop strings.

Text is released only when it can no longer become part of a stop string, so a stop
string split across tokens is still caught and never shown to the client.
"""

from __future__ import annotations

from pdd.model.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""
        self._sent = 0
        self.stopped = False

    def feed(self, token_id: int) -> str:
        """Text that is now safe to send; sets `stopped` when a stop string appeared."""
        self._text += self._detok.feed(token_id)
        return self._release(final=False)

    def feed_all(self, token_ids: list[int]) -> tuple[str, int]:
        """Feed tokens in order until a stop string appears: the text now safe to send, and
        how many of the tokens count (through the one that completed the stop string; the
        router may hand several at once, and tokens past a stop are never sent)."""
        text = []
        for n, token in enumerate(token_ids, 1):
            text.append(self.feed(token))
            if self.stopped:
                return "".join(text), n
        return "".join(text), len(token_ids)

    def flush(self) -> str:
        if not self.stopped:
            self._text += self._detok.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        start = max(0, self._sent - self._hold)
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        else:
            end = len(self._text) if final else max(self._sent, len(self._text) - self._hold)
        out, self._sent = self._text[self._sent : end], max(self._sent, end)
        return out
