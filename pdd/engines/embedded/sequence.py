"""A request's state inside one engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdd.batching import Status
from pdd.kv.blocks import PrefixHashes
from pdd.kv.radix_cache import TreeNode
from pdd.sampling.params import Logprob, SamplingParams

if TYPE_CHECKING:
    import torch

    from pdd.kv.layer_stream import LayerStream
    from pdd.sampling.guide import Guide


@dataclass(eq=False)
class Sequence:
    rid: str
    tokens: list[int]  # prompt followed by output
    prompt_len: int
    params: SamplingParams
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose KV is in `pages`
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_node: TreeNode | None = None  # locked path in the radix cache
    finish_reason: str | None = None
    hold: bool = False  # keep pages after finishing (prefill side exports them)
    want_logits: bool = False  # keep the logits of every computed position of the next step
    step_logits: torch.Tensor | None = None
    seed: int = 0  # with position, picks each sampled token (see pdd.sampling)
    # Catch-up handoff: compute given tokens without sampling, at most step_cap (0: no
    # cap) per step, then wait (RESERVED) for more.
    shadow: bool = False
    step_cap: int = 0
    guide: Guide | None = None  # the request's grammar, advanced over its output (`params.guide`)
    published: bool = False  # its prompt's full pages are in the prefix cache (`Engine._publish`)
    # each prompt token's log-probabilities by position, where asked (`params.prompt_logprobs`)
    prompt_logprobs: list[Logprob | None] = field(default_factory=list)
    # KV copies claimed and not yet done (`pdd.engines.embedded.copies`): a start waits for them
    copies: int = 0
    prompt_hashes: PrefixHashes | None = None  # its prompt's, kept as its imports are checked
    copied_end: int = 0  # an import's tokens in place so far (what counts if it is cancelled)
    copy_cancelled: bool = False
    start_deferred: bool = False  # started while its import was being copied: scheduled when it lands
    stream: LayerStream | None = None  # where its prompt's KV goes, layer by layer, as computed (P)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_pending(self) -> int:
        """Tokens whose KV still has to be computed."""
        return len(self.tokens) - self.num_computed
