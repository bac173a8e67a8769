"""When the router releases a request's tokens to its client (`pdd.policy.playout`),
at the pace it measures of each main instance."""

from __future__ import annotations

import time

from pdd.policy.playout import DEFAULT_PACE_S, Playout, observe_pace, observe_stall, release, reserve_tokens
from pdd.router.request import RouterRequest


class Pacer:
    def __init__(self, reserve_tokens: int) -> None:
        self.reserve_tokens = reserve_tokens  # the least kept (0: no reserve)
        self._pace: dict[str, float] = {}  # main instance -> its measured gap between tokens
        self._stall: dict[str, float] = {}  # main instance -> the handoff gap to cover

    def playout(self, request: RouterRequest) -> Playout:
        main = request.plan.main or ""
        pace = self._pace.get(main, DEFAULT_PACE_S)
        return Playout(reserve_tokens(self._stall.get(main), pace, self.reserve_tokens), pace)

    def stats(self) -> dict[str, dict[str, float | None]]:
        """Per main instance: its pace, the handoff gap to cover and the reserve that takes."""
        return {
            main: {
                "pace_ms": 1000 * pace,
                "handoff_gap_ms": 1000 * self._stall[main] if main in self._stall else None,
                "reserve_tokens": reserve_tokens(self._stall.get(main), pace, self.reserve_tokens),
            }
            for main, pace in self._pace.items()
        }

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
            elif request.last_relay_token is not None:  # its first token after a relay's: a handoff
                self._stall[source] = observe_stall(self._stall.get(source), now - request.last_relay_token)
            request.last_main_token = now
        elif source == request.plan.relay:
            request.last_relay_token = now
