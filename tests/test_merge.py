"""The router's merge of two producers' token streams by output position."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.router.merge import TokenMerger

TRUTH = list(range(100, 140))


def _frames(producer: str, start: int, end: int, size: int) -> list[tuple[str, int, list[int], str | None]]:
    out = []
    for a in range(start, end, size):
        b = min(end, a + size)
        out.append((producer, a, TRUTH[a:b], "length" if b == len(TRUTH) else None))
    return out


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 40), st.integers(0, 40), st.integers(1, 5), st.integers(1, 5), st.randoms())
def test_every_position_once_in_order_whatever_the_interleaving(cut, overlap, size_r, size_m, rng):
    """The relay sends [0, cut + overlap), the main instance [cut, 40): overlapping,
    in chunks, each producer in order, the two interleaved at random."""
    relay = _frames("rld", 0, min(40, cut + overlap), size_r)
    relay = [(p, a, t, None) for p, a, t, _ in relay]  # the relay hands off: it does not finish
    main = _frames("md", cut, 40, size_m) if cut < 40 else []
    if cut >= 40:
        relay = _frames("rld", 0, 40, size_r)
    merged, streams = TokenMerger(), [relay, main]
    delivered = []
    while any(streams):
        stream = rng.choice([s for s in streams if s])
        delivered += merged.add(*stream.pop(0))
    assert delivered == TRUTH == merged.delivered
    assert merged.finished and merged.finish_reason == "length" and merged.conflicts == 0
    assert len(merged.producers) == 40


def test_late_copies_are_dropped_and_disagreements_counted():
    m = TokenMerger()
    assert m.add("md", 2, [3, 4]) == []  # ahead of position 0: waits
    assert m.add("rld", 0, [1, 2, 3]) == [1, 2, 3, 4]
    assert m.producers == ["rld", "rld", "md", "md"]  # the first arrival of each position counts
    assert m.add("md", 1, [2]) == [] and m.conflicts == 0
    assert m.add("md", 1, [9]) == [] and m.conflicts == 1
    assert m.add("md", 4, [5], "stop") == [5] and m.finished and m.finish_reason == "stop"
    assert m.add("rld", 5, [6]) == [] and m.delivered == [1, 2, 3, 4, 5]


def test_the_earliest_finish_wins():
    m = TokenMerger()
    m.add("rld", 0, [1, 2, 3], "stop")
    assert m.finished and m.delivered == [1, 2, 3]
    r = random.Random(0)
    assert not TokenMerger().add("md", r.randrange(1, 5), [7], "length")
