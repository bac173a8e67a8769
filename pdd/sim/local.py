"""The deployment `pdd up` starts on this machine, simulated: the calibration check.

Every instance of the live deployment (`pdd.config.instances_for_mode`, the same
placement `pdd up` uses) becomes a simulated instance with the measured step times of
this machine's engine; all of them share the machine's cores, prefill at the lower
priority `pdd up` gives it; the line is the scenario's. Simulating `pdd demo` this way
and comparing with what `pdd demo` measured tells whether the simulator can be
believed at cluster scale.
"""

from __future__ import annotations

from dataclasses import replace

import simpy

from pdd import config as cfg
from pdd.record import RequestRecord
from pdd.sim.cluster import Cluster, DeploymentSpec, RoleSpec
from pdd.sim.hardware import Line
from pdd.sim.profile import LocalProfile
from pdd.sim.workload import agentic_sessions
from pdd.workload.scenarios import Scenario

# Loopback TCP between two processes (P -> RLD, P -> MD in one datacenter): far faster
# than any emulated line, and its time is in the step profile's export/import share.
LOOPBACK = Line(gbps=10.0, one_way_ms=0.05, price_per_hour=0.0)


def local_spec(dep: cfg.Deployment, mode: str, profile: LocalProfile, scenario: Scenario) -> DeploymentSpec:
    instances = dep.instances or cfg.instances_for_mode(dep, mode)
    nice = dep.topology.prefill_nice > 0
    roles = tuple(
        RoleSpec(
            i.role,
            i.dc,
            1,
            profile.steps,
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
    wan = Line(scenario.bandwidth_mbps / 1000, scenario.delay_ms, 0.0)
    return DeploymentSpec(
        mode,
        roles,
        wan,
        LOOPBACK,
        profile.kv_bytes_per_token,
        pages.pop(),
        profile.max_context,
        dep.policy,
        cores=profile.cores,
        request_overhead_s=profile.request_overhead_s,
    )


def simulate_demo(
    dep: cfg.Deployment, mode: str, profile: LocalProfile, scenario: Scenario, requests: int, rate: float, seed: int = 0
) -> list[RequestRecord]:
    """What `pdd demo` would measure for `mode`, by simulation."""
    spec = local_spec(dep, mode, profile, scenario)
    sessions = agentic_sessions(replace(scenario.workload, seed=seed), requests, rate)
    return Cluster(simpy.Environment(), spec).run(sessions)
