"""The garbage collector in pdd's processes: long-lived servers, and simulated runs."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_frozen = 0  # objects frozen at start-up (counted then: `gc.get_freeze_count` walks them all)


def freeze_startup_heap() -> None:
    """Take everything alive once a server is up out of the cyclic collector's sight.

    An instance holds some 600,000 objects once torch (and vLLM) are imported and its
    engine is built; every full collection walks them all (350 ms measured on two cores
    here), and it runs when serving has allocated enough, stalling every stream the
    process serves at that moment. Nothing built at start-up becomes cyclic garbage
    later, so it is frozen, as vLLM's own API server does, and only what serving
    allocates is ever collected."""
    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = gc.get_freeze_count()


def frozen_objects() -> int:
    """What `freeze_startup_heap` took out of the collector's sight (0 before it ran).
    Not `gc.get_freeze_count()` on demand: it walks every frozen object with the GIL held,
    33 ms here with torch and vLLM imported, a stall of every stream on each /pdd/stats."""
    return _frozen


@contextmanager
def no_cyclic_collection() -> Iterator[None]:
    """No cyclic collection while it lasts (reference counting still frees nearly all that
    is dropped); a decorator too. For a simulated run: the instances' radix caches make a
    tree node (and its children's dict) per cached block, hundreds of thousands a probe,
    each in a cycle with its parent, and the collector kept walking them. A same-dc A
    probe at 30 req/s took 2.6-3.3 s of CPU even collecting every 20,000 allocations,
    1.3-1.4 s without (as much as the LRU of block keys it replaced took), and two probes'
    peak RSS was 225 MB either way."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
