"""This machine's profile, as `pdd sim calibrate` writes it and `pdd sim check` reads it.

The file is checked field by field (pydantic, strict, no unknown keys), so a truncated
or hand-edited profile fails where it is read, naming the field, rather than as a
simulation with nonsense step times.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdd.lab.calibration.fit import Sample, relative_errors
from pdd.perf.steps import Fitted

PROFILE_VERSION: Final = 1
TERMS = tuple(f.name for f in fields(Fitted) if f.name != "source")  # the step model's coefficients, in order

_Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
_Count = Annotated[int, Field(ge=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _FittedFile(_Strict):
    base_s: _Seconds
    per_token_s: _Seconds
    per_pair_s: _Seconds
    per_seq_s: _Seconds
    per_kv_token_s: _Seconds
    source: str


class _ProfileFile(_Strict):
    version: Literal[1]
    fitted: _FittedFile
    samples: _Count
    median_rel_error: _Seconds
    p90_rel_error: _Seconds
    threads: _Count
    kv_bytes_per_token: _Count
    max_context: _Count
    request_overhead_s: _Seconds
    cores: _Count


assert tuple(_FittedFile.model_fields) == (*TERMS, "source"), "the profile file must hold Fitted's coefficients"


@dataclass(frozen=True)
class LocalProfile:
    """This machine, as `pdd sim calibrate` measured it: what `pdd.lab.calibration.local` needs to
    simulate a deployment of the served model here."""

    steps: Fitted
    kv_bytes_per_token: int
    max_context: int
    request_overhead_s: float  # an idle request's path through router and HTTP, beyond its engine step
    cores: int


def profile_to_json(profile: LocalProfile, samples: Sequence[Sample], threads: int = 1) -> dict[str, Any]:
    errors = relative_errors(profile.steps, samples)
    fitted = _FittedFile.model_validate(profile.steps.to_dict())
    return _ProfileFile(
        version=PROFILE_VERSION,
        fitted=fitted,
        samples=len(samples),
        median_rel_error=float(np.median(errors)),
        p90_rel_error=float(np.percentile(errors, 90)),
        threads=threads,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        max_context=profile.max_context,
        request_overhead_s=profile.request_overhead_s,
        cores=profile.cores,
    ).model_dump()


def load_profile(path: str | Path) -> LocalProfile:
    try:
        data = _ProfileFile.model_validate(json.loads(Path(path).read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON step-time profile ({e})") from None
    except ValidationError as e:
        raise ValueError(f"{path}: not a version {PROFILE_VERSION} step-time profile: {e}") from None
    return LocalProfile(
        Fitted(**data.fitted.model_dump()),
        data.kv_bytes_per_token,
        data.max_context,
        data.request_overhead_s,
        data.cores,
    )
