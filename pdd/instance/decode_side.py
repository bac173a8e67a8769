"""What every decode-side instance (main and relay) does with a request P sends it.

RESERVE locks the longest cached prefix and answers the authoritative hit (waiting
in a first-come queue while the pool is full; a relay turns an optional request away
instead, `pdd.policy.capacity`). KV frames are imported chunk by
chunk as they land, each chunk acknowledged, so P can measure the line. KV_DONE makes
the KV complete: with `emit`, decoding starts and every token goes to the request's
router with its output position; without, the role waits for a handoff.

One `DecodeJob` holds a request's whole state here; `jobs` maps ids to them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar, assert_never

from msgspec.structs import replace  # messages and sampling params are msgspec structs

from pdd.engines.port import OutputStream
from pdd.instance.reservations import ReservationQueue
from pdd.instance.role import Node, not_taken, report_failure, tokens_of
from pdd.kv import codec
from pdd.kv.pages import OutOfPages
from pdd.kv.reassembly import Reassembly
from pdd.policy.prefix import PREFIX_WAIT_S, may_hold, prefix_holder
from pdd.sampling.params import Logprob
from pdd.transfer import messages as m
from pdd.transfer import wire
from pdd.transfer.wire import FramedConnection, MsgType

log = logging.getLogger(__name__)


@dataclass(eq=False)
class DecodeJob:
    """One request on a decode-side instance, from RESERVE until it ends here."""

    reserve: m.Reserve
    peer: str  # the P that reserved it: its connections' loss ends an incomplete job
    owner: FramedConnection  # P's control connection: replies go there
    reserved: bool = False
    loaded: bool = False  # all KV is in (KV_DONE)
    first_token: int | None = None
    first_logprob: Logprob | None = None  # P's token's, where the request asks for logprobs
    prompt_logprobs: list[Logprob | None] | None = None  # P's, where asked: sent with position 0
    kv: Reassembly | None = None  # the KV arriving, from the reserved hit on (set once reserved)
    importing: asyncio.Task | None = None  # the last chunk's import (they run in token order)
    kv_in: asyncio.Event = field(default_factory=asyncio.Event)  # every prompt token's import issued, or ended
    output: list[int] = field(default_factory=list)  # output tokens known here, by position
    given: int = 0  # how many of them the engine has
    stream: OutputStream | None = None
    stall_from: float | None = None  # a handoff's final chunk arrived then; the next token ends the stall
    producing: bool = False  # this instance streams the request's tokens
    ended: bool = False
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # set once it produces or ends

    @property
    def rid(self) -> str:
        return self.reserve.rid

    @property
    def router_id(self) -> str:
        return self.reserve.router_id


J = TypeVar("J", bound=DecodeJob)


class DecodeSide(Generic[J]):
    """Base of `MainRole` and `RelayRole`; subclasses add the handoff, and their jobs
    (`job_type`) the handoff's state."""

    def __init__(self, node: Node, job_type: type[J]) -> None:
        self.node = node
        self.engine = node.engine
        self.job_type = job_type
        self.jobs: dict[str, J] = {}
        self.prefix_waits_expired = 0  # reservations that waited PREFIX_WAIT_S for a prefix holder in vain
        self.queue: ReservationQueue[J] = ReservationQueue(
            lambda job: self.node.to_router(job.router_id, m.Progress(job.rid, "queued"))
        )

    # ---- frames --------------------------------------------------------------------------
    async def on_peer(self, conn: FramedConnection, name: str, frame: wire.Frame) -> None:
        try:
            if frame.type == MsgType.KV_LAYER:
                header, blob = m.decode_kv(frame)
                if header.rid not in self.node.aborted:  # (KV still on the line when it was aborted)
                    await self._on_layer(conn, self._job(header.rid, name), codec.decode(blob))
            else:
                await self.on_peer_body(conn, name, m.between_instances(frame))
        except Exception as e:  # one bad request must not end the connection's others
            rid = m.rid_of(frame)
            log.warning("request %s from %s failed: %s: %s", rid, name, type(e).__name__, e)
            job = self.jobs.get(rid) if rid else None
            if job is not None:
                await self.fail(job, e)
            elif rid:
                await self.node.send(conn, m.Error(f"{type(e).__name__}: {e}", rid))

    def held(self) -> int:
        return len(self.jobs)

    def close(self) -> None:
        pass

    def router_reached(self) -> None:
        pass

    def optional(self, r: m.Reserve) -> bool:
        """Whether the request can do without this instance (a relay's, with an MD to
        fall back on): then a full pool refuses it at once instead of holding it back."""
        return False

    def refusal(self, r: m.Reserve) -> str | None:
        """Why this instance will not hold `r` now (None: it will, queued if need be)."""
        if self.node.full():
            return f"{self.node.spec.name} holds {self.held()} requests, its limit"
        return None

    async def on_peer_body(self, conn: FramedConnection, name: str, body: m.BetweenInstances) -> None:
        match body:
            case m.Reserve():
                await self._on_reserve(conn, name, body)
            case m.KVDone():
                await self._on_kv_done(conn, name, body)
            case m.Abort():  # P drops what it reserved or sent, for nothing
                self.node.aborted.add(body.rid)
                dropped = self.jobs.get(body.rid)
                if dropped is not None:
                    await self.end(dropped)
            case (
                m.ReserveAck() | m.KVAck() | m.Ready() | m.Handoff() | m.HandoffAck() | m.Error() | m.KVRegionAsk()
                | m.KVRegion() | m.KVPlaced() | m.KVSlotFree()
            ):  # fmt: skip
                raise m.BadMessage(f"{type(body).__name__} is not for a {self.node.spec.role} instance")
            case _:
                assert_never(body)

    async def _on_reserve(self, conn: FramedConnection, name: str, body: m.Reserve) -> None:
        if body.rid in self.node.aborted:
            return
        refusal = self.refusal(body)
        if refusal:
            await self.node.send(conn, m.ReserveAck(body.rid, error=refusal, busy=True))
            return
        job = self.jobs[body.rid] = self.job_type(body, name, conn)
        self.node.took()
        self.node.spawn(self._reserve(job))

    async def _on_kv_done(self, conn: FramedConnection, name: str, body: m.KVDone) -> None:
        if body.rid in self.node.aborted:  # confirm it anyway: P counts it off the line
            await self.node.send(conn, m.KVAck(body.rid, 0, done=True))
            return
        job = self._job(body.rid, name)
        await job.kv_in.wait()  # KV_DONE may overtake KV on another connection
        if job.importing is not None:
            await job.importing
        if job.ended:
            return
        job.loaded, job.first_token, job.first_logprob = True, body.first_token, body.first_logprob
        job.prompt_logprobs = body.prompt_logprobs
        await self.node.send(conn, m.KVAck(job.rid, len(job.reserve.prompt), done=True))
        if body.emit:
            job.output = [body.first_token]
            await self.run(job, emit_from=0)
        else:
            await self.on_loaded(job)

    async def on_router(self, router_id: str, body: m.FromRouter) -> None:
        match body:
            case m.Abort():
                self.node.aborted.add(body.rid)
                job = self.jobs.get(body.rid)
                if job is not None:
                    await self.end(job)
            case m.Submit() | m.Handoff() | m.CacheUpdate() | m.Member() | m.Drain():
                not_taken(self.node, router_id, body)
            case _:
                assert_never(body)

    def _job(self, rid: str, peer: str) -> J:
        job = self.jobs.get(rid)
        if job is None or job.peer != peer:
            raise m.BadMessage(f"request {rid!r} is not reserved here by {peer}")
        return job

    # ---- reservation and KV --------------------------------------------------------------
    async def _await_prefix(self, job: J) -> None:
        """Wait, bounded, for a request still landing here that holds most of this prompt
        (`pdd.policy.prefix`), rather than have the same KV cross the line twice."""
        deadline = time.monotonic() + PREFIX_WAIT_S
        prompt = job.reserve.prompt
        while True:
            cached = await self.engine.cached_prefix(prompt, job.reserve.params.cache_salt)
            others = self._may_hold(job)
            i = prefix_holder(prompt, cached, self.engine.page_size, [o.reserve.prompt + o.output for o in others])
            if i is None:
                return
            try:
                await asyncio.wait_for(others[i].settled.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                self.prefix_waits_expired += 1
                log.info("%s: %s did not land within %g s; reserving without it", job.rid, others[i].rid, PREFIX_WAIT_S)
                return

    def _may_hold(self, job: J) -> list[J]:
        """The unsettled requests `job` may wait for (`may_hold`; `jobs` is in arrival order)."""
        out, earlier = [], True
        for o in self.jobs.values():
            if o is job:
                earlier = False
            elif (
                may_hold(earlier, o.reserved)
                and not o.settled.is_set()
                and o.reserve.use_cache
                and o.reserve.params.cache_salt == job.reserve.params.cache_salt  # (another namespace's is no help)
            ):
                out.append(o)
        return out

    async def _reserve(self, job: J) -> None:
        r = job.reserve
        if r.use_cache:
            await self._await_prefix(job)
        if job.ended:
            return
        try:
            hit: int | None
            if self.optional(r):  # a loaded relay turns it away at once: P sends it P -> MD
                hit = await self.engine.reserve(r.rid, r.prompt, r.params, r.use_cache)
            else:
                hit = await self.queue.take(
                    job, lambda: self.engine.reserve(r.rid, r.prompt, r.params, r.use_cache), lambda: job.ended
                )
                if hit is None:
                    return
        except OutOfPages as e:
            await self._refuse(job, f"{self.node.spec.name} is full: {e}", busy=True)
            return
        except Exception as e:
            await self._refuse(job, str(e))
            return
        if job.ended:  # released or aborted while the engine reserved
            await self.engine.release(r.rid)
            return
        job.reserved, job.kv = True, Reassembly(hit, len(r.prompt))  # P sends the KV of [hit, prompt)
        if job.kv.complete:
            job.kv_in.set()
        await self.node.send(job.owner, m.ReserveAck(r.rid, hit))

    async def _refuse(self, job: J, reason: str, busy: bool = False) -> None:
        self.forget(job)
        await self.node.send(job.owner, m.ReserveAck(job.rid, error=reason, busy=busy))

    async def _on_layer(self, conn: FramedConnection, job: J, blob: codec.KVBlob) -> None:
        if job.kv is None:
            raise m.BadMessage(f"KV of {job.rid} before its reservation was answered")
        for whole in job.kv.add(blob):
            # not awaited: reading goes on (the line keeps flowing) while the engine is busy;
            # engine commands run in the order they are issued, so chunks land in token order
            job.importing = self.node.spawn(self._import(conn, job, whole))
        if job.kv.complete:
            job.kv_in.set()

    async def _import(self, conn: FramedConnection, job: J, blob: codec.KVBlob) -> None:
        try:
            await self.engine.import_kv(job.rid, blob)
        except Exception as e:
            if not job.ended:
                await self.fail(job, e)
            return
        await self.node.send(conn, m.KVAck(job.rid, blob.header.token_end))

    # ---- decoding ------------------------------------------------------------------------
    async def run(self, job: J, emit_from: int | None, shadow: bool = False, step_cap: int = 0) -> None:
        """Hand the engine the output tokens it lacks (`job.output[job.given:]`) and
        decode on (`shadow`: compute them only). Positions from `emit_from` on, known
        or produced, are streamed to the request's router."""
        new = job.output[job.given :]
        # claimed before the engine is awaited: a fill's catch-up acknowledgement racing
        # the fill itself must not hand the same tokens over twice
        job.given += len(new)
        if job.stream is None:
            stream = self.engine.watch(job.rid)
            try:
                cached = await self.engine.start(job.rid, new, shadow, step_cap)
            except BaseException:
                stream.close()
                raise
            job.stream = stream
            self.node.spawn(self._forward(job, stream))
        else:
            cached = await self.engine.start(job.rid, new, shadow, step_cap)
        job.producing = emit_from is not None
        if job.producing:
            job.settled.set()
        if emit_from is not None and emit_from < len(job.output):
            # known, not produced here: P's first token (its logprob came with KV_DONE), or a
            # takeover's given tokens, whose logprobs the router has from their producer
            lps = [job.first_logprob] if emit_from == 0 and len(job.output) == 1 and job.first_logprob else None
            prompt_lps = job.prompt_logprobs if emit_from == 0 else None
            tokens = m.Tokens(
                job.rid, emit_from, job.output[emit_from:], None, cached, logprobs=lps, prompt_logprobs=prompt_lps
            )
            self.node.to_router(job.router_id, tokens)

    async def _forward(self, job: J, stream: OutputStream) -> None:
        finished = False
        try:
            async for out in stream:
                finished = out.finish_reason not in (None, "abort")
                if out.caught_up is not None:
                    await self.on_caught_up(job, out.caught_up)
                if out.token is None:
                    continue
                job.output.append(out.token)
                tokens = tokens_of(job.rid, out)
                if job.stall_from is not None:  # the first token after a handoff: how long MD stalled
                    tokens = replace(tokens, stall_ms=1000 * (time.monotonic() - job.stall_from))
                    job.stall_from = None
                self.node.to_router(job.router_id, tokens)
                self.on_token(job)
        except RuntimeError as e:  # the engine failed this request: say so, don't go silent
            await report_failure(self.node, job.router_id, job.rid, e)
        finally:
            stream.close()
            self.forget(job)
        if finished:
            await self.on_finished(job)

    async def on_finished(self, job: J) -> None:
        """The request finished here (the relay hands its output over for the cache)."""

    def on_token(self, job: J) -> None:
        """This instance produced `job.output[-1]` (the relay watches for its handoff)."""

    async def on_caught_up(self, job: J, computed: int) -> None:
        """A catch-up chunk is computed: output positions below `computed` (main only)."""

    async def on_loaded(self, job: J) -> None:
        """KV complete without `emit`: the main instance waits for a handoff."""
        raise m.BadMessage(f"a {self.node.spec.role} instance cannot wait for a handoff")

    # ---- endings -------------------------------------------------------------------------
    def forget(self, job: J) -> None:
        job.ended = True
        job.settled.set()
        job.kv_in.set()
        if self.jobs.get(job.rid) is job:
            del self.jobs[job.rid]

    async def end(self, job: J) -> None:
        """Stop the request here and give its pages back (its KV stays in the cache)."""
        self.forget(job)
        if job.stream is not None:
            self.engine.abort(job.rid)
        elif job.reserved:
            await self.engine.release(job.rid)

    async def fail(self, job: J, error: BaseException) -> None:
        await self.end(job)
        await self.node.send(job.owner, m.Error(f"{type(error).__name__}: {error}", job.rid))
        await report_failure(self.node, job.router_id, job.rid, error)

    def peer_lost(self, name: str) -> None:
        """A connection from P is gone: what it reserved and had not finished sending is
        dropped, and the router hears so (it would otherwise wait for tokens that cannot
        come until its timeout), once the router's own heartbeats would have told it of a
        dead P: it then retries the request on another P, where MD's word, first, would
        fail it as MD's own loss. (MD hears of it at once where one of P's connections
        carries nothing: P's KV is striped over several, `pdd.instance.peers`.)"""
        for job in [j for j in self.jobs.values() if j.peer == name and not j.loaded]:
            self.node.spawn(self.end(job))
            lost = ConnectionError(f"prefill instance {name} was lost before the KV was complete")
            self.node.spawn(self._report_p_lost(job, lost))

    async def _report_p_lost(self, job: J, lost: ConnectionError) -> None:
        live = self.node.dep.liveness
        await asyncio.sleep(live.dead_after_s + live.heartbeat_s)  # (for the attempt it left: ignored)
        await report_failure(self.node, job.router_id, job.rid, lost)

    def router_lost(self, router_id: str) -> None:
        """Nobody will read these tokens any more: stop computing them."""
        for job in [j for j in self.jobs.values() if j.router_id == router_id]:
            self.node.aborted.add(job.rid)
            self.node.spawn(self.end(job))
