"""The prefill role (P): prefill, then move the KV to the decode side.

While P prefills, the main decode instance reserves (one WAN round trip, overlapped)
and answers the hit it holds; P sends exactly the KV after that hit, chunk by chunk,
one layer per frame. The pipeline is chosen here, from that reserved hit and what P
knows of the line (`Line`), by `pdd.policy.pipeline`. P tells the router the
pipeline and hits as soon as they are known, and the bytes moved when done.

One `PrefillJob` holds a request's state; replies from decode-side instances are
keyed by (request, peer), so two peers' answers never overwrite each other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pdd.instance.peers import PeerPool
from pdd.instance.standalone import report_failure
from pdd.kv import codec
from pdd.policy.pipeline import choose_pipeline
from pdd.policy.transfer import LinkEstimate, kv_chunks, kv_range, observe_rate, observe_rtt
from pdd.transfer import messages as m
from pdd.transfer import wire

if TYPE_CHECKING:
    from pdd.instance.node import Node

log = logging.getLogger(__name__)
ACK_TIMEOUT_S = 60.0
LOCAL_PRIOR = LinkEstimate(bytes_per_s=1.25e9, one_way_s=1e-4)  # inside a datacenter, until measured


@dataclass
class _Transfer:
    start: int
    end: int
    bytes_per_token: int
    acked: int = 0

    @property
    def remaining_bytes(self) -> int:
        return (self.end - max(self.acked, self.start)) * self.bytes_per_token


class Line:
    """What this P knows of the path to one datacenter: the estimate it keeps from
    reservation round trips and acknowledged KV, and the KV it has in flight there."""

    def __init__(self, prior: LinkEstimate) -> None:
        self.estimate = prior
        self._transfers: dict[tuple[str, str], _Transfer] = {}  # (request, peer)
        self._last_ack: float | None = None  # the line has been busy since then

    def in_flight(self) -> list[int]:
        return [t.remaining_bytes for t in self._transfers.values()]

    def begin(self, key: tuple[str, str], start: int, end: int, bytes_per_token: int) -> None:
        if not self._transfers:
            self._last_ack = time.monotonic()
        self._transfers[key] = _Transfer(start, end, bytes_per_token)

    def acked(self, key: tuple[str, str], token_end: int, done: bool) -> None:
        t = self._transfers.get(key)
        if t is None:
            return
        now = time.monotonic()
        delta = (token_end - max(t.acked, t.start)) * t.bytes_per_token
        t.acked = max(t.acked, token_end)
        if self._last_ack is not None and delta > 0:
            self.estimate = observe_rate(self.estimate, delta, now - self._last_ack)
        self._last_ack = now
        if done:
            self.end(key)

    def end(self, key: tuple[str, str]) -> None:
        self._transfers.pop(key, None)
        if not self._transfers:
            self._last_ack = None

    def round_trip(self, seconds: float) -> None:
        self.estimate = observe_rtt(self.estimate, seconds)


@dataclass(eq=False)
class PrefillJob:
    """One request on P, from SUBMIT until its KV is handed over (or it fails)."""

    submit: m.Submit
    router_id: str
    replies: dict[str, asyncio.Future] = field(default_factory=dict)  # peer -> its ReserveAck
    reserve_sent: dict[str, float] = field(default_factory=dict)  # peer -> when RESERVE went
    holders: set[str] = field(default_factory=set)  # peers holding state P must drop if it stops
    task: asyncio.Task | None = None

    @property
    def rid(self) -> str:
        return self.submit.rid


class PrefillRole:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.engine = node.engine
        self.policy = node.dep.policy
        self.jobs: dict[str, PrefillJob] = {}
        self.peers = PeerPool(node.spec, node.dep, node.key, self._on_reply, self._on_peer_lost)
        self.lines: dict[str, Line] = {}  # by datacenter

    def close(self) -> None:
        self.peers.close()

    def _line(self, peer: str) -> Line:
        dc = self.node.dep.instance(peer).dc
        if dc not in self.lines:
            link = self.node.dep.link
            prior = LOCAL_PRIOR if dc == self.node.spec.dc else LinkEstimate(link.bandwidth_mbps * 125_000,
                                                                              link.delay_ms / 1000)
            self.lines[dc] = Line(prior)
        return self.lines[dc]

    # ---- from routers --------------------------------------------------------------------
    async def on_router(self, router_id: str, body: Any) -> None:
        if isinstance(body, m.Submit):
            if body.rid in self.node.aborted or body.rid in self.jobs:
                return
            job = self.jobs[body.rid] = PrefillJob(body, router_id)
            job.task = self.node.spawn(self._run(job))
        elif isinstance(body, m.Abort):
            self.node.aborted.add(body.rid)
            job = self.jobs.get(body.rid)
            if job is not None and job.task is not None:
                job.task.cancel()
        else:
            self.node.to_router(router_id, m.Error(f"a prefill instance does not take {type(body).__name__}",
                                                   getattr(body, "rid", None)))

    async def on_peer(self, conn, name, frame) -> None:
        await self.node.send(conn, m.Error("a prefill instance takes no peer traffic"))

    def peer_lost(self, conn) -> None:
        pass

    def router_lost(self, router_id: str) -> None:
        for job in [j for j in self.jobs.values() if j.router_id == router_id]:
            self.node.aborted.add(job.rid)
            job.task.cancel()

    # ---- from decode-side instances ------------------------------------------------------
    async def _on_reply(self, peer: str, frame: wire.Frame) -> None:
        try:
            body = m.decode(frame)
        except m.BadMessage as e:
            log.warning("bad reply from %s: %s", peer, e)
            return
        rid = getattr(body, "rid", None)
        if isinstance(body, m.KVAck):
            self._line(peer).acked((body.rid, peer), body.token_end, body.done)
        job = self.jobs.get(rid) if rid else None
        if job is None:
            return
        fut = job.replies.get(peer)
        if isinstance(body, m.ReserveAck) and fut is not None and not fut.done():
            self._line(peer).round_trip(time.monotonic() - job.reserve_sent[peer])
            fut.set_result(body)
        elif isinstance(body, m.Error):
            self._line(peer).end((rid, peer))
            if fut is not None and not fut.done():
                fut.set_exception(RuntimeError(f"{peer}: {body.message}"))

    def _on_peer_lost(self, peer: str) -> None:
        for job in self.jobs.values():
            fut = job.replies.get(peer)
            if fut is not None and not fut.done():
                fut.set_exception(ConnectionError(f"decode instance {peer} unreachable"))
            self._line(peer).end((job.rid, peer))

    # ---- a request -----------------------------------------------------------------------
    async def _run(self, job: PrefillJob) -> None:
        try:
            await self._serve(job)
        except asyncio.CancelledError:
            pass
        except Exception as e:
            if not isinstance(e, (ConnectionError, asyncio.TimeoutError, ValueError, RuntimeError)):
                log.exception("request %s failed", job.rid)
            await report_failure(self.node, job.router_id, job.rid, e)
        finally:
            for peer in job.holders:  # they reserved (or got part of the KV) for nothing
                self.node.spawn(self._tell(peer, m.Abort(job.rid)))
                self._line(peer).end((job.rid, peer))
            self.jobs.pop(job.rid, None)
            await self.engine.release(job.rid)

    async def _tell(self, peer: str, body: Any) -> None:
        try:
            await self.node.send(await self.peers.get(peer), body)
        except (OSError, asyncio.TimeoutError, wire.FrameError) as e:
            log.debug("cannot reach %s: %s", peer, e)

    async def _reserve(self, job: PrefillJob, peer: str) -> None:
        s = job.submit
        job.replies[peer] = asyncio.get_running_loop().create_future()
        job.holders.add(peer)
        conn = await self.peers.get(peer)
        job.reserve_sent[peer] = time.monotonic()
        await m.send(conn, m.Reserve(s.rid, s.prompt, s.params, s.router_id, s.use_cache))

    async def _serve(self, job: PrefillJob) -> None:
        s = job.submit
        if s.main is None:
            raise m.BadMessage("SUBMIT to a prefill instance must name its main decode instance")
        await self._reserve(job, s.main)
        first, cached, reason = None, 0, None
        async for out in self.engine.generate(s.rid, s.prompt, replace(s.params, max_tokens=1), hold=True):
            first, cached, reason = out.token, out.cached_tokens, out.finish_reason
        if first is None:
            raise RuntimeError("prefill was aborted")
        ack = await asyncio.wait_for(job.replies[s.main], ACK_TIMEOUT_S)
        if ack.error:
            raise RuntimeError(f"decode instance refused: {ack.error}")
        start, end = kv_range(len(s.prompt), ack.hit)
        line = self._line(s.main)
        decision = choose_pipeline((end - start) * self.engine.kv_bytes_per_token, line.estimate, line.in_flight(),
                                   self.policy.ttft_budget_ms / 1000, has_relay=False)
        predicted = None if decision.predicted_s is None else 1000 * decision.predicted_s
        self.node.to_router(job.router_id, m.PipelineChosen(s.rid, decision.pipeline, cached, ack.hit, predicted))
        if reason == "stop" or s.params.max_tokens == 1:  # P's token is the whole answer
            self.node.to_router(job.router_id, m.Result(s.rid))
            self.node.to_router(job.router_id, m.Tokens(s.rid, 0, [first], reason or "length", cached))
            return
        sent = await self._send_kv(job, s.main, start, end, first, emit=True)
        wan = sent if self.peers.remote(s.main) else 0
        self.node.to_router(job.router_id, m.Result(s.rid, sent, wan))

    async def _send_kv(self, job: PrefillJob, peer: str, start: int, end: int, first: int, emit: bool) -> int:
        """Stream tokens [start, end) of the request's KV to `peer`, then KV_DONE; the
        payload bytes sent."""
        conn = await self.peers.get(peer)
        self._line(peer).begin((job.rid, peer), start, end, self.engine.kv_bytes_per_token)
        sent = 0
        for a, b in kv_chunks(start, end, self.policy.kv_chunk_tokens):
            blob = await self.engine.export_kv(job.rid, a, b)
            for layer in codec.split_layers(blob):
                sent += await m.send_kv(conn, job.rid, codec.encode(layer))
        await m.send(conn, m.KVDone(job.rid, first, emit))
        job.holders.discard(peer)  # the KV is complete there: the peer's job no longer needs P
        return sent
