"""What one engine step costs, from what it computes.

A step of continuous batching computes some new tokens (prefill chunks, extend
tokens, one per decoding sequence) and reads the KV its sequences attend to. Two
models price it: `Physics` for a group of accelerators from their datasheet figures
(`pdd.perf.physics`), and `Fitted` for a machine we measured (`pdd sim calibrate`), a
linear model whose coefficients come from real steps.

Both price a load whose fields may be numpy arrays (`steps_s`): a decode stretch
(`pdd.lab.sim.instance`) prices all its steps in one call, with the very arithmetic a
single step uses, so a stretch and step-by-step simulation agree to the last bit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class StepLoad:
    new_tokens: int  # tokens whose KV this step computes (decode: one per sequence)
    attn_pairs: float  # sum over new tokens of the context each attends to (itself included)
    seqs: int  # sequences in the step
    kv_read_tokens: int  # context tokens whose KV the step reads, over all sequences
    chunks: int = 0  # of `seqs`, those computing more than one token (prefill and extend chunks)
    chunk_pairs: float = 0.0  # of `attn_pairs`, those of the chunks
    # of the chunks' new tokens, those of chunks that end past their sequence's prompt: outputs
    # computed again (a handoff's extend, `chunk_load`), which an emulated chip does not scale
    # as it scales prompts
    output_tokens: int = 0
    output_pairs: float = 0.0  # of `chunk_pairs`, theirs


def chunk_load(start: int, n: int, prompt: int | None = None) -> StepLoad:
    """One sequence computing tokens [start, start + n): prefill, extend or decode. With
    `prompt` (its prompt's length), a chunk that ends past it is an extend of outputs
    (a handoff's, a catch-up's, a fill's): all its tokens are outputs, the prompt's last
    token or two it recomputes too — the engine leaves the last prompt token out of every
    import, a rule of the engine's and no share of the prompt's work (the simulator, which
    imports the whole prompt, never computes it)."""
    pairs = n * start + n * (n + 1) / 2
    if n <= 1:
        return StepLoad(n, pairs, 1, start + n)
    out = n if prompt is not None and start + n > prompt else 0
    return StepLoad(n, pairs, 1, start + n, 1, pairs, out, pairs if out else 0.0)


def add(a: StepLoad, b: StepLoad) -> StepLoad:
    return StepLoad(
        a.new_tokens + b.new_tokens,
        a.attn_pairs + b.attn_pairs,
        a.seqs + b.seqs,
        a.kv_read_tokens + b.kv_read_tokens,
        a.chunks + b.chunks,
        a.chunk_pairs + b.chunk_pairs,
        a.output_tokens + b.output_tokens,
        a.output_pairs + b.output_pairs,
    )


EMPTY = StepLoad(0, 0.0, 0, 0)


def decode_stretch(contexts_sum: int, seqs: int, steps: int) -> StepLoad:
    """The loads of `steps` consecutive decode steps of `seqs` sequences whose contexts
    add up to `contexts_sum` before the first: step j reads (and attends to) every
    context plus j + 1 tokens per sequence. Fields are arrays over j."""
    j = np.arange(steps, dtype=np.int64)
    kv = contexts_sum + seqs * (j + 1)
    # a stretch's fields are arrays over its steps; the step models compute on either
    fields: list[Any] = [
        np.full(steps, seqs),
        kv.astype(float),
        np.full(steps, seqs),
        kv,
        np.zeros(steps, dtype=np.int64),
        np.zeros(steps),
    ]
    return StepLoad(*fields)


class StepModel(Protocol):
    """Seconds steps of an instance take."""

    def step_s(self, load: StepLoad) -> float: ...

    def steps_s(self, load: StepLoad) -> np.ndarray: ...

    def decode_s(self, contexts_sum: int, seqs: int, steps: int) -> np.ndarray:
        """`steps_s(decode_stretch(contexts_sum, seqs, steps))`: a decode stretch's steps."""
        ...


@dataclass(frozen=True)
class Fitted:
    """t = base + new_tokens*per_token + attn_pairs*per_pair + seqs*per_seq + kv_read*per_kv_token,
    least-squares fitted to steps of a real engine."""

    base_s: float
    per_token_s: float
    per_pair_s: float
    per_seq_s: float
    per_kv_token_s: float
    source: str = ""

    def steps_s(self, load: StepLoad) -> np.ndarray:
        return np.asarray(
            self.base_s
            + load.new_tokens * self.per_token_s
            + load.attn_pairs * self.per_pair_s
            + load.seqs * self.per_seq_s
            + load.kv_read_tokens * self.per_kv_token_s,
            dtype=float,
        )

    def step_s(self, load: StepLoad) -> float:
        return float(self.steps_s(load))

    def decode_s(self, contexts_sum: int, seqs: int, steps: int) -> np.ndarray:
        return self.steps_s(decode_stretch(contexts_sum, seqs, steps))

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)
