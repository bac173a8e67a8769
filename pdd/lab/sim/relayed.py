"""The relayed pipeline of a simulated request: P -> RLD -> MD, as the live relay and
main instances run it (pdd/instance/relay.py, decode_side.py).

P sends the full KV to the relay (urgent, inside the datacenter) and the delta to MD
(background, over the line) at once; the relay streams from P's first token. Once MD
holds the KV, READY reaches the relay and the relay hands its token IDs over, one-shot
or in catch-up rounds (`choose_handoff`, `cut_over`); MD extends them and produces
the rest. A relay that finishes first sends MD its output as a fill, which MD keeps
cached for the next turn.
"""

from __future__ import annotations

from collections.abc import Generator

import simpy

from pdd.lab.sim.fleet import Fleet, Proc
from pdd.lab.sim.instance import Instance
from pdd.lab.sim.sequence import Granted, Hold, SimSeq
from pdd.lab.sim.stream import Stream, fell_back
from pdd.lab.workload.types import Session
from pdd.names import Fallback, HandoffMode
from pdd.policy.handoff import choose_handoff, cut_over, occupancy
from pdd.policy.transfer import Priority, kv_range
from pdd.record import RequestRecord


class RelayPaths:
    """The relayed pipeline of a deployment's requests."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def relayed(
        self,
        p: Instance,
        md: Instance | None,
        md_res: simpy.Process | None,
        rld: Instance,
        rld_reserved: Granted,
        s: Session,
        out: RequestRecord,
        stream: Stream,
    ) -> Proc:
        """P -> RLD -> MD (or P -> RLD when MD is out): the relay streams at once; MD
        takes over once its KV has landed."""
        env, prompt = self.fleet.env, out.prompt_tokens
        to_rld = env.process(self.fleet.send(p, rld, out, kv_range(prompt, rld_reserved[0]), Priority.URGENT))
        md_has_kv: simpy.Process | None = None  # MD's KV landed: its hold, or None (refused)
        if md is not None:
            assert md_res is not None  # reserved with every MD
            md_has_kv = env.process(self._behind_relay(p, md, md_res, out))
        yield to_rld
        rld_reserved[1].settle()  # the relay produces
        stream.emit(env.now)  # P's first token, streamed by the relay
        if out.max_tokens == 1:
            out.relay_output_tokens = 1
            rld_reserved[1].release()
            if md_has_kv is not None:
                self.fleet.env.process(self.fleet.drop_when(md_has_kv))
            return
        rseq = SimSeq(
            context=prompt,
            pending=0,
            produce=out.max_tokens - 1,
            hold=rld_reserved[1],
            blocks=self.fleet.keys(s, prompt),
        )
        finished = self.fleet.until_finished(rld, rseq)
        if md_has_kv is None:
            yield finished
            stream.take(rseq)
            out.relay_output_tokens = stream.tokens
            return
        assert md is not None  # md_has_kv is its landing
        yield finished | md_has_kv
        if not md_has_kv.triggered or md_has_kv.value is None:
            yield finished
            stream.take(rseq)
            out.relay_output_tokens = stream.tokens
            fell_back(out, Fallback.RELAY_FINISHED)
            self.fleet.env.process(self._fill(rld, md, md_has_kv, s, out))
            return
        hold = md_has_kv.value
        # READY reaches the relay: MD's acknowledgement back to P, then P -> relay.
        yield env.timeout(
            self.fleet.line_between(p, md).line.one_way_ms / 1000
            + self.fleet.line_between(p, rld).line.one_way_ms / 1000
        )
        if rseq.done:
            stream.take(rseq)
            out.relay_output_tokens = stream.tokens
            fell_back(out, Fallback.RELAY_FINISHED)
            self.fleet.env.process(self._fill(rld, md, md_has_kv, s, out))
            return
        yield from self._hand_off(rld, rseq, md, hold, s, out, stream)

    def _fill(
        self,
        rld: Instance,
        md: Instance,
        landed: simpy.Event | None,
        s: Session,
        out: RequestRecord,
        mseq: SimSeq | None = None,
        computed: int = 0,
    ) -> Proc:
        """The relay finished the request: it sends MD the output as a fill, which MD
        computes in the shadow (at most a catch-up chunk a step) once its KV has
        `landed`, and keeps with the prompt in its cache for the session's next turn."""
        if landed is not None:
            yield landed
            if landed.value is None:
                return
            mseq = SimSeq(
                context=out.prompt_tokens,
                pending=0,
                produce=0,
                hold=landed.value,
                live=False,
                blocks=self.fleet.keys(s, out.prompt_tokens + out.max_tokens),
            )
        assert mseq is not None  # without a landing to wait for, the fill continues a handoff's sequence
        yield self.fleet.env.timeout(self.fleet.line_between(rld, md).line.one_way_ms / 1000)
        mseq.on_computed = md.stop
        md.feed(mseq, out.max_tokens - computed, live=False, step_cap=self.fleet.spec.policy.catch_up_chunk)

    def _behind_relay(
        self, p: Instance, md: Instance, md_res: simpy.Process, out: RequestRecord
    ) -> Generator[simpy.Event, object, Hold | None]:
        """The delta to MD, in the background (once MD has answered, if it had not in
        time); MD's hold once it has landed, None if MD refused."""
        yield md_res
        reserved = md_res.value
        if reserved is None:
            return None
        out.d_hit_tokens = reserved[0]
        yield from self.fleet.send(p, md, out, kv_range(out.prompt_tokens, reserved[0]), Priority.BACKGROUND)
        return reserved[1]

    def _hand_off(
        self, rld: Instance, rseq: SimSeq, md: Instance, hold: Hold, s: Session, out: RequestRecord, stream: Stream
    ) -> Proc:
        env, p = self.fleet.env, self.fleet.spec.policy
        one_way = self.fleet.line_between(rld, md).line.one_way_ms / 1000
        gap = 1 + rseq.produced
        plan = choose_handoff(
            gap,
            occupancy(len(rld.running), rld.max_running),
            len(rld.waiting),
            p.handoff_threshold,
            p.catch_up_chunk,
            p.handoff,
        )
        out.handoff = plan.mode
        mseq = SimSeq(
            context=out.prompt_tokens,
            pending=0,
            produce=0,
            hold=hold,
            live=False,
            blocks=self.fleet.keys(s, out.prompt_tokens + out.max_tokens),
        )
        finished = self.fleet.until_finished(md, mseq, submit=False)
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
                out.handoff_chunks += 1
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
            out.relay_output_tokens = stream.tokens
            fell_back(out, Fallback.RELAY_FINISHED)
            self.fleet.env.process(self._fill(rld, md, None, s, out, mseq, sent))
            return
        rld.stop(rseq)
        relayed = 1 + rseq.produced
        stream.take(rseq)
        out.relay_output_tokens = relayed
        out.handoff_tokens = relayed
        out.handoff_chunks += 1
        yield env.timeout(one_way)
        mseq.produce = out.max_tokens - relayed
        hold.settle()  # MD produces
        md.feed(mseq, relayed - sent, live=True)
        yield finished
        first_s, last_s = mseq.first_s, stream.last_s
        assert first_s is not None and last_s is not None  # MD produced after the relay's last token
        out.handoff_stall_ms = 1000 * (first_s - last_s)
        stream.take(mseq)
        out.main_output_tokens = mseq.produced
