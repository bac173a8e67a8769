"""pdd's seeded draw inside vLLM: a logits processor.

vLLM keeps one random generator per request, so the token it draws at a position
depends on how many draws that generator made before: a continuation on another
instance (MD after a relay, after P's first token) would draw differently. pdd's draw
is a function of (seed, position) alone (`pdd.sampling.draw_key`), so every producer of
a position draws the same token. For a non-greedy request pdd asks vLLM for greedy
sampling and attaches its own parameters (`extra_args["pdd_draw"]`: seed, the output
position of the first token this request samples, temperature, top-k, top-p); this
processor applies pdd's sampler (`pdd.engine.sampler.sample`, the embedded engine's
own) to the row and leaves only the drawn token standing, which vLLM's argmax then
picks. Requests without it are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from pdd.engine.sampler import sample
from pdd.sampling import SamplingParams


@dataclass
class _Draw:
    params: SamplingParams
    seed: int
    first_position: int
    outputs: list[int]  # vLLM's running list of this request's sampled tokens (a live reference)


def draw_args(params: SamplingParams, seed: int, first_position: int) -> dict[str, Any]:
    """The `extra_args` entry a request carries to be sampled by pdd's draw."""
    return {
        "pdd_draw": {
            "seed": seed,
            "position": first_position,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
        }
    }


class PddDraw(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Draw] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, _new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows = sorted(self.rows)
        draws = [self.rows[i] for i in rows]
        tokens = sample(
            logits[rows].float(),
            [d.params for d in draws],
            [d.seed for d in draws],
            [d.first_position + len(d.outputs) for d in draws],
        )
        for i, token in zip(rows, tokens, strict=True):
            logits[i] = float("-inf")
            logits[i, token] = 0.0
        return logits


def _new_state(params: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> _Draw | None:
    spec = (params.extra_args or {}).get("pdd_draw") if params is not None else None
    if not isinstance(spec, dict):
        return None
    p = SamplingParams(
        max_tokens=1, temperature=float(spec["temperature"]), top_p=float(spec["top_p"]), top_k=int(spec["top_k"])
    )
    return _Draw(p, int(spec["seed"]), int(spec["position"]), output_ids)
