"""A simulated deployment serving simulated requests, decided by `pdd.policy`.

Every choice a live deployment makes is made here by the same function: the router's
plan and its dispatch by room (`plan_with_room` over `capacity.fits`/`pages_needed`,
first come first served, the anomaly filter), the reservations (`pdd.lab.sim.reserve`:
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

from collections import deque
from collections.abc import Generator, Hashable, Sequence
from dataclasses import dataclass, field

import simpy

from pdd.config import PolicySpec
from pdd.lab.sim.instance import Instance
from pdd.lab.sim.link import SharedLink
from pdd.lab.sim.parts import Proc
from pdd.lab.sim.prefill import PrefillPaths
from pdd.lab.sim.relayed import RelayPaths
from pdd.lab.sim.reserve import Reservations
from pdd.lab.sim.sequence import SimSeq
from pdd.lab.sim.stream import Stream, fell_back
from pdd.lab.sim.tcp import Tcp, TcpLink
from pdd.lab.sim.workload import SimSession
from pdd.names import RoleName
from pdd.perf.hardware import Line
from pdd.perf.steps import StepModel
from pdd.policy.capacity import fits, pages_needed
from pdd.policy.plan import Plan, anomaly_rule, plan_with_room
from pdd.policy.routing import Candidate
from pdd.policy.transfer import LineMeter, LinkEstimate
from pdd.record import RequestRecord


@dataclass(frozen=True)
class RoleSpec:
    """`count` instances of one role in one datacenter, each on `gpus` devices."""

    role: str  # standalone | prefill | relay | main (as `pdd up` names them)
    dc: str
    count: int
    steps: StepModel
    capacity_tokens: int
    max_batch_tokens: int
    max_running: int
    hardware: str = ""  # catalog name, for the cost
    gpus: int = 0
    cpu_priority: int = 0  # on shared cores, lower runs first
    max_chunks: int = 0  # prefill chunks a step may hold (0: the engine's rule, as many as its budget takes)
    max_requests: int = 256  # most requests one holds at once (`EngineConfig.max_requests`)


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    roles: tuple[RoleSpec, ...]
    wan: Line  # between datacenters
    lan: Line  # inside one
    kv_bytes_per_token: float
    block_tokens: int
    max_context: int
    policy: PolicySpec = PolicySpec()
    cores: int | None = None  # every instance shares this many cores (one machine); None: own hardware
    request_overhead_s: float = 0.0  # the router's and the HTTP path's own time before a request is planned
    tcp: Tcp | None = None  # the line between datacenters as TCP sees it (None: a fluid pipe, as `pdd wan` is)
    stretches: bool = True  # decode stretches (pdd.lab.sim.instance); off: one event per step

    @property
    def mode(self) -> str:
        roles = {r.role for r in self.roles}
        return "colocated" if "standalone" in roles else "pdd" if "relay" in roles else "pd"


@dataclass
class Cluster(PrefillPaths, RelayPaths, Reservations):
    env: simpy.Environment
    spec: DeploymentSpec
    records: list[RequestRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        cpu = simpy.PriorityResource(self.env, capacity=self.spec.cores) if self.spec.cores else None
        self.instances: dict[str, Instance] = {}
        for r in self.spec.roles:
            for i in range(r.count):
                name = f"{r.role}{i}@{r.dc}"
                self.instances[name] = Instance(
                    self.env,
                    name,
                    r.role,
                    r.dc,
                    r.steps,
                    r.capacity_tokens,
                    self.spec.block_tokens,
                    r.max_batch_tokens,
                    r.max_running,
                    cpu,
                    r.cpu_priority,
                    self.spec.stretches,
                    r.max_chunks,
                    r.max_requests,
                )
        dcs = sorted({r.dc for r in self.spec.roles})
        self.lans = {dc: SharedLink(self.env, self.spec.lan, f"lan-{dc}") for dc in dcs}
        self.wan: SharedLink | TcpLink | None = None
        if len(dcs) > 1:
            self.wan = (
                SharedLink(self.env, self.spec.wan, "wan")
                if self.spec.tcp is None
                else TcpLink(self.env, self.spec.wan, self.spec.tcp, "wan")
            )
        self.meters: dict[tuple[str, str], LineMeter] = {}  # each P's, per datacenter, as the live P keeps them
        self._key_cache: dict[int, list] = {}
        self._dispatch_line: deque[simpy.Event] = deque()  # the router's: requests waiting for room
        self._room = self.env.event()  # room came free at a decode-side instance
        p = self.spec.policy
        self.rule = anomaly_rule(
            p.anomaly_filter,
            self.spec.max_context,
            p.anomaly_max_output_tokens,
            p.anomaly_min_prompt_share,
            p.anomaly_max_hit_share,
        )

    # ---- the workload --------------------------------------------------------------------
    def run(self, sessions: list[SimSession], until: float | None = None) -> list[RequestRecord]:
        for s in sessions:
            self.start(s)
        self.env.run(until=until)
        return self.records

    def warm(self, sessions: list[SimSession], blocks: Sequence[Hashable] = ()) -> None:
        """Caches as a deployment that has served a while holds them: `blocks` on every
        instance, and each resumed session's context (`warm_tokens`) on one entry and one
        main instance, which the router's affinity then keeps it on."""
        for inst in self.instances.values():
            inst.cache.insert(list(blocks))
        entry = [i for i in self.instances.values() if i.role in ("prefill", "standalone")]
        main = [i for i in self.instances.values() if i.role == "main"]
        for s in sessions:
            if s.warm_tokens:
                keys = self._keys(s, s.warm_tokens)
                for group in (entry, main):
                    if group:
                        group[s.id % len(group)].cache.insert(keys)

    def start(self, s: SimSession) -> None:
        self.env.process(self._session(s))

    def _session(self, s: SimSession) -> Proc:
        yield self.env.timeout(max(0.0, s.start_s - self.env.now))
        for k, turn in enumerate(s.turns):
            rec = RequestRecord(
                id=f"{s.id}-{k}",
                session=s.id,
                turn=k,
                planned_anomalous=s.anomalous,
                start_s=self.env.now,
                prompt_tokens=turn.prompt_tokens,
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
                        prompt_tokens=later.prompt_tokens,
                        max_tokens=later.max_tokens,
                        error=f"not sent: turn {k} failed",
                    )
                    for j, later in enumerate(s.turns[k + 1 :], start=k + 1)
                ]
                return

    # ---- lines -----------------------------------------------------------------------------
    def link(self, a: Instance, b: Instance) -> SharedLink | TcpLink:
        return self.lans[a.dc] if a.dc == b.dc or self.wan is None else self.wan

    def line_meter(self, p: Instance, peer: Instance) -> LineMeter:
        """What P knows of the path to `peer`'s datacenter, from the line's figures on."""
        meter = self.meters.get((p.name, peer.dc))
        if meter is None:
            line = self.link(p, peer).line
            meter = self.meters[(p.name, peer.dc)] = LineMeter(LinkEstimate(line.bytes_per_s, line.one_way_ms / 1000))
        return meter

    def send(self, a: Instance, b: Instance, rec: RequestRecord, tokens: tuple[int, int], priority: int) -> Proc:
        """KV of prompt `tokens` from P `a` to `b`, on their connection. P's meter follows
        it as the live one does (`begin`, `acked`); the simulator moves it as one
        transfer, so it is acknowledged once, when it has landed."""
        start, end = tokens
        kvb = self.spec.kv_bytes_per_token
        key, meter = (rec.id, b.name), self.line_meter(a, b)
        meter.begin(key, start, end, round(kvb), priority)
        nbytes = int((end - start) * kvb)
        link = self.link(a, b)
        yield link.send(nbytes, priority, (a.name, b.name))
        meter.acked(key, end, True, self.env.now)
        rec.kv_bytes += nbytes
        rec.wan_bytes += nbytes if link is self.wan else 0

    # ---- the router --------------------------------------------------------------------------
    def _candidates(self, role: str, s: SimSession, prompt: int) -> list[Candidate]:
        keys = self._keys(s, prompt)
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

    def _plan(self, s: SimSession, rec: RequestRecord) -> Plan | None:
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

    def _dispatch(self, s: SimSession, rec: RequestRecord) -> Generator[simpy.Event, object, Plan]:
        """The request's plan once its decode side has room, first come first served (the
        router's dispatch line: no deadline, the request is admitted and will run)."""
        if not self._dispatch_line:
            plan = self._plan(s, rec)
            if plan is not None:
                return plan
        turn = self.env.event()
        self._dispatch_line.append(turn)
        if len(self._dispatch_line) > 1:
            yield turn
        while (plan := self._plan(s, rec)) is None:
            self._room = self.env.event()
            yield self._room
        self._dispatch_line.popleft()
        if self._dispatch_line:
            self._dispatch_line[0].succeed()  # the next one's turn
        return plan

    def _commit(self, plan: Plan, rec: RequestRecord, sign: int) -> None:
        """Charge (+1) or refund (-1) the decode-side instance that must hold the request:
        MD, or the relay when it produces alone (a relay behind MD turns work away itself)."""
        name = plan.main or plan.relay
        if name is None:
            return
        inst = self.instances[name]
        inst.committed_pages += sign * self._need(rec, name, plan.predicted_hit if plan.main else 0)
        inst.committed_requests += sign
        if sign < 0 and not self._room.triggered:
            self._room.succeed()

    # ---- one request ---------------------------------------------------------------------
    def _serve(self, s: SimSession, rec: RequestRecord) -> Proc:
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
                yield from self._disaggregated(plan, s, rec, stream)
        finally:
            for n in members:
                self.instances[n].queued_tokens -= work
            self._commit(plan, rec, -1)
        stream.close()

    def _keys(self, s: SimSession, tokens: int) -> list:
        """The first `tokens` // block keys of a session's context (one list per session,
        sliced: every turn's keys are a prefix of the longest)."""
        block = self.spec.block_tokens
        keys = self._key_cache.get(s.id)
        if keys is None or len(keys) < tokens // block:
            keys = self._key_cache[s.id] = s.keys(max(tokens, self.spec.max_context), block)
        return keys[: tokens // block]

    def _whole(self, inst: Instance, s: SimSession, rec: RequestRecord, stream: Stream) -> Proc:
        """Prefill and decode on one instance (colocated)."""
        prompt = rec.prompt_tokens
        hit = inst.hit_tokens(self._keys(s, prompt), prompt)
        rec.p_hit_tokens = rec.d_hit_tokens = hit
        seq = SimSeq(
            context=hit,
            pending=prompt - hit,
            produce=rec.max_tokens,
            hold=None,
            blocks=self._keys(s, prompt + rec.max_tokens),
        )
        if not self._fits(inst, seq, rec):
            return
        yield self._until_finished(inst, seq)
        stream.take(seq)

    @staticmethod
    def _fits(inst: Instance, seq: SimSeq, rec: RequestRecord) -> bool:
        """A sequence larger than the whole pool (its cached prefix included: it is pinned
        while the sequence runs) would wait forever, and block the queue."""
        need = seq.context + seq.pending + seq.produce
        if need <= inst.capacity_tokens:
            return True
        rec.error = f"{inst.name} cannot hold {need} tokens"
        return False

    def _until_finished(self, inst: Instance, seq: SimSeq, submit: bool = True) -> simpy.Event:
        done = self.env.event()
        seq.on_finish = lambda _s: done.succeed()
        if submit:
            inst.submit(seq)
        return done
