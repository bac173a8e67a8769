"""The prefill role (P): prefill, then move the KV to the decode side.

While P prefills, the main decode instance reserves (one line round trip, overlapped)
and answers the hit it holds; P sends exactly the KV after that hit, layer by layer as
the forward computes it (`pdd.instance.prefill_kv`). The pipeline is chosen here, once
prefill is done, from that reserved hit and what P knows of the line
(`pdd.policy.transfer.LineMeter`), by `pdd.policy.pipeline`. P tells the router the
pipeline and hits as soon as they are known, and the bytes moved when done.

One `PrefillJob` holds a request's state; replies from decode-side instances are
keyed by (request, peer), so two peers' answers never overwrite each other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any, assert_never

from msgspec.structs import replace  # messages and sampling params are msgspec structs

from pdd.instance.peers import PeerPool
from pdd.instance.prefill_kv import KVSenders, PrefillJob, answer, loaded, reservation
from pdd.instance.role import Node, not_taken, report_failure
from pdd.kv.layer_stream import LayerStream
from pdd.names import Fallback, Pipeline, RoleName
from pdd.policy.pipeline import answer_wait_s, choose_pipeline, main_refused, relay_refused
from pdd.policy.transfer import LOCAL_PRIOR, LineEstimate, LineMeter, Priority, kv_namespace
from pdd.transfer import messages as m
from pdd.transfer import wire

log = logging.getLogger(__name__)
RELAY_ANSWER_S = 1.0  # the relay is next door: an answer later than this is a loaded relay
PROGRESS_EVERY_S = 1.0


class PrefillRole:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.engine = node.engine
        self.policy = node.dep.policy
        self.jobs: dict[str, PrefillJob] = {}
        self.peers = PeerPool(node.spec, lambda: node.dep, node.key, self._on_reply, self._on_peer_lost)
        self.lines: dict[str, LineMeter] = {}  # by datacenter
        self.senders = KVSenders(self.engine, self.peers, self.policy.kv_chunk_tokens, self._line, node.spawn)

    def close(self) -> None:
        self.peers.close()

    def router_reached(self) -> None:
        self.peers.warm(i.name for i in self.node.dep.instances if i.role in (RoleName.RELAY, RoleName.MAIN))

    def _line(self, peer: str) -> LineMeter:
        dc = self.node.dep.instance(peer).dc
        if dc not in self.lines:
            line = self.node.dep.line
            prior = (
                LOCAL_PRIOR
                if dc == self.node.spec.dc
                else LineEstimate(line.bandwidth_mbps * 125_000, line.delay_ms / 1000)
            )
            self.lines[dc] = LineMeter(prior)
        return self.lines[dc]

    # ---- from routers --------------------------------------------------------------------
    async def on_router(self, router_id: str, body: m.FromRouter) -> None:
        match body:
            case m.Submit():
                if body.rid in self.node.aborted or body.rid in self.jobs:
                    return
                job = self.jobs[body.rid] = PrefillJob(body, router_id)
                self.node.took()
                job.task = self.node.spawn(self._run(job))
            case m.Abort():
                self.node.aborted.add(body.rid)
                running = self.jobs.get(body.rid)
                if running is not None and running.task is not None:
                    running.task.cancel()
            case m.Handoff() | m.CacheUpdate() | m.Member() | m.Drain():
                not_taken(self.node, router_id, body)
            case _:
                assert_never(body)

    async def on_peer(self, conn, name, frame) -> None:
        await self.node.send(conn, m.Error("a prefill instance takes no peer traffic"))

    def peer_lost(self, name: str) -> None:
        pass

    def held(self) -> int:
        """Foreground requests: MD's background copies behind a lagging line do not take
        the places of new requests (their producer, the relay, already has its KV)."""
        return sum(1 for j in self.jobs.values() if not j.background)

    @property
    def kv_frames_in_prefill(self) -> int:
        """KV frames sent while their prefill still computed (P streams it layer by layer)."""
        return self.senders.in_prefill

    @property
    def background_held(self) -> int:
        """MD's background copies held here (behind a lagging line, they wait at P)."""
        return sum(1 for j in self.jobs.values() if j.background)

    def router_lost(self, router_id: str) -> None:
        for job in [j for j in self.jobs.values() if j.router_id == router_id]:
            self.node.aborted.add(job.rid)
            if job.task is not None:
                job.task.cancel()

    # ---- from decode-side instances ------------------------------------------------------
    async def _on_reply(self, peer: str, body: m.BetweenInstances) -> None:
        rid = getattr(body, "rid", None)
        if isinstance(body, m.KVAck):
            self._line(peer).acked((body.rid, peer), body.token_end, body.done, time.monotonic())
        job = self.jobs.get(rid) if rid else None
        if job is None:
            return
        if isinstance(body, m.KVAck):
            job.acked[peer] = max(job.acked.get(peer, 0), body.token_end)
            if peer in job.wakes:
                job.wakes[peer].set()
            self._progress(job)
        ack, loaded = job.acks.get(peer), job.loaded.get(peer)
        if isinstance(body, m.ReserveAck) and ack is not None and not ack.done():
            self._line(peer).round_trip(time.monotonic() - job.reserve_sent[peer])
            ack.set_result(body)
        elif isinstance(body, m.KVAck) and body.done and loaded is not None and not loaded.done():
            loaded.set_result(body)
        elif isinstance(body, m.Error):
            self._line(peer).end((job.rid, peer))
            for fut in job.futures(peer):
                fut.set_exception(RuntimeError(f"{peer}: {body.message}"))

    def _progress(self, job: PrefillJob) -> None:
        """KV was acknowledged: tell the router, now and then, that the request moves
        (a slow line is not a stuck request)."""
        job.last_ack = now = time.monotonic()
        if now - job.progress_sent >= PROGRESS_EVERY_S:
            job.progress_sent = now
            self.node.to_router(job.router_id, m.Progress(job.rid, "kv"))

    def _on_peer_lost(self, peer: str) -> None:
        for job in self.jobs.values():
            for fut in job.futures(peer):
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
            self.senders.stop(job)
            for peer in job.holders:  # they reserved (or got part of the KV) for nothing
                self.node.spawn(self._tell(peer, m.Abort(job.rid)))
                self._line(peer).end((job.rid, peer))
            answers: list[asyncio.Future[Any]] = [*job.acks.values(), *job.loaded.values()]
            for fut in answers:
                if not fut.done():
                    fut.cancel()
                elif not fut.cancelled():
                    fut.exception()  # an answer nobody waited for is not an error to log
            self.jobs.pop(job.rid, None)
            await self.engine.release(job.rid)

    async def _tell(self, peer: str, body: m.BetweenInstances) -> None:
        try:
            await self.peers.send(peer, body)
        except (TimeoutError, OSError, wire.FrameError) as e:
            log.debug("cannot reach %s: %s", peer, e)

    async def _reserve(self, job: PrefillJob, peer: str, main: str | None = None) -> None:
        job.acks[peer] = asyncio.get_running_loop().create_future()
        job.holders.add(peer)
        await self._send_reserve(job, peer, main)

    def _reserve_aside(self, job: PrefillJob, peer: str) -> None:
        """MD's reservation, asked for beside the prefill: reaching MD may take the line's
        round trips (a first connection), or fail (a stalled or broken line), and the relay
        need not wait for either. A peer that cannot be reached answers with a
        ConnectionError, which `_decide` turns into the relay finishing the request."""
        ack = job.acks[peer] = asyncio.get_running_loop().create_future()
        job.holders.add(peer)

        async def ask() -> None:
            try:
                await self._send_reserve(job, peer, None)
            except Exception as e:  # (whatever it was, the request must hear of it: the ack always ends)
                if not ack.done():
                    ack.set_exception(ConnectionError(f"cannot reach {peer}: {e!r}"))

        self.node.spawn(ask())

    async def _send_reserve(self, job: PrefillJob, peer: str, main: str | None) -> None:
        s = job.submit
        conn = await self.peers.get(peer)
        if job.acks[peer].done():  # the request ended while the connection opened
            return
        job.reserve_sent[peer] = time.monotonic()
        job.forms[peer] = self._forms(peer, conn.version)
        # (the prompt's logprobs are P's to compute: the decode side keeps its prefix cache)
        salt = kv_namespace(s.params.cache_salt, job.forms[peer][0])
        params = replace(s.params, cache_salt=salt, prompt_logprobs=None)
        await self.peers.send(peer, m.Reserve(s.rid, s.prompt, params, s.router_id, s.use_cache, main))

    def _forms(self, peer: str, version: int) -> tuple[str, str]:
        """The forms KV crosses the line to `peer` in, (lossy, compressed): as it is to a
        peer in this site, or to one that speaks a protocol before them (it would refuse
        the pages)."""
        if not self.peers.remote(peer) or version < wire.LOSSY_KV_SINCE:
            return "", ""
        return self.node.dep.line.lossy_kv, self.node.dep.line.compress_kv

    async def _serve(self, job: PrefillJob) -> None:
        s = job.submit
        if s.main is None and s.relay is None:
            raise m.BadMessage("SUBMIT to a prefill instance must name its decode side")
        if s.main and s.relay:  # MD reserves while P prefills: one line round trip, overlapped
            self._reserve_aside(job, s.main)
        elif s.main:
            await self._reserve(job, s.main)
        if s.relay:  # and so does the relay, in case the request goes its way (dropped if not)
            await self._reserve(job, s.relay, s.main)
        first, cached, reason = await self._prefill(job)
        t_prefilled = time.monotonic()
        pipeline, ack, predicted, fallback = await self._decide(job)
        if s.relay and pipeline == Pipeline.P_MD:
            job.holders.discard(s.relay)
            self.senders.drop(job, s.relay)
            self.node.spawn(self._tell(s.relay, m.Abort(s.rid)))
        if s.main and pipeline == Pipeline.P_RLD:
            self.senders.drop(job, s.main)
        log.debug(
            "%s: prefill done %.0f ms after submit; decided after %.0f ms more",
            s.rid,
            1000 * (t_prefilled - job.submitted),
            1000 * (time.monotonic() - t_prefilled),
        )
        self.node.to_router(
            job.router_id, m.PipelineChosen(s.rid, pipeline, cached, ack.hit if ack else 0, predicted, fallback)
        )
        if reason == "stop" or s.params.max_tokens == 1:  # P's token is the whole answer
            self.node.to_router(job.router_id, m.Result(s.rid))
            lps = None if job.first_logprob is None else [job.first_logprob]
            tokens = m.Tokens(
                s.rid, 0, [first], reason or "length", cached, logprobs=lps, prompt_logprobs=job.prompt_logprobs
            )
            self.node.to_router(job.router_id, tokens)
            return
        paths: dict[str, Coroutine[Any, Any, int]] = {}
        if pipeline in (Pipeline.P_RLD_MD, Pipeline.P_RLD):  # the fast path: full KV to the relay, which emits at once
            assert s.relay is not None  # `_decide` chooses the relay only where SUBMIT names one
            paths[s.relay] = self._to_relay(job, s.relay, first)
        if pipeline in (Pipeline.P_MD, Pipeline.P_RLD_MD):  # the delta over the line, at the same time
            assert s.main is not None  # `_decide` chooses MD only where SUBMIT names one
            paths[s.main] = self._to_main(
                job, s.main, first, ready_to=s.relay if pipeline == Pipeline.P_RLD_MD else None
            )
        outcomes = dict(zip(paths, await asyncio.gather(*paths.values(), return_exceptions=True), strict=True))
        failed = {peer: o for peer, o in outcomes.items() if isinstance(o, BaseException)}
        if len(failed) == len(outcomes):
            raise next(iter(failed.values()))
        if s.relay is not None and s.relay in failed:  # MD has the KV but nobody produces: it takes over from P's token
            assert s.main is not None  # not every path failed: MD's is the other
            log.warning("relay %s failed %s (%s); %s takes over", s.relay, s.rid, failed[s.relay], s.main)
            await self._tell(s.main, m.Handoff(s.rid, 0, [], True, 0))
        sent = {peer: o for peer, o in outcomes.items() if not isinstance(o, BaseException)}
        line_bytes = sum(n for peer, n in sent.items() if self.peers.remote(peer))
        late_hit = None
        if ack is None and s.main is not None and s.main in sent:  # MD answered after the decision: what it held
            late_hit = job.acks[s.main].result().hit
        self.node.to_router(job.router_id, m.Result(s.rid, sum(sent.values()), line_bytes, late_hit))

    async def _prefill(self, job: PrefillJob) -> tuple[int, int, str | None]:
        """Prefill, the decode side's senders following its KV layer by layer as it is
        computed: (P's token, cached prompt tokens, finish reason)."""
        s = job.submit
        job.stream = LayerStream()
        job.exports = 1  # (the prefill's own hold on its pages)
        for peer in job.acks:  # MD behind a relay waits for the choice (`pdd.instance.prefill_kv`)
            self.senders.start(job, peer, None if s.relay and peer != s.relay else Priority.URGENT)
        first, cached, reason = None, 0, None
        try:
            params = replace(s.params, max_tokens=1)
            async for out in self.engine.generate(s.rid, s.prompt, params, hold=True, stream=job.stream):
                first, cached, reason = out.token, out.cached_tokens, out.finish_reason
                job.first_logprob = out.logprob if out.token is not None else job.first_logprob
                job.prompt_logprobs = out.prompt_logprobs or job.prompt_logprobs
        finally:
            job.stream.close()
        self.senders.exported(job)
        if first is None:
            raise RuntimeError("prefill was aborted")
        return first, cached, reason

    async def _decide(self, job: PrefillJob) -> tuple[Pipeline, m.ReserveAck | None, float | None, Fallback | None]:
        """(pipeline, MD's reservation, predicted arrival in ms, fallback) once prefill is done."""
        s = job.submit
        if s.main is None:
            return Pipeline.P_RLD, None, None, None
        budget = self.policy.ttft_budget_ms / 1000
        line = self._line(s.main)
        waited = time.monotonic()
        try:
            ack = await answer(job, s.main, answer_wait_s(budget, line.estimate) if s.relay else None)
        except (RuntimeError, ConnectionError) as e:
            refused = main_refused(s.relay is not None and await self._relay_takes(job, s.relay))
            if refused is None:
                raise
            log.warning("%s: %s; the relay finishes it", s.rid, e)
            return refused.pipeline, None, None, refused.fallback
        delta = None if ack is None else (len(s.prompt) - ack.hit) * self.engine.kv_bytes_per_token
        left = budget - (time.monotonic() - waited)
        decision = choose_pipeline(
            delta, line.estimate, line.in_flight(Priority.URGENT), left, s.relay is not None, self.policy.pipeline
        )
        if decision.pipeline == Pipeline.P_RLD_MD:
            assert s.relay is not None  # `choose_pipeline` goes through the relay only when there is one
            if not await self._relay_takes(job, s.relay):
                decision = relay_refused(decision)
        predicted = None if decision.predicted_s is None else 1000 * decision.predicted_s
        log.debug(
            "%s: %s, delta %s bytes, predicted %s ms, line %s, in flight %s",
            s.rid,
            decision.pipeline,
            delta,
            predicted,
            line.estimate,
            line.in_flight(Priority.URGENT),
        )
        return decision.pipeline, ack, predicted, decision.fallback

    async def _relay_takes(self, job: PrefillJob, relay: str) -> bool:
        """Whether the relay holds the request: it answers at once, and turns it away
        when it is loaded (`pdd.policy.capacity.relay_accepts`)."""
        try:
            return await answer(job, relay, RELAY_ANSWER_S) is not None
        except (RuntimeError, ConnectionError) as e:
            log.debug("%s: the relay does not take it: %s", job.rid, e)
            return False

    async def _to_relay(self, job: PrefillJob, relay: str, first: int) -> int:
        sent = await self.senders.finish(job, relay, first, emit=True, priority=Priority.URGENT)
        job.background = True  # the producer has its KV; what is left is MD's copy, if any
        return sent

    async def _to_main(self, job: PrefillJob, main: str, first: int, ready_to: str | None) -> int:
        """The KV MD lacks, until MD confirms it has it all; behind a relay, then READY to
        the relay. (Done once the KV is there, not once it is written: P's KV frames wait
        in several connections' buffers, megabytes on a slow line, and a P that dies
        with them unsent has not done its part: the router retries the request.)"""
        await reservation(job, main)
        job.loaded[main] = asyncio.get_running_loop().create_future()
        # behind a relay, MD's copy is off the critical path: it yields to urgent transfers
        priority = Priority.BACKGROUND if ready_to else Priority.URGENT
        sent = await self.senders.finish(job, main, first, emit=ready_to is None, priority=priority)
        await loaded(job, main)
        if ready_to:
            await self._tell(ready_to, m.Ready(job.rid))
        return sent
