"""`pdd plan`'s option types: each parses one option's text or says, in one line, what it
expected (argparse prints it naming the option)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
