"""A decode-side instance's reservations, as the live ones take them
(pdd/instance/decode_side.py, relay.py, reservations.py).

RESERVE lands a one-way delay after P sent it. A loaded relay turns an optional
request (one with an MD to fall back on) away at once (`pdd.policy.capacity.
relay_accepts`), and any instance holding `max_requests` refuses. An accepted one first
waits, bounded, for a request in flight that holds most of its prompt
(`pdd.policy.prefix`). Then a request that could never fit the pool is refused, as the
engine refuses it (too long); an optional one is refused if the pool cannot hold it
now; a required one (MD; the relay when it is the only decode side) waits in a
first-come queue with no deadline until the pool holds it (the live
`ReservationQueue`, on the simulated clock): the router dispatched it only once the
instance had room, so the line only absorbs what the router could not see. The answer
travels back a one-way delay; P learns the round trip.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import cast

import simpy

from pdd.kv.pages import OutOfPages
from pdd.lab.sim.clock import drive
from pdd.lab.sim.fleet import Fleet, Proc
from pdd.lab.sim.instance import Instance
from pdd.lab.sim.sequence import Granted, Landing
from pdd.lab.workload.types import Session
from pdd.policy.capacity import relay_accepts
from pdd.policy.prefix import PREFIX_WAIT_S, may_hold, prefix_holder
from pdd.record import RequestRecord


class Reservations:
    """A deployment's reservations: what each decode-side instance answers P."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def reserve(
        self, p: Instance, inst: Instance, s: Session, rec: RequestRecord, optional: bool
    ) -> Generator[simpy.Event, object, Granted | None]:
        """RESERVE from P: (hit, hold) once the answer is back at P, None if refused."""
        sent = self.fleet.env.now
        one_way = self.fleet.line_between(p, inst).line.one_way_ms / 1000
        yield self.fleet.env.timeout(one_way)
        granted = yield from self._held_at(inst, s, rec, optional)
        yield self.fleet.env.timeout(one_way)
        self.fleet.line_meter(p, inst).round_trip(self.fleet.env.now - sent)
        return granted

    def _held_at(
        self, inst: Instance, s: Session, rec: RequestRecord, optional: bool
    ) -> Generator[simpy.Event, object, Granted | None]:
        if optional and not relay_accepts(inst.held, len(inst.waiting), inst.max_running):
            return None
        if inst.held >= inst.max_requests:
            return None
        prompt, keys = rec.prompt_tokens, self.fleet.keys(s, rec.prompt_tokens)
        inst.without_room += 1  # held from here on, as the live instance's job is
        landing = Landing(inst, keys, next(inst.arrivals))
        yield from await_prefix(inst, landing)
        if prompt + rec.max_tokens > inst.capacity_tokens:  # the engine's "exceeds the context window"
            inst.without_room -= 1
            landing.settle()
            return None

        def attempt() -> Granted | None:
            hit = inst.hit_tokens(keys, prompt)
            hold = inst.room_for(prompt - hit + rec.max_tokens, keys[: hit // inst.block_tokens])
            return None if hold is None else (hit, hold)

        async def reserve() -> Granted:  # the live line's attempt: OutOfPages while the pool is full
            granted = attempt()
            if granted is None:
                raise OutOfPages("the pool is full")
            return granted

        granted = attempt() if optional else (yield from drive(inst.reservations.take(landing, reserve, _never)))
        if granted is None:  # (only an optional one is refused for room)
            inst.without_room -= 1
            landing.settle()
            return None
        landing.reserved, landing.keys = True, self.fleet.keys(s, prompt + rec.max_tokens)
        granted[1].landing = landing
        return granted


def _never() -> bool:
    return False  # a simulated request is never aborted while it waits


def await_prefix(inst: Instance, me: Landing) -> Proc:
    """As the live decode side: wait (at most `PREFIX_WAIT_S`) for a request that is
    not producing yet and holds most of this prompt (`prefix_holder`), reserved or
    come before this one (`may_hold`), rather than have the same KV cross the line
    twice. The simulator works in blocks: the prompt and the requests in flight are
    their block keys, the cached length is in blocks and a page is one block. A key
    names its whole prefix (chained hashes), so a request whose key at the least
    qualifying length differs cannot qualify and is passed over without a walk."""
    deadline = inst.env.now + PREFIX_WAIT_S
    keys = me.keys
    while True:
        cached = inst.cache.match_keys(keys, touch=False).num_pages
        least = max(cached + 1, len(keys) // 2)
        if least > len(keys):
            return
        mark = keys[least - 1]
        others = [
            h
            for h in inst.unsettled
            if h is not me
            and may_hold(h.order < me.order, h.reserved)
            and len(h.keys) >= least
            and h.keys[least - 1] == mark
        ]
        # Block keys stand where the live side has token IDs: prefix_holder only compares them.
        in_flight = [cast("Sequence[int]", h.keys) for h in others]
        i = prefix_holder(cast("Sequence[int]", keys), cached, 1, in_flight) if others else None
        left = deadline - inst.env.now
        if i is None or left <= 0:
            return
        yield others[i].settled() | inst.env.timeout(left)
