"""The choices of one request: their parameters, their pieces merged as they come, and
the whole (non-streamed) answer they add up to."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from fastapi import Request
from msgspec.structs import replace  # sampling params are a msgspec struct

from pdd.api.logprobs import LogprobFormatter
from pdd.api.shaping import Outcome, usage
from pdd.api.sse import Piece
from pdd.api.tools import Assistant
from pdd.sampling.params import SamplingParams

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


def whole_body(
    base: dict, outs: list[Outcome], prompt_len: int, logprobs: bool, assistants: list[Assistant] | None
) -> dict:
    """A finished request's response: a completion's, or with `assistants` (one a choice,
    each reading its text into thinking, content and calls) a chat completion's."""
    chat = assistants is not None
    choices = []
    for i, out in enumerate(outs):
        text = "".join(out.text)
        merged_lp = LogprobFormatter.merge(out.logprobs, chat) if logprobs else None
        choice: dict[str, object] = {"index": i, "finish_reason": out.finish_reason, "logprobs": merged_lp}
        if assistants is not None:
            assistant = assistants[i]
            assistant.feed(text, final=True, ids=out.token_ids)
            choice["message"] = assistant.message()
            choice["finish_reason"] = assistant.finish_reason(out.finish_reason)
        else:
            choice["text"] = text
        choice["token_ids"] = out.token_ids
        if out.prompt_logprobs is not None and not chat:
            choice["prompt_logprobs"] = out.prompt_logprobs
        if len(outs) > 1:
            choice["pdd"] = out.served()
        choices.append(choice)
    body = {
        **base,
        "object": "chat.completion" if chat else "text_completion",
        "choices": choices,
        "usage": usage(prompt_len, *outs),
        "pdd": outs[0].served(),
    }
    if chat and outs[0].prompt_logprobs is not None:  # (vLLM's place for a chat's)
        body["prompt_logprobs"] = outs[0].prompt_logprobs
    return body


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s parameters (of `n`): seed + index, as vLLM seeds its parallel
    samples, so each choice equals a single request with its seed."""
    return params if params.seed is None or not index else replace(params, seed=params.seed + index)


def countdown(n: int, then: Callable[[], None]) -> Callable[[], None]:
    """A callable that runs `then` at its n-th call."""
    left = [n]

    def tick() -> None:
        left[0] -= 1
        if not left[0]:
            then()

    return tick


async def merged(gens: list[AsyncGenerator[Piece, None]]) -> AsyncGenerator[tuple[int, Piece], None]:
    """The choices' pieces as they come, each with its choice's index; every generator
    closed on the way out (an error in one ends them all)."""
    nexts = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(gens)}
    try:
        while nexts:
            done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=nexts.__getitem__):
                i = nexts.pop(fut)
                try:
                    piece = fut.result()
                except StopAsyncIteration:
                    continue
                nexts[asyncio.ensure_future(anext(gens[i]))] = i
                yield i, piece
    finally:
        for fut in nexts:
            fut.cancel()
        await asyncio.gather(*nexts, return_exceptions=True)
        for g in gens:
            await g.aclose()


async def collect(pieces: AsyncIterator[object], client: Request) -> bool:
    """Run a non-streamed generation to its end; False (and aborted) if the client left."""

    async def drain() -> None:
        async for _ in pieces:
            pass

    task = asyncio.ensure_future(drain())
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            task.result()  # re-raises an ApiError from the generation
            return True
        if await client.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return False
