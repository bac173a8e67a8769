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
