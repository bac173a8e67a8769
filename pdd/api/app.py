"""The OpenAI-compatible HTTP front end, shared by `pdd serve` and `pdd router`.

It owns everything about the API — validation, tokenization, chat templates, stop
strings, SSE framing, usage, metrics — and nothing about where tokens come from: that
is the `Backend`. Every failure leaves as OpenAI's error JSON with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdd.api.backend import Backend, BackendError, GenRequest
from pdd.api.admission import AdmissionGate, Slot
from pdd.api.auth import RequireApiKey
from pdd.api.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
from pdd.api.metrics import ServingMetrics
from pdd.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest, _Common
from pdd.api.text import TextStream
from pdd.model.tokenizer import Tokenizer
from pdd.policy.admission import Limits
from pdd.record import RequestRecord
from pdd.sampling import SamplingParams

log = logging.getLogger(__name__)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 1024
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


@dataclass
class _Outcome:
    """What a finished generation adds up to (filled while streaming)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    record: RequestRecord | None = None

    def served(self) -> dict:
        """The `pdd` object of the response: where the request ran."""
        return self.record.served() if self.record else {}


class OpenAIServer:
    def __init__(self, backend: Backend, tokenizer: Tokenizer, model_name: str, registry: CollectorRegistry | None,
                 admission: Limits) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = ServingMetrics(backend.load, registry)
        self.gate = AdmissionGate(admission, self.metrics.registry)
        self.created = int(time.time())

    # ---- request -> (prompt ids, sampling params) ------------------------------------------
    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found")

    def _params(self, req: _Common, prompt_len: int, max_tokens: int | None, default_max: int) -> SamplingParams:
        if req.n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        if req.logprobs not in (None, False, 0):
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        limit = self.backend.max_context
        if prompt_len == 0:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if prompt_len >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens; the prompt has {prompt_len} tokens.",
                           param="prompt", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default_max, limit - prompt_len)
        if max_tokens < 1:
            raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
        if prompt_len + max_tokens > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion).",
                           param="max_tokens", code="context_length_exceeded")
        try:  # a JSON integer can be too large for any float (10**400): a client error, not a 500
            temperature, top_p = float(req.temperature), float(req.top_p)
        except OverflowError:
            raise ApiError(400, "temperature and top_p must be finite numbers") from None
        if not (0 <= temperature and math.isfinite(temperature)):  # as vLLM: no upper bound
            raise ApiError(400, "temperature must be a finite number >= 0", param="temperature")
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                    top_k=req.top_k, seed=req.seed, ignore_eos=req.ignore_eos,
                                    stop_token_ids=tuple(req.stop_token_ids))
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        if params.seed is None and not params.greedy:
            # Chosen here, once: every instance that samples a position of this request
            # (prefill, relay, main decode) then draws from the same seed.
            params = replace(params, seed=secrets.randbits(63))
        return params

    async def _prompt_ids(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, "batched prompts are not supported; send one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self._encode(_unicode(prompt, "prompt"), add_special_tokens=True)
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)

    # ---- generation ------------------------------------------------------------------------
    async def _run(self, rid: str, prompt: list[int], params: SamplingParams, stop: list[str], out: _Outcome,
                   slot: Slot) -> AsyncIterator[tuple[str, list[int]]]:
        """Yield (text delta, token ids) pieces; fill `out`; close the backend stream and
        give the admission slot back on exit."""
        text = TextStream(self.tokenizer, stop)
        gen = self.backend.generate(GenRequest(rid, prompt, params))
        t0, first, last = time.monotonic(), None, None
        self.metrics.prompt_tokens.inc(len(prompt))
        try:
            async for ev in gen:
                now = time.monotonic()
                if first is None and ev.tokens:
                    first = now
                    self.metrics.ttft.observe(now - t0)
                last = now
                out.cached_tokens = ev.cached_tokens
                delta = "".join(text.feed(t) for t in ev.tokens)
                out.token_ids.extend(ev.tokens)
                if ev.record:
                    out.record = ev.record
                if text.stopped:
                    out.finish_reason = "stop"
                elif ev.finish_reason:
                    out.finish_reason = ev.finish_reason
                    delta += text.flush()
                out.text.append(delta)
                yield delta, ev.tokens
                if out.finish_reason:
                    break
        except BackendError as e:
            self.metrics.requests.labels("error").inc()
            retry = {"Retry-After": str(self.gate.retry_after())}
            if e.status == 429:  # an instance was full: the client may come back
                raise ApiError(429, str(e), "rate_limit_exceeded", code="overloaded", headers=retry) from None
            # 503: no instance can serve it now (one is down or leaving): come back later
            raise ApiError(e.status, f"generation failed: {e}", "server_error",
                           headers=retry if e.status == 503 else None) from None
        finally:
            slot.release()
            await gen.aclose()
        n = len(out.token_ids)
        self.metrics.generation_tokens.inc(n)
        self.metrics.cache_hit_tokens.inc(out.cached_tokens)
        self.metrics.requests.labels(out.finish_reason or "abort").inc()
        if first is not None and n > 1:
            self.metrics.tpot.observe((last - first) / (n - 1))

    @staticmethod
    async def _collect(pieces: AsyncIterator[tuple[str, list[int]]], client: Request) -> bool:
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

    def _usage(self, prompt_len: int, out: _Outcome) -> dict:
        n = len(out.token_ids)
        return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n,
                "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}

    async def respond(self, chat: bool, req: _Common, prompt: list[int], max_tokens: int | None, default_max: int,
                      client: Request, slot: Slot) -> Response:
        params = self._params(req, len(prompt), max_tokens, default_max)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        out = _Outcome()
        pieces = self._run(rid, prompt, params, req.stop_strings(), out, slot)
        base = {"id": rid, "created": int(time.time()), "model": self.model_name}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            # the background release covers a client gone before the stream started
            return StreamingResponse(self._sse(chat, base, pieces, out, len(prompt), include_usage),
                                     media_type="text/event-stream", background=BackgroundTask(slot.release))
        if not await self._collect(pieces, client):
            return Response(status_code=499)  # the client left; its request was aborted
        text = "".join(out.text)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": out.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": out.finish_reason}
        choice["token_ids"] = out.token_ids
        body = {**base, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": self._usage(len(prompt), out), "pdd": out.served()}
        return JSONResponse(body)

    async def _sse(self, chat: bool, base: dict, pieces: AsyncIterator[tuple[str, list[int]]], out: _Outcome,
                   prompt_len: int, include_usage: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, ids: list[int], finish: str | None, extra: dict | None = None) -> str:
            if chat:
                choice = {"index": 0, "delta": {} if delta is None else {"content": delta}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            choice["token_ids"] = ids
            return f"data: {json.dumps({**base, 'object': obj, 'choices': [choice], **(extra or {})})}\n\n"

        try:
            if chat:
                yield f"data: {json.dumps({**base, 'object': obj, 'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}, 'finish_reason': None}]})}\n\n"
            async for delta, ids in pieces:
                if out.finish_reason:
                    yield chunk(delta, ids, out.finish_reason, {"pdd": out.served()})
                else:
                    yield chunk(delta, ids, None)
            if include_usage:
                yield f"data: {json.dumps({**base, 'object': obj, 'choices': [], 'usage': self._usage(prompt_len, out), 'pdd': out.served()})}\n\n"
        except ApiError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            await pieces.aclose()
        yield "data: [DONE]\n\n"

    # ---- routes ----------------------------------------------------------------------------
    async def admitted(self, handle: Callable[[Slot], Awaitable[Response]]) -> Response:
        """Run a /v1 handler in an admission slot (429 when the line is full); the slot is
        the response's to give back, or given back here if the handler fails."""
        slot = await self.gate.enter()
        try:
            return await handle(slot)
        except BaseException:
            slot.release()
            raise

    async def completions(self, req: CompletionRequest, client: Request, slot: Slot) -> Response:
        self._check_model(req.model)
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        return await self.respond(False, req, await self._prompt_ids(req), req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS,
                                  client, slot)

    async def chat(self, req: ChatCompletionRequest, client: Request, slot: Slot) -> Response:
        self._check_model(req.model)
        messages = [{"role": m.role, "content": _unicode(m.text(), "messages")} for m in req.messages]
        try:
            text = await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, add_generation_prompt=True)
        except Exception as e:  # a template's raise_exception, or a template bug
            raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
        prompt = await self._encode(text, add_special_tokens=False)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await self.respond(True, req, prompt, max_tokens, CHAT_DEFAULT_MAX_TOKENS, client, slot)

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize on a worker thread: a long prompt takes seconds, and the event loop
        serves every other stream and /health meanwhile. A text too long for the context
        whatever its tokens is refused first (the tokenizer holds the GIL while it works)."""
        limit = self.backend.max_context
        if len(text) > 2 * limit * self.tokenizer.longest_token_chars:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                                f"{len(text):,} characters, more than that many tokens can hold.", param="prompt")
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "pdd", "max_model_len": self.backend.max_context,
                                            # pdd's extension: what `pdd bench` draws prompt token IDs below
                                            "vocab_size": self.tokenizer.vocab_size}]}


def _unicode(text: str, param: str) -> str:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800"), which is no Unicode text:
    the tokenizer would fail on it deep inside, as a server error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{param} is not valid Unicode text ({e.reason} at position {e.start})",
                       param=param) from None
    return text


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def build_app(backend: Backend, tokenizer: Tokenizer, model_name: str, registry: CollectorRegistry | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_key: str = "", openai_api: bool = True,
              admission: Limits = Limits(256, 256)) -> FastAPI:
    """The HTTP app; without `openai_api`, only /health, /metrics and /pdd/stats (a P/D
    instance: requests reach it from the router, over the framed protocol)."""
    server = OpenAIServer(backend, tokenizer, model_name, registry, admission)
    app = FastAPI(title="pdd", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:  # added last, so it runs first: no body is read for a caller without the key
        app.add_middleware(RequireApiKey, key=api_key)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(ApiError(400, _validation_message(exc)).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(ApiError(500, f"internal error: {exc}", "server_error").body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        state = backend.health()
        return JSONResponse(state, status_code=200 if state["status"] == "ok" else 503)


    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/pdd/stats")
    async def stats() -> dict:
        return await backend.stats()

    if openai_api:
        _openai_routes(app, server)
    return app


def _openai_routes(app: FastAPI, server: OpenAIServer) -> None:
    @app.get("/v1/models")
    async def models() -> dict:
        return server.models()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, client: Request) -> Response:
        return await server.admitted(lambda slot: server.completions(req, client, slot))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, client: Request) -> Response:
        return await server.admitted(lambda slot: server.chat(req, client, slot))
