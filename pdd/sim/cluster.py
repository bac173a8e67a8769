"""A simulated deployment serving simulated requests, decided by `pdd.policy`.

Every choice a live deployment makes is made here by the same function: the router's
plan (`plan_request`, with the anomaly filter), P's pipeline choice after prefill
(`answer_wait_s`, `choose_pipeline`), the relay's handoff (`choose_handoff`,
`cut_over`), the KV range (`kv_range`) and the reservation's waiting
(`reserve_retry_delay`). The lifecycle follows the live one (pdd/instance/*.py):
reservations at submit, P's KV to the relay (urgent) and to MD (background behind a
relay) at the same time, READY to the relay once MD holds the KV, then a one-shot or
catch-up handoff of token IDs that MD extends.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import simpy

from pdd.config import PolicySpec
from pdd.policy.handoff import choose_handoff, cut_over
from pdd.policy.pipeline import answer_wait_s, choose_pipeline
from pdd.policy.plan import Plan, anomaly_rule, plan_request
from pdd.policy.retry import reserve_retry_delay
from pdd.policy.routing import Candidate
from pdd.policy.transfer import LinkEstimate, kv_range
from pdd.sim.hardware import Line
from pdd.sim.instance import Hold, Instance, SimSeq
from pdd.sim.link import SharedLink
from pdd.sim.steps import StepModel
from pdd.sim.workload import SimSession
from pdd.names import HandoffMode, Pipeline

URGENT, BACKGROUND = 0, 1
RESERVE_WAIT_S = 45.0  # as the live decode side: a full pool holds a reservation back this long


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

    @property
    def mode(self) -> str:
        roles = {r.role for r in self.roles}
        return "colocated" if "standalone" in roles else "pdd" if "relay" in roles else "pd"


@dataclass
class Outcome:
    """One request, as `pdd bench` records it."""

    session: int
    turn: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    ttft_s: float | None = None
    end_s: float | None = None
    tokens: int = 0
    max_itl_s: float = 0.0
    pipeline: str | None = None
    handoff: str | None = None
    handoff_tokens: int = 0
    handoff_stall_s: float | None = None
    rld_tokens: int = 0
    md_tokens: int = 0
    wan_bytes: float = 0.0
    p_hit: int = 0
    d_hit: int = 0
    anomalous: bool = False
    fallback: str | None = None
    failed: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.end_s is None or self.tokens < 2:
            return None
        return (self.end_s - self.arrival_s - self.ttft_s) / (self.tokens - 1)


@dataclass
class _Stream:
    """The client's view of one request: positions arrive in order, whoever produced them."""

    arrival_s: float
    first_s: float | None = None
    last_s: float | None = None
    tokens: int = 0
    max_gap_s: float = 0.0

    def emit(self, at: float) -> None:
        if self.first_s is None:
            self.first_s = at
        else:
            self.max_gap_s = max(self.max_gap_s, at - self.last_s)
        self.last_s = at
        self.tokens += 1

    def take(self, seq: SimSeq) -> None:
        """A producer's tokens after the ones already seen."""
        if seq.produced == 0:
            return
        if self.last_s is not None:
            self.max_gap_s = max(self.max_gap_s, seq.first_s - self.last_s)
        elif self.first_s is None:
            self.first_s = seq.first_s
        self.max_gap_s = max(self.max_gap_s, seq.max_gap_s)
        self.last_s = seq.last_s
        self.tokens += seq.produced


@dataclass
class Cluster:
    env: simpy.Environment
    spec: DeploymentSpec
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        cpu = simpy.PriorityResource(self.env, capacity=self.spec.cores) if self.spec.cores else None
        self.instances: dict[str, Instance] = {}
        for r in self.spec.roles:
            for i in range(r.count):
                name = f"{r.role}{i}@{r.dc}"
                self.instances[name] = Instance(self.env, name, r.role, r.dc, r.steps, r.capacity_tokens,
                                                self.spec.block_tokens, r.max_batch_tokens, r.max_running, cpu,
                                                r.cpu_priority)
        dcs = sorted({r.dc for r in self.spec.roles})
        self.lans = {dc: SharedLink(self.env, self.spec.lan, f"lan-{dc}") for dc in dcs}
        self.wan = SharedLink(self.env, self.spec.wan, "wan") if len(dcs) > 1 else None
        p = self.spec.policy
        self.rule = anomaly_rule(p.anomaly_filter, self.spec.max_context, p.anomaly_max_output_tokens,
                                 p.anomaly_min_prompt_share, p.anomaly_max_hit_share)

    # ---- the workload --------------------------------------------------------------------
    def run(self, sessions: list[SimSession], until: float | None = None) -> list[Outcome]:
        for s in sessions:
            self.start(s)
        self.env.run(until=until)
        return self.outcomes

    def start(self, s: SimSession) -> None:
        self.env.process(self._session(s))

    def _session(self, s: SimSession) -> Iterator[simpy.Event]:
        yield self.env.timeout(max(0.0, s.start_s - self.env.now))
        for k, turn in enumerate(s.turns):
            out = Outcome(s.id, k, self.env.now, turn.prompt_tokens, turn.max_tokens, anomalous=s.anomalous)
            self.outcomes.append(out)  # now: a run stopped at a horizon still sees it, unfinished
            yield self.env.process(self._serve(s, out))
            if out.failed:  # as `pdd bench`: the session's later turns are never sent, and count as failed
                for j, later in enumerate(s.turns[k + 1:], start=k + 1):
                    self.outcomes.append(Outcome(s.id, j, self.env.now, later.prompt_tokens, later.max_tokens,
                                                 anomalous=s.anomalous, failed=f"not sent: turn {k} failed"))
                return

    def link(self, a: Instance, b: Instance) -> SharedLink:
        return self.lans[a.dc] if a.dc == b.dc or self.wan is None else self.wan

    # ---- one request ---------------------------------------------------------------------
    def _candidates(self, role: str, s: SimSession, prompt: int) -> list[Candidate]:
        keys = s.keys(prompt, self.spec.block_tokens)
        return [Candidate(i.name, i.hit_tokens(keys, prompt, touch=False), i.queued_tokens)
                for i in self.instances.values() if i.role == role]

    def _plan(self, s: SimSession, out: Outcome) -> Plan:
        mode, prompt = self.spec.mode, out.prompt_tokens
        entry = "standalone" if mode == "colocated" else "prefill"
        main = self._candidates("main", s, prompt) if mode != "colocated" else []
        relay = self._candidates("relay", s, prompt) if mode == "pdd" else []
        p = self.spec.policy
        return plan_request(prompt, out.max_tokens, self._candidates(entry, s, prompt), main, relay, self.rule,
                            p.affinity_weight, p.load_weight)

    def _serve(self, s: SimSession, out: Outcome) -> Iterator[simpy.Event]:
        yield self.env.timeout(self.spec.request_overhead_s)
        plan = self._plan(s, out)
        out.anomalous = plan.anomalous
        out.fallback = plan.fallback
        members = {n for n in (plan.entry, plan.main, plan.relay) if n}
        work = out.prompt_tokens + out.max_tokens
        for n in members:
            self.instances[n].queued_tokens += work
        stream = _Stream(out.arrival_s)
        try:
            if plan.main is None and plan.relay is None or plan.anomalous:
                yield from self._whole(self.instances[plan.entry], s, out, stream)
                out.pipeline = Pipeline.P_RLD if plan.anomalous else None
            else:
                yield from self._disaggregated(plan, s, out, stream)
        finally:
            for n in members:
                self.instances[n].queued_tokens -= work
        if stream.first_s is not None and not out.failed:
            out.ttft_s = stream.first_s - out.arrival_s
            out.end_s = stream.last_s
            out.tokens = stream.tokens
            out.max_itl_s = stream.max_gap_s

    def _keys(self, s: SimSession, tokens: int) -> list:
        return s.keys(tokens, self.spec.block_tokens)

    def _whole(self, inst: Instance, s: SimSession, out: Outcome, stream: _Stream) -> Iterator[simpy.Event]:
        """Prefill and decode on one instance (colocated; the relay for a filtered request)."""
        prompt = out.prompt_tokens
        hit = inst.hit_tokens(self._keys(s, prompt), prompt)
        out.p_hit = out.d_hit = hit
        seq = SimSeq(context=hit, pending=prompt - hit, produce=out.max_tokens, hold=None,
                     blocks=self._keys(s, prompt + out.max_tokens))
        if not self._fits(inst, seq, out):
            return
        yield self._until_finished(inst, seq)
        stream.take(seq)
        if inst.role == "relay":
            out.rld_tokens = seq.produced

    @staticmethod
    def _fits(inst: Instance, seq: SimSeq, out: Outcome) -> bool:
        """A sequence larger than the whole pool (its cached prefix included: it is pinned
        while the sequence runs) would wait forever, and block the queue."""
        need = seq.context + seq.pending + seq.produce
        if need <= inst.capacity_tokens:
            return True
        out.failed = f"{inst.name} cannot hold {need} tokens"
        return False

    def _until_finished(self, inst: Instance, seq: SimSeq, submit: bool = True) -> simpy.Event:
        done = self.env.event()
        seq.on_finish = lambda _s: done.succeed()
        if submit:
            inst.submit(seq)
        return done

    def _reserve(self, inst: Instance, s: SimSession, out: Outcome, link: SharedLink) -> Iterator[simpy.Event]:
        """RESERVE from P: (hit, the hold) once the answer is back at P, or None when the
        pool stayed full for `RESERVE_WAIT_S`."""
        one_way = link.line.one_way_ms / 1000
        yield self.env.timeout(one_way)
        prompt, keys = out.prompt_tokens, self._keys(s, out.prompt_tokens)
        started, attempt = self.env.now, 0
        while True:
            hit = inst.hit_tokens(keys, prompt)
            hold = inst.hold(prompt - hit + out.max_tokens, keys[: hit // inst.block_tokens])
            if hold is not None:
                break
            delay = reserve_retry_delay(attempt, self.env.now - started, RESERVE_WAIT_S)
            if delay is None:
                yield self.env.timeout(one_way)
                return None
            yield self.env.timeout(delay)
            attempt += 1
        yield self.env.timeout(one_way)
        return hit, hold

    def _disaggregated(self, plan: Plan, s: SimSession, out: Outcome, stream: _Stream) -> Iterator[simpy.Event]:
        env, prompt = self.env, out.prompt_tokens
        p = self.instances[plan.entry]
        md = self.instances[plan.main] if plan.main else None
        rld = self.instances[plan.relay] if plan.relay else None
        md_res = env.process(self._reserve(md, s, out, self.link(p, md))) if md else None
        rld_res = env.process(self._reserve(rld, s, out, self.link(p, rld))) if rld else None
        out.p_hit = p.hit_tokens(self._keys(s, prompt), prompt)
        pseq = SimSeq(context=out.p_hit, pending=prompt - out.p_hit, produce=1, hold=None, blocks=self._keys(s, prompt))
        if not self._fits(p, pseq, out):
            for res in (md_res, rld_res):
                if res is not None:
                    self.env.process(self._drop_when(res))
            return
        yield self._until_finished(p, pseq)
        pipeline, reserved = yield from self._decide(p, md, md_res, rld is not None, out)
        if pipeline == Pipeline.P_MD:
            if rld_res is not None:
                self.env.process(self._drop_when(rld_res))
            yield from self._p_md(p, md, reserved, s, out, stream)
            return
        if rld_res is not None:
            yield rld_res
        if rld is None or rld_res.value is None:
            if pipeline == Pipeline.P_RLD_MD and reserved is not None:  # the relay refused: MD serves it, late
                out.fallback = out.fallback or "relay_refused"
                yield from self._p_md(p, md, reserved, s, out, stream)
                return
            out.failed = "no decode instance could hold the request"
            self._free(reserved)
            return
        out.pipeline = pipeline
        yield from self._relayed(p, md if pipeline == Pipeline.P_RLD_MD else None, reserved, md_res, rld, rld_res.value, s,
                                 out, stream)

    def _decide(self, p: Instance, md: Instance | None, md_res, has_relay: bool, out: Outcome):
        """P, after prefill: wait for MD's answer while P -> MD could still be in time, then
        choose. Returns (pipeline, MD's (hit, hold) or None)."""
        if md is None:
            out.fallback = out.fallback or "no_main"
            return Pipeline.P_RLD, None
        line = self.link(p, md)
        est = LinkEstimate(line.line.bytes_per_s, line.line.one_way_ms / 1000)
        budget = self.spec.policy.ttft_budget_ms / 1000
        waited = self.env.now
        if has_relay:
            yield md_res | self.env.timeout(answer_wait_s(budget, est))
        else:
            yield md_res
        answered = md_res.triggered and md_res.ok
        reserved = md_res.value if answered else None
        if answered and reserved is None:  # MD refused: the relay covers the request, counted
            out.fallback = "main_refused"
            return (Pipeline.P_RLD, None) if has_relay else (Pipeline.P_MD, None)
        delta = None
        if reserved is not None:
            out.d_hit = reserved[0]
            delta = (out.prompt_tokens - reserved[0]) * self.spec.kv_bytes_per_token
        left = budget - (self.env.now - waited)
        decision = choose_pipeline(delta, est, line.in_flight(URGENT), left, has_relay, self.spec.policy.pipeline)
        return decision.pipeline, reserved

    @staticmethod
    def _free(reserved: tuple[int, Hold] | None) -> None:
        if reserved is not None:
            reserved[1].release()

    def _p_md(self, p: Instance, md: Instance, reserved, s: SimSession, out: Outcome,
              stream: _Stream) -> Iterator[simpy.Event]:
        out.pipeline = Pipeline.P_MD
        if reserved is None:
            out.failed = "the decode instance refused the reservation"
            return
        start, end = kv_range(out.prompt_tokens, reserved[0])
        nbytes = (end - start) * self.spec.kv_bytes_per_token
        yield self.link(p, md).send(nbytes, URGENT)
        out.wan_bytes += nbytes if self.link(p, md) is self.wan else 0
        stream.emit(self.env.now)  # P's first token, streamed by MD as the KV lands
        if out.max_tokens > 1:
            seq = SimSeq(context=out.prompt_tokens, pending=0, produce=out.max_tokens - 1, hold=reserved[1],
                         blocks=self._keys(s, out.prompt_tokens + out.max_tokens))
            yield self._until_finished(md, seq)
            stream.take(seq)
        else:
            reserved[1].release()
        out.md_tokens = stream.tokens

    def _relayed(self, p: Instance, md: Instance | None, reserved, md_res, rld: Instance,
                 rld_reserved: tuple[int, int], s: SimSession, out: Outcome, stream: _Stream) -> Iterator[simpy.Event]:
        """P -> RLD -> MD (or P -> RLD when MD is out): the relay streams at once; MD
        takes over once its KV has landed."""
        env, kvb, prompt = self.env, self.spec.kv_bytes_per_token, out.prompt_tokens
        start, end = kv_range(prompt, rld_reserved[0])
        to_rld = self.link(p, rld).send((end - start) * kvb, URGENT)
        md_has_kv = env.process(self._behind_relay(p, md, reserved, md_res, out)) if md else None
        yield to_rld
        stream.emit(env.now)  # P's first token, streamed by the relay
        if out.max_tokens == 1:
            out.rld_tokens = 1
            rld_reserved[1].release()
            if md_has_kv is not None:
                self.env.process(self._drop_when(md_has_kv))
            return
        rseq = SimSeq(context=prompt, pending=0, produce=out.max_tokens - 1, hold=rld_reserved[1],
                      blocks=self._keys(s, prompt))
        finished = self._until_finished(rld, rseq)
        if md_has_kv is None:
            yield finished
            stream.take(rseq)
            out.rld_tokens = stream.tokens
            return
        yield finished | md_has_kv
        if not md_has_kv.triggered or md_has_kv.value is None:
            yield finished
            stream.take(rseq)
            out.rld_tokens = stream.tokens
            out.fallback = out.fallback or "relay_finished"
            self.env.process(self._drop_when(md_has_kv))
            return
        hold = md_has_kv.value
        # READY reaches the relay: MD's acknowledgement back to P, then P -> relay.
        yield env.timeout(self.link(p, md).line.one_way_ms / 1000 + self.link(p, rld).line.one_way_ms / 1000)
        if rseq.done:
            stream.take(rseq)
            out.rld_tokens = stream.tokens
            out.fallback = out.fallback or "relay_finished"
            hold.release()
            return
        yield from self._hand_off(rld, rseq, md, hold, s, out, stream)

    @staticmethod
    def _drop_when(event: simpy.Event) -> Iterator[simpy.Event]:
        """Give back a reservation that will not be used, once it is made: `event` gives
        (hit, hold), a hold, or None (refused)."""
        yield event
        value = event.value
        if value is not None:
            (value[1] if isinstance(value, tuple) else value).release()

    def _behind_relay(self, p: Instance, md: Instance, reserved, md_res, out: Outcome) -> Iterator[simpy.Event]:
        """The delta to MD, in the background (once MD has answered, if it had not in
        time); MD's hold once it has landed, None if MD refused."""
        if reserved is None:
            yield md_res
            reserved = md_res.value
            if reserved is None:
                return None
            out.d_hit = reserved[0]
        start, end = kv_range(out.prompt_tokens, reserved[0])
        nbytes = (end - start) * self.spec.kv_bytes_per_token
        line = self.link(p, md)
        yield line.send(nbytes, BACKGROUND)
        out.wan_bytes += nbytes if line is self.wan else 0
        return reserved[1]

    def _hand_off(self, rld: Instance, rseq: SimSeq, md: Instance, hold: Hold, s: SimSession, out: Outcome,
                  stream: _Stream) -> Iterator[simpy.Event]:
        env, p = self.env, self.spec.policy
        one_way = self.link(rld, md).line.one_way_ms / 1000
        occupancy, waiting = rld.load()
        gap = 1 + rseq.produced
        plan = choose_handoff(gap, occupancy, waiting, p.handoff_threshold, p.catch_up_chunk, p.handoff)
        out.handoff = plan.mode
        mseq = SimSeq(context=out.prompt_tokens, pending=0, produce=0, hold=hold, live=False,
                      blocks=self._keys(s, out.prompt_tokens + out.max_tokens))
        finished = self._until_finished(md, mseq, submit=False)
        sent = 0
        if plan.mode == HandoffMode.CATCH_UP:
            rounds, previous = 0, None
            while True:
                produced = 1 + rseq.produced
                if rseq.done:  # the relay finished meanwhile: nothing left to hand over
                    break
                chunk = produced - sent
                computed = env.event()
                mseq.on_computed = lambda _s, ev=computed: ev.succeed() if not ev.triggered else None
                yield env.timeout(one_way)
                md.feed(mseq, chunk, live=False, step_cap=plan.chunk)
                sent = produced
                yield computed
                yield env.timeout(one_way)  # the acknowledgement
                rounds += 1
                produced = 1 + rseq.produced
                if rseq.done or cut_over(produced, sent, p.handoff_threshold, rounds, previous):
                    break
                previous = produced - sent
            mseq.on_computed = None
        if rseq.done:
            stream.take(rseq)
            out.rld_tokens = stream.tokens
            out.fallback = out.fallback or "relay_finished"
            md.stop(mseq)
            return
        rld.stop(rseq)
        relayed = 1 + rseq.produced
        stream.take(rseq)
        out.rld_tokens = relayed
        out.handoff_tokens = relayed
        yield env.timeout(one_way)
        mseq.produce = out.max_tokens - relayed
        md.feed(mseq, relayed - sent, live=True)
        yield finished
        out.handoff_stall_s = mseq.first_s - stream.last_s
        stream.take(mseq)
        out.md_tokens = mseq.produced

