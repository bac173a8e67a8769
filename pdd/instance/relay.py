"""The relay decode role (RLD): next to P, it hides the line's latency.

P sends it the full KV over the fast path; it decodes at once and its tokens go
straight to the router (the Eager Output Tokens). When P says MD holds the prompt's
KV (READY), the relay hands over by token IDs, as `pdd.policy.handoff` decides from
its load: one-shot (stop now, send every token) or catch-up (send chunks while still
producing; cut over once MD is within the threshold). After the cut-over it has
nothing left of the request: its pages go to its prefix cache.

If MD never gets ready (lost, or the line stalls) the relay simply finishes the
request; if the connection to MD drops during a catch-up, it abandons the handoff and
finishes too. Either way MD is sent the output as a fill, to keep for the session's
next turn. The anomaly filter's requests come from P like any other, without MD:
the relay decodes them to the end (their KV never crosses the line).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from pdd.engines.port import RequestError
from pdd.instance.decode_side import DecodeJob, DecodeSide
from pdd.instance.peers import PeerPool
from pdd.instance.role import Node, report_failure
from pdd.names import HandoffMode, RoleName
from pdd.policy.capacity import relay_accepts
from pdd.policy.handoff import HandoffPlan, choose_handoff, cut_over, occupancy
from pdd.transfer import messages as m
from pdd.transfer import wire
from pdd.transfer.wire import FramedConnection

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RelayJob(DecodeJob):
    handoff: asyncio.Task | None = None
    sent: int = 0  # output positions handed to MD so far
    computed: int = 0  # ... of which MD has computed (acknowledged)
    rounds: int = 0
    cutting: bool = False  # stopping for the final chunk: the handoff must not be cancelled now
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # a new token or acknowledgement


class RelayRole(DecodeSide[RelayJob]):
    def __init__(self, node: Node) -> None:
        super().__init__(node, RelayJob)
        self.policy = node.dep.policy
        self.peers = PeerPool(node.spec, lambda: node.dep, node.key, self._on_reply, self._on_main_lost)

    def optional(self, r: m.Reserve) -> bool:
        return r.main is not None  # MD can produce it (later): the relay only hides latency

    def refusal(self, r: m.Reserve) -> str | None:
        load = self.engine.load()
        if self.optional(r) and not relay_accepts(self.held(), load.waiting, load.max_running):
            return (
                f"{self.node.spec.name} is loaded ({self.held()} held, {load.waiting} waiting, "
                f"batch of {load.max_running})"
            )
        return super().refusal(r)

    def close(self) -> None:
        self.peers.close()

    def router_reached(self) -> None:
        self.peers.warm(i.name for i in self.node.dep.instances if i.role == RoleName.MAIN)

    async def on_peer_body(self, conn: FramedConnection, name: str, body: m.BetweenInstances) -> None:
        if isinstance(body, m.Ready):
            job = self.jobs.get(body.rid)  # gone: it finished here before MD was ready
            if isinstance(job, RelayJob) and job.peer == name and job.handoff is None and job.reserve.main:
                job.handoff = self.node.spawn(self._hand_off(job, job.reserve.main))
        else:
            await super().on_peer_body(conn, name, body)

    def on_token(self, job: RelayJob) -> None:
        job.progress.set()

    async def on_finished(self, job: RelayJob) -> None:
        """It finished here before any cut-over: MD, which holds (or will hold) the
        prompt's KV, gets the output as a fill, so the next turn hits at MD. A cut-over
        already begun finds nothing to cut and sends nothing, so the fill goes then too:
        without it MD would hold the request's pages until its handoff watchdog."""
        if job.reserve.main:
            try:
                conn = await self.peers.get(job.reserve.main)
                await m.send(
                    conn,
                    m.Handoff(
                        job.rid, job.sent, job.output[job.sent :], False, step_cap=self.policy.catch_up_chunk, fill=True
                    ),
                )
            except (TimeoutError, OSError, wire.FrameError) as e:
                log.debug("no fill of %s for %s: %s", job.rid, job.reserve.main, e)

    def forget(self, job: RelayJob) -> None:
        super().forget(job)
        if (
            isinstance(job, RelayJob)
            and job.handoff is not None
            and not job.cutting
            and job.handoff is not asyncio.current_task()
        ):
            job.handoff.cancel()  # it ended here (finished, aborted): nothing to hand over

    # ---- replies from MD -------------------------------------------------------------------
    async def _on_reply(self, main: str, body: m.BetweenInstances) -> None:
        job = self.jobs.get(getattr(body, "rid", None) or "")
        if not isinstance(job, RelayJob):
            return
        if isinstance(body, m.HandoffAck):
            job.computed = max(job.computed, body.computed)
            job.rounds += 1
            job.progress.set()
        elif isinstance(body, m.Error) and job.handoff is not None:  # MD refused: finish here
            log.warning("handoff of %s refused by %s: %s", job.rid, main, body.message)
            job.handoff.cancel()

    def _on_main_lost(self, main: str) -> None:
        for job in self.jobs.values():
            if isinstance(job, RelayJob) and job.reserve.main == main and job.handoff is not None:
                job.handoff.cancel()  # no handoff: the relay finishes the request

    # ---- the handoff -----------------------------------------------------------------------
    async def _hand_off(self, job: RelayJob, main: str) -> None:
        try:
            conn = await self.peers.get(main)
            if job.stream is None:  # its KV has not even arrived here: MD starts from P's token
                await self.end(job)
                await m.send(conn, m.Handoff(job.rid, 0, [], True, 0))
                self.node.to_router(job.router_id, m.HandedOff(job.rid, HandoffMode.ONE_SHOT, 0))
                return
            load = self.engine.load()
            plan = choose_handoff(
                len(job.output),
                occupancy(load.running, load.max_running),
                load.waiting,
                self.policy.handoff_threshold,
                self.policy.catch_up_chunk,
                self.policy.handoff,
            )
            if plan.mode == HandoffMode.CATCH_UP:
                await self._catch_up(job, conn, plan)
            await self._cut_over(job, conn, plan)
        except asyncio.CancelledError:
            pass
        except (TimeoutError, OSError, wire.FrameError) as e:
            log.warning("handoff of %s abandoned: %s", job.rid, e)
            if job.cutting:  # its sequence is cut here: nobody produces unless the router has MD take over
                await report_failure(self.node, job.router_id, job.rid, e)

    async def _send_chunks(self, job: RelayJob, conn: FramedConnection, plan: HandoffPlan) -> None:
        """Every produced token MD lacks, in chunks of `plan.chunk`."""
        while job.sent < len(job.output):
            chunk = job.output[job.sent : job.sent + plan.chunk]
            await m.send(conn, m.Handoff(job.rid, job.sent, chunk, False, step_cap=plan.chunk))
            job.sent += len(chunk)

    async def _catch_up(self, job: RelayJob, conn: FramedConnection, plan: HandoffPlan) -> None:
        """Relay on while MD computes what it is sent; return when it is close enough."""
        threshold = self.policy.handoff_threshold
        await self._send_chunks(job, conn, plan)
        acked, gap = job.rounds, None
        while True:
            job.progress.clear()
            if job.rounds != acked:  # MD caught up with a round: send what came since, or stop
                acked = job.rounds
                if cut_over(len(job.output), job.computed, threshold, job.rounds, gap):
                    return
                gap = len(job.output) - job.computed
                await self._send_chunks(job, conn, plan)
            await job.progress.wait()

    async def _cut_over(self, job: RelayJob, conn: FramedConnection, plan: HandoffPlan) -> None:
        job.cutting = True
        try:
            output = await self.engine.cut(job.rid)
        except RequestError:
            return  # it finished here meanwhile: on_finished sends MD the output as a fill
        await m.send(conn, m.Handoff(job.rid, job.sent, output[job.sent :], True, len(output)))
        chunks = 1 + (job.rounds if plan.mode == HandoffMode.CATCH_UP else 0)
        self.node.to_router(job.router_id, m.HandedOff(job.rid, plan.mode, len(output), chunks))
