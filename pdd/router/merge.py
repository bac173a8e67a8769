"""One ordered token stream from several producers.

In PDD mode a request's tokens come from a relay and then from the main decode
instance, and around a handoff (or a takeover after a failure) both may send the same
positions, in any order. Every TOKENS frame says the output position of its first
token, so the merger delivers each position exactly once, in order: the first arrival
wins, later copies are dropped (and counted if they disagree, which exact sampling
rules out), and a position that arrives early waits for the ones before it. A token's
log-probabilities (where the request asks) are kept by position beside it, from
whichever copy carries them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.sampling.params import Logprob


@dataclass
class TokenMerger:
    delivered: list[int] = field(default_factory=list)
    producers: list[str] = field(default_factory=list)  # who produced each delivered position
    conflicts: int = 0  # positions two producers disagreed on
    finish_reason: str | None = None
    _ahead: dict[int, tuple[int, str]] = field(default_factory=dict)  # position -> (token, producer)
    _end: int | None = None  # the position after the last one, once a producer finished
    logprobs: dict[int, Logprob] = field(default_factory=dict)  # position -> its token's, where carried
    prompt_logprobs: list[Logprob | None] | None = None  # P's, from whichever copy of position 0 carries them

    def add(
        self,
        producer: str,
        pos: int,
        tokens: list[int],
        finish_reason: str | None = None,
        logprobs: list[Logprob] | None = None,
        prompt_logprobs: list[Logprob | None] | None = None,
    ) -> list[int]:
        """Take a producer's tokens for positions [pos, pos + len) (and their logprobs, and
        with position 0 the prompt's); the tokens that are now deliverable in order."""
        if pos == 0 and prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = prompt_logprobs
        for i, token in enumerate(tokens):
            p = pos + i
            if logprobs is not None and i < len(logprobs):
                self.logprobs.setdefault(p, logprobs[i])
            known = self.delivered[p] if p < len(self.delivered) else self._ahead.get(p, (None,))[0]
            if known is None:
                self._ahead[p] = (token, producer)
            elif known != token:
                self.conflicts += 1
        if finish_reason is not None:
            end = pos + len(tokens)
            if self._end is None or end < self._end:
                self._end, self.finish_reason = end, finish_reason
        new = []
        while len(self.delivered) in self._ahead and not self.finished:
            token, who = self._ahead.pop(len(self.delivered))
            self.delivered.append(token)
            self.producers.append(who)
            new.append(token)
        return new

    @property
    def finished(self) -> bool:
        return self._end is not None and len(self.delivered) >= self._end

    def count(self, producer: str) -> int:
        return self.producers.count(producer)
