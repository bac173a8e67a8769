"""What a layout can carry at most, from the step model alone: the planner's analytic
capacity, which seeds its goodput search and prunes layouts that cannot win.

Three ceilings, each optimistic (no queueing, perfect batching):
- prefill: every P step full (`max_batch_tokens`), so a request pays its share of a
  full step's weights, all-to-all and fixed costs, plus its own attention over its
  cached prefix (at P, the previous turn's prompt: P never holds the answer MD decoded);
- decode: the largest batch whose step still meets the TPOT target and whose KV fits
  the pool, at the workload's mean context, spread over the mean output, on every
  instance that decodes (a relay decodes each request's first tokens);
- the line: the mean KV delta per request against the line's bandwidth, plus what the
  relays could finish without MD (a request kept on the relay sends nothing over it).
The layout's capacity is the smallest. The simulation then finds the real goodput
below it; a layout whose capacity per cost is below a fraction of the best goodput
per cost already found is not simulated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise

import numpy as np

from pdd.lab.sim.fleet import DeploymentSpec, RoleSpec
from pdd.lab.workload.agentic import AgenticConfig, estimate_hits, plan_session_shapes
from pdd.perf.physics import Physics
from pdd.perf.steps import chunk_load, decode_stretch

SAMPLE_REQUESTS = 3000


@dataclass(frozen=True)
class Shape:
    """The workload's per-request averages (decode-side hit as the planner of turns
    expects; a prefill instance's own hit apart, `prefilled`)."""

    requests: list[tuple[int, int]]  # (prompt tokens, hit tokens) of a sample
    mean_output: float
    mean_context: float  # a decoding sequence's context, halfway through its output
    # (prompt tokens, hit tokens) at a prefill instance, which caches the prompts it computed but
    # never the tokens the decode side produced: a later turn recomputes the previous answer
    # (None: as `requests`)
    prefilled: list[tuple[int, int]] | None = None

    @property
    def mean_delta(self) -> float:
        return float(np.mean([p - h for p, h in self.requests]))


def shape_of(config: AgenticConfig) -> Shape:
    turns = estimate_hits(config, SAMPLE_REQUESTS)
    outputs = [t.max_tokens for s in plan_session_shapes(config, SAMPLE_REQUESTS, 1.0) for t in s.turns]
    mean_output = float(np.mean(outputs))
    requests = [(t.prompt_tokens, t.hit_tokens) for t in turns]
    # a later turn's hit at P is the previous turn's prompt (the turns of a session are consecutive)
    prefilled = [(t.prompt_tokens, before.prompt_tokens if t.turn else t.hit_tokens) for before, t in pairwise(turns)]
    prefilled.insert(0, requests[0])
    return Shape(requests, mean_output, float(np.mean([p for p, _ in requests])) + mean_output / 2, prefilled)


def prefill_rps(role: RoleSpec, shape: Shape) -> float:
    """Requests a second one prefill instance can take, batching perfectly: a P instance
    at its own hits (`Shape.prefilled`), a colocated one, which decodes too, at the
    decode side's."""
    physics = role.steps
    assert isinstance(physics, Physics), "the bounds split a step into the physical model's parts"
    requests = shape.prefilled if role.role == "prefill" and shape.prefilled is not None else shape.requests
    return _prefill_rps(physics, role.max_batch_tokens, tuple(requests))


@lru_cache(maxsize=64)
def _prefill_rps(physics: Physics, max_batch_tokens: int, requests: tuple[tuple[int, int], ...]) -> float:
    # (a plan's layouts share two P instances, one a chip: 3,000 requests priced twice, not per layout)
    full = physics.parts(chunk_load(0, max_batch_tokens))
    shared = float(full["dense"] + full["experts"] + full["all_to_all"] + full["fixed"]) / max_batch_tokens
    seconds = [(p - h) * shared + float(physics.parts(chunk_load(h, p - h))["attention"]) for p, h in requests]
    return 1.0 / float(np.mean(seconds))


def decode_rps(role: RoleSpec, shape: Shape, tpot_s: float) -> float:
    """Requests a second one decode instance finishes at the largest batch that meets
    the TPOT target and fits its pool."""
    context = int(shape.mean_context)
    fits = max(1, int(role.capacity_tokens / (context + shape.mean_output / 2)))
    low, high = 1, min(fits, role.max_running)
    step = lambda b: float(role.steps.steps_s(decode_stretch(b * context, b, 1))[0])  # noqa: E731
    if step(low) > tpot_s:
        return low / step(low) / shape.mean_output
    while low < high:  # the largest batch within the TPOT target
        mid = (low + high + 1) // 2
        low, high = (mid, high) if step(mid) <= tpot_s else (low, mid - 1)
    return low / step(low) / shape.mean_output


def capacity_rps(spec: DeploymentSpec, shape: Shape, tpot_s: float) -> dict[str, float]:
    """Each ceiling of a deployment, and the smallest (`rps`)."""
    caps: dict[str, float] = {}
    relays = 0.0  # what relays decode: each request's first tokens, or all of one kept off the line
    for r in spec.roles:
        if r.role in ("prefill", "standalone"):
            caps["prefill"] = caps.get("prefill", 0.0) + r.count * prefill_rps(r, shape)
        if r.role in ("main", "standalone", "relay"):
            decodes = r.count * decode_rps(r, shape, tpot_s)
            caps["decode"] = caps.get("decode", 0.0) + decodes
            relays += decodes if r.role == "relay" else 0.0
    if len({r.dc for r in spec.roles}) > 1:  # (a request a relay finishes sends no KV over the line)
        caps["line"] = spec.line.bytes_per_s / (shape.mean_delta * spec.kv_bytes_per_token) + relays
    caps["rps"] = min(caps.values())
    return caps
