"""What KV crosses, in which pieces, and how long the line will take.

The line model is processor sharing: concurrent transfers split the bandwidth evenly,
which is what one TCP connection per peer, written frame by frame by each request's
task, comes to. The instances keep a `LinkEstimate` per line from what they observe
(reservation round trips, acknowledged KV), and predict with `finish_s`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

RTT_DECAY = 0.1  # how fast a one-way estimate rises towards larger samples (it drops at once)
RATE_ALPHA = 0.3  # weight of a new throughput sample


def kv_range(prompt_tokens: int, reserved_hit: int) -> tuple[int, int]:
    """The prompt tokens whose KV the receiver lacks: everything after its reserved hit."""
    if not 0 <= reserved_hit < prompt_tokens:
        raise ValueError(f"a reserved hit of {reserved_hit} leaves nothing of a {prompt_tokens}-token prompt")
    return reserved_hit, prompt_tokens


def kv_chunks(start: int, end: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) in pieces of `chunk_tokens`: each travels (one frame per layer) and
    is imported on its own, so the receiver works while the rest is on the line."""
    return [(a, min(end, a + chunk_tokens)) for a in range(start, end, chunk_tokens)]


@dataclass(frozen=True)
class LinkEstimate:
    bytes_per_s: float
    one_way_s: float


def observe_rtt(est: LinkEstimate, rtt_s: float) -> LinkEstimate:
    """Round trips include the far side's queueing: believe the smallest, forget slowly."""
    half = rtt_s / 2
    one_way = half if half < est.one_way_s else est.one_way_s + RTT_DECAY * (half - est.one_way_s)
    return replace(est, one_way_s=one_way)


def observe_rate(est: LinkEstimate, nbytes: int, seconds: float) -> LinkEstimate:
    """Bytes the far side acknowledged over an interval in which the line was never idle."""
    if seconds <= 0 or nbytes <= 0:
        return est
    return replace(est, bytes_per_s=(1 - RATE_ALPHA) * est.bytes_per_s + RATE_ALPHA * nbytes / seconds)


def finish_s(nbytes: int, in_flight: Sequence[int], link: LinkEstimate) -> float:
    """When `nbytes` sent now will have arrived, sharing the line with transfers that
    still have `in_flight` bytes to go: under fair sharing each of them delays it by at
    most its own remainder, and by no more than `nbytes`."""
    ahead = sum(min(r, nbytes) for r in in_flight)
    return link.one_way_s + (ahead + nbytes) / link.bytes_per_s
