"""What KV crosses, in which pieces, and how long the line will take.

The line model is processor sharing: concurrent transfers split the bandwidth evenly,
which is what one TCP connection per peer, written frame by frame by each request's
task, comes to. The instances keep a `LineEstimate` per line from what they observe
(reservation round trips, acknowledged KV), and predict with `finish_s`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum


class Priority(IntEnum):
    """What a connection between instances carries: control frames (reservations,
    handoffs, aborts) never wait behind KV; urgent KV (on a request's critical path:
    P -> MD, the relay's copy) goes before background KV (MD's copy behind a relay)."""

    CONTROL = -1
    URGENT = 0
    BACKGROUND = 1


RTT_DECAY = 0.1  # how fast a one-way estimate rises towards larger samples (it drops at once)
RATE_ALPHA = 0.3  # weight of a new throughput sample


def kv_range(prompt_tokens: int, reserved_hit: int) -> tuple[int, int]:
    """The prompt tokens whose KV the receiver lacks: everything after its reserved hit."""
    if not 0 <= reserved_hit < prompt_tokens:
        raise ValueError(f"a reserved hit of {reserved_hit} leaves nothing of a {prompt_tokens}-token prompt")
    return reserved_hit, prompt_tokens


def kv_namespace(cache_salt: str, lossy_kv: str) -> str:
    """The cache namespace a request's KV lives in on a decode instance across the line:
    its own (`cache_salt`), or, where that KV crosses the line quantized (`lossy_kv`), one
    of that form's beside it, so that exact KV is never taken from lossy pages (a later
    request across the line in the same form reuses them)."""
    return f"{cache_salt}\x00lossy-kv:{lossy_kv}" if lossy_kv else cache_salt


def kv_chunks(start: int, end: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) in pieces of `chunk_tokens`: each travels (one frame per layer) and
    is imported on its own, so the receiver works while the rest is on the line."""
    return [(a, min(end, a + chunk_tokens)) for a in range(start, end, chunk_tokens)]


@dataclass(frozen=True)
class LineEstimate:
    bytes_per_s: float
    one_way_s: float


def observe_rtt(est: LineEstimate, rtt_s: float) -> LineEstimate:
    """Round trips include the far side's queueing: believe the smallest, forget slowly."""
    half = rtt_s / 2
    one_way = half if half < est.one_way_s else est.one_way_s + RTT_DECAY * (half - est.one_way_s)
    return replace(est, one_way_s=one_way)


def observe_rate(est: LineEstimate, nbytes: int, seconds: float) -> LineEstimate:
    """Bytes the far side acknowledged over an interval in which the line was never idle."""
    if seconds <= 0 or nbytes <= 0:
        return est
    return replace(est, bytes_per_s=(1 - RATE_ALPHA) * est.bytes_per_s + RATE_ALPHA * nbytes / seconds)


def finish_s(nbytes: int, in_flight: Sequence[int], line: LineEstimate) -> float:
    """When `nbytes` sent now will have arrived, sharing the line with transfers that
    still have `in_flight` bytes to go: under fair sharing each of them delays it by at
    most its own remainder, and by no more than `nbytes`."""
    ahead = sum(min(r, nbytes) for r in in_flight)
    return line.one_way_s + (ahead + nbytes) / line.bytes_per_s


RATE_WINDOW_S = 0.1  # the shortest window a rate is measured over
LOCAL_PRIOR = LineEstimate(bytes_per_s=1.25e9, one_way_s=1e-4)  # inside a datacenter, until measured


@dataclass
class _Transfer:
    start: int
    end: int
    bytes_per_token: int
    priority: int
    acked: int = 0

    @property
    def remaining_bytes(self) -> int:
        return (self.end - max(self.acked, self.start)) * self.bytes_per_token


@dataclass
class LineMeter:
    """What a sender knows of the path to one datacenter: the estimate it keeps from
    reservation round trips and acknowledged KV, and the KV it has in flight there.
    A state updated by what the sender observes (times are passed in), so a
    simulated sender estimates its line exactly as a live one does.

    Rates are measured over windows of at least `RATE_WINDOW_S` between
    acknowledgements while transfers are in flight: acknowledgements come in bursts
    (the far side imports between its steps), and a window opened on an idle line
    would count the delay as slowness."""

    estimate: LineEstimate
    _transfers: dict[tuple[str, str], _Transfer] = field(default_factory=dict)  # (request, peer)
    _window: float | None = None  # when the current measuring window opened
    _window_bytes: int = 0

    def in_flight(self, priority: int) -> list[int]:
        """What a transfer of this priority shares the line with (lower ones yield to it)."""
        return [t.remaining_bytes for t in self._transfers.values() if t.priority <= priority]

    def begin(self, key: tuple[str, str], start: int, end: int, bytes_per_token: int, priority: int) -> None:
        self._transfers[key] = _Transfer(start, end, bytes_per_token, priority)

    def acked(self, key: tuple[str, str], token_end: int, done: bool, now_s: float) -> None:
        t = self._transfers.get(key)
        if t is None:
            return
        if self._window is None:
            self._window, self._window_bytes = now_s, 0
        else:
            self._window_bytes += (token_end - max(t.acked, t.start)) * t.bytes_per_token
            if now_s - self._window >= RATE_WINDOW_S:
                self.estimate = observe_rate(self.estimate, self._window_bytes, now_s - self._window)
                self._window, self._window_bytes = now_s, 0
        t.acked = max(t.acked, token_end)
        if done:
            self.end(key)

    def end(self, key: tuple[str, str]) -> None:
        self._transfers.pop(key, None)
        if not self._transfers:
            self._window = None

    def round_trip(self, seconds: float) -> None:
        self.estimate = observe_rtt(self.estimate, seconds)
