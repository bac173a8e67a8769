"""One request on vLLM, as the engine port sees it: what was asked, what it produced,
and how its outputs reach the role that watches it.

A request pdd starts from its prompt (`generate`) is a plain vLLM request. A request
whose KV is imported (`reserve`, then `start`) is a vLLM streaming-input session
(vLLM's resumable requests): the prompt goes in first, as the reservation (its KV
loaded asynchronously into the blocks vLLM allocated), and every later `start` adds
tokens to the same request, whose blocks, KV and prefix-cache entries it keeps. So a
handoff is a continuation: the relay's tokens are a new input chunk, and vLLM
computes exactly those tokens (the extend), never the prompt again. A catch-up chunk
is computed the same way, in the shadow. The rules vLLM imposes on such chunks:

* a chunk samples at least one token before the next chunk is taken; in the shadow
  pdd asks for one and drops it (vLLM drops a chunk's last sampled token itself when
  the next chunk comes, as it was never computed);
* a chunk must bring at least one token to compute, so a shadow chunk holds back its
  last token for the next chunk (the final chunk, after a catch-up that computed
  everything, still has one token to compute and so a position to sample from);
* one of vLLM's outputs may cover several chunks (vLLM merges the outputs its reader has
  not taken yet), so a chunk computed for its KV ends with its one token, not with a
  finish reason (`_end_kv_chunks`);
* the prompt's last token is recomputed once, when the load completes: vLLM never
  schedules a request with nothing to compute (`Scheduler._update_waiting_for_remote_kv`
  sets `num_computed_tokens = num_tokens - 1` for a fully loaded prompt). It is the
  only recomputed token of an imported prompt.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pdd.engines.port import StepOutput
from pdd.engines.vllm.draw import draw_args
from pdd.kv.blocks import PrefixHashes
from pdd.kv.layer_stream import LayerStream
from pdd.sampling.params import Logprob, SamplingParams

log = logging.getLogger(__name__)
LOAD, SHADOW, FINAL = "load", "shadow", "final"  # what a session's input chunk is for
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
UNCACHED_SALT = "pdd-uncached:"  # an import that reuses nothing: its blocks are hashed apart from everyone's


class Watch:
    """A request's outputs, in order, on the loop that watches it."""

    def __init__(self, on_close: Callable[[], None]) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self._on_close = on_close

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    def close(self) -> None:
        self._on_close()


@dataclass(eq=False)
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    session: bool
    hold: bool = False
    outputs: list[int] = field(default_factory=list)  # output tokens by position: given or produced
    pending: list[int] = field(default_factory=list)  # given, not yet sent to vLLM (a shadow chunk's last)
    chunks: deque[tuple[str, int]] = field(default_factory=deque)  # sent chunks not yet done: (kind, outputs held)
    inputs: asyncio.Queue = field(default_factory=asyncio.Queue)  # a session's next input chunks (None ends it)
    watchers: list[Watch] = field(default_factory=list)
    hit: int = 0  # prompt tokens vLLM held at admission (the reservation's local hit)
    blocks: list[int] = field(default_factory=list)  # the reservation's (or a hold's) block ids
    imported: int = 0  # prompt tokens whose KV is in or on its way in (from the hit on)
    prompt_hashes: PrefixHashes | None = None  # its prompt's, kept as its imports are checked
    writes: list[asyncio.Future] = field(default_factory=list)  # imports being written
    loaded: bool = False  # the scheduler was told the KV is complete
    producing: bool = False  # a final chunk was sent: outputs are streamed
    reserved: asyncio.Future | None = None
    held: asyncio.Future | None = None  # (blocks, computed tokens) once a hold's request finished
    task: asyncio.Task | None = None
    ended: bool = False
    stream: LayerStream | None = None  # a prefill P streams: its layers go there as computed (`layer_reads`)
    stream_reads: list[asyncio.Future] = field(default_factory=list)  # its layers' reads, in order
    streamed: dict[int, int] = field(default_factory=dict)  # layer -> the prompt token its reads reach
    stream_whole: asyncio.Event = field(default_factory=asyncio.Event)  # every layer of the prompt is there

    def emit(self, out: StepOutput | BaseException) -> None:
        for w in self.watchers:
            w.queue.put_nowait(out)


def seed_of(params: SamplingParams) -> int:
    return params.seed if params.seed is not None else secrets.randbits(63)


def vllm_params(
    params: SamplingParams,
    seed: int,
    prompt: list[int],
    outputs: list[int],
    max_tokens: int,
    eos_ids: frozenset[int],
    extra: dict[str, Any] | None = None,
) -> Any:
    """vLLM's sampling parameters for `max_tokens` positions after `outputs` (the output
    tokens before, given): greedy in vLLM, pdd's own draw and shaping
    (`pdd.engines.vllm.draw`) for anything else."""
    from vllm import SamplingParams as VllmParams
    from vllm.sampling_params import RequestOutputKind

    args = dict(extra or {})
    stops = frozenset(params.stop_token_ids) | eos_ids
    if not params.greedy or params.shapes or params.guide:
        args.update(draw_args(params, seed, prompt, outputs, stops, eos_ids))
    return VllmParams(
        max_tokens=max_tokens,
        temperature=0.0,
        # vLLM's raw log-probabilities (its default logprobs_mode): before its processors, pdd's draw included
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,  # (vLLM then computes the whole prompt: no prefix cache)
        ignore_eos=params.ignore_eos,
        stop_token_ids=[] if params.ignore_eos else sorted(stops),
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
        extra_args=args or None,
    )


def chunk_params(extra: dict[str, Any] | None = None, logprobs: int | None = None) -> Any:
    """A chunk computed only for its KV: one greedy token, dropped. `logprobs`: the
    request's, on every chunk of its session (vLLM sizes a session's logprobs by its first
    chunk's parameters, and fails a later chunk that asks for more)."""
    from vllm import SamplingParams as VllmParams
    from vllm.sampling_params import RequestOutputKind

    return VllmParams(
        max_tokens=1,
        temperature=0.0,
        ignore_eos=True,
        logprobs=logprobs,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
        extra_args=extra,
    )


async def chunk_stream(req: Request) -> AsyncIterator[Any]:
    """The session's input chunks, as vLLM reads them, until pdd ends it."""
    while True:
        item = await req.inputs.get()
        if item is None:
            return
        yield item


def deliver(req: Request, out: Any) -> bool:
    """One of vLLM's outputs for `req`: emit what pdd's watchers must see. True once
    the request is done here (finished, or its session's final chunk finished)."""
    c = out.outputs[0]
    tokens, reason = list(c.token_ids), c.finish_reason
    if reason is not None and reason not in FINISH_REASONS:
        log.warning("vLLM ended request %s: %s (%s)", req.rid, reason, c.stop_reason)
        req.emit(RuntimeError(f"vLLM ended request {req.rid}: {reason}"))
        return True
    logprobs = list(c.logprobs or [])  # (a KV chunk's token asked for none: these are the final chunk's)
    if req.session and _end_kv_chunks(req, tokens, reason):
        return False
    # the tail that is the tokens left (a merged output's KV chunk asked for none)
    logprobs = ([None] * len(tokens) + logprobs)[len(logprobs) :] if logprobs else []
    cached = req.hit if req.session else (out.num_cached_tokens or 0)
    for i, token in enumerate(tokens):
        req.outputs.append(token)
        last = FINISH_REASONS.get(reason) if i == len(tokens) - 1 else None
        lp = _logprob(token, logprobs[i], req.params.logprobs or 0) if logprobs and logprobs[i] else None
        position = len(req.outputs) - 1
        prompt_lps = _prompt_logprobs(req, out.prompt_logprobs) if position == 0 else None
        req.emit(StepOutput(req.rid, token, last, cached, position, logprob=lp, prompt_logprobs=prompt_lps))
    if reason is not None and not tokens:
        req.emit(StepOutput(req.rid, None, FINISH_REASONS[reason], cached))
    return reason is not None


def _prompt_logprobs(req: Request, entries: list[dict[int, Any] | None] | None) -> list[Logprob | None] | None:
    """pdd's form of vLLM's prompt logprobs (the first position's None), where asked."""
    if req.params.prompt_logprobs is None or entries is None:
        return None
    top = req.params.prompt_logprobs
    return [None if e is None else _logprob(t, e, top) for t, e in zip(req.prompt, entries, strict=True)]


def _logprob(token: int, entry: dict[int, Any], top: int) -> Logprob:
    """pdd's form of vLLM's logprobs of one position ({token: Logprob(logprob, rank)}):
    the chosen token's, and the `top` likeliest by rank."""
    ranked = sorted((v.rank, t, v.logprob) for t, v in entry.items() if v.rank is not None and v.rank <= top)
    return (entry[token].logprob, tuple((t, lp) for _, t, lp in ranked))


def _end_kv_chunks(req: Request, tokens: list[int], reason: str | None) -> bool:
    """End the chunks computed only for their KV that this output covers, taking their
    dropped tokens off `tokens` (in place); True when nothing of it is left to emit.

    One output can cover several chunks: vLLM's `RequestOutputCollector` merges DELTA
    outputs its consumer has not read yet (`RequestOutput.add(aggregate=True)`), across a
    streaming session's chunks too, keeping only the last finish reason. So the load
    chunk's token and finish can arrive glued to the final chunk's first tokens, when
    the final chunk was queued behind the load (vLLM's `Scheduler._handle_stopped_request`
    starts it in the next step) and this loop was busy for a step. Read by finish
    reason, that output ended the load chunk and dropped the final chunk's tokens; the
    final chunk then waited for outputs that had come already, and its request sat
    finished in vLLM (WAITING_FOR_STREAMING_REQ), its session never ended. A chunk computed
    for its KV samples exactly one token (`chunk_params`), so here each such chunk ends
    with its first token, whatever the output's finish reason says."""
    spent = False  # the output's finish reason was a KV chunk's: nothing is left to emit
    while req.chunks and req.chunks[0][0] != FINAL:
        if tokens:
            del tokens[0]
            spent = not tokens
        elif reason is not None and not spent:  # ended without its token (vLLM aborted it)
            spent = True
        else:
            break
        kind, held = req.chunks.popleft()
        if kind == SHADOW:
            req.emit(StepOutput(req.rid, None, None, caught_up=held))
    return spent
