"""`pdd plan`'s options: their parser, their defaults, and their types (each type parses
one option's text or says, in one line, what it expected; argparse prints it naming the
option)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdd.lab.plan import paper
from pdd.lab.plan.layouts import SERVED
from pdd.lab.plan.planner import Probe
from pdd.names import AttentionLayout


def floats_arg(value: str) -> list[float]:
    try:
        return [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {value!r}") from None


def pair_arg(kind: type) -> Callable[[str], tuple[Any, Any]]:
    def parse(value: str) -> tuple[Any, Any]:
        try:
            low, high = (kind(v) for v in value.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected LOW,HIGH, got {value!r}") from None
        return low, high

    return parse


def names_arg(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def workload_arg(value: str) -> tuple[str, Path | None]:
    kind, _, path = value.partition(":")
    if kind == "agentic" and not path:
        return "agentic", None
    if kind == "mooncake" and path:
        return "mooncake", Path(path)
    raise argparse.ArgumentTypeError("expected 'agentic' or 'mooncake:PATH'")


def attention_arg(value: str) -> list[AttentionLayout]:
    try:
        return [AttentionLayout(v) for v in names_arg(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layouts of {', '.join(AttentionLayout)}, got {value!r}") from None


CONTENDERS = 2  # each family's best two by the screen: its error orders more than it prices


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `pdd plan`; defaults are the plan file's, else the spec's setting
    (pdd/lab/plan/paper.py, `DEFAULTS`)."""
    p.add_argument(
        "--plan-file",
        type=Path,
        help="a TOML file of the buyer's chips, sites, fleet, line, model (a Hugging Face config.json), SLO "
        "and workload (docs/cli.md); a flag given here overrides its key",
    )
    p.add_argument("--max-gpus", type=int, help=f"GPU budget; layouts spend all of it (default {DEFAULTS['max_gpus']})")
    p.add_argument(
        "--cell-gpus",
        type=int,
        help="a budget above this is planned as identical cells of at most this many GPUs, each its own "
        "deployment, sessions split among them by a session-affine balancer; one cell is simulated at its "
        f"share of the rate (0: one deployment whatever the budget; default {DEFAULTS['cell_gpus']})",
    )
    p.add_argument(
        "--line-gbps",
        type=floats_arg,
        help="line bandwidths to try for the cross-datacenter layouts (default 25,100)",
    )
    p.add_argument(
        "--chips",
        type=names_arg,
        help="A and/or B: the first is datacenter A's (P, relays), the last B's (MD across the line); "
        "same-dc PD is tried on each (default A,B)",
    )
    p.add_argument(
        "--workload",
        type=workload_arg,
        metavar="agentic|mooncake:PATH",
        help="agentic: the spec's 64K agentic sessions (default); mooncake: the trace, its arrivals "
        "rescaled to each probed rate",
    )
    p.add_argument(
        "--tool-time-s",
        type=pair_arg(float),
        metavar="LOW,HIGH",
        help="agentic: seconds a tool runs between a turn's answer and the next turn, drawn uniformly "
        "(default none); the session's KV waits in the decode side's cache meanwhile",
    )
    p.add_argument(
        "--task-tokens",
        type=pair_arg(int),
        metavar="LOW,HIGH",
        help=f"agentic: a session's first prompt beyond the system prompt, drawn uniformly (default "
        f"{paper.WORKLOAD.task_tokens[0]},{paper.WORKLOAD.task_tokens[1]}); near the context "
        f"({paper.WORKLOAD.max_context:,}) every request is about that long",
    )
    _add_probe_arguments(p)
    _add_output_arguments(p)


def _add_probe_arguments(p: argparse.ArgumentParser) -> None:
    """How each layout's goodput is probed, and the SLO it is judged by."""
    p.add_argument(
        "--requests",
        type=int,
        default=Probe.requests,
        help=f"requests judged per goodput probe, after the warm-up (default {Probe.requests})",
    )
    p.add_argument(
        "--warmup-s",
        type=float,
        default=Probe.warmup_s,
        help=f"seconds of arrivals before a probe judges any, after a warm start (default {Probe.warmup_s:g})",
    )
    p.add_argument(
        "--min-window-s",
        type=float,
        default=Probe.min_window_s,
        help=f"shortest judged window of a probe, whatever its requests (default {Probe.min_window_s:g})",
    )
    p.add_argument("--steps", type=int, default=Probe.steps, help=f"bisection steps per layout (default {Probe.steps})")
    p.add_argument(
        "--contenders",
        type=int,
        default=CONTENDERS,
        help=f"layouts of each family simulated, its best by the analytic screen (default {CONTENDERS}; 0: all)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="layouts simulated at once, one process each (default: 2, or the cores if fewer)",
    )
    p.add_argument("--slo-ttft-ms", type=float, help=f"default {paper.SLO_TTFT_MS:g}")
    p.add_argument("--slo-tpot-ms", type=float, help=f"default {paper.SLO_TPOT_MS:g}")
    p.add_argument(
        "--attainment",
        type=float,
        help="share of requests within the SLO that goodput requires (default 0.9)",
    )


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """What the search covers beyond its layouts, and what it prints and writes."""
    p.add_argument("--top", type=int, default=8, help="layouts to print (default 8)")
    p.add_argument(
        "--exact",
        action="store_true",
        help="find every simulated layout's goodput (default: only until it is shown not to beat its "
        "family's best, one probe at the rate that would)",
    )
    p.add_argument(
        "--published",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="evaluate the publication's layouts as given (88 A against 43 A + 32 B, the nearest buildable), "
        "head to head, on the first --line-gbps (default: yes; four layouts, about 10 s on two cores)",
    )
    p.add_argument(
        "--target-rps",
        type=float,
        help="also find each family's cheapest layout within the budget that meets the SLO at this many "
        "requests a second (one probe at that rate a layout, cheapest first)",
    )
    p.add_argument(
        "--attention",
        type=attention_arg,
        help="attention layouts each side may take (tp, tp-dcp, dp-ep), with the instance size searched for "
        "each (default: those serving runs: " + ",".join(a for a in AttentionLayout if SERVED[a] is None) + ")",
    )
    p.add_argument(
        "--aiconfigurator",
        metavar="MODEL_ID",
        help="the model's Hugging Face id in NVIDIA AIConfigurator's databases (the plan extra): each side whose "
        "chip and layout they cover takes its step times from them (the roofline fitted), the rest the roofline",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="probe the verdict's two layouts again with this many seeds in all and print the spread (default 1)",
    )
    p.add_argument("--out", type=Path, help="write every layout's numbers and the assumptions here (JSON)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def probe_of(args: argparse.Namespace) -> Probe:
    return Probe(
        args.requests,
        args.warmup_s,
        (args.slo_ttft_ms, args.slo_tpot_ms),
        args.attainment,
        args.steps,
        args.min_window_s,
    )


DEFAULTS: dict[str, Any] = {"max_gpus": 88, "cell_gpus": 128, "line_gbps": [25.0, 100.0], "chips": ["A", "B"]}
DEFAULTS |= {"workload": ("agentic", None), "slo_ttft_ms": paper.SLO_TTFT_MS, "slo_tpot_ms": paper.SLO_TPOT_MS}
DEFAULTS |= {"attainment": Probe.attainment, "aiconfigurator": None}
