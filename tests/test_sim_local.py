"""This machine's deployments, simulated: `pdd sim --profile` and the calibration check.

The check's verdict is what a user reads, so it must flag a mode whose measured TTFT
the simulation misses by more than the tolerance, and pass one it predicts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pdd import config as cfg
from pdd.cli import main
from pdd.engines.embedded.pacing import StepPacer
from pdd.lab.calibration.check import check, mode_deployment
from pdd.lab.calibration.local import local_spec, on_scenario_line, simulate_demo
from pdd.lab.calibration.profile import LocalProfile, profile_to_json
from pdd.lab.sim.metrics import summary
from pdd.lab.workload.scenarios import SCENARIOS
from pdd.perf.steps import Fitted, StepLoad, chunk_load

STEPS = Fitted(0.002, 8e-5, 9e-8, 2e-5, 1e-6, source="test")
PROFILE = LocalProfile(STEPS, kv_bytes_per_token=4096, max_context=4096, request_overhead_s=0.02, cores=2)


def _write_profile(path: Path) -> None:
    samples = [(StepLoad(n, n * n / 2, 1, n), STEPS.step_s(StepLoad(n, n * n / 2, 1, n))) for n in (1, 64, 512)]
    path.write_text(json.dumps(profile_to_json(PROFILE, samples)))


def test_sim_simulates_a_deployment_of_this_machine(tmp_path: Path) -> None:
    profile, out = tmp_path / "profile.json", tmp_path / "sim.json"
    _write_profile(profile)
    assert main(["sim", "--profile", str(profile), "--modes", "pd-cross-dc,pdd", "--requests", "8",
                 "--out", str(out)]) == 0
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"pd-cross-dc", "pdd"}
    assert all(m["requests"] == 8 and m["completed"] == 8 for m in modes.values())
    assert sum(modes["pdd"]["pipelines"].values()) == 8 and modes["pd-cross-dc"]["line_bytes"] > 0


def test_check_flags_the_mode_it_mispredicts() -> None:
    scenario = SCENARIOS["paper"]
    predicted = {mode: summary(simulate_demo(cfg.load(None), mode, PROFILE, scenario, 6, scenario.rate), 2000, 200)
                 for mode in ("colocated", "pdd")}
    measured = {"colocated": predicted["colocated"],
                "pdd": predicted["pdd"] | {"ttft_ms": {q: 3 * v for q, v in predicted["pdd"]["ttft_ms"].items()}}}
    report = {"modes": measured, "meta": {"config": {"scenario": "paper", "rate": scenario.rate, "requests": 6,
                                                     "seed": 0, "slo_ttft_ms": 2000, "slo_tpot_ms": 200}}}
    result = check(report, PROFILE)["modes"]
    assert result["colocated"]["within"] and result["colocated"]["p50"]["error"] == pytest.approx(0.0)
    assert not result["pdd"]["within"] and result["pdd"]["p50"]["error"] == pytest.approx(-2 / 3)


def test_an_emulated_demo_is_simulated_on_its_chips_in_its_time_and_with_its_mode_options() -> None:
    scenario = SCENARIOS["paper"]
    paced = cfg.Deployment(topology=cfg.TopologySpec(hardware="emulated", dilation=3.0))
    dep, base = mode_deployment(paced, "pd-same-dc:main=2")
    assert (base, dep.topology.main) == ("pd-same-dc", 2)
    with pytest.raises(ValueError, match="does not model the option"):
        mode_deployment(paced, "pdd:bandwidth=9")
    spec = local_spec(on_scenario_line(dep, scenario), base, PROFILE)
    assert spec.cores is None  # each paced instance on a chip of its own
    assert [(r.role, r.steps.name) for r in spec.roles] == [("prefill", "A"), ("main", "A"), ("main", "A")]
    cross = local_spec(on_scenario_line(paced, scenario), "pdd", PROFILE)
    assert [r.steps.name for r in cross.roles] == ["A", "A", "B"]
    assert cross.line.gbps == pytest.approx(scenario.bandwidth_mbps / 3 / 1000)  # the line in emulated time
    # the simulated steps are the pacer's own (the live runtime holds each step to this function)
    assert cross.roles[2].steps.step_s(chunk_load(2000, 1)) == StepPacer("B", 16.0, 3.0).step_s([(2000, 1, 1000)])
    slow = summary(simulate_demo(paced, "pd-same-dc", PROFILE, scenario, 6, scenario.rate), 6000, 600)
    fast = summary(simulate_demo(replace(paced, topology=replace(paced.topology, dilation=1.0)), "pd-same-dc",
                                 PROFILE, scenario, 6, scenario.rate), 2000, 200)
    assert slow["tpot_ms"]["p50"] == pytest.approx(3 * fast["tpot_ms"]["p50"], rel=0.02)
