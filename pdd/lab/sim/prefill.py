"""P's part of a simulated disaggregated request, as the live prefill instance runs it
(pdd/instance/prefill.py).

The reservations go out as the request is submitted: MD's, and the relay's in case
the request goes its way (optional while there is an MD to fall back on). P prefills,
then decides (`_decide`, the live `_decide`): it waits for MD's answer while P -> MD
could still be in time (`answer_wait_s`, from its `LineMeter`), chooses
(`choose_pipeline`), and falls back as the live P does: a relay that does not take the
request sends it P -> MD (`relay_refused`), an MD that refuses leaves it to the relay
alone, or fails it (`main_refused`). P -> MD waits for MD's answer however long MD's
line holds it: a required reservation has no deadline.
"""

from __future__ import annotations

from collections.abc import Generator

import simpy

from pdd.lab.sim.fleet import Fleet, Proc
from pdd.lab.sim.instance import Instance
from pdd.lab.sim.relayed import RelayPaths
from pdd.lab.sim.reserve import Reservations
from pdd.lab.sim.sequence import SimSeq
from pdd.lab.sim.stream import Stream, fell_back
from pdd.lab.workload.types import Session
from pdd.names import Pipeline
from pdd.policy.capacity import RELAY_ANSWER_S
from pdd.policy.pipeline import Decision, answer_wait_s, choose_pipeline, main_refused, relay_refused
from pdd.policy.plan import Plan
from pdd.policy.transfer import Priority, kv_range
from pdd.record import RequestRecord


class PrefillPaths:
    """P's part of a deployment's disaggregated requests, which reserves at the decode
    side (`reservations`) and hands a relayed pipeline to `relay`."""

    def __init__(self, fleet: Fleet, reservations: Reservations, relay: RelayPaths) -> None:
        self.fleet, self.reservations, self.relay = fleet, reservations, relay

    def disaggregated(self, plan: Plan, s: Session, rec: RequestRecord, stream: Stream) -> Proc:
        env, prompt = self.fleet.env, rec.prompt_tokens
        p = self.fleet.instances[plan.entry]
        md = self.fleet.instances[plan.main] if plan.main else None
        rld = self.fleet.instances[plan.relay] if plan.relay else None
        md_res = env.process(self.reservations.reserve(p, md, s, rec, False)) if md else None
        rld_res = env.process(self.reservations.reserve(p, rld, s, rec, md is not None)) if rld else None
        rec.p_hit_tokens = p.hit_tokens(self.fleet.keys(s, prompt), prompt)
        pseq = SimSeq(
            context=rec.p_hit_tokens,
            pending=prompt - rec.p_hit_tokens,
            produce=1,
            hold=None,
            blocks=self.fleet.keys(s, prompt),
        )
        if not self.fleet.fits(p, pseq, rec):
            for res in (md_res, rld_res):
                if res is not None:
                    self.fleet.env.process(self.fleet.drop_when(res))
            return
        yield self.fleet.until_finished(p, pseq)
        decision = yield from self._decide(p, md, md_res, rld_res, rec)
        if decision is None:
            assert md is not None  # only MD's refusal leaves no pipeline
            rec.error = f"{md.name} refused the reservation, and the relay did not take the request"
            if rld_res is not None:
                self.fleet.env.process(self.fleet.drop_when(rld_res))
            return
        rec.pipeline = decision.pipeline
        rec.kv_predicted_ms = None if decision.predicted_s is None else 1000 * decision.predicted_s
        if decision.fallback:
            fell_back(rec, decision.fallback)
        if decision.pipeline == Pipeline.P_MD:
            assert md is not None and md_res is not None  # P -> MD is chosen only with an MD
            if rld_res is not None:
                self.fleet.env.process(self.fleet.drop_when(rld_res))
            yield from self._p_md(p, md, md_res, s, rec, stream)
            return
        assert rld is not None and rld_res is not None  # a relayed pipeline is chosen only with a relay
        yield rld_res  # taken already, unless the relay is the only decode side (its line may hold it)
        if rld_res.value is None:
            rec.error = f"{rld.name} refused the reservation"
            return
        yield from self.relay.relayed(
            p, md if decision.pipeline == Pipeline.P_RLD_MD else None, md_res, rld, rld_res.value, s, rec, stream
        )

    def _decide(
        self,
        p: Instance,
        md: Instance | None,
        md_res: simpy.Process | None,
        rld_res: simpy.Process | None,
        rec: RequestRecord,
    ) -> Generator[simpy.Event, object, Decision | None]:
        """P, after prefill: the pipeline (a `Decision`), or None when MD refused and the
        relay will not take the request either."""
        if md is None:  # the relay produces alone (the plan counted it: no_main)
            return Decision(Pipeline.P_RLD, None)
        assert md_res is not None  # reserved with every MD
        meter = self.fleet.line_meter(p, md)
        budget = self.fleet.spec.policy.ttft_budget_ms / 1000
        waited = self.fleet.env.now
        if rld_res is not None:
            yield md_res | self.fleet.env.timeout(answer_wait_s(budget, meter.estimate))
        else:
            yield md_res
        reserved = md_res.value if md_res.triggered else None
        if md_res.triggered and reserved is None:  # MD refused: the relay covers it, counted, if it takes it
            takes = rld_res is not None and (yield from self._relay_takes(rld_res))
            return main_refused(takes)
        delta = None
        if reserved is not None:
            rec.d_hit_tokens = reserved[0]
            delta = int((rec.prompt_tokens - reserved[0]) * self.fleet.spec.kv_bytes_per_token)
        left = budget - (self.fleet.env.now - waited)
        decision = choose_pipeline(
            delta,
            meter.estimate,
            meter.in_flight(Priority.URGENT),
            left,
            rld_res is not None,
            self.fleet.spec.policy.pipeline,
        )
        if decision.pipeline == Pipeline.P_RLD_MD:
            assert rld_res is not None  # choose_pipeline takes the relay only when there is one
            if not (yield from self._relay_takes(rld_res)):
                decision = relay_refused(decision)
        return decision

    def _relay_takes(self, rld_res: simpy.Process) -> Generator[simpy.Event, object, bool]:
        """Whether the relay holds the request: it answers at once, unless loaded."""
        yield rld_res | self.fleet.env.timeout(RELAY_ANSWER_S)
        return rld_res.triggered and rld_res.value is not None

    def _p_md(
        self, p: Instance, md: Instance, md_res: simpy.Process, s: Session, rec: RequestRecord, stream: Stream
    ) -> Proc:
        yield md_res  # its answer, however long MD's line holds it (at once when it is in)
        reserved = md_res.value
        if reserved is None:
            rec.error = f"{md.name} refused the reservation"
            return
        rec.d_hit_tokens = reserved[0]
        yield from self.fleet.send(p, md, rec, kv_range(rec.prompt_tokens, reserved[0]), Priority.URGENT)
        reserved[1].settle()  # MD produces
        stream.emit(self.fleet.env.now)  # P's first token, streamed by MD as the KV lands
        if rec.max_tokens > 1:
            seq = SimSeq(
                context=rec.prompt_tokens,
                pending=0,
                produce=rec.max_tokens - 1,
                hold=reserved[1],
                blocks=self.fleet.keys(s, rec.prompt_tokens + rec.max_tokens),
            )
            yield self.fleet.until_finished(md, seq)
            stream.take(seq)
        else:
            reserved[1].release()
        rec.main_output_tokens = stream.tokens
