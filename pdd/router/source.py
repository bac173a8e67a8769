"""The router's token source: plans each request and drives it through the instances.

colocated: one standalone instance runs the request. P/D modes: P prefills while the
main decode instance (MD) reserves its cached prefix, sends it the missing KV, and MD
streams the tokens. PDD mode adds the relay (RLD) next to P: P picks P -> MD or
P -> RLD -> MD from MD's reservation; RLD streams the first tokens and hands over to
MD by token IDs; the anomaly filter keeps a few requests on RLD alone.

The router's mirror of each instance's cache only guides the plan; MD's reservation
decides what is sent, and the difference is exported as drift. Tokens from several
producers are merged by output position (`TokenMerger`). When an instance is lost,
the request goes on through what is left where it can (another P before the first
token; MD takes over from a lost relay; the relay finishes without MD) and fails with
a clear error where it cannot.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import AsyncGenerator
from typing import Any, assert_never

from prometheus_client import CollectorRegistry

from pdd.api.source import GenerationError, GenEvent, GenRequest, Load
from pdd.config import Deployment
from pdd.names import Fallback, Pipeline, RoleName
from pdd.policy.plan import missing_roles
from pdd.policy.playout import next_release_s
from pdd.policy.recovery import Failed, Recovery, State, failure_status, recover
from pdd.router.client import InstanceClient, InstanceDown
from pdd.router.members import Membership
from pdd.router.metrics import RouterMetrics
from pdd.router.planning import Planner
from pdd.router.playout import TokenPlayout
from pdd.router.request import LOST_AFTER_HANDOFF, RouterRequest
from pdd.tasks import Tasks
from pdd.transfer import messages as m
from pdd.transfer.wire import connection_key

log = logging.getLogger(__name__)


class RouterSource:
    def __init__(self, dep: Deployment, registry: CollectorRegistry) -> None:
        self.dep = dep
        self.router_id = secrets.token_hex(8)
        self.metrics = RouterMetrics(registry, lambda: self.clients.values())
        self.members = Membership(dep, connection_key(dep.secret, "instances"), self.router_id, self.metrics.kv_sent)
        self.clients = self.members.clients  # by name; instances join and leave at run time
        self.planner = Planner(dep, self.clients)
        self.playout = TokenPlayout(dep.router.handoff_reserve_tokens)
        self.in_flight = 0
        self.closing = False  # shutting down: no new requests (`close_admission`)
        self.expired = ""  # the shutdown's grace ran out: why the requests still running end (`expire`)
        self._aborts = Tasks()  # aborts sent from a request's end (not awaited there)

    async def start(self, timeout: float = 60.0) -> None:
        for c in self.clients.values():
            c.start()
        await asyncio.gather(*(c.wait_ready(timeout) for c in list(self.clients.values())))

    async def stop(self) -> None:
        await asyncio.gather(*(c.stop() for c in list(self.clients.values())))

    @property
    def max_context(self) -> int:
        return self.planner.max_context

    @max_context.setter
    def max_context(self, tokens: int) -> None:  # the model's, set by the caller
        self.planner.max_context = tokens

    def _work(self, request: RouterRequest) -> int:
        return len(request.req.prompt) + request.req.params.max_tokens

    async def _submit(self, request: RouterRequest, q: asyncio.Queue) -> None:
        plan = request.plan
        self.planner.commit(request, +1)
        for name in request.members:
            self.clients[name].register(request.rid, q)
            self.clients[name].queued_tokens += self._work(request)
        if plan.fallback:
            self._fell_back(request, Fallback(plan.fallback))
        r = request.req
        await self.clients[plan.entry].send(
            m.Submit(
                request.rid,
                r.prompt,
                r.params,
                self.router_id,
                plan.main,
                plan.relay,
                self.dep.policy.decode_radix_cache,
            )
        )

    def _release(self, request: RouterRequest) -> None:
        self.planner.commit(request, -1)
        for name in request.members:
            c = self.clients.get(name)
            if c is not None:  # (None: it left the deployment since)
                c.unregister(request.rid)
                c.queued_tokens -= self._work(request)

    # ---- a request -------------------------------------------------------------------------
    async def generate(self, req: GenRequest) -> AsyncGenerator[GenEvent, None]:
        if self.closing:
            raise GenerationError("this router is shutting down: send the request to another", 503)
        request = await self.planner.dispatch(req)
        q: asyncio.Queue = asyncio.Queue()
        sent = 0  # output positions yielded so far
        self.in_flight += 1
        try:
            await self._submit(request, q)
            while True:
                if self.expired:
                    raise GenerationError(self.expired, 503)
                item = await self._next(request, q)
                if item is not None:
                    source, body = item
                    if getattr(body, "rid", request.rid) != request.rid:
                        continue  # a straggler of an earlier attempt
                    new = await self._handle(request, q, source, body)
                    if new:
                        request.held += new
                        request.last_progress = time.monotonic()
                    if request.stranded:
                        raise GenerationError(
                            f"no instance is left to produce the request (instances {', '.join(request.members)})", 503
                        )
                out = self.playout.play_out(request)
                if request.merger.finished and not request.held:
                    yield self._with_logprobs(request, self._finish(request, out), sent)
                    return
                if out:
                    yield self._with_logprobs(request, GenEvent(out, None, self._cached(request)), sent)
                    sent += len(out)
        except InstanceDown as e:
            self.metrics.failures.inc()
            raise GenerationError(str(e)) from None
        except GenerationError:
            self.metrics.failures.inc()
            raise
        finally:
            self.in_flight -= 1
            self._release(request)
            self._abort_rest(request)

    async def _next(self, request: RouterRequest, q: asyncio.Queue) -> tuple[str, Any] | None:
        """The request's next body, or None when a held token is due to be released. The
        timeouts run from the last new token (or the submission), not from the last body:
        messages that bring no token (a repeated loss report, say) are no progress."""
        timeout = self.dep.router.stall_timeout_s if request.merger.delivered else self.dep.router.token_timeout_s
        left = timeout - (time.monotonic() - request.last_progress)
        due = next_release_s(
            len(request.held),
            time.monotonic() - request.last_release,
            request.relay_will_hand_over,
            request.relay_stopped,
            self.playout.playout(request),
        )
        try:
            if left <= 0:
                raise TimeoutError
            return await asyncio.wait_for(q.get(), left if due is None else min(due, left))
        except TimeoutError:
            if due is not None and due <= left:
                return None
            members = ", ".join(request.members)
            raise GenerationError(f"no progress for {timeout:g} s (instances {members})", 504) from None

    @staticmethod
    def _cached(request: RouterRequest) -> int:
        return request.chosen.p_hit if request.chosen else request.cached

    async def _handle(self, request: RouterRequest, q: asyncio.Queue, source: str, body: m.ForRequest) -> list[int]:
        """Apply one body to the request; the tokens it made deliverable."""
        match body:
            case m.Tokens():
                request.cached = body.cached_tokens
                if body.stall_ms is not None:
                    request.stall_ms = body.stall_ms
                self.playout.observe(request, source)
                return request.merger.add(
                    source, body.pos, body.tokens, body.finish_reason, body.logprobs, body.prompt_logprobs
                )
            case m.Progress():
                self._progressed(request)
            case m.PipelineChosen():
                self._progressed(request)
                self._chosen(request, body)
            case m.Result():
                request.result = body
            case m.HandedOff():
                request.handed_off, request.relay_done = body, True
                if request.main_done:
                    raise GenerationError(LOST_AFTER_HANDOFF, 503)
            case m.Error():
                await self._on_error(request, q, source, body)
            case _:
                assert_never(body)
        return []

    @staticmethod
    def _progressed(request: RouterRequest) -> None:
        if not request.merger.delivered:
            request.last_progress = time.monotonic()  # slow, not stuck: its first-token timeout starts again

    def _chosen(self, request: RouterRequest, body: m.PipelineChosen) -> None:
        """P chose the request's pipeline (and said what it found at MD)."""
        request.chosen = body
        if request.plan.main and body.pipeline != Pipeline.P_RLD:
            self.metrics.observe_drift(request.plan.predicted_hit, body.d_hit)
        if body.pipeline == Pipeline.P_MD:
            request.relay_done = True
        elif body.pipeline == Pipeline.P_RLD:
            request.main_done = True
        if body.fallback:
            self._fell_back(request, body.fallback)

    def _role_of(self, name: str) -> str:
        """An instance's role ("" once it has left the deployment)."""
        c = self.clients.get(name)
        return c.spec.role if c is not None else ""

    async def _on_error(self, request: RouterRequest, q: asyncio.Queue, source: str, err: m.Error) -> None:
        """Go on through what is left, or fail (`pdd.policy.recovery`)."""
        plan, role = request.plan, self._role_of(source)
        failed = Failed(
            entry=source == plan.entry,
            relay=source == plan.relay,
            main=source == plan.main,
            lost=err.lost,
            busy=err.busy,
        )
        state = State(
            p_done=request.result is not None,
            delivered=len(request.merger.delivered),
            attempt=request.attempt,
            max_attempts=self.dep.router.prefill_retries,
            other_entry_up=any(c.available for c in self.clients.values() if c.spec.role == role and c.name != source),
            chosen=request.chosen is not None,
            relay_producing=request.relay_producing,
            has_main=plan.main is not None,
            main_done=request.main_done,
            relay_done=request.relay_done,
            handed_off=request.handed_off is not None,
            main_produced=plan.main is not None and request.merger.count(plan.main) > 0,
        )
        action = recover(failed, state)
        message = f"{source}: {err.message}"
        if failed.relay and not failed.entry:
            request.relay_done = True
        if action == Recovery.IGNORE:
            return
        if action == Recovery.RETRY_PREFILL:
            self._release(request)
            retry = self.planner.plan(request.req)  # (it was dispatched: no second wait for room)
            assert retry is not None  # without `room`, a plan or GenerationError, never None
            request.restart(retry)
            self._fell_back(request, Fallback.PREFILL_RETRY)
            await self._submit(request, q)
        elif action == Recovery.RELAY_GOES_ON:
            request.main_done = True
            self._fell_back(request, Fallback.PREFILL_LOST if failed.entry else Fallback.MAIN_LOST)
        elif action == Recovery.MAIN_TAKES_OVER:
            self._fell_back(request, Fallback.RELAY_LOST)
            main = self.clients.get(plan.main or "")
            if main is None:
                raise GenerationError(message, failure_status(err.busy, err.lost))
            delivered = request.merger.delivered
            await main.send(m.Handoff(request.rid, 0, list(delivered), True, len(delivered)))
        else:
            if failed.main and request.handed_off:
                message = LOST_AFTER_HANDOFF
            raise GenerationError(message, failure_status(err.busy, err.lost))

    @staticmethod
    def _with_logprobs(request: RouterRequest, event: GenEvent, first: int) -> GenEvent:
        """`event` (positions from `first` on) with its tokens' logprobs, and with the first
        token the prompt's, where asked."""
        if request.req.params.logprobs is not None:
            event.logprobs = [request.merger.logprobs.get(first + i) for i in range(len(event.tokens))]
        if first == 0 and request.req.params.prompt_logprobs is not None:
            event.prompt_logprobs = request.merger.prompt_logprobs
        return event

    def _fell_back(self, request: RouterRequest, why: Fallback) -> None:
        request.fallbacks.append(why)
        self.metrics.fallback(why)

    def _finish(self, request: RouterRequest, new: list[int]) -> GenEvent:
        last = request.merger.producers[-1] if request.merger.producers else None
        if request.pipeline == Pipeline.P_RLD_MD and last == request.plan.relay:  # never silent: it ended on the relay
            self._fell_back(request, Fallback.RELAY_FINISHED)
        drift = request.plan.predicted_hit - request.chosen.d_hit if request.chosen and request.plan.main else None
        record = request.record(drift)
        if request.whole:  # its own prefix cache is the only one involved
            record.p_hit_tokens = request.cached
            record.d_hit_tokens = request.cached if request.plan.relay is None else 0
        self.metrics.finished(request, record)
        return GenEvent(new, request.merger.finish_reason, self._cached(request), record)

    def _abort_rest(self, request: RouterRequest) -> None:
        """Tell instances still holding something of the request to drop it (not
        awaited: this may run inside a cancelled, disconnected request)."""
        done = request.done_members()
        if request.merger.finished and request.merger.producers:
            done.add(request.merger.producers[-1])
            if request.merger.producers[-1] == request.plan.relay and request.pipeline == Pipeline.P_RLD_MD:
                done.add(request.plan.entry)  # they finish MD's copy (a fill)
                if request.plan.main is not None:
                    done.add(request.plan.main)
        for name in request.members:
            if name not in done and name in self.clients:
                self._aborts.spawn(self._abort(self.clients[name], request.rid))

    async def _abort(self, c: InstanceClient, rid: str) -> None:
        try:
            await c.send(m.Abort(rid))
        except InstanceDown:
            pass

    # ---- state -----------------------------------------------------------------------------
    def load(self) -> Load:
        return Load(running=self.in_flight, waiting=self.planner.queue.waiting, kv_usage=0.0)

    def health(self) -> dict:
        """Alive while it serves HTTP: a router with no instance behind it is not ready, but
        restarting it would mend nothing."""
        return {"status": "ok"}

    def ready(self) -> dict:
        if self.closing:
            return {"status": "unavailable", "reason": "shutting down"}
        healthy = Counter(c.spec.role for c in self.clients.values() if c.available)
        missing = missing_roles(healthy, self.planner.entry_role, self.planner.entry_role == RoleName.PREFILL)
        return {"status": "unavailable", "missing": missing} if missing else {"status": "ok"}

    def close_admission(self) -> None:
        """SIGTERM (`pdd.shutdown`): /ready fails and new requests get a 503 naming why;
        those in flight go on."""
        self.closing = True

    def expire(self, why: str) -> None:
        """The shutdown's grace ran out: each request still running ends with `why`, an error
        its client reads, at its next token or timeout check (its instances told to abort)."""
        self.expired = why

    async def stats(self) -> dict:
        return {
            "line_bytes": self.line_bytes(),
            "kv_open": sum(len(c.kv_open) for c in self.clients.values()),
            **self.metrics.snapshot(),
            "membership": self.members.stats(),
            "dispatch_waiting": self.planner.queue.waiting,
            "max_context": self.max_context,
            "playout": self.playout.stats(),
            "groups": self.members.groups(),
            "instances": {
                c.name: {
                    "role": c.spec.role,
                    "group": c.spec.group,
                    "healthy": c.healthy,
                    "protocol": c.protocol,  # while upgrading: who still speaks the version before
                    "software": c.software,
                    "draining": c.draining,
                    "refusing": c.refusing,  # it said it takes no new work (shutting down, engine dead)
                    "queued_tokens": c.queued_tokens,
                    "pages": c.pages,  # as the instance sized them (its snapshot), what admission plans with
                    "max_context": c.max_context,
                    "committed_pages": c.committed_pages,
                    "committed_requests": c.committed_requests,
                    "mirror_pages": len(c.mirror.hashes),
                    "mirror_gaps": c.mirror.gaps,
                }
                for c in self.clients.values()
            },
        }

    def line_bytes(self) -> int:
        """The KV bytes P sent across the line, as the instances count them (each request's
        RESULT). Not the line emulator's count: the emulator is a lab tool, and a real line
        has none (tests and the demo read its count as a cross-check)."""
        return self.metrics.totals["kv_bytes:line"]
