"""Which instances serve a request, and when it may leave for them.

The router plans each request (`pdd.policy.plan`) from its mirrors of the instances'
caches and their queued work, and dispatches it only once its decode-side instance
has room for it (`pdd.policy.capacity`): until then it waits in the dispatch queue,
first come first served. The planner keeps what the router has committed to each
decode-side instance (pages and requests), charging a request when it leaves and
refunding it when it ends.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdd.api.source import GenerationError, GenRequest
from pdd.config import Deployment
from pdd.names import Mode, RoleName
from pdd.policy.capacity import Room, fits, pages_needed
from pdd.policy.plan import Plan, anomaly_rule, plan_request, plan_with_room
from pdd.policy.routing import Candidate
from pdd.policy.transfer import kv_namespace
from pdd.router.client import InstanceClient
from pdd.router.dispatch import DispatchQueue
from pdd.router.request import RouterRequest
from pdd.transfer.wire import LOSSY_KV_SINCE


class Planner:
    def __init__(self, dep: Deployment, clients: Mapping[str, InstanceClient]) -> None:
        self.dep = dep
        self.clients = clients  # (the router's, live: instances join and leave)
        self.model_context = 0  # what the model declares, set by the caller (0: unknown)
        self.entry_role = RoleName.STANDALONE if dep.mode == Mode.COLOCATED else RoleName.PREFILL
        self.queue = DispatchQueue()  # admitted requests waiting for room at their decode side

    @property
    def max_context(self) -> int:
        """Prompt and output tokens one request may hold: the least any instance takes, as it
        reported it (an engine that sized itself) or as its config sizes it, and the model's."""
        limits = [c.max_context or c.spec.engine.num_pages * c.spec.engine.page_size for c in self.clients.values()]
        limits = [x for x in (*limits, self.model_context) if x]
        return min(limits, default=0)

    @max_context.setter
    def max_context(self, tokens: int) -> None:
        self.model_context = tokens

    def _candidates(self, role: str, req: GenRequest, use_mirror: bool = True) -> list[Candidate]:
        def hit(c: InstanceClient) -> int:
            # a decode instance across the line from P (in the router's site) holds the
            # request's KV in the namespace of the form it crosses in (exact to one that is older)
            lossy = self.dep.line.lossy_kv
            if lossy and (
                role == RoleName.PREFILL or c.spec.dc == self.dep.router.dc or (c.protocol or 0) < LOSSY_KV_SINCE
            ):
                lossy = ""
            return c.mirror.predicted_hit(req.prompt, kv_namespace(req.params.cache_salt, lossy)) if use_mirror else 0

        return [
            Candidate(c.name, hit(c), c.queued_tokens, c.available and not _too_old(c, req.params.needs_protocol()[0]))
            for c in self.clients.values()
            if c.spec.role == role
        ]

    def _need(self, req: GenRequest, name: str, hit_tokens: int) -> int:
        """The KV pages `req` takes at decode-side instance `name` (`pdd.policy.capacity`)."""
        page_size = self.clients[name].spec.engine.page_size
        return pages_needed(len(req.prompt), req.params.max_tokens, hit_tokens, page_size)

    def _fits(self, name: str, need: int) -> bool:
        c = self.clients[name]
        return fits(need, c.committed_pages, c.committed_requests, Room(c.pages, c.spec.engine.max_requests))

    def plan(self, req: GenRequest, room: bool = False) -> Plan | None:
        """The request's instances. With `room`, only decode-side instances that have room
        for it now: None while every one that is up is full (the request waits its turn).
        GenerationError 503 when an instance every request needs is down."""
        p = self.dep.policy
        rule = anomaly_rule(
            p.anomaly_filter,
            self.max_context,
            p.anomaly_max_output_tokens,
            p.anomaly_min_prompt_share,
            p.anomaly_max_hit_share,
        )
        disaggregated = self.entry_role == RoleName.PREFILL
        main = self._candidates(RoleName.MAIN, req, p.decode_radix_cache) if disaggregated else []
        relay = self._candidates(RoleName.RELAY, req) if disaggregated and self.dep.mode == Mode.PDD else []
        entry = self._candidates(self.entry_role, req)
        n, m, weights = len(req.prompt), req.params.max_tokens, (p.affinity_weight, p.load_weight)
        try:
            if room and disaggregated:  # dispatch by room: the same decision the simulator makes

                def has_room(c: Candidate) -> bool:
                    return self._fits(c.name, self._need(req, c.name, c.predicted_hit_tokens))

                return plan_with_room(n, m, entry, main, relay, rule, has_room, *weights)
            return plan_request(n, m, entry, main, relay, rule, *weights)
        except LookupError as e:
            needs, field = req.params.needs_protocol()
            old = sorted(c.name for c in self.clients.values() if _too_old(c, needs))
            why = f" ({field} needs protocol {needs}: {', '.join(old)} speak older)" if old else ""
            raise GenerationError(f"{e}{why}", 503) from None

    async def dispatch(self, req: GenRequest) -> RouterRequest:
        """Plan the request once its decode side has room, first come first served."""

        def attempt() -> RouterRequest | None:
            plan = self.plan(req, room=True)
            return None if plan is None else RouterRequest(req, plan)

        return await self.queue.turn(attempt)

    def commit(self, request: RouterRequest, sign: int) -> None:
        """Charge (+1) or refund (-1) the decode-side instance that must hold the request:
        MD, or the relay when it produces alone. (A relay behind MD is optional: it
        turns work away itself.)"""
        plan = request.plan
        name = plan.main or plan.relay
        c = self.clients.get(name) if name else None
        if c is None:
            return
        c.committed_pages += sign * self._need(request.req, c.name, plan.predicted_hit if plan.main else 0)
        c.committed_requests += sign
        if sign < 0:
            self.queue.changed()


def _too_old(c: InstanceClient, needs: int) -> bool:
    """An instance that speaks a protocol before what the request sets (`needs`): planned
    it, it would refuse the request, or (protocol 4, a salted one) share the tenant's
    prefixes with everyone. A rolling upgrade's middle: the others take it."""
    return needs > 0 and c.protocol is not None and c.protocol < needs
