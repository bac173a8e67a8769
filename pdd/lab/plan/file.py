"""`pdd plan --plan-file F`: the buyer's own chips, prices, fleet, line, model, SLO and
workload, in one TOML file; a flag given on the command line overrides its key.

    [chips.MI300X]            # a chip the catalog lacks; a catalog name overrides its figures
    memory_gb = 192
    hbm_tbps = 5.3
    tflops_bf16 = 1307
    tflops_fp8 = 2615
    price_per_hour = 2.6      # any currency: every cost and BCR is in it
    [sites]
    A = "H800"                # P and the relays (and same-site PD)
    B = "MI300X"              # MD across the line
    [fleet]
    gpus = 88                 # the most GPUs a layout uses (--max-gpus)
    owned = { H800 = 88 }     # a layout uses no more of a chip than the fleet owns (others are bought)
    budget_per_hour = 300     # and costs no more an hour
    cell_gpus = 128           # a larger budget is planned as identical cells of at most this (--cell-gpus)
    [line]
    gbps = [25, 100]
    rtt_ms = 40
    price_per_gbps_hour = 0.08
    [model]
    config = "deepseek-v3/config.json"   # a Hugging Face config.json, relative to this file
    [slo]
    ttft_ms = 5000
    tpot_ms = 50
    [workload]
    kind = "agentic"          # or "mooncake" with trace = "PATH"

A mistake is one line that names the key (`PlanFileError`).
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdd.lab.plan import paper
from pdd.lab.plan.planner import Layout
from pdd.perf.hardware import CHIPS, Chip
from pdd.perf.hf_model import ModelConfigError, dtype_bytes, load_model, read_parsed
from pdd.perf.model import ModelShape

# [chips.NAME] key -> (Chip field, factor to the field's unit)
CHIP_KEYS = {
    "memory_gb": ("mem_gb", 1.0),
    "hbm_tbps": ("mem_bw_gbs", 1000.0),
    "tflops_bf16": ("bf16_tflops", 1.0),
    "tflops_fp8": ("fp8_tflops", 1.0),
    "price_per_hour": ("price_per_hour", 1.0),
    "nvlink_gbs": ("scale_up_gbs", 1.0),
    "network_gbs": ("scale_out_gbs", 1.0),
}
NEW_CHIP_NEEDS = ("memory_gb", "hbm_tbps", "tflops_bf16", "tflops_fp8", "price_per_hour")
TABLES = {
    "chips": None,
    "sites": ("A", "B"),
    "fleet": ("gpus", "cell_gpus", "owned", "budget_per_hour"),
    "line": ("gbps", "rtt_ms", "price_per_gbps_hour"),
    "model": ("config", "name", "expert_dtype", "dense_dtype", "kv_dtype", "aiconfigurator"),
    "slo": ("ttft_ms", "tpot_ms", "attainment"),
    "workload": ("kind", "trace", "task_tokens", "tool_time_s"),
}


class PlanFileError(ValueError):
    """What is wrong with a plan file, in one line naming the key."""


@dataclass(frozen=True)
class Fleet:
    """What the buyer already has and may spend: GPUs owned per site's chip (a layout
    uses no more of it), and the most a layout may cost an hour."""

    owned: dict[str, int] = field(default_factory=dict)  # by site, "A" / "B"
    budget_per_hour: float | None = None

    def allows(self, layout: Layout, setting: paper.Setting, max_gpus: int) -> bool:
        """Whether `layout` fits the GPU budget, the GPUs owned and the money budget."""
        bill = layout.bill(setting)
        within = all(bill.gpus.get(site, 0) <= n for site, n in self.owned.items())
        money = self.budget_per_hour is None or bill.per_hour <= self.budget_per_hour
        return layout.gpus(setting) <= max_gpus and within and money

    def spending(self, layouts: Sequence[Layout], setting: paper.Setting, max_gpus: int) -> list[Layout]:
        """The layouts the fleet allows that spend it: no further P or MD instance would
        still be allowed (so with 64 A owned, all-A is searched at 64 A, not dropped)."""
        return [
            lay
            for lay in layouts
            if self.allows(lay, setting, max_gpus)
            and not any(
                self.allows(more, setting, max_gpus)
                for more in (replace(lay, prefill=lay.prefill + 1), replace(lay, main=lay.main + 1))
            )
        ]


def _number(value: Any, key: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or (positive and not value > 0):
        raise PlanFileError(f"{key}: expected a number{' > 0' if positive else ''}, got {value!r}")
    return float(value)


def _table(data: dict[str, Any], name: str) -> dict[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise PlanFileError(f"[{name}]: expected a table")
    allowed = TABLES[name]
    for key in table:
        if allowed is not None and key not in allowed:
            raise PlanFileError(f"[{name}] {key}: unknown key (expected one of {', '.join(allowed)})")
    return table


def _chips(data: dict[str, Any]) -> dict[str, Chip]:
    """The catalog, with the file's chips added or their figures overridden."""
    chips = dict(CHIPS)
    for name, figures in _table(data, "chips").items():
        key = f"[chips.{name}]"
        if not isinstance(figures, dict):
            raise PlanFileError(f"{key}: expected a table")
        for k in figures:
            if k not in CHIP_KEYS:
                raise PlanFileError(f"{key} {k}: unknown key (expected one of {', '.join(CHIP_KEYS)})")
        if name not in chips:
            missing = [k for k in NEW_CHIP_NEEDS if k not in figures]
            if missing:
                raise PlanFileError(
                    f"{key} {missing[0]}: missing (a chip the catalog lacks needs {', '.join(NEW_CHIP_NEEDS)})"
                )
            base = Chip(name, 0, 0, 0, 0, paper.SETTING.a.scale_up_gbs, paper.SETTING.a.scale_out_gbs, 0, "plan file")
        else:
            base = replace(chips[name], source=f"{chips[name].source}; overridden by the plan file")
        values: dict[str, Any] = {
            CHIP_KEYS[k][0]: _number(v, f"{key} {k}") * CHIP_KEYS[k][1] for k, v in figures.items()
        }
        chips[name] = replace(base, **values)
    return chips


def _pair(value: Any, key: str) -> tuple[Any, Any]:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int | float) for v in value)):
        raise PlanFileError(f"{key}: expected [LOW, HIGH], got {value!r}")
    return value[0], value[1]


def _model(data: dict[str, Any], base: Path) -> ModelShape | None:
    table = _table(data, "model")
    if "config" not in table:
        if table:
            raise PlanFileError("[model] config: missing (the path of a Hugging Face config.json)")
        return None
    widths = {}
    for key, width in (("expert_dtype", "expert_bytes"), ("dense_dtype", "dense_bytes"), ("kv_dtype", "kv_bytes")):
        if key in table:
            try:
                widths[width] = dtype_bytes(str(table[key]), f"[model] {key}")
            except ModelConfigError as exc:
                raise PlanFileError(str(exc)) from None
    try:
        return load_model(base / str(table["config"]), table.get("name"), **widths)
    except ModelConfigError as exc:
        raise PlanFileError(f"[model] config: {exc}") from None


def read_plan_file(path: Path, args: argparse.Namespace) -> tuple[paper.Setting, Fleet]:
    """The setting and fleet `path` describes; its other keys fill `args`' options that
    the command line left unset (None)."""
    data = read_parsed(path, tomllib.loads, "TOML", PlanFileError)
    for name in data:
        if name not in TABLES:
            raise PlanFileError(f"[{name}]: unknown table (expected one of {', '.join(TABLES)})")
    chips, setting = _chips(data), paper.SETTING
    sites = _table(data, "sites")
    for site, name in sites.items():
        if name not in chips:
            raise PlanFileError(f"[sites] {site}: unknown chip {name!r} (known: {', '.join(chips)})")
    setting = replace(setting, a=chips[sites.get("A", setting.a.name)], b=chips[sites.get("B", setting.b.name)])
    line = _table(data, "line")
    if "rtt_ms" in line:
        setting = replace(setting, one_way_ms=_number(line["rtt_ms"], "[line] rtt_ms") / 2)
    if "price_per_gbps_hour" in line:
        price = _number(line["price_per_gbps_hour"], "[line] price_per_gbps_hour", positive=False)
        setting = replace(setting, line_price_per_gbps_hour=price)
    if "gbps" in line and args.line_gbps is None:
        gbps = line["gbps"] if isinstance(line["gbps"], list) else [line["gbps"]]
        args.line_gbps = [_number(g, "[line] gbps") for g in gbps]
    if (model := _model(data, path.parent)) is not None:
        setting = replace(setting, model=model)
    if "aiconfigurator" in data.get("model", {}) and args.aiconfigurator is None:
        args.aiconfigurator = str(data["model"]["aiconfigurator"])
    fleet = _fleet(_table(data, "fleet"), setting, args)
    _slo_and_workload(data, path.parent, args)
    return setting, fleet


def _fleet(table: dict[str, Any], setting: paper.Setting, args: argparse.Namespace) -> Fleet:
    if "gpus" in table and args.max_gpus is None:
        args.max_gpus = int(_number(table["gpus"], "[fleet] gpus"))
    if "cell_gpus" in table and args.cell_gpus is None:
        args.cell_gpus = int(_number(table["cell_gpus"], "[fleet] cell_gpus", positive=False))
        if args.cell_gpus < 0:
            raise PlanFileError(f"[fleet] cell_gpus: expected GPUs >= 0 (0: one cell), got {table['cell_gpus']!r}")
    owned = table.get("owned", {})
    if not isinstance(owned, dict):
        raise PlanFileError("[fleet] owned: expected a table of chip = GPUs")
    by_site: dict[str, int] = {}
    for name, count in owned.items():
        sites = [s for s, chip in (("A", setting.a), ("B", setting.b)) if chip.name == name]
        if not sites:
            raise PlanFileError(f"[fleet] owned.{name}: not a chip of [sites] ({setting.a.name}, {setting.b.name})")
        for site in sites:
            by_site[site] = int(_number(count, f"[fleet] owned.{name}", positive=False))
    budget = table.get("budget_per_hour")
    return Fleet(by_site, None if budget is None else _number(budget, "[fleet] budget_per_hour"))


def _slo_and_workload(data: dict[str, Any], base: Path, args: argparse.Namespace) -> None:
    slo = _table(data, "slo")
    for key, dest in (("ttft_ms", "slo_ttft_ms"), ("tpot_ms", "slo_tpot_ms"), ("attainment", "attainment")):
        if key in slo and getattr(args, dest) is None:
            setattr(args, dest, _number(slo[key], f"[slo] {key}"))
    work = _table(data, "workload")
    kind = work.get("kind", "agentic")
    if kind not in ("agentic", "mooncake"):
        raise PlanFileError(f"[workload] kind: expected 'agentic' or 'mooncake', got {kind!r}")
    if kind == "mooncake" and "trace" not in work:
        raise PlanFileError("[workload] trace: missing (the path of the Mooncake trace)")
    if args.workload is None:
        args.workload = ("mooncake", base / str(work["trace"])) if kind == "mooncake" else ("agentic", None)
    for key in ("task_tokens", "tool_time_s"):
        if key in work and getattr(args, key) is None:
            low, high = _pair(work[key], f"[workload] {key}")
            setattr(args, key, (int(low), int(high)) if key == "task_tokens" else (float(low), float(high)))
