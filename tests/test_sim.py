"""The cluster simulator (`pdd.lab.sim`): what a user of `pdd sim` would notice.

Every request is accounted for and no pool room leaks; a line never moves more bytes
than its bandwidth allows, shared fairly; more bandwidth never slows a lone request;
a fully cached prompt sends (almost) nothing over the line; the simulator decides with
the very functions the router and the instances call; the anomaly filter keeps a long,
short-answer request on the relay; and a run is deterministic.

Only simulated time is asserted (never wall-clock): everything here is exact.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import simpy

from pdd.lab.plan import paper
from pdd.lab.sim.cluster import Cluster
from pdd.lab.sim.fleet import DeploymentSpec
from pdd.lab.sim.line import SharedLine
from pdd.lab.workload.agentic import plan_session_shapes
from pdd.lab.workload.types import Session, Turn
from pdd.names import Fallback, HandoffMode, Pipeline
from pdd.perf.hardware import line
from pdd.record import RequestRecord

REQUESTS = 300
KVB = paper.MODEL.kv_bytes_per_token
BLOCK = paper.SETTING.block_tokens


def _run(spec: DeploymentSpec, sessions: list[Session]) -> Cluster:
    """Run to the end (every event processed: the simulation has drained)."""
    env = simpy.Environment()
    cluster = Cluster(env, spec)
    cluster.run(sessions)
    assert env.peek() == float("inf")
    return cluster


def _requests(sessions: list[Session]) -> int:
    return sum(len(s.turns) for s in sessions)


def _capacity(role: str, tokens: int, count: int = 1, dc: str = "A", hw: str = "A"):
    return dataclasses.replace(paper.role(role, dc, count, hw), capacity_tokens=tokens)


# ---- 1. every request completes or is counted as failed; no pool room leaks ----------------

def _agentic(rate: float = 2.0) -> list[Session]:
    return plan_session_shapes(paper.WORKLOAD, REQUESTS, rate)


def _scenarios() -> dict[str, tuple[DeploymentSpec, list[Session]]]:
    R, dep = paper.role, paper.deployment
    wl = _agentic()
    scenarios = {name: (spec, wl) for name, spec in paper.paper_deployments().items()}
    # A decode pool that holds two or three requests at a time: reservations wait for room.
    scenarios["pd-cross-dc, tight MD pool"] = (
        dep("tight", (R("prefill", "A", 2, "A"), _capacity("main", 150_000, dc="B", hw="B"))), wl)
    scenarios["pdd, tight MD pool"] = (
        dep("tight", (R("prefill", "A", 2, "A"), R("relay", "A", 1, "A"),
                      _capacity("main", 150_000, dc="B", hw="B"))), wl)
    # A decode pool smaller than many requests: some reservations are refused.
    scenarios["pd-cross-dc, MD pool too small"] = (
        dep("small-md", (R("prefill", "A", 2, "A"), _capacity("main", 40_000, dc="B", hw="B"))), wl)
    scenarios["pdd, MD pool too small"] = (
        dep("small-md", (R("prefill", "A", 2, "A"), R("relay", "A", 1, "A"),
                         _capacity("main", 40_000, dc="B", hw="B"))), wl)
    # A relay too small for the anomalous requests and for low-hit long prompts.
    scenarios["pdd, tiny relay"] = (
        dep("tiny-relay", (R("prefill", "A", 2, "A"), _capacity("relay", 30_000),
                           R("main", "B", 2, "B"))), wl)
    # One colocated instance whose pool cannot hold the longest requests.
    scenarios["colocated, pool too small"] = (dep("small-colo", (_capacity("standalone", 30_000),)), wl)
    # Low-hit, not anomalous (prompt under half the context) prompts with a one-token
    # answer: P-RLD-MD, where P's token is the whole answer.
    one_token = [Session(i, (Turn(20_000, 1),), 100.0 * i) for i in range(5)]
    scenarios["pdd, one-token answers"] = (paper.paper_deployments()["pdd"], one_token)
    return scenarios


SCENARIOS = _scenarios()
# Where a request may fail, and why: a pool that cannot hold it (turned away at once), or
# one too small for the load (a reservation refused after waiting), and the later turns
# of its session, never sent. Every other scenario serves every request.
_TOO_SMALL = ("cannot hold", "not sent: turn")
ALLOWED_FAILURES = {
    "pd-cross-dc, tight MD pool": ("refused the reservation", "not sent: turn"),
    "pd-cross-dc, MD pool too small": ("refused the reservation", "not sent: turn"),
    # the anomaly filter's requests, larger than the relay's whole pool: its reservation refuses them
    "pdd, tiny relay": (*_TOO_SMALL, "refused the reservation"),
    "colocated, pool too small": _TOO_SMALL,
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_request_completes_or_fails_and_no_pool_room_leaks(name: str) -> None:
    spec, sessions = SCENARIOS[name]
    cluster = _run(spec, sessions)
    outcomes = cluster.records
    problems = []
    seen = {(o.session, o.turn) for o in outcomes}
    missing = [(s.id, k) for s in sessions for k in range(len(s.turns)) if (s.id, k) not in seen]
    # `pdd bench` records every turn: a failed one with its error, and the later turns of
    # its session as failed "not sent" (pdd/lab/bench/client.py `_run_session`).
    if len(outcomes) != _requests(sessions):
        problems.append(f"{len(outcomes)} outcomes for {_requests(sessions)} requests; "
                        f"{len(missing)} never recorded, e.g. {missing[:5]}")
    allowed = ALLOWED_FAILURES.get(name, ())
    failed = [o for o in outcomes if o.error]
    wrong = [o for o in failed if not any(reason in o.error for reason in allowed)]
    if wrong:
        problems.append(f"{len(wrong)} requests failed that this scenario must serve, e.g. {wrong[0]}")
    sent = [o for o in outcomes if not (o.error or "").startswith("not sent")]
    if 2 * (len(outcomes) - len(failed)) < len(sent):  # even a pool too small serves most it is sent
        problems.append(f"{len(failed)} of {len(outcomes)} requests failed, of {len(sent)} sent")
    for o in outcomes:
        if o.error:
            continue
        if not (o.ttft_ms is not None and o.ttft_ms > 0 and o.e2e_ms is not None
                and o.e2e_ms >= o.ttft_ms - 1e-6 and o.output_tokens == o.max_tokens):
            problems.append(f"neither served in full nor failed: {o}")
    leaked = {n: i.used for n, i in cluster.instances.items() if i.used != 0}
    if leaked:
        problems.append(f"pool tokens still reserved after the run drained: {leaked}")
    stuck = {n: [(q.pending, q.produce) for q in i.waiting] for n, i in cluster.instances.items() if i.waiting}
    if stuck:
        problems.append(f"sequences never admitted (pending, produce): {stuck}")
    running = {n: len(i.running) for n, i in cluster.instances.items() if i.running}
    if running:
        problems.append(f"sequences still running: {running}")
    queued = {n: i.queued_tokens for n, i in cluster.instances.items() if i.queued_tokens}
    if queued:
        problems.append(f"router's queued work not given back: {queued}")
    assert not problems, "\n".join(problems)


def test_a_relay_that_cannot_hold_the_request_leaves_it_to_the_main_instance() -> None:
    """A P-RLD-MD request the relay cannot hold, while MD reserved it: the relay turns it
    away at once (pdd/instance/relay.py), and P sends it P -> MD, counted as the live P
    counts it (`policy.pipeline.relay_refused`): served, not failed, and not late."""
    R = paper.role
    spec = paper.deployment("small-relay", (R("prefill", "A", 1, "A"), _capacity("relay", 10_000),
                                            R("main", "B", 1, "B")))
    cluster = _run(spec, [Session(0, (Turn(20_000, 200),))])
    (o,) = cluster.records
    assert o.error is None, o
    assert o.pipeline == Pipeline.P_MD and o.fallbacks == [Fallback.RELAY_BUSY], o
    assert o.output_tokens == o.max_tokens and o.main_output_tokens == o.max_tokens, o
    assert o.ttft_ms < 5000, o  # no wait for a refusal: the relay answers at once
    assert all(i.used == 0 for i in cluster.instances.values())


def test_under_overload_every_admitted_request_completes_and_a_small_relay_stays_within_its_batch() -> None:
    """Far more sessions than one MD pool holds, and a relay that decodes two at once: as
    live, the router holds each request until MD has room and MD's own line has no
    deadline, so every request completes, many after waiting well past the old 45 s
    refusal; the relay turns optional requests away (P -> MD, `relay_busy`) rather
    than hold more than it decodes in one batch."""
    R = paper.role
    relay = dataclasses.replace(R("relay", "A", 1, "A"), max_running=2)
    spec = paper.deployment("overload", (R("prefill", "A", 1, "A"), relay, _capacity("main", 100_000, dc="B", hw="B")))
    sessions = plan_session_shapes(dataclasses.replace(paper.WORKLOAD, anomalous_fraction=0.0), 500, 50.0)
    cluster = _run(spec, sessions)
    records = cluster.records
    assert len(records) == _requests(sessions)
    assert [o for o in records if o.error is not None] == []
    assert all(o.output_tokens == o.max_tokens for o in records)
    assert sum(o.ttft_ms > 45_000 for o in records) > len(records) // 4  # they waited, and were served
    assert sum(Fallback.RELAY_BUSY in o.fallbacks for o in records) > 0  # the relay turned some away
    assert cluster.instances["relay0@A"].stats.peak_held <= relay.max_running
    # the router, not MD's line, holds the waiting requests (without dispatch by room MD would hold them all)
    assert cluster.instances["main0@B"].stats.peak_held <= len(sessions) // 2
    assert all(i.used == 0 and i.committed_requests == 0 and i.held == 0 for i in cluster.instances.values())


def test_a_full_main_instance_holds_a_reservation_as_long_as_it_takes() -> None:
    """MD's pool taken by work the router cannot see (another router's, say) for a
    minute: the request the router dispatched waits in MD's line, past the 45 s after
    which the decode side used to refuse it, and is served once the pool frees."""
    R = paper.role
    spec = paper.deployment("busy-md", (R("prefill", "A", 1, "A"), _capacity("main", 100_000, dc="B", hw="B")))
    env = simpy.Environment()
    cluster = Cluster(env, spec)
    md = cluster.instances["main0@B"]
    foreign = md.hold(90_000)

    def release_later():
        yield env.timeout(60.0)
        foreign.release()

    env.process(release_later())
    (o,) = cluster.run([Session(0, (Turn(20_000, 100),))])
    assert o.error is None and o.output_tokens == 100, o
    assert o.ttft_ms > 60_000, o
    assert md.used == 0 and md.held == 0


# ---- 2. the line ---------------------------------------------------------------------------

GBPS = 10.0
DELAY_MS = 3.0


def _line() -> tuple[simpy.Environment, SharedLine]:
    env = simpy.Environment()
    return env, SharedLine(env, line(GBPS, DELAY_MS), "line")


def _send_at(env: simpy.Environment, line: SharedLine, at: float, nbytes: float, priority: int,
             done: dict[int, float], key: int):
    def go():
        yield env.timeout(at)
        yield line.send(nbytes, priority)
        done[key] = env.now
    return env.process(go())


def test_line_never_beats_its_bandwidth() -> None:
    env, line = _line()
    bw, delay = line.line.bytes_per_s, DELAY_MS / 1000
    rng = random.Random(7)
    transfers = []  # (start, bytes, priority)
    for _ in range(300):
        transfers.append((rng.uniform(0.0, 2.0), rng.choice([1e4, 1e6, 1e7]) * rng.uniform(0.1, 30.0),
                          rng.choice([0, 1])))
    done: dict[int, float] = {}
    for k, (at, nbytes, prio) in enumerate(transfers):
        _send_at(env, line, at, nbytes, prio, done, k)
    env.run()
    assert len(done) == len(transfers)
    assert line.stats.bytes == pytest.approx(sum(n for _, n, _ in transfers))
    tol = 1e-6 * bw  # float residue
    for k, (at, nbytes, _) in enumerate(transfers):
        # alone on the line at best, and never before the bytes could have crossed
        assert done[k] >= at + nbytes / bw + delay - 1e-9, (k, at, nbytes, done[k])
    first = min(at for at, _, _ in transfers)
    delivered = 0.0
    for k in sorted(done, key=done.get):
        delivered += transfers[k][1]
        t = done[k]
        assert delivered <= bw * (t - delay - first) + tol, (t, delivered, bw * (t - delay - first))
    # Work-conserving: the line is never idle while bytes wait, so its last byte lands
    # when a single FIFO server of the same rate would finish (any order, same total).
    free = 0.0
    for at, nbytes, _ in sorted(transfers):
        free = max(free, at) + nbytes / bw
    assert max(done.values()) == pytest.approx(free + delay, rel=1e-9)


def test_line_processor_sharing_and_priority() -> None:
    env, line = _line()
    bw, delay = line.line.bytes_per_s, DELAY_MS / 1000
    size = 50e6
    done: dict[int, float] = {}
    # two equal transfers together finish together, at twice one alone
    _send_at(env, line, 0.0, size, 0, done, 0)
    _send_at(env, line, 0.0, size, 0, done, 1)
    # later: a transfer of 2S and one of S share; S finishes at 2S/bw, 2S at 3S/bw
    t1 = 1.0
    _send_at(env, line, t1, 2 * size, 0, done, 2)
    _send_at(env, line, t1, size, 0, done, 3)
    # later still: a background transfer is overtaken by an urgent one, which runs as if alone
    t2 = 2.0
    _send_at(env, line, t2, size, 1, done, 4)
    _send_at(env, line, t2 + 0.01, size, 0, done, 5)
    # an empty transfer takes the one-way delay only
    _send_at(env, line, 3.0, 0, 0, done, 6)
    env.run()
    assert done[0] == pytest.approx(2 * size / bw + delay, rel=1e-9)
    assert done[1] == pytest.approx(done[0], rel=1e-12)
    assert done[3] == pytest.approx(t1 + 2 * size / bw + delay, rel=1e-9)
    assert done[2] == pytest.approx(t1 + 3 * size / bw + delay, rel=1e-9)
    assert done[5] == pytest.approx(t2 + 0.01 + size / bw + delay, rel=1e-9)
    assert done[4] == pytest.approx(t2 + 2 * size / bw + delay, rel=1e-9)
    assert done[6] == pytest.approx(3.0 + delay, rel=1e-9)


# ---- 3. more bandwidth never slows a lone request ------------------------------------------

def _lone_sessions(requests: int = 80) -> list[Session]:
    """Agentic sessions 5,000 simulated seconds apart: one request in the system at a
    time (a session's turns follow each other)."""
    sessions = plan_session_shapes(paper.WORKLOAD, requests, 1.0)
    return [dataclasses.replace(s, start_s=5000.0 * i) for i, s in enumerate(sessions)]


@pytest.mark.parametrize("deployment", ["pd-cross-dc", "pdd"])
def test_more_bandwidth_never_worsens_an_uncontended_ttft(deployment: str) -> None:
    sessions = _lone_sessions()
    runs = {}
    # Cross-dc PD: TCP without its random draws (jitter, losses), which would fall on
    # different rounds at different bandwidths (a timeout is no property of the
    # bandwidth). PDD: a fluid line, the one P's prediction (`policy.transfer.finish_s`)
    # assumes; on a TCP line a P-MD choice can be later than predicted by the slow start
    # the prediction does not know (BENCHMARKS.md counts how often).
    steady = None if deployment == "pdd" else \
        dataclasses.replace(paper.SETTING.tcp, jitter_ms=0.0, loss_per_segment=0.0)
    for gbps in (10.0, 25.0, 100.0):
        spec = dataclasses.replace(paper.paper_deployments(gbps)[deployment], tcp=steady)
        outcomes = _run(spec, sessions).records
        assert len(outcomes) == _requests(sessions) and not any(o.error for o in outcomes)
        runs[gbps] = {(o.session, o.turn): o for o in outcomes}
    budget = paper.POLICY.ttft_budget_ms / 1000
    for low, high in ((10.0, 25.0), (25.0, 100.0)):
        for key, slow in runs[low].items():
            fast = runs[high][key]
            if fast.pipeline == slow.pipeline:
                assert fast.ttft_ms <= slow.ttft_ms + 1e-6, (deployment, key, low, high, slow, fast)
            else:
                # PDD only: a faster line lets P choose P-MD for a delta that went through the
                # relay on a slower line. By design that first token may come later than the
                # relay's, by no more than the TTFT budget (pdd.policy.pipeline).
                assert deployment == "pdd" and (slow.pipeline, fast.pipeline) == (Pipeline.P_RLD_MD, Pipeline.P_MD), \
                    (key, slow, fast)
                assert fast.ttft_ms <= slow.ttft_ms + 1000 * budget + 1e-6, (key, slow, fast)


# ---- 4. a fully cached prompt sends (almost) nothing --------------------------------------

@pytest.mark.parametrize("deployment", ["pd-cross-dc", "pdd"])
@pytest.mark.parametrize("prompt", [32 * BLOCK, 32 * BLOCK + 77])
def test_full_hit_sends_only_the_uncacheable_tail(deployment: str, prompt: int) -> None:
    """The same prompt, again and again: separate sessions sharing one trace prefix, each
    after the one before has ended. After the first, the decode side holds every full
    block of it. (A session's own turns each add the answer before them: no two of its
    prompts are the same.)

    Not exactly 0 bytes cross: the simulator's hit, as the engine's match, leaves at least
    one prompt token to compute (its logits give the next token), and only whole blocks
    are cached. So the delta is the prompt's last token when the prompt is block-aligned,
    and its partial last block otherwise: always under one block's KV."""
    spec = paper.paper_deployments()[deployment]
    keys = tuple(("shared-prefix", i) for i in range(prompt // BLOCK))
    traced = [Session(i, (Turn(prompt, 64),), 1000.0 * i, trace_keys=keys) for i in range(6)]
    tail = prompt - min(prompt // BLOCK * BLOCK, prompt - 1)
    outcomes = sorted(_run(spec, traced).records, key=lambda o: o.start_s)
    assert len(outcomes) == 6 and not any(o.error for o in outcomes)
    assert outcomes[0].line_bytes == prompt * KVB  # nothing cached yet: the whole prompt
    for o in outcomes[1:]:
        assert o.pipeline == Pipeline.P_MD, o
        assert o.d_hit_tokens == prompt - tail, o
        assert o.line_bytes == tail * KVB, o
        assert o.line_bytes <= BLOCK * KVB, o


# ---- 5. the simulator decides with the serving system's functions --------------------------

# Each decision the simulator makes, the module that calls it, and the live code that
# calls the very same function.
POLICIES = {
    "plan_with_room": ("pdd.lab.sim.cluster", "pdd.policy.plan"),  # = the router's plan(room=True): see below
    "anomaly_rule": ("pdd.lab.sim.cluster", "pdd.router.planning"),
    "fits": ("pdd.lab.sim.cluster", "pdd.router.planning"),
    "pages_needed": ("pdd.lab.sim.cluster", "pdd.router.planning"),
    "relay_accepts": ("pdd.lab.sim.reserve", "pdd.instance.relay"),
    "prefix_holder": ("pdd.lab.sim.reserve", "pdd.instance.decode_side"),
    "may_hold": ("pdd.lab.sim.reserve", "pdd.instance.decode_side"),
    "reserve_retry_delay": ("pdd.instance.reservations", "pdd.instance.reservations"),
    "choose_pipeline": ("pdd.lab.sim.prefill", "pdd.instance.prefill"),
    "answer_wait_s": ("pdd.lab.sim.prefill", "pdd.instance.prefill"),
    "main_refused": ("pdd.lab.sim.prefill", "pdd.instance.prefill"),
    "relay_refused": ("pdd.lab.sim.prefill", "pdd.instance.prefill"),
    "kv_range": ("pdd.lab.sim.prefill", "pdd.instance.prefill_kv"),
    "choose_handoff": ("pdd.lab.sim.relayed", "pdd.instance.relay"),
    "cut_over": ("pdd.lab.sim.relayed", "pdd.instance.relay"),
    "occupancy": ("pdd.lab.sim.relayed", "pdd.instance.relay"),
}
# P's line estimate: the live prefill instance's `LineMeter`, every method it uses.
METER = ("begin", "acked", "end", "in_flight", "round_trip")
# Runs that take every path: a tight MD pool (its reservations wait in the queue), one too
# small for the longest requests (MD refuses them: the relay produces alone), a relay
# too small (it turns requests away: P -> MD).
PATHS = ("pdd", "pdd, tight MD pool", "pdd, MD pool too small", "pdd, tiny relay")


def test_simulator_calls_the_router_and_instance_policies(monkeypatch) -> None:
    """Every decision is the live code's own function and constant, and runs that take
    every path call each of them: a simulator that imported them and decided otherwise
    would fail here."""
    import importlib

    from pdd.instance import decode_side
    from pdd.instance import prefill as live_prefill
    from pdd.lab.sim import prefill as sim_prefill
    from pdd.lab.sim import relayed, reserve
    from pdd.policy.transfer import LineMeter

    calls: dict[str, int] = {}

    def spying(name: str, f):
        def spy(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return f(*args, **kwargs)
        return spy

    for name, (sim_module, live_module) in POLICIES.items():
        sim, live = importlib.import_module(sim_module), importlib.import_module(live_module)
        assert getattr(sim, name) is getattr(live, name), name
        monkeypatch.setattr(sim, name, spying(name, getattr(sim, name)))
    assert live_prefill.LineMeter is LineMeter
    for method in METER:
        monkeypatch.setattr(LineMeter, method, spying(f"LineMeter.{method}", getattr(LineMeter, method)))
    assert reserve.PREFIX_WAIT_S is decode_side.PREFIX_WAIT_S
    assert sim_prefill.Priority is live_prefill.Priority and relayed.Priority is live_prefill.Priority
    assert sim_prefill.RELAY_ANSWER_S == live_prefill.RELAY_ANSWER_S
    for name in PATHS:
        _run(*SCENARIOS[name])
    expected = set(POLICIES) | {f"LineMeter.{m}" for m in METER}
    assert set(calls) == expected, f"never called: {sorted(expected - set(calls))}"


def test_the_simulator_runs_the_live_lines_and_names_what_it_does_not(monkeypatch) -> None:
    """The router's `DispatchQueue` and a decode instance's `ReservationQueue` are the very
    classes the simulator waits in, on its clock, its prefix cache is the engine's
    `RadixCache` and its batches are planned by the engine's `Scheduler`; runs that take
    every path hold requests in both lines (an attempt refused, then granted once room
    came free), evict from the caches and schedule every batch they step. Where a
    sequence's KV room comes from is the simulator's own, for the reason in NOT_LIVE."""
    from pdd.batching import BaseKV, Scheduler
    from pdd.engines.embedded.paged_kv import PagedKV
    from pdd.instance.reservations import ReservationQueue
    from pdd.kv.radix_cache import RadixCache
    from pdd.lab.sim.clock import SimClock
    from pdd.lab.sim.not_live import NOT_LIVE
    from pdd.router.dispatch import DispatchQueue
    from pdd.router.mirror import CacheMirror

    cluster = Cluster(simpy.Environment(), SCENARIOS["pdd"][0])
    assert type(cluster.queue) is DispatchQueue
    for inst in cluster.instances.values():
        assert type(inst.reservations) is ReservationQueue and isinstance(inst.reservations._clock, SimClock)
        assert type(inst.cache) is RadixCache
        assert type(inst.scheduler) is Scheduler
        assert isinstance(inst.scheduler.kv, BaseKV) and not isinstance(inst.scheduler.kv, PagedKV)
    assert PagedKV.__name__ in NOT_LIVE and CacheMirror.__name__ in NOT_LIVE
    assert all(len(why) > 100 for why in NOT_LIVE.values())  # each with its reason
    assert not any(isinstance(v, CacheMirror) for v in vars(cluster).values())  # (it reads the caches)
    tries: dict[str, list[int]] = {"dispatch": [], "reservation": []}
    turn, take = DispatchQueue.turn, ReservationQueue.take

    async def counted_turn(self, attempt):
        n = 0

        def counted():
            nonlocal n
            n += 1
            return attempt()

        got = await turn(self, counted)
        tries["dispatch"].append(n)
        return got

    async def counted_take(self, job, attempt, ended):
        n = 0

        async def counted():
            nonlocal n
            n += 1
            return await attempt()

        got = await take(self, job, counted, ended)
        tries["reservation"].append(n)
        return got

    evict, evicted = RadixCache.evict, []

    def counted_evict(self, num_pages):
        evicted.append(evict(self, num_pages))
        return evicted[-1]

    monkeypatch.setattr(DispatchQueue, "turn", counted_turn)
    monkeypatch.setattr(ReservationQueue, "take", counted_take)
    schedule, batches = Scheduler.schedule, []

    def counted_schedule(self):
        batches.append(schedule(self))
        return batches[-1]

    monkeypatch.setattr(RadixCache, "evict", counted_evict)
    monkeypatch.setattr(Scheduler, "schedule", counted_schedule)
    steps = 0
    for name in PATHS:
        cluster = _run(*SCENARIOS[name])
        steps += sum(inst.stats.steps for inst in cluster.instances.values())
    assert tries["dispatch"] and tries["reservation"]
    assert sum(evicted) > 0, "no run filled a cache"
    # every step's batch came from the live scheduler (a decode run's later steps are its first's)
    assert sum(bool(b) for b in batches) > 0 and steps >= sum(bool(b) for b in batches)
    assert max(tries["dispatch"]) > 1 and max(tries["reservation"]) > 1, {k: max(v) for k, v in tries.items()}


def test_the_simulators_dispatch_is_the_routers() -> None:
    """`plan_with_room`, which the simulator plans with, decides exactly as the router's
    `Planner.plan(room=True)` (pdd/router/planning.py) over the same instances: which
    MD and relay, when to wait (None), when the anomaly filter is off."""
    import random
    from types import SimpleNamespace

    from pdd.config import LineSpec, PolicySpec
    from pdd.names import Mode, RoleName
    from pdd.policy.capacity import Room, fits, pages_needed
    from pdd.policy.plan import anomaly_rule, plan_with_room
    from pdd.policy.routing import Candidate
    from pdd.router.planning import Planner
    from pdd.sampling.params import SamplingParams

    rng = random.Random(5)
    policy = PolicySpec(affinity_weight=2.0)
    page, pages, max_requests, max_context = 16, 64, 4, 1024
    engine = SimpleNamespace(page_size=page, num_pages=pages, max_requests=max_requests)
    for case in range(400):
        clients = {}
        for role, count in ((RoleName.PREFILL, 2), (RoleName.MAIN, rng.randint(0, 3)),
                            (RoleName.RELAY, rng.randint(0, 1))):
            for i in range(count):
                hit = rng.choice([0, 64, 512, 900])
                clients[f"{role}{i}"] = SimpleNamespace(
                    name=f"{role}{i}", spec=SimpleNamespace(role=role, engine=engine),
                    queued_tokens=rng.randint(0, 3000), available=role == RoleName.PREFILL or rng.random() > 0.15,
                    committed_pages=rng.randint(0, pages), committed_requests=rng.randint(0, max_requests),
                    pages=pages, max_context=0, mirror=SimpleNamespace(predicted_hit=lambda p, salt, h=hit: h))
        if not any(c.spec.role in (RoleName.MAIN, RoleName.RELAY) and c.available for c in clients.values()):
            continue  # (the router answers 503 there; not a dispatch decision)
        planner = Planner(SimpleNamespace(mode=Mode.PDD, policy=policy, line=LineSpec()), clients)
        planner.max_context = max_context
        prompt, max_tokens = rng.choice([100, 600, 1000]), rng.choice([4, 100, 400])
        req = SimpleNamespace(prompt=[1] * prompt, params=SamplingParams(max_tokens=max_tokens))
        cands = {role: [Candidate(c.name, c.mirror.predicted_hit(req.prompt, ""), c.queued_tokens, c.available)
                        for c in clients.values() if c.spec.role == role] for role in RoleName}

        def has_room(c: Candidate, clients=clients, prompt=prompt, max_tokens=max_tokens) -> bool:
            k = clients[c.name]
            return fits(pages_needed(prompt, max_tokens, c.predicted_hit_tokens, page), k.committed_pages,
                        k.committed_requests, Room(pages, max_requests))

        rule = anomaly_rule(policy.anomaly_filter, max_context, policy.anomaly_max_output_tokens,
                            policy.anomaly_min_prompt_share, policy.anomaly_max_hit_share)
        ours = plan_with_room(prompt, max_tokens, cands[RoleName.PREFILL], cands[RoleName.MAIN],
                              cands[RoleName.RELAY], rule, has_room, policy.affinity_weight, policy.load_weight)
        assert ours == planner.plan(req, room=True), case


# ---- 6. the anomaly filter -----------------------------------------------------------------

def test_anomalous_request_is_prefilled_on_p_and_decoded_wholly_on_the_relay() -> None:
    spec = paper.paper_deployments()["pdd"]
    prompt = 40_000  # over half the 64K context, fresh: a low hit everywhere
    cluster = _run(spec, [Session(0, (Turn(prompt, 32),), anomalous=True)])
    (o,) = cluster.records
    assert o.error is None and o.anomalous
    assert o.pipeline == Pipeline.P_RLD
    assert o.output_tokens == o.relay_output_tokens == 32 and o.main_output_tokens == 0
    assert o.line_bytes == 0 and o.handoff is None
    # P prefilled it (not the relay, whose streams its chunks would stall); the relay decoded
    # all of it; the main instances saw nothing
    prefilled, produced = {}, {}
    for inst in cluster.instances.values():
        prefilled[inst.role] = prefilled.get(inst.role, 0) + inst.stats.prefill_tokens
        produced[inst.role] = produced.get(inst.role, 0) + inst.stats.tokens_out
    assert prefilled == {"prefill": prompt, "relay": 0, "main": 0}
    assert produced["relay"] == 31 and produced["main"] == 0  # P's first token, then the relay's
    assert cluster.line.stats.bytes == 0


def test_low_hit_long_output_goes_through_the_relay_and_is_handed_off() -> None:
    spec = paper.paper_deployments()["pdd"]
    prompt, output = 31_000, 1000
    # turn 1 is fresh (a low hit, a long output); turn 2 is long (over half the context)
    # with a short output, but MD now holds its prefix, so it is not anomalous, and its
    # small delta goes P-MD
    session = Session(0, (Turn(prompt, output), Turn(1_000, 32)))
    first, second = sorted(_run(spec, [session]).records, key=lambda o: o.turn)
    assert first.error is None and not first.anomalous
    assert first.pipeline == Pipeline.P_RLD_MD
    assert first.handoff in (HandoffMode.ONE_SHOT, HandoffMode.CATCH_UP)
    assert first.handoff_tokens >= 1 and first.main_output_tokens >= 1
    assert first.relay_output_tokens + first.main_output_tokens == first.output_tokens == output
    assert first.line_bytes == prompt * KVB
    assert second.prompt_tokens >= spec.max_context // 2 and second.max_tokens < 500
    assert second.error is None and not second.anomalous and second.pipeline == Pipeline.P_MD
    assert second.d_hit_tokens >= prompt


# ---- 7. determinism ------------------------------------------------------------------------

def test_same_sessions_same_outcomes() -> None:
    def once() -> list[RequestRecord]:
        return _run(paper.paper_deployments()["pdd"], plan_session_shapes(paper.WORKLOAD, REQUESTS, 2.0)).records

    a, b = once(), once()
    assert len(a) == REQUESTS
    assert a == b


# ---- 7b. MD waits for an earlier arrival that holds its prompt, reserved or not ------------

def test_a_reservation_waits_for_an_earlier_arrival_not_reserved_yet() -> None:
    """As the live side (`pdd.instance.decode_side._may_hold`): a request still waiting for
    its own reservation holds most of a later one's prompt, so the later one waits for it
    rather than fetch the same KV over the line; an earlier one never waits for a later
    arrival that is not reserved (the two would wait for each other), but does once it is."""
    from pdd.lab.sim.instance import Instance
    from pdd.lab.sim.reserve import await_prefix
    from pdd.lab.sim.sequence import Landing
    from pdd.perf.hardware import CATALOG
    from pdd.perf.model import MODELS
    from pdd.perf.physics import Physics

    model = next(iter(MODELS.values()))
    prompt = [("turn", i) for i in range(8)]

    def waited(earlier_reserved: bool, later_reserved: bool, wait_for_later: bool) -> float:
        env = simpy.Environment()
        inst = Instance(env, "main0@B", "main", "B", Physics(CATALOG["B"], model, 8), 400_000, BLOCK, 16384, 64)
        first = Landing(inst, prompt, next(inst.arrivals), reserved=earlier_reserved)
        second = Landing(inst, prompt + [("next", 0)], next(inst.arrivals), reserved=later_reserved)
        me, other = (first, second) if wait_for_later else (second, first)
        done: list[float] = []

        def ask():
            yield from await_prefix(inst, me)
            done.append(env.now)

        def land():
            yield env.timeout(3.0)
            other.settle()

        env.process(ask())
        env.process(land())
        env.run()
        return done[0]

    assert waited(False, False, wait_for_later=False) == 3.0  # the earlier one is still in the line
    assert waited(True, False, wait_for_later=False) == 3.0
    assert waited(False, False, wait_for_later=True) == 0.0  # a later arrival not reserved: no circle
    assert waited(False, True, wait_for_later=True) == 3.0  # a later one reserved: it waits for nothing


# ---- 8. a running request's cached prefix is never evicted under it ----------------------

def test_a_running_requests_prefix_is_locked_against_eviction():
    """The instance's cache is the engine's radix cache over a pool of blocks: a hold
    locks its prefix, newer blocks evict the others, and released, it may go too."""
    env = simpy.Environment()
    inst = dataclasses.replace(paper.role("main", "B", 1, "B"), capacity_tokens=6 * BLOCK)
    cluster = Cluster(env, paper.deployment("x", (paper.role("prefill", "A", 1, "A"), inst)))
    md = cluster.instances["main0@B"]
    md.keep(["a0", "a1"])
    md.keep(["c0"])
    hold = md.hold(2 * BLOCK, ["a0", "a1"])  # a request runs on this prefix, with 2 blocks of its own
    assert hold is not None
    md.keep(["b0", "b1", "b2"])  # newer blocks: room for two beside the hold and its prefix
    assert md.hit_tokens(["a0", "a1", "x"], 3 * BLOCK) == 2 * BLOCK  # the locked prefix stayed
    assert md.hit_tokens(["c0", "x"], 2 * BLOCK) == 0  # the oldest other went
    assert md.hit_tokens(["b0", "b1", "b2", "x"], 4 * BLOCK) == 2 * BLOCK  # the tail found no room
    assert md.cache.cached_pages == 4 and md.kv_held_tokens == 4 * BLOCK
    hold.release()
    md.keep([f"d{i}" for i in range(6)])  # the whole pool: the prefix goes now
    assert md.hit_tokens(["a0", "x"], 2 * BLOCK) == 0 and md.cache.cached_pages == 6


def test_pool_room_counts_the_pinned_prefix():
    """A hold beside a pinned prefix needs room for both: the pool never over-commits."""
    env = simpy.Environment()
    inst = dataclasses.replace(paper.role("main", "B", 1, "B"), capacity_tokens=10 * BLOCK)
    cluster = Cluster(env, paper.deployment("x", (paper.role("prefill", "A", 1, "A"), inst)))
    md = cluster.instances["main0@B"]
    md.keep([("s", i) for i in range(6)])
    hold = md.hold(4 * BLOCK, [("s", i) for i in range(6)])
    assert hold is not None and md.hold(1, ()) is None  # 6 pinned + 4 held = the whole pool
    hold.release()
    assert md.used == 0 and md.hold(4 * BLOCK, ()) is not None


# ---- 9. goodput is judged in steady state ------------------------------------------------

def test_a_steady_window_judges_only_what_arrives_in_it():
    from pdd.lab.sim.runner import Window, run_window, steady_sessions, tail_s

    slo = (paper.SLO_TTFT_MS, paper.SLO_TPOT_MS)
    window = Window(30.0, 60.0, tail_s(paper.WORKLOAD.output_tokens[1], slo))
    result = run_window(paper.paper_deployments()["pd-same-dc"], steady_sessions(paper.WORKLOAD), 0.5, window, slo)
    assert 0 < result["requests"] < result["simulated_requests"]  # the warm-up is simulated, not judged
    assert result["offered_rps"] == pytest.approx(result["requests"] / 30.0)
    assert result["slo_attainment"] == 1.0  # a light load meets the SLO


def test_a_pools_held_share_counts_the_prefixes_its_requests_pin() -> None:
    """What the planner reports as a decode pool's use (`utilisation`'s `<role>_kv`): the
    requests' own room and the cached prefix blocks they pin, which no eviction may take
    either; released, neither is held."""
    from pdd.lab.sim.instance import Instance
    from pdd.perf.hardware import CATALOG
    from pdd.perf.model import MODELS
    from pdd.perf.physics import Physics

    env = simpy.Environment()
    inst = Instance(env, "main0@B", "main", "B", Physics(CATALOG["B"], next(iter(MODELS.values())), 8), 400_000,
                    BLOCK, 16384, 64)
    prefix = [("shared", i) for i in range(40)]
    inst.keep(prefix)
    hold = inst.hold(3 * BLOCK, prefix)
    assert hold is not None and inst.used == 3 * BLOCK
    assert inst.kv_held_tokens == 3 * BLOCK + 40 * BLOCK
    hold.release()
    assert inst.kv_held_tokens == 0 and inst.cache.cached_pages == 40  # the prefix stays cached, held by nobody


def test_a_turn_waits_for_its_tool_and_a_warm_start_resumes_inside_the_wait() -> None:
    """A turn with `pause_s` is sent that long after the previous answer, its context held
    in the cache meanwhile; a session resumed while a tool runs starts when it is sent."""
    from pdd.lab.sim.runner import NOMINAL_TPOT_S, NOMINAL_TTFT_S, _resume

    s = Session(0, (Turn(4 * BLOCK, 8), Turn(BLOCK, 8, pause_s=3.0), Turn(BLOCK, 8, pause_s=2.0)))
    spec = paper.deployment("colo", (paper.role("standalone", "A", 1, "A"),))
    r0, r1, r2 = sorted(_run(spec, [s]).records, key=lambda r: r.turn)
    assert all(r.error is None and r.output_tokens == 8 for r in (r0, r1, r2))
    assert r1.start_s == pytest.approx(r0.start_s + r0.e2e_ms / 1000 + 3.0)
    assert r2.start_s == pytest.approx(r1.start_s + r1.e2e_ms / 1000 + 2.0)
    assert r1.p_hit_tokens == 4 * BLOCK  # the first turn's context (its full blocks) waited in the cache

    first = NOMINAL_TTFT_S + 8 * NOMINAL_TPOT_S
    resumed = _resume(s, first + 0.5)  # half a second into the first tool's run
    assert resumed is not None and resumed.start_s == pytest.approx(2.5)
    assert [t.pause_s for t in resumed.turns] == [0.0, 2.0] and resumed.warm_tokens == 4 * BLOCK + 8
    assert resumed.prompts() == s.prompts()[1:]
