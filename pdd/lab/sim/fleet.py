"""What a simulated deployment is made of, and what each of its managers uses: the
deployment's shape (`DeploymentSpec`: roles, lines, the policy), and the `Fleet`, its
instances and the lines between them, with the helpers every manager shares (sending KV,
a session's cache keys, waiting for a sequence). `pdd.lab.sim.cluster.Cluster` is a
fleet and composes its managers: the router's dispatch (itself), P's paths
(`pdd.lab.sim.prefill`), the relayed pipeline (`pdd.lab.sim.relayed`) and the decode
side's reservations (`pdd.lab.sim.reserve`), each holding the fleet."""

from __future__ import annotations

from collections.abc import Generator, Hashable
from dataclasses import dataclass
from typing import TypeAlias

import simpy

from pdd.config import PolicySpec
from pdd.lab.sim.instance import Instance
from pdd.lab.sim.line import SharedLine
from pdd.lab.sim.sequence import SimSeq
from pdd.lab.sim.tcp import Tcp, TcpLine
from pdd.lab.sim.workload import session_keys
from pdd.lab.workload.types import Session
from pdd.perf.hardware import Line
from pdd.perf.steps import StepModel
from pdd.policy.transfer import LineEstimate, LineMeter
from pdd.record import RequestRecord

# A simpy process body (what `Environment.process` runs) that returns nothing.
Proc: TypeAlias = Generator[simpy.Event, object, None]


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
    line: Line  # between datacenters
    lan: Line  # inside one
    kv_bytes_per_token: float
    block_tokens: int
    max_context: int
    policy: PolicySpec = PolicySpec()
    cores: int | None = None  # every instance shares this many cores (one machine); None: own hardware
    request_overhead_s: float = 0.0  # the router's and the HTTP path's own time before a request is planned
    tcp: Tcp | None = None  # the line between datacenters as TCP sees it (None: a fluid pipe, as `pdd line` is)
    stretches: bool = True  # decode stretches (pdd.lab.sim.instance); off: one event per step

    @property
    def mode(self) -> str:
        roles = {r.role for r in self.roles}
        return "colocated" if "standalone" in roles else "pdd" if "relay" in roles else "pd"


class Fleet:
    """A deployment's instances, built from its roles, and the lines between them: one
    shared line inside each datacenter, one line between them (a fluid pipe, or TCP)."""

    def __init__(self, env: simpy.Environment, spec: DeploymentSpec) -> None:
        self.env, self.spec = env, spec
        cpu = simpy.PriorityResource(env, capacity=spec.cores) if spec.cores else None
        self.instances: dict[str, Instance] = {}
        for r in spec.roles:
            for i in range(r.count):
                name = f"{r.role}{i}@{r.dc}"
                self.instances[name] = Instance(
                    env,
                    name,
                    r.role,
                    r.dc,
                    r.steps,
                    r.capacity_tokens,
                    spec.block_tokens,
                    r.max_batch_tokens,
                    r.max_running,
                    cpu,
                    r.cpu_priority,
                    spec.stretches,
                    r.max_chunks,
                    r.max_requests,
                )
        dcs = sorted({r.dc for r in spec.roles})
        self.lans = {dc: SharedLine(env, spec.lan, f"lan-{dc}") for dc in dcs}
        self.line: SharedLine | TcpLine | None = None
        if len(dcs) > 1:
            self.line = (
                SharedLine(env, spec.line, "line") if spec.tcp is None else TcpLine(env, spec.line, spec.tcp, "line")
            )
        self.meters: dict[tuple[str, str], LineMeter] = {}  # each P's, per datacenter, as the live P keeps them
        self._key_cache: dict[int, list[Hashable]] = {}

    # ---- lines -----------------------------------------------------------------------------
    def line_between(self, a: Instance, b: Instance) -> SharedLine | TcpLine:
        return self.lans[a.dc] if a.dc == b.dc or self.line is None else self.line

    def line_meter(self, p: Instance, peer: Instance) -> LineMeter:
        """What P knows of the path to `peer`'s datacenter, from the line's figures on."""
        meter = self.meters.get((p.name, peer.dc))
        if meter is None:
            line = self.line_between(p, peer).line
            meter = self.meters[(p.name, peer.dc)] = LineMeter(LineEstimate(line.bytes_per_s, line.one_way_ms / 1000))
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
        line = self.line_between(a, b)
        yield line.send(nbytes, priority, (a.name, b.name))
        meter.acked(key, end, True, self.env.now)
        rec.kv_bytes += nbytes
        rec.line_bytes += nbytes if line is self.line else 0

    # ---- requests ------------------------------------------------------------------------
    def keys(self, s: Session, tokens: int) -> list:
        """The first `tokens` // block keys of a session's context (one list per session,
        sliced: every turn's keys are a prefix of the longest)."""
        block = self.spec.block_tokens
        keys = self._key_cache.get(s.id)
        if keys is None or len(keys) < tokens // block:
            keys = self._key_cache[s.id] = session_keys(s, max(tokens, self.spec.max_context), block)
        return keys[: tokens // block]

    @staticmethod
    def fits(inst: Instance, seq: SimSeq, rec: RequestRecord) -> bool:
        """A sequence larger than the whole pool (its cached prefix included: it is pinned
        while the sequence runs) would wait forever, and block the queue."""
        need = seq.context + seq.pending + seq.produce
        if need <= inst.capacity_tokens:
            return True
        rec.error = f"{inst.name} cannot hold {need} tokens"
        return False

    def until_finished(self, inst: Instance, seq: SimSeq, submit: bool = True) -> simpy.Event:
        done = self.env.event()
        seq.on_finish = lambda _s: done.succeed()
        if submit:
            inst.submit(seq)
        return done

    @staticmethod
    def drop_when(event: simpy.Event) -> Proc:
        """Give back a reservation that will not be used, once it is made: `event` gives
        (hit, hold), a hold, or None (refused)."""
        yield event
        value = event.value
        if value is not None:
            (value[1] if isinstance(value, tuple) else value).release()
