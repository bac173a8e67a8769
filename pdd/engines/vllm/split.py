"""Which tokens of a request a rank's cache holds under vLLM's decode context parallelism.

With `decode_context_parallel_size` D > 1 (DCP: an MLA model's latent cache split
across the tensor-parallel ranks by token instead of copied whole onto each), vLLM's
scheduler counts blocks of B * D tokens (B: `cache_config.block_size`, each rank's own
block) and every rank keeps, in its block of the same id, the tokens that fall to it.
vLLM's rule (`vllm.v1.worker.block_table.ComputeSlotMappingKernel`, with I =
`cp_kv_cache_interleave_size`, which divides B): a position p of the request, at
offset o = p mod (B * D) of its scheduler block, belongs to DCP rank (o // I) mod D,
which stores it at offset (o // (D * I)) * I + o mod I of its own block. I = 1 deals
tokens round-robin; I = B gives each rank whole blocks in turn.

An export gathers each rank's tokens back in token order; an import scatters a blob's
tokens to the ranks that hold them (`kvio`), and each worker reads and writes only its
own (`copier`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenSplit:
    """One rank's share of the tokens: DCP rank `rank` of `world`, `interleave` tokens at a time."""

    rank: int = 0
    world: int = 1
    interleave: int = 1

    def owned(self, positions: torch.Tensor) -> torch.Tensor:
        """Which of `positions` (a request's token positions, or positions counted from
        the start of one of its scheduler blocks) this rank holds: a bool mask."""
        return (positions // self.interleave) % self.world == self.rank

    def positions(self, start: int, end: int) -> torch.Tensor:
        """The positions in [start, end) this rank holds, in token order."""
        span = torch.arange(start, end, dtype=torch.long)
        return span[self.owned(span)] if self.world > 1 else span

    def index(self, start: int, end: int, origin: int) -> slice | torch.Tensor:
        """Where this rank's positions in [start, end) sit in a tensor of tokens from
        `origin` on (a slice when it holds them all: a plain copy)."""
        if self.world == 1:
            return slice(start - origin, end - origin)
        return self.positions(start, end) - origin

    def slots(self, blocks: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """Where this rank's cache holds its `positions` (counted from the first of the
        scheduler's `blocks`, which span `block_size * world` tokens each): rank-local
        slots of `block_size`-token blocks."""
        span = block_size * self.world
        offsets = positions % span
        local = (offsets // (self.world * self.interleave)) * self.interleave + offsets % self.interleave
        return blocks[positions // span] * block_size + local
