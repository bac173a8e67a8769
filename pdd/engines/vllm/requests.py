"""The request side of `VllmEngine`: generate, reserve, start, cut, release, abort.

Every request is a task that reads vLLM's output stream and emits pdd's step outputs
to whoever watches it (`streams`). The scheduler side of the connector answers
reservations and holds over the bridge (`on_scheduler`, on a bridge thread); those
answers land on the loop that asked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from pdd.engines.port import RequestError, StepOutput
from pdd.engines.vllm import streams
from pdd.engines.vllm.events import SALT_PREFIX
from pdd.engines.vllm.layer_reads import LayerReads
from pdd.engines.vllm.streams import FINAL, LOAD, SHADOW, Request, Watch
from pdd.kv.layer_stream import LayerStream
from pdd.kv.pages import OutOfPages
from pdd.sampling.params import SamplingParams

log = logging.getLogger(__name__)


class Requests:
    # the engine's (`VllmEngine`): vLLM itself, the bridge to its scheduler side, the counters
    llm: Any
    counters: dict[str, int]
    tell_scheduler: Callable[[str, str], None]
    record_finished: Callable[[str, int], None]

    def __init__(self, eos_ids: frozenset[int], vocab_size: int, max_context: int) -> None:
        self.eos_ids, self.vocab_size, self.limit = eos_ids, vocab_size, max_context
        self.reqs: dict[str, Request] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        """The loop requests run on (set by the first request: nothing is held before one)."""
        if self.loop is None:
            raise RuntimeError("no request has run on this engine yet")
        return self.loop

    # ---- checks ----------------------------------------------------------------------
    def _new(self, rid: str, prompt: list[int], params: SamplingParams, session: bool, hold: bool = False) -> Request:
        if rid in self.reqs:
            raise RequestError(f"request id {rid!r} is already active")
        if not prompt:
            raise RequestError("prompt must contain at least one token")
        self._check_tokens(prompt)
        if any(t >= self.vocab_size for t, _ in params.logit_bias):
            raise RequestError(f"logit_bias names a token id beyond the vocabulary of {self.vocab_size}")
        if len(prompt) + params.max_tokens > self.limit:
            raise RequestError(
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds the context "
                f"window of {self.limit} tokens"
            )
        self.loop = asyncio.get_running_loop()
        req = self.reqs[rid] = Request(rid, list(prompt), params, streams.seed_of(params), session, hold)
        return req

    def _check_tokens(self, tokens: list[int]) -> None:
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in tokens):
            raise RequestError(f"token ids must be integers in [0, {self.vocab_size})")

    def reservation(self, rid: str) -> Request:
        req = self.reqs.get(rid)
        if req is None or not req.session or req.reserved is None:
            raise RequestError(f"request {rid!r} is not reserved for import")
        return req

    # ---- plain requests ----------------------------------------------------------------
    def watch(self, rid: str) -> Watch:
        req = self.reqs.get(rid)
        w = Watch(lambda: req.watchers.remove(w) if req is not None and w in req.watchers else None)
        if req is not None:
            req.watchers.append(w)
        return w

    async def generate(
        self, rid: str, prompt: list[int], params: SamplingParams, hold: bool = False, stream: LayerStream | None = None
    ):
        """With `stream`, the prompt's layers are read as vLLM computes them (`layer_reads`)."""
        req = self._new(rid, prompt, params, session=False, hold=hold)
        req.stream = stream
        w = Watch(lambda: None)
        req.watchers.append(w)
        if hold:
            req.held = self._loop.create_future()
        sp = streams.vllm_params(
            params,
            req.seed,
            prompt,
            [],
            params.max_tokens,
            self.eos_ids,
            {"kv_transfer_params": {"pdd": {"rid": rid, "hold": hold, "stream": stream is not None}}},
        )
        inputs: dict[str, Any] = {"prompt_token_ids": prompt, **salted(params)}
        req.task = asyncio.ensure_future(self._consume(req, self.llm.generate(inputs, sp, rid)))  # type: ignore[arg-type]
        done = False
        try:
            async for out in w:
                if out.finish_reason is not None:
                    await LayerReads.whole(req)
                yield out
                done = out.finish_reason is not None
        finally:
            if not done:
                self.abort(rid)

    async def _consume(self, req: Request, outputs: Any) -> None:
        try:
            async for out in outputs:
                if not req.ended and streams.deliver(req, out):
                    self._ended(req)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # vLLM failed the request (or died): whoever waits on it hears it
            log.warning("vLLM request %s failed: %s", req.rid, e)
            error = RequestError(str(e)) if "Validation" in type(e).__name__ else RuntimeError(f"engine failure: {e}")
            for fut in (req.reserved, req.held):
                if fut is not None and not fut.done():
                    fut.set_exception(error)
            req.emit(error)
            self._ended(req)

    def _ended(self, req: Request) -> None:
        """Its last output is out: a session ends (its KV goes to vLLM's prefix cache); a
        hold stays until released; anything else is forgotten."""
        req.ended = True
        if req.session:
            req.inputs.put_nowait(None)
        if not req.hold:
            self._forget(req)

    # ---- imported requests -------------------------------------------------------------
    async def reserve(self, rid: str, prompt: list[int], params: SamplingParams, use_cache: bool = True) -> int:
        from vllm.engine.protocol import StreamingInput

        req = self._new(rid, prompt, params, session=True)
        req.reserved = self._loop.create_future()
        extra = {"kv_transfer_params": {"pdd": {"rid": rid, "op": "import"}}}
        first: dict[str, Any] = {"prompt_token_ids": list(prompt), **salted(params)}
        if not use_cache:
            # vLLM's own switch (skip_reading_prefix_cache) turns the connector's load off
            # too; a salt of the request's own makes vLLM's hashes match nothing cached
            first["cache_salt"] = f"{streams.UNCACHED_SALT}{rid}"
        lps = params.logprobs
        req.inputs.put_nowait(StreamingInput(first, streams.chunk_params(extra, lps)))  # type: ignore[arg-type]
        req.chunks.append((LOAD, 0))
        req.task = asyncio.ensure_future(
            self._consume(req, self.llm.generate(streams.chunk_stream(req), streams.chunk_params(None, lps), rid))
        )
        try:
            req.hit = await req.reserved
        except BaseException:
            self.abort(rid)
            raise
        req.imported = req.hit
        return req.hit

    async def start(self, rid: str, tokens: list[int], shadow: bool = False, step_cap: int = 0) -> int:
        """(vLLM computes a chunk in one step: `step_cap` is honoured by the relay's chunk size.)"""
        from vllm.engine.protocol import StreamingInput

        req = self.reqs.get(rid)
        if req is None or not req.session or req.producing or req.ended or req.reserved is None:
            raise RequestError(f"request {rid!r} is not reserved")
        await req.reserved
        self._check_tokens(tokens)
        if len(req.outputs) + len(tokens) > req.params.max_tokens:
            raise RequestError(
                f"{len(req.outputs) + len(tokens)} output tokens exceed max_tokens {req.params.max_tokens}"
            )
        if not req.loaded:
            await asyncio.gather(*req.writes)  # (an import that failed fails this too)
            if req.imported < len(req.prompt) - 1:
                raise RequestError(
                    f"imported KV ends at {req.imported}: vLLM needs the prompt's KV up to its last "
                    f"token ({len(req.prompt)})"
                )
            await asyncio.to_thread(self.tell_scheduler, "loaded", rid)
            req.loaded = True
        req.outputs.extend(tokens)
        send = req.pending + list(tokens)
        if shadow:
            send, req.pending = send[:-1], send[-1:]
            if not send:  # nothing to compute yet: caught up at once
                req.emit(StepOutput(rid, None, None, caught_up=len(req.outputs)))
                return req.hit
            chunk = StreamingInput(
                {"prompt_token_ids": send},  # type: ignore[arg-type]
                streams.chunk_params(None, req.params.logprobs),
            )
            req.chunks.append((SHADOW, len(req.outputs)))
        else:
            left = req.params.max_tokens - len(req.outputs)
            if not send or left < 1:
                raise RequestError("nothing left to compute: a continuation needs a token and a position to sample")
            req.pending = []
            chunk = StreamingInput(
                {"prompt_token_ids": send},  # type: ignore[arg-type]
                streams.vllm_params(req.params, req.seed, req.prompt, req.outputs, left, self.eos_ids),
            )
            req.chunks.append((FINAL, len(req.outputs)))
            req.producing = True
        req.inputs.put_nowait(chunk)
        return req.hit

    async def cut(self, rid: str) -> list[int]:
        req = self.reqs.get(rid)
        if req is None or req.ended:
            raise RequestError(f"request {rid!r} is not active")
        output = list(req.outputs)
        self.abort(rid)
        return output

    async def release(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None:
            return
        if req.hold and req.ended:
            await asyncio.to_thread(self.tell_scheduler, "free", rid)
            self._forget(req)
        else:
            self.abort(rid)

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None:
            return
        was_running = not req.ended
        self._forget(req)
        if req.task is not None:
            req.task.cancel()  # vLLM's generate aborts the request as it is cancelled
        if req.hold and req.ended:  # finished and held: nothing runs, the hold must go
            self._loop.create_task(asyncio.to_thread(self.tell_scheduler, "free", rid))
        self.counters["aborted"] += was_running
        req.emit(StepOutput(rid, None, "abort"))

    def _forget(self, req: Request) -> None:
        if self.reqs.get(req.rid) is req:
            del self.reqs[req.rid]

    # ---- the scheduler side's answers (a bridge thread) ----------------------------------
    def on_scheduler(self, header: dict[str, Any]) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._answer, header)

    def _answer(self, header: dict[str, Any]) -> None:
        op, req = header["op"], self.reqs.get(header["rid"])
        if op == "finished":
            self.record_finished(header["rid"], header["computed"])
        if req is None:
            if op == "finished" and header.get("held") is not None:  # released before it was held
                self._loop.create_task(asyncio.to_thread(self.tell_scheduler, "free", header["rid"]))
            return
        if op == "reserved" and req.reserved is not None and not req.reserved.done():
            req.blocks = header["blocks"]
            req.reserved.set_result(header["hit"])
        elif op == "refused" and req.reserved is not None and not req.reserved.done():
            req.reserved.set_exception(OutOfPages(f"reservation needs {header['need']} blocks, {header['free']} free"))
        elif op == "finished" and req.held is not None and not req.held.done():
            if header.get("held") is None:
                req.held.set_exception(RequestError(f"request {req.rid!r} ended without its KV held"))
            else:
                req.held.set_result((header["held"], header["tokens"]))


def salted(params: SamplingParams) -> dict[str, str]:
    """The request's cache_salt as vLLM takes it (vLLM hashes it into the first block)."""
    return {"cache_salt": SALT_PREFIX + params.cache_salt} if params.cache_salt else {}
