"""The simulator's physics: a MoE decode step costs what its batch touches, the line
behaves like TCP and reproduces the spec's handoff microbenchmark, and the analytic
decode stretch is exactly step-by-step simulation. No timing is asserted."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import simpy

from pdd.lab.plan import paper
from pdd.lab.sim.instance import Instance
from pdd.lab.sim.runner import simulate
from pdd.lab.sim.sequence import SimSeq
from pdd.lab.sim.tcp import HANDOFF_MEAN_S, HANDOFF_PEAK_S, Tcp, TcpLine, calibrate_one_way_ms, handoff_times_s
from pdd.lab.workload.agentic import plan_session_shapes
from pdd.lab.workload.types import Session, Turn
from pdd.perf.hardware import CATALOG, LINE_ONE_WAY_MS, Line
from pdd.perf.model import MODELS, dense_twin
from pdd.perf.physics import Physics, touched_max
from pdd.perf.steps import chunk_load, decode_stretch

MOE = MODELS["paper-1t"]


def _decode_s(model, batch: int, context: int = 1024) -> float:
    return float(Physics(CATALOG["B"], model, 8).steps_s(decode_stretch(batch * context, batch, 1))[0])


# ---- 1. decode costs what the batch touches ------------------------------------------------

def test_moe_decode_step_grows_with_the_batch_and_a_dense_one_does_not() -> None:
    dense = dense_twin(MOE)
    assert dense.active_params == pytest.approx(MOE.active_params)
    moe_growth = _decode_s(MOE, 128) / _decode_s(MOE, 1)
    dense_growth = _decode_s(dense, 128) / _decode_s(dense, 1)
    assert moe_growth > 3.0, moe_growth  # a batch of 128 reads ~93 % of the experts, a lone token 2 %
    assert dense_growth < 1.15, dense_growth  # every weight is read at any batch: only the KV grows
    steps = [_decode_s(MOE, b) for b in (1, 4, 16, 64, 128, 256)]
    assert steps == sorted(steps)


def test_expert_coverage_is_the_spec_arithmetic() -> None:
    # 384 experts, top 8: a batch of 15 touches ~28 %, of 128 ~93 % (one GPU holds them all)
    assert touched_max(384, 8, 1, 15) / 384 == pytest.approx(0.27, abs=0.01)
    assert touched_max(384, 8, 1, 128) / 384 == pytest.approx(0.93, abs=0.01)
    # across 8 GPUs the step waits for the most-touched one: more than the mean
    assert touched_max(384, 8, 8, 15) > touched_max(384, 8, 1, 15) / 8
    assert touched_max(384, 8, 8, 10_000) == 48


def test_a_tail_chunk_costs_about_a_whole_weight_read() -> None:
    """A few hundred tokens after a long cached prefix read every expert once and attend
    to the whole prefix: their step is far dearer per token than a full chunk's."""
    physics = Physics(CATALOG["A"], MOE, 16)
    tail, full = physics.step_s(chunk_load(62_000, 512)), physics.step_s(chunk_load(0, 16_384))
    assert tail / 512 > 5 * full / 16_384


def test_capacity_comes_from_memory() -> None:
    s = paper.SETTING
    assert s.instance_gpus("A") == 16  # 594 GB of weights do not fit 8 x 80 GB at 90 %
    assert s.instance_gpus("B") == 8
    assert s.kv_capacity_tokens("B", 8) == int((8 * 141e9 * 0.9 - MOE.weight_bytes) / MOE.kv_bytes_per_token)
    roomier = dataclasses.replace(s, memory_utilization=0.95)
    assert roomier.kv_capacity_tokens("B", 8) > s.kv_capacity_tokens("B", 8)


def test_a_decode_stretch_priced_per_batch_size_is_the_general_step_model_to_the_bit() -> None:
    """`decode_s` prices what does not depend on the context once per batch size; every
    step must still cost exactly what the general model gives it (the plan's output is
    compared to the last digit across versions)."""
    for chip, gpus, model in ((CATALOG["A"], 16, MOE), (CATALOG["B"], 8, MOE), (CATALOG["B"], 8, dense_twin(MOE))):
        physics = Physics(chip, model, gpus)
        for seqs, contexts in ((1, 900), (7, 7 * 30_000), (128, 128 * 20_000), (600, 600 * 9_000)):
            for _ in range(2):  # the second call reads the per-batch-size cache
                fast = physics.decode_s(contexts, seqs, 300)
                slow = physics.steps_s(decode_stretch(contexts, seqs, 300))
                assert fast.tolist() == slow.tolist(), (chip.name, gpus, seqs)


# ---- 2. the line ---------------------------------------------------------------------------

def test_the_line_reproduces_the_spec_handoff_microbenchmark() -> None:
    times = handoff_times_s(Line(25.0, LINE_ONE_WAY_MS, 0.0))
    assert statistics.mean(times) == pytest.approx(HANDOFF_MEAN_S, rel=0.10)
    assert max(times) == pytest.approx(HANDOFF_PEAK_S, rel=0.10)
    assert calibrate_one_way_ms(25.0) == pytest.approx(LINE_ONE_WAY_MS, rel=0.05)


def test_slow_start_makes_a_handoff_round_trip_bound_not_bandwidth_bound() -> None:
    quiet = dataclasses.replace(Tcp(), jitter_ms=0.0, loss_per_segment=0.0)
    at = {gbps: handoff_times_s(Line(gbps, 10.0, 0.0), quiet, runs=3)[0] for gbps in (10.0, 100.0)}
    fluid_s = 4649 * 1024 / (25e9 / 8) + 0.010
    assert at[10.0] == pytest.approx(at[100.0], rel=0.05)  # ~8 round trips either way
    assert at[10.0] > 10 * fluid_s
    warm = dataclasses.replace(quiet, idle_restart=False)
    assert handoff_times_s(Line(25.0, 10.0, 0.0), warm, runs=3)[-1] < 0.5 * at[10.0]  # a warm window


def test_connections_share_the_line_fairly_and_a_window_caps_one() -> None:
    env = simpy.Environment()
    tcp = dataclasses.replace(Tcp(), jitter_ms=0.0, loss_per_segment=0.0, window_bytes=8e6)
    line = TcpLine(env, Line(100.0, 5.0, 0.0), tcp)
    done: dict[str, float] = {}

    def go(key: str, nbytes: float):
        yield line.send(nbytes, 0, key)
        done[key] = env.now

    env.process(go("a", 500e6))
    env.run()
    alone = done["a"]
    cap = 8e6 / 0.010  # one window per round trip: 800 MB/s, under the line's 12.5 GB/s
    assert alone == pytest.approx(500e6 / cap, rel=0.15)
    env = simpy.Environment()
    line = TcpLine(env, Line(100.0, 5.0, 0.0), tcp)
    done.clear()
    for key in "abcd":
        env.process(go(key, 500e6))
    env.run()
    assert max(done.values()) == pytest.approx(min(done.values()), rel=1e-6)  # four windows fit the line
    assert line.stats.bytes == 4 * 500e6


# ---- 3. the analytic decode stretch is step-by-step simulation ---------------------------

def _decode_run(stretches: bool) -> list[SimSeq]:
    env = simpy.Environment()
    inst = Instance(env, "main0@B", "main", "B", Physics(CATALOG["B"], MOE, 8), 400_000, 256, 16384, 64,
                    stretches=stretches)
    plan = [(0.0, 3000, 0, 40), (0.05, 12000, 0, 25), (0.2, 500, 700, 30), (0.2, 8000, 0, 60), (0.9, 100, 50, 5)]
    seqs = [SimSeq(context=c, pending=p, produce=n, hold=None, token_times=[]) for _, c, p, n in plan]

    def arrive(at: float, seq: SimSeq):
        yield env.timeout(at)
        inst.submit(seq)

    def stop_one():  # a handoff cut in the middle of a stretch
        yield env.timeout(0.3)
        inst.stop(seqs[3])

    for (at, *_), seq in zip(plan, seqs, strict=True):
        env.process(arrive(at, seq))
    env.process(stop_one())
    env.run()
    return seqs


def test_the_decode_stretch_equals_per_step_simulation() -> None:
    fast, slow = _decode_run(True), _decode_run(False)
    for a, b in zip(fast, slow, strict=True):
        assert a.produced == b.produced and a.done == b.done and a.stopped == b.stopped
        assert a.token_times == pytest.approx(b.token_times, rel=1e-12, abs=1e-12)
        assert a.max_gap_s == pytest.approx(b.max_gap_s, rel=1e-9)
    assert fast[3].stopped and 0 < fast[3].produced < 60  # the stop fell inside a stretch


def test_a_whole_deployment_runs_the_same_with_and_without_stretches() -> None:
    sessions = plan_session_shapes(paper.WORKLOAD, 60, 1.0)
    sessions.append(Session(10_000, (Turn(45_000, 300),), 5.0, anomalous=True))
    spec = paper.paper_deployments()["pdd"]
    fast, fast_events = simulate(spec, sessions)
    slow, slow_events = simulate(dataclasses.replace(spec, stretches=False), sessions)
    key = lambda o: (o.session, o.turn)  # noqa: E731
    for a, b in zip(sorted(fast, key=key), sorted(slow, key=key), strict=True):
        assert (a.pipeline, a.handoff, a.output_tokens, a.relay_output_tokens, a.error) == \
               (b.pipeline, b.handoff, b.output_tokens, b.relay_output_tokens, b.error), (a, b)
        assert a.ttft_ms == pytest.approx(b.ttft_ms, rel=1e-9) and a.e2e_ms == pytest.approx(b.e2e_ms, rel=1e-9)
    assert fast_events < slow_events / 5  # what the stretches are for
