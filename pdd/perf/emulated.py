"""The step model of an emulated accelerator, shared by the live pacer and the simulator.

A paced engine (`pdd.engines.embedded.pacing`) holds each step until the chip it emulates would
have finished it; `pdd sim check` simulates a paced deployment with the very same
function, so what is left between the two is the control plane's error, not two step
models. The tiny model's requests are the spec's scaled down by `scale` (contexts and
prompts; outputs are not scaled), so a step is priced as the spec's model would run it
at full size: a chunk of n prompt tokens after a context of c is one of n x s tokens
after c x s; a decode stays one token, over a context of c x s, and so does each output
token a chunk computes again (MD's extend of the relay's tokens at a handoff). Time
runs `dilation` times slower than the chip's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdd.names import AttentionLayout
from pdd.perf.hardware import CATALOG
from pdd.perf.model import MODELS, SPEC_CONTEXT, SPEC_MODEL
from pdd.perf.physics import MEMORY_UTILIZATION, MIN_KV_CONTEXTS, Efficiency, Physics, instance_gpus
from pdd.perf.steps import StepLoad, decode_stretch

# The layout an emulated chip's steps are priced in: the latent split across the ranks
# (`tp-dcp`), one copy of each token's KV, as `pdd sim check` simulates the same steps.
EMULATED_ATTENTION = AttentionLayout.TP_DCP


def token_scale(max_context: int) -> float:
    """How much larger the spec's requests are than a model's with this context."""
    return max(1.0, SPEC_CONTEXT / max_context)


def scaled(load: StepLoad, s: float) -> StepLoad:
    """`load` with every prompt chunk and context `s` times longer; decodes, and outputs
    computed again in a chunk (a handoff's extend), still one token each.

    Exact on the aggregate (no per-sequence detail needed): a prompt chunk [c, c + n)
    has n*c + n(n+1)/2 pairs, so at s times the size s^2 of them less (s^2 - s) n / 2; a
    token at c that stays one token (a decode, an output) has c + 1, so s (c + 1) - (s - 1);
    each sequence reads c + n (chunk) or c + 1 (decode) tokens of KV, so s times that less
    (s - 1) per decode (a chunk ending in outputs reads s - 1 tokens more than scaled so:
    nothing next to its context)."""
    decodes = np.asarray(load.seqs) - np.asarray(load.chunks)
    outputs = np.asarray(load.output_tokens)
    prompt_tokens = np.asarray(load.new_tokens) - decodes - outputs
    prompt_pairs = np.asarray(load.chunk_pairs) - np.asarray(load.output_pairs)
    output_pairs: Any = s * np.asarray(load.output_pairs) - (s - 1) * outputs  # a float or a stretch's array
    chunk_pairs = s * s * prompt_pairs - (s * s - s) / 2 * prompt_tokens + output_pairs
    decode_pairs = s * (np.asarray(load.attn_pairs) - np.asarray(load.chunk_pairs)) - (s - 1) * decodes
    return StepLoad(
        decodes + outputs + s * prompt_tokens,  # numpy, on scalars or a stretch's arrays
        chunk_pairs + decode_pairs,
        load.seqs,
        s * np.asarray(load.kv_read_tokens) - (s - 1) * decodes,
        load.chunks,
        chunk_pairs,
        load.output_tokens,
        output_pairs,
    )


@dataclass(frozen=True)
class EmulatedSteps:
    """Seconds a step takes on the emulated chip (`physics`), for the tiny model's load."""

    physics: Physics
    scale: float  # the spec's lengths over the served model's (`token_scale`)
    dilation: float = 1.0
    name: str = field(default="", compare=False)  # the catalog's name of the chip

    def steps_s(self, load: StepLoad) -> np.ndarray:
        return np.asarray(self.dilation * self.physics.steps_s(scaled(load, self.scale)), dtype=float)

    def decode_s(self, contexts_sum: int, seqs: int, steps: int) -> np.ndarray:
        return self.steps_s(decode_stretch(contexts_sum, seqs, steps))

    def step_s(self, load: StepLoad) -> float:
        if not np.any(np.asarray(load.seqs)):
            return 0.0
        return float(self.steps_s(load))


def emulated_steps(hardware: str, scale: float, dilation: float = 1.0) -> EmulatedSteps:
    """The catalog's chip `hardware` on the spec's instance of it (the spec's model, on
    the fewest whole nodes that hold it and its contexts: the simulator's paper setting's),
    as `pdd up --hardware emulated` paces it."""
    if hardware not in CATALOG:
        raise ValueError(f"unknown hardware {hardware!r}: native, or one of {sorted(CATALOG)}")
    chip, model = CATALOG[hardware], MODELS[SPEC_MODEL]
    gpus = instance_gpus(chip, model, MEMORY_UTILIZATION, MIN_KV_CONTEXTS, SPEC_CONTEXT, EMULATED_ATTENTION) or 8
    return EmulatedSteps(Physics(chip, model, gpus, Efficiency(), EMULATED_ATTENTION), scale, dilation, hardware)
