"""pdd's seeded draw inside vLLM: a logits processor.

vLLM keeps one random generator per request, so the token it draws at a position
depends on how many draws that generator made before: a continuation on another
instance (MD after a relay, after P's first token) would draw differently. pdd's draw
is a function of (seed, position) alone (`pdd.sampling.params.draw_key`), so every producer of
a position draws the same token. For a non-greedy request, or one whose logits are
shaped (penalties, logit bias, `min_tokens`) or held to a grammar (`pdd.sampling.guide`: its
matcher advanced over the output so far, given tokens included), pdd asks vLLM for
greedy sampling and attaches its own parameters (`extra_args["pdd_draw"]`: pdd's sampling parameters, seed,
the output position of the first token this request samples, and what shaping needs
of the prompt and of the output before it); this processor applies pdd's sampler
(`pdd.sampling.draw.sample`, the embedded engine's own) to the row and leaves only the
drawn token standing, which vLLM's argmax then picks. vLLM's own penalties are never
asked for: they would count a continuation's given tokens as prompt, not output, and run
after this processor. Requests without it are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from pdd.sampling.draw import sample
from pdd.sampling.guide import Guide, Guides
from pdd.sampling.params import SamplingParams


@dataclass
class _Draw:
    params: SamplingParams
    seed: int
    first_position: int
    seen: list[int]  # the prompt's distinct tokens, where the repetition penalty needs them
    given: list[int]  # output tokens before this request's first sampled one (P's, a relay's)
    outputs: list[int]  # vLLM's running list of this request's sampled tokens (a live reference)
    stops: frozenset[int]  # EOS and the request's stop tokens (for `min_tokens`)
    eos: list[int]  # the model's EOS tokens (a grammar's end)
    guide: Guide | None = None  # the request's grammar, once its first token is drawn here


def draw_args(
    params: SamplingParams,
    seed: int,
    prompt: list[int],
    outputs: list[int],
    stops: frozenset[int],
    eos: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """The `extra_args` entry a request carries to be sampled (and its logits shaped) by
    pdd: its parameters, seed, and what shaping needs of the prompt and of the output
    tokens before the first it samples (`outputs`: none on P; P's and the relay's on MD)."""
    return {
        "pdd_draw": {
            "params": msgspec.to_builtins(params),
            "seed": seed,
            "position": len(outputs),
            "seen": sorted(set(prompt)) if params.repetition_penalty != 1.0 else [],
            "given": list(outputs) if params.shapes or params.guide else [],
            "stops": sorted(stops),
            "eos": sorted(eos),
        }
    }


class PddDraw(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Draw] = {}
        self._config = vllm_config  # (its model's tokenizer and vocabulary: a grammar's, when one comes)

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
            [(d.seen, d.given + d.outputs) if d.params.shapes else None for d in draws],
            [d.stops for d in draws],
            [self._guide(d) for d in draws],
        )
        for i, token in zip(rows, tokens, strict=True):
            logits[i] = float("-inf")
            logits[i, token] = 0.0
        return logits

    def _guide(self, d: _Draw) -> Guide | None:
        """The row's grammar, advanced over the output so far (given tokens included)."""
        if d.params.guide is None:
            return None
        if d.guide is None:
            model = self._config.model_config
            guides = Guides(Path(model.tokenizer) / "tokenizer.json", model.get_vocab_size(), d.eos)
            d.guide = guides.start(*d.params.guide)
        d.guide.advance(d.given + d.outputs)
        return d.guide


def _new_state(params: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> _Draw | None:
    spec = (params.extra_args or {}).get("pdd_draw") if params is not None else None
    if not isinstance(spec, dict):
        return None
    p = msgspec.convert(spec["params"], SamplingParams)
    stops = frozenset(spec["stops"])
    return _Draw(
        p, int(spec["seed"]), int(spec["position"]), spec["seen"], spec["given"], output_ids, stops, spec["eos"]
    )
