"""A simulated deployment serving simulated requests, decided by `pdd.policy`.

Every choice a live deployment makes is made here by the same function: the router's
plan and its dispatch by room (`plan_with_room` over `capacity.fits`/`pages_needed`,
the anomaly filter, in the router's own `DispatchQueue` on the simulated clock), the
reservations (`pdd.lab.sim.reserve`:
`relay_accepts`, `prefix_holder`, `reserve_retry_delay`), P's pipeline choice after
prefill with its `LineMeter` (`pdd.lab.sim.prefill`: `answer_wait_s`, `choose_pipeline`,
`main_refused`, `relay_refused`), the relay's handoff (`pdd.lab.sim.relayed`:
`choose_handoff` with `occupancy`, `cut_over`) and the KV range (`kv_range`). The
lifecycle follows the live one (pdd/router, pdd/instance): the router holds a request
until its decode side has room, reservations go out at submit, P's KV goes to the
relay (urgent) and to MD (background behind a relay) at once, READY reaches the relay
once MD holds the KV, then a one-shot or catch-up handoff of token IDs that MD
extends. Each request is a `pdd.record.RequestRecord`, filled as the router fills one.
"""

from __future__ import annotations

from collections.abc import Generator, Hashable, Sequence

import simpy

from pdd.lab.sim.clock import SimClock, drive
from pdd.lab.sim.fleet import DeploymentSpec, Fleet, Proc
from pdd.lab.sim.instance import Instance
from pdd.lab.sim.prefill import PrefillPaths
from pdd.lab.sim.relayed import RelayPaths
from pdd.lab.sim.reserve import Reservations
from pdd.lab.sim.sequence import SimSeq
from pdd.lab.sim.stream import Stream, fell_back
from pdd.lab.workload.types import Session
from pdd.names import RoleName
from pdd.policy.capacity import fits, pages_needed
from pdd.policy.plan import Plan, anomaly_rule, plan_with_room
from pdd.policy.routing import Candidate
from pdd.record import RequestRecord
from pdd.router.dispatch import DispatchQueue


class Cluster(Fleet):
    """A deployment's fleet and its managers: the router's dispatch (here), P's paths,
    the relayed pipeline and the decode side's reservations, each holding the fleet."""

    def __init__(self, env: simpy.Environment, spec: DeploymentSpec) -> None:
        super().__init__(env, spec)
        self.records: list[RequestRecord] = []
        self.reservations = Reservations(self)
        self.relay = RelayPaths(self)
        self.prefill = PrefillPaths(self, self.reservations, self.relay)
        self.queue = DispatchQueue(SimClock(env))  # the router's: requests waiting for room
        p = spec.policy
        self.rule = anomaly_rule(
            p.anomaly_filter,
            spec.max_context,
            p.anomaly_max_output_tokens,
            p.anomaly_min_prompt_share,
            p.anomaly_max_hit_share,
        )

    # ---- the workload --------------------------------------------------------------------
    def run(self, sessions: list[Session], until: float | None = None) -> list[RequestRecord]:
        for s in sessions:
            self.start(s)
        self.env.run(until=until)
        return self.records

    def warm(self, sessions: list[Session], prefixes: Sequence[Sequence[Hashable]] = ()) -> None:
        """Caches as a deployment that has served a while holds them: `prefixes` (each a
        prompt's blocks) on every instance, and each resumed session's context
        (`warm_tokens`) on one entry and one main instance, which the router's affinity
        then keeps it on."""
        for inst in self.instances.values():
            for blocks in prefixes:
                inst.keep(blocks)
        entry = [i for i in self.instances.values() if i.role in ("prefill", "standalone")]
        main = [i for i in self.instances.values() if i.role == "main"]
        for s in sessions:
            if s.warm_tokens:
                keys = self.keys(s, s.warm_tokens)
                for group in (entry, main):
                    if group:
                        group[s.id % len(group)].keep(keys)

    def start(self, s: Session) -> None:
        self.env.process(self._session(s))

    def _session(self, s: Session) -> Proc:
        yield self.env.timeout(max(0.0, s.start_s - self.env.now))
        prompts = s.prompts()
        for k, turn in enumerate(s.turns):
            if turn.pause_s:  # its tool runs
                yield self.env.timeout(turn.pause_s)
            rec = RequestRecord(
                id=f"{s.id}-{k}",
                session=s.id,
                turn=k,
                planned_anomalous=s.anomalous,
                start_s=self.env.now,
                prompt_tokens=prompts[k],
                max_tokens=turn.max_tokens,
            )
            self.records.append(rec)  # now: a run stopped at a horizon still sees it, unfinished
            yield self.env.process(self._serve(s, rec))
            if rec.error:  # as `pdd bench`: the session's later turns are never sent, and count as failed
                self.records += [
                    RequestRecord(
                        id=f"{s.id}-{j}",
                        session=s.id,
                        turn=j,
                        planned_anomalous=s.anomalous,
                        prompt_tokens=prompts[j],
                        max_tokens=s.turns[j].max_tokens,
                        error=f"not sent: turn {k} failed",
                    )
                    for j in range(k + 1, len(s.turns))
                ]
                return

    # ---- the router --------------------------------------------------------------------------
    def _candidates(self, role: str, s: Session, prompt: int) -> list[Candidate]:
        keys = self.keys(s, prompt)
        return [
            Candidate(i.name, i.hit_tokens(keys, prompt, touch=False), i.queued_tokens)
            for i in self.instances.values()
            if i.role == role
        ]

    def _need(self, rec: RequestRecord, name: str, hit_tokens: int) -> int:
        """KV pages (a page is a block here) the request takes at decode-side `name`."""
        return pages_needed(rec.prompt_tokens, rec.max_tokens, hit_tokens, self.instances[name].block_tokens)

    def _has_room(self, rec: RequestRecord, c: Candidate) -> bool:
        inst = self.instances[c.name]
        return fits(
            self._need(rec, c.name, c.predicted_hit_tokens), inst.committed_pages, inst.committed_requests, inst.room
        )

    def _plan(self, s: Session, rec: RequestRecord) -> Plan | None:
        mode, prompt = self.spec.mode, rec.prompt_tokens
        entry = RoleName.STANDALONE if mode == "colocated" else RoleName.PREFILL
        main = self._candidates(RoleName.MAIN, s, prompt) if mode != "colocated" else []
        relay = self._candidates(RoleName.RELAY, s, prompt) if mode == "pdd" else []
        p = self.spec.policy
        return plan_with_room(
            prompt,
            rec.max_tokens,
            self._candidates(entry, s, prompt),
            main,
            relay,
            self.rule,
            lambda c: self._has_room(rec, c),
            p.affinity_weight,
            p.load_weight,
        )

    def _dispatch(self, s: Session, rec: RequestRecord) -> Generator[simpy.Event, object, Plan]:
        """The request's plan once its decode side has room, first come first served (the
        router's dispatch queue: no deadline, the request is admitted and will run)."""
        return (yield from drive(self.queue.turn(lambda: self._plan(s, rec))))

    def _commit(self, plan: Plan, rec: RequestRecord, sign: int) -> None:
        """Charge (+1) or refund (-1) the decode-side instance that must hold the request:
        MD, or the relay when it produces alone (a relay behind MD turns work away itself)."""
        name = plan.main or plan.relay
        if name is None:
            return
        inst = self.instances[name]
        inst.committed_pages += sign * self._need(rec, name, plan.predicted_hit if plan.main else 0)
        inst.committed_requests += sign
        if sign < 0:
            self.queue.changed()

    # ---- one request ---------------------------------------------------------------------
    def _serve(self, s: Session, rec: RequestRecord) -> Proc:
        yield self.env.timeout(self.spec.request_overhead_s)
        plan = yield from self._dispatch(s, rec)
        rec.anomalous, rec.d_hit_predicted = plan.anomalous, plan.predicted_hit
        rec.instances = {"entry": plan.entry, "relay": plan.relay, "main": plan.main}
        if plan.fallback:
            fell_back(rec, plan.fallback)
        members = {n for n in (plan.entry, plan.main, plan.relay) if n}
        work = rec.prompt_tokens + rec.max_tokens
        for n in members:
            self.instances[n].queued_tokens += work
        self._commit(plan, rec, +1)
        stream = Stream(rec)
        try:
            if plan.main is None and plan.relay is None:
                yield from self._whole(self.instances[plan.entry], s, rec, stream)
            else:
                yield from self.prefill.disaggregated(plan, s, rec, stream)
        finally:
            for n in members:
                self.instances[n].queued_tokens -= work
            self._commit(plan, rec, -1)
        stream.close()

    def _whole(self, inst: Instance, s: Session, rec: RequestRecord, stream: Stream) -> Proc:
        """Prefill and decode on one instance (colocated)."""
        prompt = rec.prompt_tokens
        hit = inst.hit_tokens(self.keys(s, prompt), prompt)
        rec.p_hit_tokens = rec.d_hit_tokens = hit
        seq = SimSeq(
            context=hit,
            pending=prompt - hit,
            produce=rec.max_tokens,
            hold=None,
            blocks=self.keys(s, prompt + rec.max_tokens),
        )
        if not self.fits(inst, seq, rec):
            return
        yield self.until_finished(inst, seq)
        stream.take(seq)
