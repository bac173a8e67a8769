"""Emulated accelerators: each engine step takes at least what a chip would take for it.

On one machine every instance shares the same CPU, so how long a step takes depends on
what the other processes did meanwhile, and nothing of the spec's heterogeneous
hardware shows. With `[engine] hardware = "A"` (or "B", or any chip of the
simulator's catalog) the runtime computes every step for real — the tokens are the
engine's own — and then holds it until the time that chip would have taken, from the
simulator's step model (`pdd.perf.emulated`: the paper's 1T MoE model on the paper's
instance of that chip, the tiny model's lengths scaled up by `token_scale`), the same
function `pdd sim check` simulates a paced deployment with. Real tokens, emulated time.

The emulated time runs `dilation` times slower than the chip would (the line and the
SLOs are stretched alike by `pdd up`): the CPU must finish each step within its
emulated time, or the step takes its real time and the run is no longer paced — the
runtime counts those overruns, and every report prints them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class PaceStats:
    """How the emulated times came out against the real ones."""

    steps: int = 0
    overruns: int = 0  # steps whose real time exceeded the emulated one
    prefill_steps: int = 0
    prefill_s: float = 0.0  # emulated seconds of steps with a chunk (prefill, extend)
    decode_steps: int = 0
    decode_s: float = 0.0  # emulated seconds of decode-only steps
    real_s: float = 0.0
    slept_s: float = 0.0

    def to_dict(self) -> dict[str, float | None]:  # None: no step of that kind yet
        return {
            "steps": self.steps,
            "overruns": self.overruns,
            "prefill_step_ms": 1000 * self.prefill_s / self.prefill_steps if self.prefill_steps else None,
            "decode_step_ms": 1000 * self.decode_s / self.decode_steps if self.decode_steps else None,
            "real_ms_per_step": 1000 * self.real_s / self.steps if self.steps else None,
            "paced_share": 1 - self.overruns / self.steps if self.steps else None,
        }


@dataclass
class StepPacer:
    """The emulated seconds of one engine step, and the tally of how pacing went."""

    hardware: str
    scale: float  # `pdd.perf.emulated.token_scale`
    dilation: float = 1.0
    stats: PaceStats = field(default_factory=PaceStats)

    def __post_init__(self) -> None:
        from pdd.perf.emulated import emulated_steps

        self._steps = emulated_steps(self.hardware, self.scale, self.dilation)  # an unknown chip: the error names them
        physics = self._steps.physics
        self.describe = {
            "hardware": self.hardware,
            "chip": physics.chip.name,
            "gpus": physics.gpus,
            "model": physics.model.name,
            "token_scale": self.scale,
            "dilation": self.dilation,
        }

    def step_s(self, computed: Sequence[tuple[int, int, int]]) -> float:
        """`computed`: (start, tokens, prompt length) of each sequence in the step, as the
        engine ran it; priced by the simulator's own emulated-chip model (`pdd.perf.emulated`)."""
        from pdd.perf.steps import EMPTY, add, chunk_load

        load = EMPTY
        for start, n, prompt in computed:
            load = add(load, chunk_load(start, n, prompt))
        return self._steps.step_s(load)

    def tally(self, computed: Sequence[tuple[int, int, int]], emulated_s: float, real_s: float) -> None:
        s = self.stats
        s.steps += 1
        s.real_s += real_s
        s.overruns += real_s > emulated_s
        s.slept_s += max(0.0, emulated_s - real_s)
        if any(n > 1 for _, n, _ in computed):
            s.prefill_steps += 1
            s.prefill_s += emulated_s
        else:
            s.decode_steps += 1
            s.decode_s += emulated_s
