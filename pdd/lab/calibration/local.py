"""The deployment `pdd up` starts on this machine, simulated: the calibration check.

Every instance of the live deployment (`pdd.config.instances_for_mode`, the same
placement `pdd up` uses) becomes a simulated instance with the measured step times of
this machine's engine; all of them share the machine's cores, prefill at the lower
priority `pdd up` gives it; the line is the scenario's. Simulating `pdd demo` this way
and comparing with what `pdd demo` measured tells whether the simulator can be
believed at cluster scale.

A paced deployment (`topology.hardware = "emulated"`) is simulated with each instance's
emulated chip (`pdd.perf.emulated`, the function its pacer holds steps to) on hardware
of its own, and the line in emulated time: what is left between prediction and
measurement is then the control plane's error (and any step the CPU overran).
"""

from __future__ import annotations

from dataclasses import replace

import simpy

from pdd import config as cfg
from pdd.engines.port import AUTO, AUTO_SIZES, EngineConfig
from pdd.lab.calibration.profile import LocalProfile
from pdd.lab.sim.cluster import Cluster
from pdd.lab.sim.fleet import DeploymentSpec, RoleSpec
from pdd.lab.workload.agentic import plan_session_shapes
from pdd.lab.workload.scenarios import Scenario
from pdd.perf.emulated import emulated_steps, token_scale
from pdd.perf.hardware import Line
from pdd.perf.steps import StepModel
from pdd.record import RequestRecord

# Loopback TCP between two processes (P -> RLD, P -> MD in one datacenter): far faster
# than any emulated line, and its time is in the step profile's export/import share.
LOOPBACK = Line(gbps=10.0, one_way_ms=0.05, price_per_hour=0.0)


def on_scenario_line(dep: cfg.Deployment, scenario: Scenario) -> cfg.Deployment:
    """`dep` on the scenario's line (what `pdd demo` passes `pdd up`), in emulated time
    where its instances are paced (`cfg.in_emulated_time`, as `pdd up` does)."""
    line = replace(
        dep.line, bandwidth_mbps=scenario.bandwidth_mbps, delay_ms=scenario.delay_ms, jitter_ms=scenario.jitter_ms
    )
    return cfg.in_emulated_time(replace(dep, line=line))


def local_spec(dep: cfg.Deployment, mode: str, profile: LocalProfile) -> DeploymentSpec:
    """`dep` (on its line: `on_scenario_line`) as `pdd up --mode mode` starts it here."""
    instances = dep.instances or cfg.instances_for_mode(dep, mode)
    sized = [f"{i.name}: {k}" for i in instances for k in AUTO_SIZES if getattr(i.engine, k) == AUTO]
    if sized:
        raise ValueError(
            f"the simulator needs each instance's sizes, which vLLM chooses itself at start ({', '.join(sized)}): "
            "give [engine] num_pages, max_running and max_batch_tokens (/pdd/stats of a running instance shows "
            "vLLM's choice)"
        )
    paced = dep.topology.hardware != "native"
    nice = dep.topology.prefill_nice > 0 and not paced  # `pdd up` renices native instances only

    def steps(engine: EngineConfig) -> StepModel:
        if engine.hardware == "native":
            return profile.steps
        return emulated_steps(engine.hardware, token_scale(profile.max_context), engine.dilation)

    roles = tuple(
        RoleSpec(
            i.role,
            i.dc,
            1,
            steps(i.engine),
            i.engine.num_pages * i.engine.page_size,
            i.engine.max_batch_tokens,
            i.engine.max_running,
            cpu_priority=1 if nice and i.role == "prefill" else 0,
            max_requests=i.engine.max_requests,
        )
        for i in instances
    )
    pages = {i.engine.page_size for i in instances}
    if len(pages) != 1:
        raise ValueError("the simulator needs one page size across the deployment")
    line = Line(dep.line.bandwidth_mbps / 1000, dep.line.delay_ms, 0.0)
    return DeploymentSpec(
        mode,
        roles,
        line,
        LOOPBACK,
        profile.kv_bytes_per_token,
        pages.pop(),
        profile.max_context,
        dep.policy,
        cores=None if paced else profile.cores,  # a paced instance waits for its own chip, not for a core
        request_overhead_s=profile.request_overhead_s,
    )


def simulate_demo(
    dep: cfg.Deployment, mode: str, profile: LocalProfile, scenario: Scenario, requests: int, rate: float, seed: int = 0
) -> list[RequestRecord]:
    """What `pdd demo` would measure for `mode`, by simulation."""
    spec = local_spec(on_scenario_line(dep, scenario), mode, profile)
    sessions = plan_session_shapes(replace(scenario.workload, seed=seed), requests, rate)
    return Cluster(simpy.Environment(), spec).run(sessions)
