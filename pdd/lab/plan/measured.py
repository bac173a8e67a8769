"""Step times measured, where NVIDIA AIConfigurator's databases cover the chip, the model
and the layout (the `plan` extra): each such side's roofline (`pdd.perf.physics`) fitted
to them.

AIConfigurator prices a step from per-operation timings measured on the chip under a
serving engine (vLLM's, here). The simulator needs a step's time for any load, and the
analytic screen the step's parts, so rather than look each step up, the roofline's
dense, expert and attention parts are each scaled, and its fixed cost a step set, by
non-negative least squares on relative error over the decode steps (batch x context) and
prefills AIConfigurator estimates for the same layout (`Efficiency.scale`). A side keeps
its roofline where the chip or model is not covered, where the layout is one this does
not map (`tp-dcp`; `dp-ep` over more than one node, whose per-rank batches and cross-node
terms are not checked), or where the fit misses an estimate by more than `MAX_FIT_ERROR`;
the report says which, and why.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

from pdd.lab.plan import paper
from pdd.names import AttentionLayout
from pdd.perf.physics import GPUS_PER_NODE, Physics
from pdd.perf.steps import StepLoad, chunk_load, decode_stretch

SYSTEMS = {"H100": "h100_sxm", "H200": "h200_sxm", "B200": "b200_sxm"}  # pdd's chip: AIConfigurator's system
DECODE = [(1, 4096), (8, 4096), (32, 4096), (64, 4096), (16, 32768), (64, 32768), (128, 8192)]  # (batch, context)
PREFILL = [2048, 8192, 16384]
MAX_FIT_ERROR = 0.25


def covered(model: str) -> bool:
    """Whether AIConfigurator ships the model `model` names (its Hugging Face id)."""
    import aiconfigurator_core

    configs = Path(aiconfigurator_core.__file__).parent / "model_configs"
    return (configs / f"{model.replace('/', '--')}_config.json").exists()


def _why_not(chip: str, attention: AttentionLayout, gpus: int) -> str | None:
    if chip not in SYSTEMS:
        return f"AIConfigurator has no {chip}"
    if attention == AttentionLayout.TP_DCP:
        return "AIConfigurator does not model tp-dcp"
    if attention == AttentionLayout.DP_EP and gpus > GPUS_PER_NODE:
        return "dp-ep across nodes is not mapped"
    return None


def samples(model: str, chip: str, attention: AttentionLayout, gpus: int, moe: bool) -> list[tuple[StepLoad, float]]:
    """(an instance's load, AIConfigurator's seconds for it): decode steps and prefills.
    Under `dp-ep` AIConfigurator's batch is one rank's: the instance's load is every rank's."""
    from aiconfigurator_core.sdk.engine import EngineHandle

    dp = attention == AttentionLayout.DP_EP
    engine = EngineHandle.compile(
        model,
        SYSTEMS[chip],
        "vllm",
        tp_size=1 if dp else gpus,
        attention_dp_size=gpus if dp else 1,
        fmha_quant_mode="bfloat16",
        kvcache_quant_mode="bfloat16",
        **({"moe_ep_size": gpus, "moe_tp_size": 1} if moe else {}),
    )
    ranks = gpus if dp else 1
    out = [
        (decode_stretch(ranks * batch * context, ranks * batch, 1), engine.predict_decode_latency(batch, context))
        for batch, context in DECODE
    ]
    for n in PREFILL:
        one = chunk_load(0, n)
        load = StepLoad(*(ranks * getattr(one, f) for f in StepLoad.__dataclass_fields__))
        out.append((load, engine.predict_prefill_latency(1, n)))
    return [(load, ms / 1000) for load, ms in out]


def fit(physics: Physics, measured: list[tuple[StepLoad, float]]) -> tuple[Physics, float]:
    """`physics` with its parts scaled and its fixed cost a step fitted to `measured`, and
    the fit's largest relative error."""
    plain = replace(physics, eff=replace(physics.eff, scale=(1.0, 1.0, 1.0), step_overhead_s=0.0))
    times = np.array([t for _, t in measured])
    parts = [plain.parts(load) for load, _ in measured]
    design = np.array([[float(p["dense"]), float(p["experts"]), float(p["attention"]), 1.0] for p in parts])
    rest = np.array([float(p["all_to_all"]) + float(p["fixed"]) for p in parts])
    design, target = design / times[:, None], (times - rest) / times
    norm = np.linalg.norm(design, axis=0)
    norm[norm == 0] = 1.0
    k = nnls(design / norm, target)[0] / norm
    eff = replace(physics.eff, scale=(float(k[0]), float(k[1]), float(k[2])), step_overhead_s=float(k[3]))
    fitted = replace(physics, eff=eff)
    return fitted, max(abs(fitted.step_s(load) / t - 1) for load, t in measured)


def measure(setting: paper.Setting, model: str) -> tuple[paper.Setting, list[dict[str, Any]]]:
    """`setting` with each side AIConfigurator covers for `model` (a Hugging Face id it
    ships) fitted to its estimates, and a row per side naming its step times' source."""
    report, roles = [], []
    known = covered(model)
    fits: dict[tuple[str, str, int], tuple[Physics, float]] = {}  # sides of one layout share it
    for role in setting.roles:
        chip = setting.chip(role.hw).name
        row = {"side": role.side, "hw": role.hw, "chip": chip, "attention": str(role.attention), "gpus": role.gpus}
        why = _why_not(chip, role.attention, role.gpus) if known else f"AIConfigurator has no {model}"
        if why is None:
            key = (chip, str(role.attention), role.gpus)
            if key not in fits:
                physics = setting.physics(role.hw, role.gpus, role.side)
                moe = bool(setting.model.experts)
                fits[key] = fit(physics, samples(model, chip, role.attention, role.gpus, moe))
            fitted, error = fits[key]
            row["fit_error"] = error
            if error <= MAX_FIT_ERROR:
                roles.append(replace(role, eff=fitted.eff))
                report.append(row | {"source": "AIConfigurator", "scale": fitted.eff.scale})
                continue
            why = f"the fit misses AIConfigurator by {error:.0%}"
        roles.append(role)
        report.append(row | {"source": "roofline", "why": why})
    return replace(setting, roles=tuple(roles)), report
