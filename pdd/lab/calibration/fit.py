"""Fitting a `Fitted` step model to measured engine steps (`pdd sim calibrate`):
non-negative least squares, relative error."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from datetime import date
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from pdd.perf.steps import Fitted, StepLoad

Sample = tuple[StepLoad, float]  # what a step computed, and its seconds


def _design(loads: Sequence[StepLoad]) -> np.ndarray:
    return np.array([[1.0, x.new_tokens, x.attn_pairs, x.seqs, x.kv_read_tokens] for x in loads], dtype=float)


def _machine() -> str:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{cpus}"
    except OSError:
        pass
    return f"{platform.machine()} x{cpus}"


def fit(samples: Sequence[Sample], threads: int = 1) -> Fitted:
    """Non-negative least squares, each step weighted by 1/t: the fit minimises relative
    error, so a 2 ms decode step counts as much as a 1 s prefill (unweighted, the long
    prefills would own the fit), and no term can buy accuracy by going negative, which
    would price some unseen step at less than nothing."""
    if not samples:
        raise ValueError("no steps to fit")
    times = np.array([t for _, t in samples], dtype=float)
    if not (times > 0).all():
        raise ValueError("step times must be positive")
    a = _design([load for load, _ in samples]) / times[:, None]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0  # a term no step exercises stays 0
    coef = nnls(a / scale, np.ones(len(samples)))[0] / scale  # columns span ~10 decades: solve them at one scale
    source = f"{_machine()}, {threads} torch thread(s), {date.today().isoformat()}, {len(samples)} steps"
    base_s, per_token_s, per_pair_s, per_seq_s, per_kv_token_s = (float(c) for c in coef)  # _design's columns
    return Fitted(base_s, per_token_s, per_pair_s, per_seq_s, per_kv_token_s, source=source)


def relative_errors(fitted: Fitted, samples: Sequence[Sample]) -> np.ndarray:
    return np.array([abs(fitted.step_s(load) - t) / t for load, t in samples])
