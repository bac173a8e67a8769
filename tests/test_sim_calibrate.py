"""The step-time calibration: the fit recovers what generated its data, never goes
negative, the measured loads are what the engine scheduled, and bad profiles are refused.
No timing is asserted: the machine running the tests is shared and noisy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pdd.engines.port import EngineConfig
from pdd.lab.calibration.fit import fit
from pdd.lab.calibration.measure import Group, measure
from pdd.lab.calibration.profile import LocalProfile, load_profile, profile_to_json
from pdd.perf.steps import EMPTY, Fitted, StepLoad, add, chunk_load

TRUTH = Fitted(base_s=1.5e-3, per_token_s=9e-5, per_pair_s=7e-8, per_seq_s=2e-5, per_kv_token_s=1.2e-6)


def _loads() -> list[StepLoad]:
    """Prefills, cached tails, decode batches and extends beside them."""
    loads = [chunk_load(0, n) for n in (32, 100, 700, 2000)]
    loads += [chunk_load(p, n) for p in (512, 2992) for n in (8, 256, 1000)]
    for batch, context in ((1, 64), (8, 1024), (48, 3000), (16, 256)):
        decode = EMPTY
        for i in range(batch):
            decode = add(decode, chunk_load(context + i, 1))
        loads += [decode, add(decode, chunk_load(context, 32)), add(decode, chunk_load(0, 300))]
    return loads


def test_fit_recovers_known_coefficients() -> None:
    fitted = fit([(load, TRUTH.step_s(load)) for load in _loads()], threads=2)
    for name in ("base_s", "per_token_s", "per_pair_s", "per_seq_s", "per_kv_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6), name
    assert "2 torch thread(s)" in fitted.source and f"{len(_loads())} steps" in fitted.source


def test_fit_is_never_negative_where_least_squares_would_be() -> None:
    truth = Fitted(1.5e-3, 9e-5, 7e-8, 0.0, 1.2e-6)
    rng = np.random.default_rng(3)
    samples = [(load, truth.step_s(load) * rng.uniform(0.9, 1.1)) for load in _loads()]
    times = np.array([t for _, t in samples])
    design = np.array([[1, x.new_tokens, x.attn_pairs, x.seqs, x.kv_read_tokens] for x, _ in samples]) / times[:, None]
    unconstrained = np.linalg.lstsq(design, np.ones(len(samples)), rcond=None)[0]
    assert unconstrained.min() < 0  # else this test would not exercise the constraint
    fitted = fit(samples)
    coef = [fitted.base_s, fitted.per_token_s, fitted.per_pair_s, fitted.per_seq_s, fitted.per_kv_token_s]
    assert min(coef) >= 0
    assert fitted.per_seq_s == 0.0


_OPENED: list[EngineConfig] = []


def _recorded_engine(model_dir: Path, config: EngineConfig, threads: int, eos_ids: frozenset[int]):
    """A backend of its own name for the test: the embedded engine, its opening recorded."""
    from pdd.engines.embedded.runtime import open_embedded

    _OPENED.append(config)
    return open_embedded(model_dir, config, threads, eos_ids)


def test_measure_records_what_the_engine_scheduled(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration reaches the engine only through the port (the backend `[engine]
    backend` names), and works out each step's load from outputs alone: every load it
    reports is exactly a step the engine scheduled."""
    import torch

    from pdd.batching import Scheduler
    from pdd.engines import port as engine_port

    scheduled: list[StepLoad] = []
    schedule = Scheduler.schedule

    def recording(self: Scheduler) -> list:
        batch = schedule(self)
        load = EMPTY
        for seq, n in batch:
            load = add(load, chunk_load(seq.num_computed, n))
        scheduled.append(load)
        return batch

    monkeypatch.setattr(Scheduler, "schedule", recording)
    threads = torch.get_num_threads()
    calls: list[tuple[int, int]] = []
    monkeypatch.setitem(engine_port._ENGINES, "recorded", f"{__name__}:_recorded_engine")
    # every kind of shape, small: prefills alone, a cached tail, decode batches, extends and
    # a prefill beside decoders that started in different steps
    plan = (Group(0, 0, False, (32, 100)), Group(64, 0, True, (8,)), Group(64, 5, True, (0, 1, 8)),
            Group(32, 3, False, (0, 40)))
    measured = measure(str(tiny_model_dir), EngineConfig(backend="recorded"), threads=1, budget_s=60.0,
                       progress=lambda done, total: calls.append((done, total)), plan=plan)
    assert [c.backend for c in _OPENED] == ["recorded"]
    samples = measured.samples
    assert torch.get_num_threads() == threads
    loads = [load for load, _ in samples]
    assert len(loads) == sum(len(g.sizes) for g in plan)
    assert loads[:3] == [chunk_load(0, 32), chunk_load(0, 100), chunk_load(64, 8)]
    assert {load.seqs for load in loads} == {1, 5, 6, 3, 4}
    # every load was worked out from outputs alone: each is exactly a step the engine ran
    missing = [load for load in loads if load not in scheduled]
    assert not missing, missing
    assert all(t > 0 for _, t in samples)
    assert calls[0][0] == 1 and calls[-1][0] == len(samples) and calls[-1][1] >= len(samples)
    assert measured.kv_bytes_per_token > 0 and measured.max_context > 0


def test_an_output_is_placed_by_its_engine_step_not_by_when_it_came() -> None:
    """A decoder's token that reached the caller late, nearest the next step's, is still
    placed in the step that made it; only a backend that cannot say its steps is placed
    by arrival (the two failures this replaced: contexts off by one per decoder)."""
    import asyncio

    from pdd.engines.port import StepOutput
    from pdd.lab.calibration.measure import _Batch

    async def go() -> tuple[int, int]:
        batch = _Batch()
        for step in (10, 11, 12):
            batch.seen(StepOutput("d0", 1, None, position=step - 10, step=step))
        batch.times = [0.0, 0.010, 0.020]  # decoder 0's tokens arrived a step (10 ms) apart
        late = 0.019  # and decoder 1's of step 11 nearest step 12's
        told = await batch.position_of(StepOutput("d1", 1, None, position=7, step=11), late)
        untold = await batch.position_of(StepOutput("d1", 1, None, position=7), late)
        return told, untold

    assert asyncio.run(go()) == (1, 2)


def test_profile_round_trip(tmp_path: Path) -> None:
    samples = [(load, TRUTH.step_s(load)) for load in _loads()]
    local = LocalProfile(fit(samples), kv_bytes_per_token=4096, max_context=4096, request_overhead_s=0.004, cores=2)
    profile = profile_to_json(local, samples, threads=4)
    assert profile["samples"] == len(samples) and profile["threads"] == 4
    assert profile["median_rel_error"] < 1e-6 and profile["p90_rel_error"] < 1e-6
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    assert load_profile(path) == local


def _good_profile() -> dict:
    return {"version": 1, "fitted": {**TRUTH.to_dict()}, "samples": 10, "median_rel_error": 0.1,
            "p90_rel_error": 0.2, "threads": 1, "kv_bytes_per_token": 4096, "max_context": 4096,
            "request_overhead_s": 0.004, "cores": 2}


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


@pytest.mark.parametrize("text", [
    "{not json",
    "[1, 2]",
    json.dumps({**_good_profile(), "version": 2}),
    json.dumps(_without(_good_profile(), "fitted")),
    json.dumps({**_good_profile(), "fitted": _without(TRUTH.to_dict(), "per_seq_s")}),
    json.dumps({**_good_profile(), "fitted": {**TRUTH.to_dict(), "per_gpu_s": 1.0}}),
    json.dumps({**_good_profile(), "fitted": {**TRUTH.to_dict(), "base_s": -1e-3}}),
    json.dumps({**_good_profile(), "fitted": {**TRUTH.to_dict(), "per_token_s": "fast"}}),
    json.dumps({**_good_profile(), "fitted": {**TRUTH.to_dict(), "source": 3}}),
    json.dumps({**_good_profile(), "samples": 0}),
    json.dumps({**_good_profile(), "threads": True}),
    json.dumps(_without(_good_profile(), "p90_rel_error")),
    json.dumps(_without(_good_profile(), "request_overhead_s")),
    json.dumps({**_good_profile(), "cores": 0}),
])
def test_load_profile_rejects_a_malformed_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="bad.json"):
        load_profile(path)
    path.write_text(json.dumps(_good_profile()))
    assert load_profile(path).steps == TRUTH


def test_importing_the_module_does_not_import_torch() -> None:
    code = "import sys, pdd.lab.calibration.calibrate, pdd.lab.calibration.measure; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_simulator_reaches_no_engine_but_through_the_port() -> None:
    """Nothing in pdd/lab/sim imports the embedded engine (issue 13 § 1): calibration goes
    through `pdd.engines.port`, so any backend can be calibrated."""
    import ast

    import pdd.lab.sim

    offenders = []
    for path in sorted(Path(pdd.lab.sim.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            room = "pdd.engines.embedded"
            offenders += [f"{path.name}: {n}" for n in names if n == room or n.startswith(f"{room}.")]
    assert not offenders


def test_request_overhead_is_the_median_ttft_less_its_prefill_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The `pdd up` measurement's glue (it once imported a class pdd.lab.demo no longer had):
    the deployment it starts is asked for its router and stopped; the overhead is the
    median TTFT less one prefill step. The deployment and the bench are stand-ins: a real
    `pdd up` takes longer than the suite can spend (test_cli_e2e calibrates --skip-http)."""
    import types

    from pdd.lab import demo_deploy
    from pdd.lab.bench import client
    from pdd.lab.calibration.calibrate import request_overhead_s
    from pdd.record import RequestRecord

    seen: list[str] = []

    class Deployment:
        def __init__(self, mode: str, config: Path | None) -> None:
            seen.append(mode)

        def wait_router(self, timeout_s: float) -> str:
            return "http://127.0.0.1:1"

        def stop(self) -> None:
            seen.append("stopped")

    def bench(url: str, sessions: list, quiet: bool) -> types.SimpleNamespace:
        ttfts = [40.0, 10.0, 30.0, None, 20.0]
        return types.SimpleNamespace(records=[RequestRecord(id=str(i), ttft_ms=t) for i, t in enumerate(ttfts)])

    monkeypatch.setattr(demo_deploy, "DemoDeployment", Deployment)
    monkeypatch.setattr(client, "run_bench", bench)
    got = request_overhead_s(TRUTH, requests=5, prompt_tokens=64)
    assert seen == ["colocated", "stopped"]
    assert got == pytest.approx(0.030 - TRUTH.step_s(chunk_load(0, 64)))
