"""The main decode role (MD): the remote datacenter's decode capacity.

It receives the KV delta its reservation asked for and either decodes at once
(P -> MD) or, behind a relay (P -> RLD -> MD), waits for the relay's handoff: token
IDs only, whose KV it recomputes by extend (PDD_SPEC item 2). Catch-up chunks are
computed in the shadow, at most `step_cap` a step, and acknowledged; the final chunk
makes MD the producer, streaming every position from the handoff's `emit_from`. A
router may send the final chunk itself when the relay is lost (a takeover). When the
relay finished the request itself, its output arrives as a fill: computed in the
shadow and kept, with the prompt, in the prefix cache for the session's next turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from pdd.instance.decode_side import DecodeJob, DecodeSide
from pdd.instance.role import Node, Tombstones
from pdd.transfer import messages as m
from pdd.transfer.wire import FramedConnection

log = logging.getLogger(__name__)
HANDOFF_IDLE_S = 60.0
MAX_EARLY = 1024  # requests whose handoff frames arrived before their reservation


@dataclass(eq=False)
class MainJob(DecodeJob):
    final: m.Handoff | None = None  # arrived before the KV was complete: applied then
    relay_conn: FramedConnection | None = None  # catch-up acknowledgements go there
    step_cap: int = 0  # catch-up: most handed-over tokens computed per step
    computed: int = 0  # output positions computed in the shadow
    fill: bool = False  # the relay finished: compute its output for the cache, then let go


class MainRole(DecodeSide[MainJob]):
    def __init__(self, node: Node) -> None:
        super().__init__(node, MainJob)
        # The relay's frames and P's reservation come on different connections; after a
        # stalled line a relay's handoff (a fill, say) can overtake the reservation. It is
        # kept here, bounded, and applied when the reservation lands: refused, it would
        # leave the reservation waiting for a handoff that never comes, pages held.
        self.early: OrderedDict[str, list[tuple[m.Handoff, FramedConnection]]] = OrderedDict()
        self.ended = Tombstones()  # requests that were here: a late handoff for one is refused

    async def on_peer_body(self, conn: FramedConnection, name: str, body: m.BetweenInstances) -> None:
        if isinstance(body, m.Handoff):
            job = self.jobs.get(body.rid)
            if job is None:
                self._keep_early(body, conn)
                return
            await self._on_handoff(job, body, conn)
            return
        await super().on_peer_body(conn, name, body)
        if isinstance(body, m.Reserve):
            early, job = self.early.pop(body.rid, []), self.jobs.get(body.rid)
            if job is not None:
                for h, reply_to in early:
                    await self._on_handoff(job, h, reply_to)
        elif isinstance(body, m.Abort):
            self.early.pop(body.rid, None)

    def _keep_early(self, h: m.Handoff, conn: FramedConnection) -> None:
        if h.rid in self.ended or h.rid in self.node.aborted:  # the relay hears so and finishes alone
            raise m.BadMessage(f"request {h.rid!r} is not held here")
        self.early.setdefault(h.rid, []).append((h, conn))
        while len(self.early) > MAX_EARLY:
            self.early.popitem(last=False)

    async def on_router(self, router_id: str, body: m.FromRouter) -> None:
        if isinstance(body, m.Handoff):  # the relay was lost: take over from what the client has
            job = self.jobs.get(body.rid)
            if job is None or job.router_id != router_id:
                self.node.to_router(router_id, m.Error(f"request {body.rid!r} is not held here", body.rid))
                return
            try:
                await self._on_handoff(job, body, None)
            except Exception as e:
                await self.fail(job, e)
        else:
            if isinstance(body, m.Abort):
                self.early.pop(body.rid, None)
            await super().on_router(router_id, body)

    def forget(self, job: MainJob) -> None:
        self.ended.add(job.rid)
        super().forget(job)

    async def _on_handoff(self, job: MainJob, h: m.Handoff, reply_to: FramedConnection | None) -> None:
        if job.producing:
            return  # already the producer (P -> MD, or an earlier final chunk): nothing to take over
        have = job.output
        if h.start > len(have) or have[h.start : h.start + len(h.tokens)] != h.tokens[: len(have) - h.start]:
            raise m.BadMessage(f"handoff tokens at {h.start} do not continue the {len(have)} known")
        have.extend(h.tokens[len(have) - h.start :])
        if reply_to is not None:
            job.relay_conn = reply_to
        if h.final:
            job.final = h
        else:
            job.step_cap, job.fill = h.step_cap, h.fill
        if job.loaded:
            await self._apply(job)

    async def on_loaded(self, job: MainJob) -> None:
        self.node.spawn(self._watch(job))
        await self._apply(job)

    async def _watch(self, job: MainJob) -> None:
        """A request waiting for a handoff that makes no progress (its relay finished
        and the fill was lost, say) must not hold pages forever."""
        seen = -1
        while not job.ended and not job.producing:
            if len(job.output) == seen:
                log.warning("%s: no handoff for %.0f s; dropped", job.rid, HANDOFF_IDLE_S)
                await self.end(job)
                return
            seen = len(job.output)
            await asyncio.sleep(HANDOFF_IDLE_S)

    async def _apply(self, job: MainJob) -> None:
        """Compute what was handed over: in the shadow, or taking over on the final chunk."""
        if job.final is None:
            if len(job.output) > job.given:
                await self.run(job, None, shadow=True, step_cap=job.step_cap)
            elif job.fill and job.computed == len(job.output):
                await self.end(job)  # its KV stays in the prefix cache
            return
        h, job.final = job.final, None
        if not job.output:  # nothing was relayed (a takeover before any token): start at P's token
            assert job.first_token is not None  # KV_DONE set it with `loaded`, which every caller waits for
            job.output = [job.first_token]
        job.stall_from = time.monotonic()
        job.relay_conn = None
        await self.run(job, h.emit_from)

    async def on_caught_up(self, job: MainJob, computed: int) -> None:
        job.computed = computed
        if job.fill:
            await self._apply(job)
        elif job.relay_conn is not None:
            await self.node.send(job.relay_conn, m.HandoffAck(job.rid, computed))
