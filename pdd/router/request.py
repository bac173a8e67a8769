"""A request's whole life at the router, in one object.

The plan (which instances), the attempt (a prefill instance lost before the first
token is retried on another, under a new attempt id), what P decided (pipeline, hits),
the handoff, the merged token stream and the failures survived. The backend feeds it
every body that arrives for the request and performs the I/O it asks for; the record
it builds is the `pdd` object of the response.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdd.api.source import GenRequest
from pdd.names import Pipeline
from pdd.policy.plan import Plan
from pdd.record import RequestRecord
from pdd.router.merge import TokenMerger
from pdd.transfer import messages as m

LOST_AFTER_HANDOFF = "the main decode instance was lost after the relay handed the request over"


@dataclass(eq=False)
class RouterRequest:
    req: GenRequest
    plan: Plan
    attempt: int = 0
    merger: TokenMerger = field(default_factory=TokenMerger)
    chosen: m.PipelineChosen | None = None  # P's decision
    result: m.Result | None = None  # P's transfers are over
    handed_off: m.HandedOff | None = None
    stall_ms: float | None = None  # MD's extend stall at the handoff
    relay_done: bool = False  # the relay has nothing left to do (handed off, lost, or finished)
    main_done: bool = False  # likewise for the main instance (lost, or dropped from the plan)
    fallbacks: list[str] = field(default_factory=list)
    cached: int = 0  # prompt tokens cached where it ran (colocated: the instance's own count)
    held: list[int] = field(default_factory=list)  # merged tokens not yet released (playout reserve)
    released: int = 0  # tokens given to the client
    last_release: float = 0.0
    last_main_token: float | None = None
    last_relay_token: float | None = None
    last_progress: float = field(default_factory=time.monotonic)  # submitted, or the last new token merged

    def restart(self, plan: Plan) -> None:
        """A new attempt on other instances; what the client already has is kept."""
        self.attempt += 1
        self.plan = plan
        self.chosen = self.result = self.handed_off = None
        self.relay_done = self.main_done = False
        self.last_progress = time.monotonic()

    @property
    def rid(self) -> str:
        """The id the instances know this attempt by."""
        return f"{self.req.rid}.{self.attempt}"

    @property
    def members(self) -> list[str]:
        return list(dict.fromkeys(n for n in (self.plan.entry, self.plan.relay, self.plan.main) if n))

    @property
    def pipeline(self) -> str:
        if self.chosen is not None:
            return self.chosen.pipeline
        if self.plan.main is None and self.plan.relay is None:
            return Pipeline.COLOCATED
        return Pipeline.P_RLD if self.plan.main is None else (Pipeline.P_RLD_MD if self.plan.relay else Pipeline.P_MD)

    @property
    def whole(self) -> bool:
        """It runs on one instance, prefill and decode (colocated)."""
        return self.plan.main is None and self.plan.relay is None

    @property
    def relay_producing(self) -> bool:
        """Whether the relay is (or will be) the one producing tokens: before a handoff,
        in a pipeline through the relay."""
        return self.pipeline in (Pipeline.P_RLD_MD, Pipeline.P_RLD) and not self.handed_off and not self.relay_done

    @property
    def stranded(self) -> bool:
        """Unfinished, and every instance that could produce its tokens has been written
        off (lost, refused, or dropped by P's choice of pipeline): nothing will come."""
        if self.whole or self.merger.finished:
            return False
        return (self.plan.main is None or self.main_done) and (self.plan.relay is None or self.relay_done)

    @property
    def relay_will_hand_over(self) -> bool:
        """A relay produces and will hand over to the main instance: keep a reserve."""
        return self.relay_producing and self.plan.main is not None and not self.main_done

    @property
    def relay_stopped(self) -> bool:
        """Handed over, and the main instance's first token has not arrived yet."""
        return self.handed_off is not None and (self.plan.main is None or self.merger.count(self.plan.main) == 0)

    def done_members(self) -> set[str]:
        """Instances with nothing left of this request: no abort needs to reach them."""
        done = set()
        if self.result is not None:
            done.add(self.plan.entry)
        if self.relay_done and self.plan.relay:
            done.add(self.plan.relay)
        if self.main_done and self.plan.main:
            done.add(self.plan.main)
        return done

    def record(self, drift: int | None) -> RequestRecord:
        """Where the request ran: the server's part of its record (the `pdd` object)."""
        c, r, mg = self.chosen, self.result, self.merger
        relay = self.plan.relay
        return RequestRecord(
            pipeline=self.pipeline,
            p_hit_tokens=c.p_hit if c else 0,
            d_hit_tokens=r.d_hit if r and r.d_hit is not None else (c.d_hit if c else 0),
            d_hit_predicted=self.plan.predicted_hit,
            mirror_drift_tokens=drift,
            kv_predicted_ms=c.predicted_ms if c else None,
            kv_bytes=r.kv_bytes if r else 0,
            line_bytes=r.line_bytes if r else 0,
            relay_output_tokens=mg.count(relay) if relay else 0,
            main_output_tokens=len(mg.delivered) - (mg.count(relay) if relay else 0),
            handoff=self.handed_off.mode if self.handed_off else None,
            handoff_tokens=self.handed_off.upto if self.handed_off else 0,
            handoff_chunks=self.handed_off.chunks if self.handed_off else 0,
            handoff_stall_ms=self.stall_ms,
            anomalous=self.plan.anomalous,
            fallbacks=list(self.fallbacks),
            retries=self.attempt,
            instances={"entry": self.plan.entry, "relay": relay, "main": self.plan.main},
            seed=self.req.params.seed,
        )
