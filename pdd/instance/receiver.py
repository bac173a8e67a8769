"""What every decode-side instance (main and relay) does with a request P sends it.

RESERVE locks the longest cached prefix and answers the authoritative hit (waiting,
per `pdd.policy.retry`, while the pool is full). KV frames are imported chunk by
chunk as they land, each chunk acknowledged, so P can measure the line. KV_DONE makes
the KV complete: with `emit`, decoding starts and every token goes to the request's
router with its output position; without, the role waits for a handoff.

One `DecodeJob` holds a request's whole state here; `jobs` maps ids to them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pdd.engine.kv_pool import OutOfPages
from pdd.instance.standalone import report_failure, tokens_of
from pdd.kv import codec
from pdd.policy.retry import reserve_retry_delay
from pdd.transfer import messages as m
from pdd.transfer import wire
from pdd.transfer.wire import FramedConnection, MsgType

if TYPE_CHECKING:
    from pdd.instance.engine_port import OutputStream
    from pdd.instance.node import Node

log = logging.getLogger(__name__)
RESERVE_WAIT_S = 45.0  # a full pool holds a reservation back this long, then refuses


@dataclass(eq=False)
class DecodeJob:
    """One request on a decode-side instance, from RESERVE until it ends here."""

    reserve: m.Reserve
    owner: FramedConnection  # P's connection: replies go there, and its loss ends an incomplete job
    reserved: bool = False
    loaded: bool = False  # all KV is in (KV_DONE)
    first_token: int | None = None
    layers: list[codec.KVBlob] = field(default_factory=list)  # the chunk in flight, layer by layer
    stream: OutputStream | None = None
    ended: bool = False

    @property
    def rid(self) -> str:
        return self.reserve.rid

    @property
    def router_id(self) -> str:
        return self.reserve.router_id


class DecodeSide:
    """Base of `MainRole` and `RelayRole`; subclasses add the handoff."""

    job_type: type[DecodeJob] = DecodeJob

    def __init__(self, node: Node) -> None:
        self.node = node
        self.engine = node.engine
        self.jobs: dict[str, DecodeJob] = {}

    # ---- frames --------------------------------------------------------------------------
    async def on_peer(self, conn: FramedConnection, name: str, frame: wire.Frame) -> None:
        try:
            if frame.type == MsgType.KV_LAYER:
                header, blob = m.decode_kv(frame)
                await self._on_layer(conn, self._job(header.rid, conn), codec.decode(blob))
            else:
                await self.on_peer_body(conn, name, m.decode(frame))
        except Exception as e:  # one bad request must not end the connection's others
            rid = m.rid_of(frame)
            log.warning("request %s from %s failed: %s: %s", rid, name, type(e).__name__, e)
            job = self.jobs.get(rid) if rid else None
            if job is not None:
                await self.fail(job, e)
            elif rid:
                await self.node.send(conn, m.Error(f"{type(e).__name__}: {e}", rid))

    async def on_peer_body(self, conn: FramedConnection, name: str, body: Any) -> None:
        if isinstance(body, m.Reserve):
            if body.rid in self.node.aborted:
                return
            job = self.jobs[body.rid] = self.job_type(body, conn)
            self.node.spawn(self._reserve(job))
        elif isinstance(body, m.KVDone):
            job = self._job(body.rid, conn)
            job.loaded, job.first_token = True, body.first_token
            await self.node.send(conn, m.KVAck(job.rid, len(job.reserve.prompt), done=True))
            if body.emit:
                await self.begin(job, [body.first_token], emit_from=0)
            else:
                await self.on_loaded(job)
        elif isinstance(body, (m.Release, m.Abort)):
            job = self.jobs.get(body.rid)
            if isinstance(body, m.Abort):
                self.node.aborted.add(body.rid)
            if job is not None:
                await self.end(job)
        else:
            raise m.BadMessage(f"{type(body).__name__} is not for a {self.node.spec.role} instance")

    async def on_router(self, router_id: str, body: Any) -> None:
        if isinstance(body, m.Abort):
            self.node.aborted.add(body.rid)
            job = self.jobs.get(body.rid)
            if job is not None:
                await self.end(job)
        else:
            self.node.to_router(router_id, m.Error(f"{type(body).__name__} is not for a {self.node.spec.role} "
                                                   "instance", getattr(body, "rid", None)))

    def _job(self, rid: str, conn: FramedConnection) -> DecodeJob:
        job = self.jobs.get(rid)
        if job is None or job.owner is not conn:
            raise m.BadMessage(f"request {rid!r} is not reserved here by this peer")
        return job

    # ---- reservation and KV --------------------------------------------------------------
    async def _reserve(self, job: DecodeJob) -> None:
        r = job.reserve
        started, attempt = time.monotonic(), 0
        while not job.ended:
            try:
                hit = await self.engine.reserve(r.rid, r.prompt, r.params, r.use_cache)
            except OutOfPages as e:
                delay = reserve_retry_delay(attempt, time.monotonic() - started, RESERVE_WAIT_S)
                if delay is None:
                    await self._refuse(job, f"decode instance full: {e}")
                    return
                attempt += 1
                await asyncio.sleep(delay)
                continue
            except Exception as e:
                await self._refuse(job, str(e))
                return
            if job.ended:  # released or aborted while the engine reserved
                await self.engine.release(r.rid)
                return
            job.reserved = True
            await self.node.send(job.owner, m.ReserveAck(r.rid, hit))
            return

    async def _refuse(self, job: DecodeJob, reason: str) -> None:
        self._forget(job)
        await self.node.send(job.owner, m.ReserveAck(job.rid, error=reason))

    async def _on_layer(self, conn: FramedConnection, job: DecodeJob, blob: codec.KVBlob) -> None:
        job.layers.append(blob)
        if blob.header.layer_end == blob.header.num_layers:  # the chunk's last layer: import it whole
            whole, job.layers = codec.join_layers(job.layers), []
            await self.engine.import_kv(job.rid, whole)
            await self.node.send(conn, m.KVAck(job.rid, whole.header.token_end))

    # ---- decoding ------------------------------------------------------------------------
    async def begin(self, job: DecodeJob, tokens: list[int], emit_from: int, stall_from: float | None = None) -> None:
        """Extend the reserved request by output tokens `tokens` and decode on, streaming
        every output position from `emit_from` to the router."""
        job.stream = self.engine.watch(job.rid)
        try:
            cached = await self.engine.start(job.rid, tokens)
        except BaseException:
            job.stream.close()
            raise
        if emit_from < len(tokens):
            self.node.to_router(job.router_id, m.Tokens(job.rid, emit_from, tokens[emit_from:], None, cached))
        self.node.spawn(self._forward(job, stall_from))

    async def _forward(self, job: DecodeJob, stall_from: float | None) -> None:
        stream = job.stream
        try:
            async for out in stream:
                if out.finish_reason == "abort" or out.token is None:
                    continue
                tokens = tokens_of(job.rid, out)
                if stall_from is not None:  # the first token after a handoff: how long MD stalled
                    tokens = replace(tokens, stall_ms=1000 * (time.monotonic() - stall_from))
                    stall_from = None
                self.on_token(job, out.position, out.token)
                self.node.to_router(job.router_id, tokens)
        except RuntimeError as e:  # the engine failed this request: say so, don't go silent
            await report_failure(self.node, job.router_id, job.rid, e)
        finally:
            stream.close()
            self._forget(job)

    def on_token(self, job: DecodeJob, position: int, token: int) -> None:
        """A token this instance produced (the relay tracks them for its handoff)."""

    async def on_loaded(self, job: DecodeJob) -> None:
        """KV complete without `emit`: the main instance waits for a handoff."""
        raise m.BadMessage(f"a {self.node.spec.role} instance cannot wait for a handoff")

    # ---- endings -------------------------------------------------------------------------
    def _forget(self, job: DecodeJob) -> None:
        job.ended = True
        if self.jobs.get(job.rid) is job:
            del self.jobs[job.rid]

    async def end(self, job: DecodeJob) -> None:
        """Stop the request here and give its pages back (its KV stays in the cache)."""
        self._forget(job)
        if job.stream is not None:
            self.engine.abort(job.rid)
        elif job.reserved:
            await self.engine.release(job.rid)

    async def fail(self, job: DecodeJob, error: BaseException) -> None:
        await self.end(job)
        await self.node.send(job.owner, m.Error(f"{type(error).__name__}: {error}", job.rid))
        await report_failure(self.node, job.router_id, job.rid, error)

    def peer_lost(self, conn: FramedConnection) -> None:
        """P is gone: what it reserved and had not finished sending is dropped."""
        for job in [j for j in self.jobs.values() if j.owner is conn and not j.loaded]:
            self.node.spawn(self.end(job))

    def router_lost(self, router_id: str) -> None:
        """Nobody will read these tokens any more: stop computing them."""
        for job in [j for j in self.jobs.values() if j.router_id == router_id]:
            self.node.aborted.add(job.rid)
            self.node.spawn(self.end(job))
