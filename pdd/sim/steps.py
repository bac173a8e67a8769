"""What one engine step costs, from what it computes.

A step of continuous batching computes some new tokens (prefill chunks, extend
tokens, one per decoding sequence) and reads the KV its sequences attend to. Two
models price it: `Roofline` for a GPU group from its catalog figures (compute time
against memory time, whichever is longer), and `Fitted` for a machine we measured
(`pdd sim calibrate`), a linear model whose coefficients come from real steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

from pdd.sim.hardware import Hardware
from pdd.sim.model import ModelSpec


@dataclass(frozen=True)
class StepLoad:
    new_tokens: int  # tokens whose KV this step computes (decode: one per sequence)
    attn_pairs: float  # sum over new tokens of the context each attends to (itself included)
    seqs: int  # sequences in the step
    kv_read_tokens: int  # context tokens whose KV the step reads, over all sequences


def chunk_load(start: int, n: int) -> StepLoad:
    """One sequence computing tokens [start, start + n): prefill, extend or decode."""
    return StepLoad(n, n * start + n * (n + 1) / 2, 1, start + n)


def add(a: StepLoad, b: StepLoad) -> StepLoad:
    return StepLoad(a.new_tokens + b.new_tokens, a.attn_pairs + b.attn_pairs, a.seqs + b.seqs,
                    a.kv_read_tokens + b.kv_read_tokens)


EMPTY = StepLoad(0, 0.0, 0, 0)


class StepModel(Protocol):
    """Seconds one step of an instance takes."""

    def step_s(self, load: StepLoad) -> float: ...


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

    def step_s(self, load: StepLoad) -> float:
        return (self.base_s + load.new_tokens * self.per_token_s + load.attn_pairs * self.per_pair_s
                + load.seqs * self.per_seq_s + load.kv_read_tokens * self.per_kv_token_s)

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)


@dataclass(frozen=True)
class Roofline:
    """A model served by `gpus` devices of one kind (tensor/expert parallel): a step
    takes the longer of its arithmetic at `mfu` of peak and its memory traffic (the
    active weights once, plus the KV it reads and writes) at `mbu` of peak bandwidth,
    plus a fixed launch and communication overhead."""

    hw: Hardware
    model: ModelSpec
    gpus: int
    mfu: float = 0.5
    mbu: float = 0.7
    overhead_s: float = 0.004

    def step_s(self, load: StepLoad) -> float:
        if load.seqs == 0:
            return 0.0
        m = self.model
        flops = 2.0 * m.active_params * load.new_tokens + m.attn_flops_per_pair * load.attn_pairs
        traffic = m.active_weight_bytes + m.kv_bytes_per_token * (load.kv_read_tokens + load.new_tokens)
        compute = flops / (self.gpus * self.hw.tflops * 1e12 * self.mfu)
        memory = traffic / (self.gpus * self.hw.mem_bw_gbs * 1e9 * self.mbu)
        return max(compute, memory) + self.overhead_s
