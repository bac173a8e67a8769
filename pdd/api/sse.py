"""Streaming responses: OpenAI's server-sent event framing of a generation."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator

from pdd.api.protocol import ApiError
from pdd.api.shaping import Outcome, usage
from pdd.api.tools import Assistant

Piece = tuple[str, list[int], dict | None]  # a text delta, its token ids, their `logprobs` object (where asked)


async def sse_events(
    chat: bool,
    base: dict,
    pieces: AsyncGenerator[tuple[int, Piece], None],
    outs: list[Outcome],
    prompt_len: int,
    include_usage: bool,
    assistants: list[Assistant] | None = None,
) -> AsyncIterator[str]:
    """A generation of one or more choices (`pieces`: each with its choice's index,
    filling `outs`) as OpenAI's server-sent events: one chunk per piece, a choice's record
    on its last, usage if asked, an error as an event (the status is sent already), [DONE].
    `assistants`: a chat's (None: a completion's), one a choice (thinking as
    `reasoning`, as the pinned vLLM names it, tool calls as `tool_calls`, each in its own key of the delta)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    opened: set[int] = set()

    def chunk(i: int, piece: Piece, finish: str | None, extra: dict | None = None) -> str:
        delta, ids, logprobs = piece
        if assistants is not None:  # (a chat's)
            reasoning, content, calls = assistants[i].feed(delta, final=finish is not None, ids=ids)
            said: dict[str, object] = {"content": content}
            if reasoning:
                said["reasoning"] = reasoning
            if calls:
                said["tool_calls"] = [c.openai() for c in calls]
            finish = assistants[i].finish_reason(finish)
            choice = {"index": i, "delta": said, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": i, "text": delta, "logprobs": logprobs, "finish_reason": finish}
        choice["token_ids"] = ids
        extra = dict(extra or {})
        if i not in opened:  # a choice's first chunk: the prompt's logprobs, where asked (vLLM's places)
            opened.add(i)
            if outs[i].prompt_logprobs is not None:
                if chat:
                    extra["prompt_logprobs"] = outs[i].prompt_logprobs
                else:
                    choice["prompt_logprobs"] = outs[i].prompt_logprobs
        return f"data: {json.dumps({**base, 'object': obj, 'choices': [choice], **extra})}\n\n"

    try:
        if chat:
            for i in range(len(outs)):
                opening = {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                yield f"data: {json.dumps({**base, 'object': obj, 'choices': [opening]})}\n\n"
        async for i, piece in pieces:
            out = outs[i]
            if out.finish_reason:
                yield chunk(i, piece, out.finish_reason, {"pdd": out.served()})
            else:
                yield chunk(i, piece, None)
        if include_usage:
            tail = {**base, "object": obj, "choices": [], "usage": usage(prompt_len, *outs), "pdd": outs[0].served()}
            yield f"data: {json.dumps(tail)}\n\n"
    except ApiError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    finally:
        await pieces.aclose()
    yield "data: [DONE]\n\n"
