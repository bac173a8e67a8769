"""Named demo scenarios: a workload, its arrival rate and the line between datacenters.

`paper` is a scaled copy of the published evaluation (PDD_SPEC § The results to beat),
and the default of `pdd demo`; `short` is the earlier short-output agentic run, kept
for comparison. Every number of `paper` follows from the arithmetic in `PAPER_NOTES`
(also in BENCHMARKS.md), so a reader can check what was scaled and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pdd.lab.workload.agentic import AgenticConfig

PAPER_NOTES = """\
The spec's evaluation: 64K-token contexts, a 90 % average prefix hit with 70-80 % of
requests above 95 %, 1K output tokens, ~50 KB of KV per token (1T model), a 10-100
Gbit/s line whose latency is tens to hundreds of times RDMA's. A full-context miss is
64K x 50 KB = 3.2 GB: 2.6 s on an idle 10 Gbit/s line.
Scaled to the tiny model (4 KiB of KV per token, 4,096-token context):
- contexts / 16: up to 4,000 tokens;
- the line: 50 Mbit/s, so a full-context miss (4,000 x 4 KiB = 16 MB) takes the same
  2.6 s idle; 2 ms +- 0.5 ms one way (the spec's sub-millisecond metro latency, rounded
  up);
- sessions: a shared 128-token system prompt, a 300-800-token task (the first turn is
  a ~80 % miss: 0.3-0.6 s of line), then turns that re-send the context plus a tool
  output (log-uniform 4-96 tokens; 6 % are 300-1,000): 70-72 % of requests hit above
  95 % at the decode side, 87-89 % of prompt tokens on average (91-92 % without the
  anomalous requests);
- outputs 320-768 tokens (mean 544): 7 s at a loaded decode step of ~13 ms, 2.7x the
  full-context miss and over 10x a first turn's transfer;
- 3 % of sessions are anomalous: one long input (60-95 % of the context), 1-4 tokens out;
- sessions start as a Poisson process, 0.4 per second.
"""


@dataclass(frozen=True)
class Scenario:
    name: str
    workload: AgenticConfig
    requests: int  # turns in a demo run
    rate: float  # session starts per second (inf: all at once)
    bandwidth_mbps: float
    delay_ms: float
    jitter_ms: float
    notes: str


SCENARIOS = {
    "paper": Scenario(
        "paper",
        AgenticConfig(
            system_prompt_tokens=128,
            task_tokens=(300, 800),
            turns=(4, 12),
            output_tokens=(320, 768),
            max_context=4000,
            anomalous_output_tokens=(1, 4),
        ),
        requests=40,
        rate=0.4,
        bandwidth_mbps=50.0,
        delay_ms=2.0,
        jitter_ms=0.5,
        notes=PAPER_NOTES,
    ),
    "short": Scenario(
        "short",
        AgenticConfig(),
        requests=40,
        rate=math.inf,
        bandwidth_mbps=20.0,
        delay_ms=20.0,
        jitter_ms=5.0,
        notes="Short agentic turns (8-48 output tokens), every session at once, a 20 Mbit/s line "
        "with 20 ms +- 5 ms one way: the earlier demo, where relays finish most low-hit requests alone.",
    ),
}

# What every scenario above is scaled to: the embedded tiny model.
TINY_CONTEXT = 4096
TINY_KV_BYTES_PER_TOKEN = 4096  # 4 layers x 2 KV heads x 64 x (K, V) x fp32


def fit_workload(config: AgenticConfig, context_tokens: int, vocab_size: int) -> tuple[AgenticConfig, float]:
    """`config` for a served model: token IDs drawn from its vocabulary, and every length
    (system prompt, task, tool outputs, outputs, context cap) multiplied by the model's
    context over the tiny model's when it is shorter. Returns the config and that factor."""
    scale = min(1.0, context_tokens / TINY_CONTEXT)

    def span(bounds: tuple[int, int]) -> tuple[int, int]:
        return max(1, round(bounds[0] * scale)), max(1, round(bounds[1] * scale))

    fitted = replace(
        config,
        vocab_size=vocab_size,
        system_prompt_tokens=round(config.system_prompt_tokens * scale),
        task_tokens=span(config.task_tokens),
        tool_output_tokens=span(config.tool_output_tokens),
        large_tool_output_tokens=span(config.large_tool_output_tokens),
        output_tokens=span(config.output_tokens),
        max_context=int(config.max_context * scale),
    )
    return fitted, scale


def fit_scenario(
    scenario: Scenario, context_tokens: int, vocab_size: int, kv_bytes_per_token: int
) -> tuple[Scenario, str]:
    """`scenario` for a served model, and a line that says what changed.

    The workload is fitted to the model's context (`fit_workload`); the line's bandwidth
    follows the model's KV bytes per token and that context factor, so that a request's
    KV occupies the line as long as with the tiny model (a full-context miss of the
    `paper` scenario: 2.6 s idle), which is what the scenario's numbers are built on.
    Decode speed is the model's own: outputs are not rescaled for it.
    """
    workload, scale = fit_workload(scenario.workload, context_tokens, vocab_size)
    line_scale = scale * kv_bytes_per_token / TINY_KV_BYTES_PER_TOKEN
    fitted = replace(scenario, workload=workload, bandwidth_mbps=scenario.bandwidth_mbps * line_scale)
    if fitted == scenario:
        return scenario, f"scenario {scenario.name} as published (the model has the tiny model's shape)"
    return fitted, (
        f"scenario {scenario.name} fitted to the model: context {context_tokens} tokens "
        f"(lengths x {scale:.3g}, contexts up to {workload.max_context}), vocabulary {vocab_size}, "
        f"{kv_bytes_per_token:,} KV bytes per token: the line at {fitted.bandwidth_mbps:.4g} Mbit/s "
        f"(x {line_scale:.3g}) so each request's KV takes as long on it as with the tiny model"
    )
