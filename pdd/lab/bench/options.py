"""Options that several `pdd bench` targets take, each defined once: every target's
parser composes the groups it reads, so its `--help` lists its own options only."""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def _workload(value: str) -> tuple[str, Path | None]:
    if value == "agentic":
        return "agentic", None
    kind, _, path = value.partition(":")
    if kind == "mooncake" and path:
        return "mooncake", Path(path)
    raise argparse.ArgumentTypeError("expected 'agentic' or 'mooncake:PATH'")


def out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="write the JSON report here")


def model_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory or hub name (default: a fresh tiny model)")


def threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (default 1)")


def server(p: argparse.ArgumentParser) -> None:
    """A live OpenAI-compatible server to send requests to."""
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model id (default: the first from /v1/models)")


def client(p: argparse.ArgumentParser) -> None:
    """How requests are drawn and waited for."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=120.0, help="per request (default 120)")
    p.add_argument(
        "--vocab-size",
        type=int,
        help="prompt token IDs are drawn below this (default: the served model's vocabulary, "
        "from /v1/models; 4096 if it does not say)",
    )


def workload(p: argparse.ArgumentParser) -> None:
    """The agentic sessions or Mooncake trace replayed, and the SLOs they are judged by."""
    p.add_argument(
        "--workload",
        type=_workload,
        default=("agentic", None),
        metavar="agentic|mooncake:PATH",
        help="default: agentic",
    )
    p.add_argument(
        "--requests", type=int, default=100, help="agentic: total turns; mooncake: first N trace lines (default 100)"
    )
    p.add_argument(
        "--rate", type=float, default=math.inf, help="agentic session starts per second, Poisson; inf = all at once"
    )
    p.add_argument(
        "--scenario",
        choices=("paper", "short"),
        default="paper",
        help="agentic: the workload shape of that demo scenario (default paper)",
    )
    p.add_argument(
        "--scale",
        type=int,
        help="mooncake: divide lengths by this (512-token blocks -> 512/scale); default: "
        "the smallest scale from 16 up at which the trace fits the served model's context",
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="mooncake: divide arrival times by this")
    p.add_argument(
        "--max-context",
        type=int,
        help="cap on prompt + output tokens (default: agentic, the scenario's, its lengths scaled "
        "down to a served context shorter than the tiny model's; mooncake, the served context)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="default 2000")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0, help="default 200")
