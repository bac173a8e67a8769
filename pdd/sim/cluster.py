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

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import simpy

from pdd.config import PolicySpec
from pdd.policy.pipeline import answer_wait_s, choose_pipeline
from pdd.policy.plan import Plan, anomaly_rule, plan_request
from pdd.policy.prefix import PREFIX_WAIT_S
from pdd.policy.retry import reserve_retry_delay
from pdd.policy.routing import Candidate
from pdd.policy.transfer import LinkEstimate, kv_range, observe_rate, observe_rtt
from pdd.sim.hardware import Line
from pdd.sim.instance import Instance
from pdd.sim.sequence import Hold, SimSeq
from pdd.sim.link import SharedLink
from pdd.sim.outcome import Outcome, Stream
from pdd.sim.relayed import BACKGROUND, URGENT, RelayPaths
from pdd.sim.steps import StepModel
from pdd.sim.tcp import Tcp, TcpLink
from pdd.sim.workload import SimSession
from pdd.names import Pipeline

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
    max_chunks: int = 0  # prefill chunks a step may hold (0: the engine's rule, as many as its budget takes)


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
    stretches: bool = True  # decode stretches (pdd.sim.instance); off: one event per step

    @property
    def mode(self) -> str:
        roles = {r.role for r in self.roles}
        return "colocated" if "standalone" in roles else "pdd" if "relay" in roles else "pd"


@dataclass
class Cluster(RelayPaths):
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
                                                r.cpu_priority, self.spec.stretches, r.max_chunks)
        dcs = sorted({r.dc for r in self.spec.roles})
        self.lans = {dc: SharedLink(self.env, self.spec.lan, f"lan-{dc}") for dc in dcs}
        self.wan: SharedLink | TcpLink | None = None
        if len(dcs) > 1:
            self.wan = SharedLink(self.env, self.spec.wan, "wan") if self.spec.tcp is None else \
                TcpLink(self.env, self.spec.wan, self.spec.tcp, "wan")
        # What each P knows of each line: the live prefill instance's estimate, kept from
        # reservation round trips and delivered KV with the same functions.
        self.estimates: dict[tuple[str, str], LinkEstimate] = {}
        self._key_cache: dict[int, list] = {}
        p = self.spec.policy
        self.rule = anomaly_rule(p.anomaly_filter, self.spec.max_context, p.anomaly_max_output_tokens,
                                 p.anomaly_min_prompt_share, p.anomaly_max_hit_share)

    # ---- the workload --------------------------------------------------------------------
    def run(self, sessions: list[SimSession], until: float | None = None) -> list[Outcome]:
        for s in sessions:
            self.start(s)
        self.env.run(until=until)
        return self.outcomes

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

    def link(self, a: Instance, b: Instance) -> SharedLink | TcpLink:
        return self.lans[a.dc] if a.dc == b.dc or self.wan is None else self.wan

    def estimate(self, p: Instance, peer: Instance) -> LinkEstimate:
        line = self.link(p, peer).line
        return self.estimates.get((p.name, peer.dc), LinkEstimate(line.bytes_per_s, line.one_way_ms / 1000))

    def send(self, a: Instance, b: Instance, nbytes: float, priority: int) -> Iterator[simpy.Event]:
        """KV from `a` to `b` on their connection; `a`'s estimate learns from its delivery."""
        started = self.env.now
        yield self.link(a, b).send(nbytes, priority, (a.name, b.name))
        est = self.estimate(a, b)
        seconds = self.env.now - started - est.one_way_s
        if nbytes > 0 and seconds > 0:
            self.estimates[(a.name, b.dc)] = observe_rate(est, int(nbytes), seconds)

    # ---- one request ---------------------------------------------------------------------
    def _candidates(self, role: str, s: SimSession, prompt: int) -> list[Candidate]:
        keys = self._keys(s, prompt)
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
        stream = Stream(out)
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
        """The first `tokens` // block keys of a session's context (one list per session,
        sliced: every turn's keys are a prefix of the longest)."""
        block = self.spec.block_tokens
        keys = self._key_cache.get(s.id)
        if keys is None or len(keys) < tokens // block:
            keys = self._key_cache[s.id] = s.keys(max(tokens, self.spec.max_context), block)
        return keys[: tokens // block]

    def _whole(self, inst: Instance, s: SimSession, out: Outcome, stream: Stream) -> Iterator[simpy.Event]:
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

    def _reserve(self, p: Instance, inst: Instance, s: SimSession, out: Outcome) -> Iterator[simpy.Event]:
        """RESERVE from P: (hit, the hold) once the answer is back at P, or None when the
        pool stayed full for `RESERVE_WAIT_S`. P's estimate of the line learns the round trip."""
        sent = self.env.now
        one_way = self.link(p, inst).line.one_way_ms / 1000
        yield self.env.timeout(one_way)
        prompt, keys = out.prompt_tokens, self._keys(s, out.prompt_tokens)
        yield from self._await_prefix(inst, keys, prompt)
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
        hold.unsettled(self._keys(s, prompt + out.max_tokens))
        yield self.env.timeout(one_way)
        self.estimates[(p.name, inst.dc)] = observe_rtt(self.estimate(p, inst), self.env.now - sent)
        return hit, hold

    def _await_prefix(self, inst: Instance, keys: list, prompt: int) -> Iterator[simpy.Event]:
        """As the live decode side (`DecodeSide._await_prefix`): an agent's next turn
        often arrives before the last one's KV (or a relay's fill of its output) has
        landed. When a request that is not producing yet holds more of this prompt than
        the cache does, and at least half, wait for it to settle (at most
        `PREFIX_WAIT_S`) rather than send the same KV across the line twice."""
        deadline = self.env.now + PREFIX_WAIT_S
        block = inst.block_tokens
        while True:
            best = max(inst.cache.match(keys, touch=False) * block + block, prompt // 2)
            holder = None
            for other in inst.unsettled:
                shared = block * next((i for i, (a, b) in enumerate(zip(other.keys, keys)) if a != b),
                                      min(len(other.keys), len(keys)))
                if shared >= best:
                    best, holder = shared, other
            left = deadline - self.env.now
            if holder is None or left <= 0:
                return
            yield holder.settled() | self.env.timeout(left)

    def _disaggregated(self, plan: Plan, s: SimSession, out: Outcome, stream: Stream) -> Iterator[simpy.Event]:
        env, prompt = self.env, out.prompt_tokens
        p = self.instances[plan.entry]
        md = self.instances[plan.main] if plan.main else None
        rld = self.instances[plan.relay] if plan.relay else None
        md_res = env.process(self._reserve(p, md, s, out)) if md else None
        rld_res = env.process(self._reserve(p, rld, s, out)) if rld else None
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
        yield from self._relayed(p, md if pipeline == Pipeline.P_RLD_MD else None, reserved, md_res, rld,
                                 rld_res.value, s, out, stream)

    def _decide(self, p: Instance, md: Instance | None, md_res, has_relay: bool, out: Outcome):
        """P, after prefill: wait for MD's answer while P -> MD could still be in time, then
        choose. Returns (pipeline, MD's (hit, hold) or None)."""
        if md is None:
            out.fallback = out.fallback or "no_main"
            return Pipeline.P_RLD, None
        line = self.link(p, md)
        est = self.estimate(p, md)
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
              stream: Stream) -> Iterator[simpy.Event]:
        out.pipeline = Pipeline.P_MD
        if reserved is None:
            out.failed = "the decode instance refused the reservation"
            return
        start, end = kv_range(out.prompt_tokens, reserved[0])
        nbytes = (end - start) * self.spec.kv_bytes_per_token
        yield from self.send(p, md, nbytes, URGENT)
        out.wan_bytes += nbytes if self.link(p, md) is self.wan else 0
        reserved[1].settle()  # MD produces
        stream.emit(self.env.now)  # P's first token, streamed by MD as the KV lands
        if out.max_tokens > 1:
            seq = SimSeq(context=out.prompt_tokens, pending=0, produce=out.max_tokens - 1, hold=reserved[1],
                         blocks=self._keys(s, out.prompt_tokens + out.max_tokens))
            yield self._until_finished(md, seq)
            stream.take(seq)
        else:
            reserved[1].release()
        out.md_tokens = stream.tokens
