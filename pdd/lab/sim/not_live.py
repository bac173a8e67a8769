"""The parts of serving the simulator writes itself rather than runs, each with why.

Everything else a simulated deployment does is serving's own code on the simulated clock
(the router's `DispatchQueue`, a decode instance's `ReservationQueue`, the engine's
`Scheduler` and `RadixCache`, every decision in `pdd.policy`; `tests/test_sim.py` checks
that the runs reach them). What `pdd plan` and `pdd sim` say rests on these copies too,
so they are named here, and printed with the simulator's docs (docs/simulator.md).
"""

from __future__ import annotations

NOT_LIVE: dict[str, str] = {
    "PagedKV": "the engine's PagedKV takes pages as a sequence grows and preempts the newest "
    "when none are left; a simulated sequence reserves its prompt and all its output when "
    "admitted (pdd.lab.sim.room.ReservedKV), so no step can run short and a decode-only run of up to 4096 "
    "steps is priced as one event (16x fewer events: BENCHMARKS.md), which the planner's time "
    "rests on (pdd.lab.sim.instance)",
    "the request lifecycle (pdd.router.request, pdd.instance)": "the live lifecycle is asyncio "
    "coroutines over HTTP and the KV wire; the simulator's (pdd.lab.sim.cluster, prefill, relayed) "
    "is simpy processes that take the same steps in the same order and make every choice with the "
    "same pdd.policy functions, since the live coroutines would need sockets and real time to run",
    "CacheMirror": "the router plans on its mirror of each instance's radix cache, kept from cache "
    "events that can be lost (then stale until a snapshot); the simulated router reads the "
    "instance's RadixCache itself (Instance.hit_tokens), as a mirror with no lag and no lost event "
    "would: events on the simulated clock would arrive at once, and a mirror's staleness is not modelled",
    "KV transfers in slices (pdd.transfer)": "live KV moves page by page in slices over several "
    "streams, staged concurrently with framing; the simulator sends a request's KV range as one "
    "transfer on the line (pdd.lab.sim.line: a fair share of its bandwidth, TCP's ramp over the "
    "round trip), so no slice arrives early and no per-slice cost is priced",
}
