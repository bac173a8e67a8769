"""When the router releases a request's tokens to its client (`pdd.policy.playout`),
at the pace it measures of each main instance."""

from __future__ import annotations

import time

from pdd.policy.playout import DEFAULT_PACE_S, Playout, observe_pace, release
from pdd.router.request import RouterRequest


class Pacer:
    def __init__(self, reserve_tokens: int) -> None:
        self.reserve_tokens = reserve_tokens
        self._pace: dict[str, float] = {}  # main instance -> its measured gap between tokens

    def playout(self, request: RouterRequest) -> Playout:
        return Playout(self.reserve_tokens, self._pace.get(request.plan.main or "", DEFAULT_PACE_S))

    def play_out(self, request: RouterRequest) -> list[int]:
        """The held tokens to release to the client now."""
        now = time.monotonic()
        if request.merger.finished:
            n = len(request.held)
        else:
            n = release(
                len(request.held),
                request.released,
                now - request.last_release,
                request.pacing,
                request.relay_stopped,
                self.playout(request),
            )
        out, request.held = request.held[:n], request.held[n:]
        if out:
            request.released += len(out)
            request.last_release = now
        return out

    def observe(self, request: RouterRequest, source: str) -> None:
        """A token from `source`: the main instance's gap between tokens, which the
        playout reserve drains at."""
        now = time.monotonic()
        if source == request.plan.main:
            if request.last_main_token is not None:
                self._pace[source] = observe_pace(self._pace.get(source, DEFAULT_PACE_S), now - request.last_main_token)
            request.last_main_token = now
