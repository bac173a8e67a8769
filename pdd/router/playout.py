"""When the router releases a request's tokens to its client (`pdd.policy.playout`),
at the pace it measures of each instance, with a reserve as long as the handoffs it saw."""

from __future__ import annotations

import time

from pdd.policy.playout import DEFAULT_PACE_S, Playout, observe_pace, observe_stall, playout, release, reserve_tokens
from pdd.router.request import RouterRequest


class TokenPlayout:
    def __init__(self, reserve_tokens: int) -> None:
        self.reserve_tokens = reserve_tokens  # the least kept (0: no reserve)
        self._pace: dict[str, float] = {}  # instance -> its measured gap between tokens (main and relay)
        self._stall: dict[str, float] = {}  # main instance -> the handoff gap to cover

    def playout(self, request: RouterRequest) -> Playout:
        main = request.plan.main or ""
        pace = self._pace.get(main, DEFAULT_PACE_S)
        reserve = reserve_tokens(self._stall.get(main), pace, self.reserve_tokens)
        return playout(reserve, pace, self._pace.get(request.plan.relay or "", DEFAULT_PACE_S))

    def stats(self) -> dict[str, dict[str, float]]:
        """Per instance: its pace; per main instance also the handoff gap to cover and the
        reserve that takes."""
        out = {}
        for name, pace in self._pace.items():
            row = {"pace_ms": 1000 * pace}
            if name in self._stall:
                row["handoff_gap_ms"] = 1000 * self._stall[name]
                row["reserve_tokens"] = reserve_tokens(self._stall[name], pace, self.reserve_tokens)
            out[name] = row
        return out

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
                request.relay_will_hand_over,
                request.relay_stopped,
                self.playout(request),
            )
        out, request.held = request.held[:n], request.held[n:]
        if out:
            request.released += len(out)
            request.last_release = now
        return out

    def observe(self, request: RouterRequest, source: str) -> None:
        """A token from `source`: the instances' gaps between tokens (the playout reserve
        fills and drains at their pace), and at a main instance's first token after a
        relay's, the handoff's gap."""
        now = time.monotonic()
        if source == request.plan.main:
            if request.last_main_token is not None:
                self._observe_pace(source, now - request.last_main_token)
            elif request.last_relay_token is not None:  # its first token after a relay's: a handoff
                self._stall[source] = observe_stall(self._stall.get(source), now - request.last_relay_token)
            request.last_main_token = now
        elif source == request.plan.relay:
            if request.last_relay_token is not None:
                self._observe_pace(source, now - request.last_relay_token)
            request.last_relay_token = now

    def _observe_pace(self, name: str, gap_s: float) -> None:
        self._pace[name] = observe_pace(self._pace.get(name, DEFAULT_PACE_S), gap_s)
