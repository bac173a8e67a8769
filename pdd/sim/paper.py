"""The published evaluation, at its own scale: `pdd sim --paper`.

PDD_SPEC § The results to beat: 64K total length, a 90 % average hit with the spec's
skew, 1K output tokens; same-datacenter homogeneous PD on 88 GPU A, against PDD on
GPU A (P + RLD) and GPU B (MD) joined by one line. Every assumption below is printed
with the results and kept in the JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.config import PolicySpec
from pdd.sim.cluster import DeploymentSpec, RoleSpec
from pdd.sim.hardware import CATALOG, Hardware, line, rdma
from pdd.sim.model import MODELS, ModelSpec
from pdd.sim.steps import Roofline
from pdd.workload.agentic import AgenticConfig

MODEL = MODELS["paper-1t"]
GPUS_PER_INSTANCE = 8
MEMORY_UTILIZATION = 0.9  # of device memory for weights + KV, as serving engines default
BLOCK_TOKENS = 256  # cache granularity (the demo's 16-token pages x 16)
LINE_GBPS = 25.0
SLO_TTFT_MS = 5000.0
SLO_TPOT_MS = 50.0

# The demo's `paper` scenario (pdd/workload/scenarios.py) is the spec's setting / 16;
# this is it x 16 again, back at the spec's scale: 64K contexts, a 2K shared system
# prompt, 4.8-12.8K-token tasks, tool outputs of 64-1,536 tokens (6 %: 4.8-16K), 1K
# output tokens on average (768-1,280), 3 % anomalous sessions with 16-64 output tokens.
WORKLOAD = AgenticConfig(system_prompt_tokens=2048, task_tokens=(4800, 12800), turns=(8, 24),
                         tool_output_tokens=(64, 1536), large_tool_output_tokens=(4800, 16000),
                         output_tokens=(768, 1280), max_context=65536, anomalous_output_tokens=(16, 64))

# The spec's thresholds at the spec's scale: a 64-token catch-up threshold, and a TTFT
# budget of about ten decode steps of this model (P -> MD must not cost a relay's TTFT
# more than that). With several decode instances, the router's default 1:1 weighing of
# a cached token against a queued one moves sessions between instances (the decode-side
# hit falls from the workload's 89 % to 85 %); 4:1 keeps them where their prefix is
# (88 %). See BENCHMARKS.md.
POLICY = PolicySpec(ttft_budget_ms=100.0, handoff_threshold=64, catch_up_chunk=64, affinity_weight=4.0)


def kv_capacity_tokens(hw: Hardware, model: ModelSpec, gpus: int) -> int:
    """KV tokens one instance holds: its memory, less the weights."""
    room = gpus * hw.mem_gb * 1e9 * MEMORY_UTILIZATION - model.weight_bytes
    if room <= 0:
        raise ValueError(f"{model.name} does not fit on {gpus} x {hw.name}")
    return int(room / model.kv_bytes_per_token)


def role(name: str, dc: str, count: int, hw_name: str, model: ModelSpec = MODEL,
         gpus: int = GPUS_PER_INSTANCE) -> RoleSpec:
    hw = CATALOG[hw_name]
    return RoleSpec(name, dc, count, Roofline(hw, model, gpus), kv_capacity_tokens(hw, model, gpus),
                    max_batch_tokens=16384, max_running=128, hardware=hw_name, gpus=gpus)


def deployment(name: str, roles: tuple[RoleSpec, ...], gbps: float = LINE_GBPS, model: ModelSpec = MODEL,
               policy: PolicySpec = POLICY) -> DeploymentSpec:
    return DeploymentSpec(name, roles, line(gbps), rdma(), model.kv_bytes_per_token, BLOCK_TOKENS,
                          WORKLOAD.max_context, policy)


def paper_deployments(gbps: float = LINE_GBPS) -> dict[str, DeploymentSpec]:
    """88 GPU A in one site (P:D 4:7); and 40 GPU A + 32 GPU B across the line, without
    PDD (every A a P) and with it (two of the five A instances relays). The spec's 43 A
    is not a multiple of this model's 8-GPU instance; 40 is the nearest. Two relays, not
    one: the anomalous 3 % (40-62K fresh tokens each) are about 30 % of all prefill work
    here, and one relay running them whole falls behind (its TTFT P99 grows without
    bound, and their long prefill chunks stall the relay's decodes)."""
    return {
        "same-dc-pd": deployment("same-dc-pd", (role("prefill", "A", 4, "A"), role("main", "A", 7, "A")), gbps),
        "cross-dc-pd": deployment("cross-dc-pd", (role("prefill", "A", 5, "A"), role("main", "B", 4, "B")), gbps),
        "pdd": deployment("pdd", (role("prefill", "A", 3, "A"), role("relay", "A", 2, "A"),
                                  role("main", "B", 4, "B")), gbps),
    }


@dataclass(frozen=True)
class Bill:
    gpus: dict[str, int]
    per_hour: float  # GPU A hours per hour


def bill(spec: DeploymentSpec, b_price: float | None = None) -> Bill:
    """What the deployment costs an hour: its devices, plus the line when it spans sites."""
    gpus: dict[str, int] = {}
    cost = 0.0
    for r in spec.roles:
        gpus[r.hardware] = gpus.get(r.hardware, 0) + r.count * r.gpus
        price = CATALOG[r.hardware].price_per_hour
        if r.hardware == "B" and b_price is not None:
            price = b_price
        cost += r.count * r.gpus * price
    if len({r.dc for r in spec.roles}) > 1:
        cost += spec.wan.price_per_hour
    return Bill(gpus, cost)


PAPER = {"ttft_change": -0.515, "goodput_change": 0.278, "cost_change": (-0.071, -0.035), "bcr_change": 0.375,
         "rld_share": 0.062}

