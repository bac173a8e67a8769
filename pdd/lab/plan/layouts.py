"""Each side's attention layout and instance size, searched: what `pdd plan` assumes
each role runs, named as serving names it (`pdd.names.AttentionLayout`).

For each side (prefill: P; decode: the relays and MD) and each site's chip, every layout
and every instance size of whole nodes that holds the model and `MIN_KV_CONTEXTS`
contexts is priced by the step model: decode by the tokens a second one instance
decodes at the TPOT target per unit of price (`pdd.perf.decode`), prefill by the tokens
a second it prefills of a half-context prompt, in chunks, per unit of price. The best
per side and chip (the smallest instance within `SIZE_TOLERANCE` of it, for a finer
choice of counts within a budget; of those, the one with the most room for KV: a
prefill instance's room is its prefix cache, which its computing rate does not see) is
what the planner's layouts are built of; the expert-parallel size
is the instance's (the experts spread over all its GPUs). Only layouts serving can run
are offered unless named (`SERVED`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pdd.lab.plan import paper
from pdd.names import AttentionLayout
from pdd.perf.decode import decode_rate
from pdd.perf.model import SPEC_CONTEXT
from pdd.perf.physics import MIN_KV_CONTEXTS, instance_sizes
from pdd.perf.steps import chunk_load

# What serving runs (`attention =` in a member's config; `pdd.engines.vllm.layout` moves
# each layout's KV, DCP's split by token included) for every role, and why not where a
# layout is named that it does not: None, served.
SERVED: dict[AttentionLayout, str | None] = {
    AttentionLayout.TP: None,
    AttentionLayout.TP_DCP: None,
    AttentionLayout.DP_EP: None,
}
SIDES = ("prefill", "decode")
SIZE_TOLERANCE = 0.05  # the smallest instance within this of the best per price: finer layouts of a budget


def _prefill_rate(setting: paper.Setting, hw: str, gpus: int, side: str, context: int) -> float:
    """Tokens a second one instance prefills of a `context`-token prompt, in chunks."""
    physics = setting.physics(hw, gpus, side)
    step = setting.max_batch_tokens
    seconds = sum(physics.step_s(chunk_load(start, min(step, context - start))) for start in range(0, context, step))
    return context / seconds


def options(
    setting: paper.Setting, tpot_s: float, layouts: Sequence[AttentionLayout], context: int = SPEC_CONTEXT // 2
) -> list[dict[str, Any]]:
    """Every (side, chip, layout, size) that holds the model, with its tokens a second per
    unit of price (`per_price`; 0 where not one sequence decodes within the TPOT target)."""
    rows = []
    for hw in ("A", "B"):
        chip = setting.chip(hw)
        for attention in layouts:
            trial = replace(setting, attention=attention, roles=())
            sizes = instance_sizes(
                chip, setting.model, setting.memory_utilization, MIN_KV_CONTEXTS, paper.WORKLOAD.max_context, attention
            )
            for gpus in sizes:
                for side in SIDES:
                    if side == "prefill":
                        rate: float | None = _prefill_rate(trial, hw, gpus, side, context)
                    else:
                        decoded = decode_rate(
                            trial.physics(hw, gpus, side),
                            trial.kv_capacity_tokens(hw, gpus, side),
                            context,
                            tpot_s,
                            setting.max_running,
                        )
                        rate = decoded.tokens_per_s if decoded else None
                    rows.append(
                        {
                            "side": side,
                            "hw": hw,
                            "chip": chip.name,
                            "attention": str(attention),
                            "gpus": gpus,
                            "kv_tokens": trial.kv_capacity_tokens(hw, gpus, side),
                            "tokens_per_s": rate or 0.0,
                            "per_price": (rate or 0.0) / (gpus * chip.price_per_hour),
                            "served": SERVED[attention] is None,
                            "why_not_served": SERVED[attention],
                        }
                    )
    return rows


def choose(
    setting: paper.Setting, tpot_s: float, layouts: Sequence[AttentionLayout] | None = None
) -> tuple[paper.Setting, list[dict[str, Any]]]:
    """`setting` with each side's best layout on each chip (`roles`), and every option
    priced, each marked with the sides that chose it (`chosen`). A relay takes the
    smallest decode instance (the best per price of that size): it decodes only the
    requests whose KV is crossing. `layouts`: those to try (default: those serving runs)."""
    tried = list(layouts) if layouts else [a for a in AttentionLayout if SERVED[a] is None]
    rows = options(setting, tpot_s, tried)
    for r in rows:
        r["chosen"] = []
    chosen = []
    for hw in ("A", "B"):
        for side in (*SIDES, "relay"):
            mine = [r for r in rows if (r["side"], r["hw"]) == (side.replace("relay", "decode"), hw) and r["per_price"]]
            if not mine:
                continue
            if side == "relay":
                smallest = min(r["gpus"] for r in mine)
                best = max((r for r in mine if r["gpus"] == smallest), key=lambda r: r["per_price"])
            else:
                top = max(r["per_price"] for r in mine)
                near = [r for r in mine if r["per_price"] >= (1 - SIZE_TOLERANCE) * top]
                best = min(near, key=lambda r: (r["gpus"], -r["kv_tokens"], -r["per_price"]))
            best["chosen"].append(side)
            chosen.append(paper.RoleLayout(side, hw, AttentionLayout(best["attention"]), best["gpus"]))
    return replace(setting, roles=tuple(chosen)), rows


def smallest(setting: paper.Setting) -> paper.Setting:
    """`setting` with each chosen layout on the fewest nodes that hold it: the publication's
    layouts are counted in such instances (`pdd.lab.plan.published.published`)."""
    roles = []
    for r in setting.roles:
        sizes = instance_sizes(
            setting.chip(r.hw),
            setting.model,
            setting.memory_utilization,
            MIN_KV_CONTEXTS,
            paper.WORKLOAD.max_context,
            r.attention,
        )
        roles.append(replace(r, gpus=sizes[0]))
    return replace(setting, roles=tuple(roles))
