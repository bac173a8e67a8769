"""The router's token source: orchestrates instances for each request.

colocated: one standalone instance runs the request.
P/D modes: P prefills while the decode instance reserves its cached prefix; P streams
the missing KV to it; the decode instance streams the tokens back here. The router's
mirror of each instance's cache only guides the choice of instances; the decode
instance's reservation decides what is sent, and the difference is exported as drift.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from pdd.api.backend import BackendError, GenEvent, GenRequest, Load
from pdd.config import Deployment
from pdd.instance.messages import params_to_wire
from pdd.policy.routing import Candidate, pick
from pdd.router.client import InstanceClient, InstanceDown
from pdd.transfer.wire import MsgType, link_key

log = logging.getLogger(__name__)


class RouterBackend:
    def __init__(self, dep: Deployment, registry: CollectorRegistry) -> None:
        self.dep = dep
        self.max_context = 0  # set from the model config by the caller
        key = link_key(dep.secret, "instances")
        self.clients = {i.name: InstanceClient(i, *dep.address(i, dep.router.dc), key) for i in dep.instances}
        self.entry_role = "standalone" if dep.mode == "colocated" else "prefill"
        self.in_flight = 0
        self._aborts: set[asyncio.Task] = set()
        self.completed = 0
        self.drift_abs_total = 0
        r = registry
        self.m_pipelines = Counter("pdd_router_pipeline_requests", "Requests by pipeline", ["pipeline"], registry=r)
        self.m_drift = Histogram("pdd_router_mirror_drift_tokens", "Predicted minus reserved decode-side hit tokens",
                                 registry=r, buckets=(-4096, -512, -64, -1, 0, 1, 64, 512, 4096))
        self.m_kv_bytes = Counter("pdd_router_kv_bytes", "KV bytes moved from P to the decode side", ["path"], registry=r)
        self.m_failures = Counter("pdd_router_failures", "Requests failed by an instance or a link", registry=r)

    async def start(self, timeout: float = 60.0) -> None:
        for c in self.clients.values():
            c.start()
        await asyncio.gather(*(c.wait_ready(timeout) for c in self.clients.values()))

    async def stop(self) -> None:
        await asyncio.gather(*(c.stop() for c in self.clients.values()))

    def _choose(self, role: str, prompt: list[int], use_mirror: bool = True) -> tuple[InstanceClient, int]:
        clients = [c for c in self.clients.values() if c.spec.role == role]
        cands = [Candidate(c.name, c.mirror.predicted_hit(prompt) if use_mirror else 0, c.queued_tokens, c.healthy)
                 for c in clients]
        try:
            best = pick(cands, len(prompt), self.dep.policy.affinity_weight, self.dep.policy.load_weight)
        except LookupError:
            raise BackendError(f"no healthy {role} instance", 503) from None
        return self.clients[best.name], best.predicted_hit_tokens

    async def generate(self, req: GenRequest) -> AsyncIterator[GenEvent]:
        p, _ = self._choose(self.entry_role, req.prompt)
        drc = self.dep.policy.decode_radix_cache
        d, predicted = (p, 0) if self.entry_role == "standalone" else self._choose("main", req.prompt, drc)
        q: asyncio.Queue = asyncio.Queue()
        work = len(req.prompt) + req.params.max_tokens
        record = {"pipeline": "colocated" if d is p else "P-MD", "p_hit_tokens": 0, "d_hit_tokens": 0, "wan_bytes": 0,
                  "rld_output_tokens": 0, "md_output_tokens": 0, "handoff": None}
        for c in {p, d}:
            c.register(req.rid, q)
            c.queued_tokens += work
        self.in_flight += 1
        finished = False
        try:
            msg = {"rid": req.rid, "prompt": req.prompt, "params": params_to_wire(req.params)}
            if d is not p:
                msg.update(decode=d.name, use_cache=drc)
            await p.send(MsgType.SUBMIT, msg)
            async for event in self._events(req, q, p, d, predicted, record):
                finished = event.finish_reason is not None
                yield event
        except InstanceDown as e:
            self.m_failures.inc()
            raise BackendError(str(e)) from None
        finally:
            self.in_flight -= 1
            for c in {p, d}:
                c.unregister(req.rid)
                c.queued_tokens -= work
            if not finished:  # not awaited: this may run inside a cancelled (disconnected) request
                for c in {p, d}:
                    task = asyncio.ensure_future(self._abort(c, req.rid))
                    self._aborts.add(task)
                    task.add_done_callback(self._aborts.discard)

    async def _events(self, req: GenRequest, q: asyncio.Queue, p: InstanceClient, d: InstanceClient,
                      predicted: int, record: dict) -> AsyncIterator[GenEvent]:
        result_seen = d is p  # P/D: P's RESULT (hits, bytes) must arrive before we finish
        while True:
            source, kind, msg = await self._next(q, p, d)
            if kind == MsgType.RESULT:
                self._on_result(msg, predicted, record)
                result_seen = True
            if kind != MsgType.TOKENS:
                continue
            tokens = list(msg.get("tokens") or [])
            record["md_output_tokens"] += len(tokens)
            event = GenEvent(tokens, msg.get("finish_reason"), int(msg.get("cached_tokens") or 0))
            if event.finish_reason:
                while not result_seen:
                    _, kind, msg = await self._next(q, p, d)
                    if kind == MsgType.RESULT:
                        self._on_result(msg, predicted, record)
                        result_seen = True
                if d is p:
                    record.update(p_hit_tokens=event.cached_tokens, d_hit_tokens=event.cached_tokens)
                event.cached_tokens = record["p_hit_tokens"]
                self.m_pipelines.labels(record["pipeline"]).inc()
                event.record = dict(record)
                self.completed += 1
            yield event
            if event.finish_reason:
                return

    async def _next(self, q: asyncio.Queue, p: InstanceClient, d: InstanceClient) -> tuple[str, MsgType, dict]:
        """The request's next frame; errors, lost instances and silence become BackendError."""
        timeout = self.dep.router.token_timeout_s
        try:
            source, kind, msg = await asyncio.wait_for(q.get(), timeout)
        except asyncio.TimeoutError:
            self.m_failures.inc()
            raise BackendError(f"no progress for {timeout:.0f} s (instances {p.name}, {d.name})", 504) from None
        if kind == MsgType.ERROR:
            self.m_failures.inc()
            raise BackendError(f"{source}: {msg.get('message', 'failed')}", 503 if msg.get("lost") else 500)
        return source, kind, msg

    def _on_result(self, msg: dict, predicted: int, record: dict) -> None:
        record.update(p_hit_tokens=msg.get("p_hit", 0), d_hit_tokens=msg.get("d_hit", 0), wan_bytes=msg.get("wan_bytes", 0),
                      d_hit_predicted=predicted)
        drift = predicted - record["d_hit_tokens"]
        self.m_drift.observe(drift)
        self.drift_abs_total += abs(drift)
        self.m_kv_bytes.labels("wan" if msg.get("wan_bytes") else "local").inc(msg.get("kv_bytes", 0))

    async def _abort(self, c: InstanceClient, rid: str) -> None:
        try:
            await c.send(MsgType.ABORT, {"rid": rid})
        except InstanceDown:
            pass

    def load(self) -> Load:
        return Load(running=self.in_flight, waiting=0, kv_usage=0.0)

    async def stats(self) -> dict:
        return {"wan_bytes": await self.wan_bytes(), "requests": self.completed, "mirror_drift_abs_tokens": self.drift_abs_total,
                "instances": {c.name: {"healthy": c.healthy, "queued_tokens": c.queued_tokens,
                                       "mirror_pages": len(c.mirror.hashes), "mirror_gaps": c.mirror.gaps}
                              for c in self.clients.values()}}

    async def wan_bytes(self) -> int:
        """Bytes the WAN line carried both ways, as its emulator counted them."""
        link = self.dep.link
        if not link.admin_port:
            return 0
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                s = (await client.get(f"http://{link.host}:{link.admin_port}/stats")).json()
        except (httpx.HTTPError, ValueError):
            return 0
        return int(s.get("bytes_a_to_b", 0)) + int(s.get("bytes_b_to_a", 0))
