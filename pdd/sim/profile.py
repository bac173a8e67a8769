"""This machine's profile, as `pdd sim calibrate` writes it and `pdd sim check` reads it."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdd.sim.fit import Sample, relative_errors
from pdd.sim.steps import Fitted

PROFILE_VERSION = 1
_TERMS = ("base_s", "per_token_s", "per_pair_s", "per_seq_s", "per_kv_token_s")  # Fitted's, in order


@dataclass(frozen=True)
class LocalProfile:
    """This machine, as `pdd sim calibrate` measured it: what `pdd.sim.local` needs to
    simulate a deployment of the served model here."""

    steps: Fitted
    kv_bytes_per_token: int
    max_context: int
    request_overhead_s: float  # an idle request's path through router and HTTP, beyond its engine step
    cores: int


def profile_to_json(profile: LocalProfile, samples: Sequence[Sample], threads: int = 1) -> dict[str, Any]:
    errors = relative_errors(profile.steps, samples)
    return {"version": PROFILE_VERSION, "fitted": profile.steps.to_dict(), "samples": len(samples),
            "median_rel_error": float(np.median(errors)), "p90_rel_error": float(np.percentile(errors, 90)),
            "threads": threads, "kv_bytes_per_token": profile.kv_bytes_per_token,
            "max_context": profile.max_context, "request_overhead_s": profile.request_overhead_s,
            "cores": profile.cores}


def _check_number(path: str | Path, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{path}: {name} must be a non-negative number, not {value!r}")
    return float(value)


def _check_count(path: str | Path, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path}: {name} must be a positive integer, not {value!r}")
    return value


def load_profile(path: str | Path) -> LocalProfile:
    """Check every field, so a truncated or hand-edited profile fails here, by name,
    rather than as a simulation with nonsense step times."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON step-time profile ({e})") from None
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
        raise ValueError(f"{path}: not a version {PROFILE_VERSION} step-time profile")
    fitted = data.get("fitted")
    if not isinstance(fitted, dict) or set(fitted) != {*_TERMS, "source"}:
        raise ValueError(f"{path}: 'fitted' must hold exactly {', '.join(_TERMS)} and source")
    if not isinstance(fitted["source"], str):
        raise ValueError(f"{path}: fitted.source must be a string")
    for name in ("median_rel_error", "p90_rel_error"):
        _check_number(path, name, data.get(name))
    for name in ("samples", "threads"):
        _check_count(path, name, data.get(name))
    coef = [_check_number(path, f"fitted.{name}", fitted[name]) for name in _TERMS]
    return LocalProfile(Fitted(*coef, source=fitted["source"]),
                        _check_count(path, "kv_bytes_per_token", data.get("kv_bytes_per_token")),
                        _check_count(path, "max_context", data.get("max_context")),
                        _check_number(path, "request_overhead_s", data.get("request_overhead_s")),
                        _check_count(path, "cores", data.get("cores")))
