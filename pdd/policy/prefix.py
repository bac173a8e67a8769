"""Whether MD waits for a request in flight that holds most of a new prompt.

An agent's next turn arrives as soon as the last one ends, often before the last
one's KV (or, when a relay finished it, its output) has landed at MD. When a request
there that is not producing yet (its KV still on the line, or waiting for a relay)
holds more of the new prompt than the cache does — at least a page more, and at
least half the prompt — MD waits for it to settle, bounded, rather than have the same
KV cross the line twice. A producing request keeps its pages until it finishes:
nothing to wait for.
"""

from __future__ import annotations

from collections.abc import Sequence

PREFIX_WAIT_S = 10.0  # the longest MD waits for such a request to land


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def may_hold(earlier: bool, reserved: bool) -> bool:
    """Whether an unsettled request may be waited for: one reserved (a reservation waits
    for nothing), or one that came before (it waits, if at all, for one before it). One
    that came later and is not reserved yet may itself be waiting, for the one asking: a
    session's next turn, sent while this turn waits for the one before, holds all of this
    prompt. Two requests waiting for each other would both sit out PREFIX_WAIT_S; waiting
    only on an earlier arrival or on a reservation cannot go round in a circle."""
    return earlier or reserved


def prefix_holder(
    prompt: Sequence[int], cached_tokens: int, page_size: int, in_flight: Sequence[Sequence[int]]
) -> int | None:
    """Which of the unsettled requests `in_flight` (each its prompt and known output)
    to wait for: the one sharing the longest prefix with `prompt`, if that beats the
    cache by a page and covers half the prompt; None: reserve now."""
    best, holder = max(cached_tokens + page_size, len(prompt) // 2), None
    for i, tokens in enumerate(in_flight):
        shared = common_prefix(tokens, prompt)
        if shared >= best:
            best, holder = shared, i
    return holder
