"""What a `pdd plan` probe replays, as plain data that travels to worker processes: the
agentic sessions of a config, or a trace rescaled to each probed rate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdd.lab.plan import paper
from pdd.lab.plan.bounds import Shape, shape_of
from pdd.lab.sim.runner import Sessions, draw_ahead, steady_sessions, turns_per_session
from pdd.lab.sim.workload import trace_sessions
from pdd.lab.workload.agentic import AgenticConfig
from pdd.lab.workload.mooncake import TRACE_BLOCK_TOKENS, TraceRecord
from pdd.lab.workload.types import Session


@dataclass(frozen=True)
class Workload:
    """What a goodput probe replays, as plain data (it travels to worker processes):
    the agentic sessions of `config`, or the trace `records` rescaled to each rate."""

    name: str
    config: AgenticConfig | None = None
    records: tuple[TraceRecord, ...] = ()
    max_context: int = paper.WORKLOAD.max_context

    @property
    def turns(self) -> float:
        return turns_per_session(self.config) if self.config is not None else 1.0

    @property
    def longest_output(self) -> int:
        if self.config is not None:
            return self.config.output_tokens[1]
        return max(r.output_length for r in self.records)

    @property
    def block_tokens(self) -> int:
        return paper.SETTING.block_tokens if self.config is not None else TRACE_BLOCK_TOKENS

    def sessions(self) -> Sessions:
        if self.config is not None:
            return steady_sessions(self.config)
        records = self.records
        natural = len(records) / ((records[-1].timestamp_ms - records[0].timestamp_ms) / 1000)

        def replay(rate: float, end_s: float) -> list[Session]:
            drawn = trace_sessions(records, time_scale=rate / natural, max_context=self.max_context)
            return [s for s in drawn if s.start_s < end_s]

        return replay

    def draw_ahead(self, rps: float, end_s: float) -> None:
        """Draw now what a probe at `rps` until `end_s` replays, and every smaller probe
        with it (see `pdd.lab.sim.runner.draw_ahead`); a trace is drawn as it is rescaled."""
        if self.config is not None:
            draw_ahead(self.config, rps / self.turns, end_s)

    def shape(self) -> Shape:
        if self.config is not None:
            return shape_of(self.config)
        requests = [(min(r.input_length, self.max_context), 0) for r in self.records]
        return Shape(
            requests,
            float(sum(r.output_length for r in self.records) / len(self.records)),
            float(sum(p for p, _ in requests) / len(requests)),
        )


def agentic(config: AgenticConfig = paper.WORKLOAD) -> Workload:
    """The agentic sessions; the name says where they differ from the spec's in tasks or tool time."""
    name = "agentic"
    if config.task_tokens != paper.WORKLOAD.task_tokens:
        name += f", tasks of {config.task_tokens[0]:,}-{config.task_tokens[1]:,} tokens"
    if config.tool_time_s[1]:
        name += f", {config.tool_time_s[0]:g}-{config.tool_time_s[1]:g} s of tool time between turns"
    return Workload(name, config)


def mooncake(records: Sequence[TraceRecord], max_context: int = paper.WORKLOAD.max_context) -> Workload:
    """The trace, its arrival times squeezed or stretched to the probed rate (its
    burstiness kept); a probe longer than the trace offers less than its rate, and its
    measured rate says so."""
    if len(records) < 2 or records[-1].timestamp_ms == records[0].timestamp_ms:
        raise ValueError("the trace needs at least two distinct timestamps to be replayed at a rate")
    return Workload("mooncake", None, tuple(records), max_context)
