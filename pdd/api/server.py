"""The OpenAI API's handlers: admission, tokenization, chat templates, stop strings,
running a generation on the `TokenSource` and answering it whole or streamed."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry
from starlette.background import BackgroundTask

from pdd.api.access import Access, access_of
from pdd.api.admission import AdmissionGate, Slot
from pdd.api.choices import choice_params, collect, countdown, merged, whole_body
from pdd.api.logprobs import LogprobFormatter
from pdd.api.metrics import ServingMetrics
from pdd.api.parsers import Parsers
from pdd.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest, _Common
from pdd.api.response_store import DEFAULT_KEPT, ResponseStore, Stored
from pdd.api.responses import ResponseForm, ResponsesRequest, named_as_responses
from pdd.api.shaping import Outcome, sampling_params, unicode_text
from pdd.api.source import GenerationError, GenRequest, TokenSource
from pdd.api.sse import Piece, sse_events
from pdd.api.text import TextStream
from pdd.api.tools import Assistant, ToolPlan
from pdd.model.tokenizer import Tokenizer
from pdd.policy.admission import Limits
from pdd.sampling.guide import GuideError, Guides
from pdd.sampling.params import SamplingParams

log = logging.getLogger(__name__)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIServer:
    def __init__(
        self,
        source: TokenSource,
        tokenizer: Tokenizer,
        model_name: str,
        registry: CollectorRegistry | None,
        admission: Limits,
        tenants: bool = False,
        parsers: Parsers = Parsers(),
        responses_kept: int = DEFAULT_KEPT,
    ) -> None:
        """`tenants`: keep each API key's requests in a prefix-cache namespace of their own
        when they give no cache_salt (a server of several named keys); `parsers`: the
        reasoning and tool-call parsers (`pdd.api.parsers`); `responses_kept`: how many
        stored responses `/v1/responses` keeps (`pdd.api.response_store`)."""
        self.parsers = parsers
        self.tool_parser = parsers.tool
        self.stored = ResponseStore(responses_kept)
        self.source = source
        self.tenants = tenants
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = ServingMetrics(source.load, registry)
        self.gate = AdmissionGate(admission, self.metrics.registry)
        vocab = tokenizer.source
        self.guides = None if vocab is None else Guides(vocab, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids))
        self.created = int(time.time())

    # ---- request -> (prompt ids, sampling params) ------------------------------------------
    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found"
            )

    async def _prompt_ids(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, "batched prompts are not supported; send one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            special = req.add_special_tokens is not False  # (vLLM's default for a completion: true)
            return await self._encode(unicode_text(prompt, "prompt"), add_special_tokens=special)
        # the request model validated its shape: a batch of one is unwrapped above, so what is
        # left is a list of token ids (the checker cannot follow the unwrapping)
        ids = cast(list[int], prompt)
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(ids)

    # ---- generation ------------------------------------------------------------------------
    async def _run(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        stop: list[str],
        out: Outcome,
        release: Callable[[], None],
        access: Access,
        chat: bool = False,
        echo: str | None = None,
        order: tuple[asyncio.Event, bool] | None = None,
    ) -> AsyncGenerator[Piece, None]:
        """Yield (text delta, token ids, their `logprobs` object where asked) pieces; fill
        `out` and `access`; close the source's stream and give the admission slot back on
        exit (`release`). With `echo` (the prompt's text), a first piece says the prompt,
        with its logprobs where asked (no token ids: those are the output's). `order`: an
        event and whether this generation sets it (with its first token, or its end) or
        starts once it is set: the choices of one request after the first's prefill, which
        they then find in the prefix cache."""
        text = TextStream(self.tokenizer, stop)
        formatter = LogprobFormatter(self.tokenizer, chat) if params.logprobs is not None else None
        gen = self.source.generate(GenRequest(rid, prompt, params))
        first, last = None, None
        access.rid, access.prompt_tokens = rid, len(prompt)
        self.metrics.prompt_tokens.inc(len(prompt))
        try:
            if order is not None and not order[1]:
                await order[0].wait()
            async for ev in gen:
                now = time.monotonic()
                if first is None and ev.tokens:
                    if order is not None:
                        order[0].set()
                    first = access.first_token = now
                    self.metrics.ttft.observe(now - access.arrived)
                    if params.prompt_logprobs is not None:
                        out.prompt_logprobs = LogprobFormatter(self.tokenizer, chat).prompt(prompt, ev.prompt_logprobs)
                    if echo is not None:
                        said = None
                        if formatter is not None:
                            said = formatter.piece(prompt, ev.prompt_logprobs or [None] * len(prompt))
                            out.logprobs.append(said)
                        out.text.append(echo)
                        yield echo, [], said
                elif ev.tokens and last is not None:
                    for gap in [now - last] + [0.0] * (len(ev.tokens) - 1):
                        self.metrics.itl.observe(gap)
                if ev.tokens:
                    last = now
                out.cached_tokens = ev.cached_tokens
                delta, kept = text.feed_all(ev.tokens)
                tokens = ev.tokens[:kept]
                out.token_ids.extend(tokens)
                if ev.record:
                    out.record = ev.record
                if text.stopped:
                    out.finish_reason = "stop"
                elif ev.finish_reason:
                    out.finish_reason = ev.finish_reason
                    delta += text.flush()
                out.text.append(delta)
                logprobs = None
                if formatter is not None:
                    logprobs = formatter.piece(tokens, (ev.logprobs or [None] * len(ev.tokens))[:kept])
                    out.logprobs.append(logprobs)
                yield delta, tokens, logprobs
                if out.finish_reason:
                    break
        except GenerationError as e:
            raise self._failed(e) from None
        finally:
            if order is not None:
                order[0].set()
            release()
            await gen.aclose()
            access.completion_tokens += len(out.token_ids)
            access.finish = out.finish_reason or "abort"
            access.pipeline = out.record.pipeline or "" if out.record else ""
        self._observe_end(out, first, last, access)

    def _failed(self, e: GenerationError) -> ApiError:
        """A generation's failure as the client's error (counted)."""
        self.metrics.requests.labels("error").inc()
        retry = {"Retry-After": str(self.gate.retry_after())}
        if e.status == 429:  # an instance was full: the client may come back
            return ApiError(429, str(e), "rate_limit_exceeded", code="overloaded", headers=retry)
        # 503: no instance can serve it now (one is down or leaving): come back later
        return ApiError(e.status, f"generation failed: {e}", "server_error", headers=retry if e.status == 503 else None)

    def _observe_end(self, out: Outcome, first: float | None, last: float | None, access: Access) -> None:
        """A finished generation's metrics: tokens, cache hits, its end, TPOT, end to end."""
        n = len(out.token_ids)
        self.metrics.generation_tokens.inc(n)
        self.metrics.cache_hit_tokens.inc(out.cached_tokens)
        self.metrics.requests.labels(out.finish_reason or "abort").inc()
        if first is not None and last is not None and n > 1:  # (set together, by the first token)
            self.metrics.tpot.observe((last - first) / (n - 1))
        self.metrics.e2e.observe(time.monotonic() - access.arrived)

    async def respond(
        self,
        chat: bool,
        req: _Common,
        prompt: list[int],
        max_tokens: int | None,
        default_max: int,
        client: Request,
        slot: Slot,
        tools: ToolPlan | None = None,
        form: ResponseForm | None = None,
    ) -> Response:
        """Run a request and answer it: a completion, a chat completion (`chat`), or with
        `form`, a chat completion in the Responses API's shapes."""
        limit, defaults = self.source.max_context, self.tokenizer.generation_defaults
        access = access_of(client.scope)
        params = sampling_params(
            req, len(prompt), max_tokens, default_max, limit, defaults, access.api_key if self.tenants else ""
        )
        if params.guide is not None:
            self._check_guide(req, params.guide)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        outs = [Outcome() for _ in range(req.n)]
        release = countdown(req.n, slot.release)  # the slot is the request's, whatever its n
        stop = req.stop_strings()
        echo = None
        if isinstance(req, CompletionRequest) and req.echo:
            given = req.prompt[0] if isinstance(req.prompt, list) and isinstance(req.prompt[0], str) else req.prompt
            echo = given if isinstance(given, str) else self.tokenizer.decode(prompt)
        # n > 1: the first choice's prefill goes first, the others find it in the prefix cache
        first_token = asyncio.Event() if req.n > 1 else None
        pieces = [
            self._run(
                rid if req.n == 1 else f"{rid}-{i}",
                prompt,
                choice_params(params, i),
                stop,
                out,
                release,
                access,
                chat,
                echo,
                None if first_token is None else (first_token, i == 0),
            )
            for i, out in enumerate(outs)
        ]
        base = {"id": rid, "created": int(time.time()), "model": self.model_name}
        if form is not None:
            assistant = self.assistant(req, tools, prompt)
            if req.stream:
                return StreamingResponse(
                    form.events(merged(pieces), outs[0], assistant, len(prompt)),
                    media_type="text/event-stream",
                    background=BackgroundTask(slot.release),
                )
            if not await collect(merged(pieces), client):
                return Response(status_code=499)
            return JSONResponse(form.whole(outs[0], assistant, len(prompt)))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            # the background release covers a client gone before the stream started
            assistants = [self.assistant(req, tools, prompt) for _ in outs] if chat else None
            return StreamingResponse(
                sse_events(chat, base, merged(pieces), outs, len(prompt), include_usage, assistants),
                media_type="text/event-stream",
                background=BackgroundTask(slot.release),
            )
        if not await collect(merged(pieces), client):
            return Response(status_code=499)  # the client left; its request was aborted
        readers = [self.assistant(req, tools, prompt) for _ in outs] if chat else None
        return JSONResponse(whole_body(base, outs, len(prompt), params.logprobs is not None, readers))

    # ---- routes ----------------------------------------------------------------------------
    async def admitted(self, client: Request, handle: Callable[[Slot], Awaitable[Response]]) -> Response:
        """Run a /v1 handler in an admission slot (429 when the queue is full); the slot is
        the response's to give back, or given back here if the handler fails."""
        slot = await self.gate.enter()
        self.metrics.queue.observe(time.monotonic() - access_of(client.scope).arrived)
        try:
            return await handle(slot)
        except BaseException:
            slot.release()
            raise

    async def completions(self, req: CompletionRequest, client: Request, slot: Slot) -> Response:
        self._check_model(req.model)
        return await self.respond(
            False, req, await self._prompt_ids(req), req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, client, slot
        )

    async def chat(
        self, req: ChatCompletionRequest, client: Request, slot: Slot, form: ResponseForm | None = None
    ) -> Response:
        """A chat completion; with `form`, answered in the Responses API's shapes."""
        self._check_model(req.model)
        messages = [m.template_form(f"messages[{i}].") for i, m in enumerate(req.messages)]
        tools = req.tool_plan()
        prompt = await self.chat_prompt(messages, tools, req.chat_template_kwargs or {}, bool(req.add_special_tokens))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        # as vLLM: without max_tokens, a chat completion may take the rest of the context
        return await self.respond(True, req, prompt, max_tokens, self.source.max_context, client, slot, tools, form)

    async def chat_prompt(
        self, messages: list[dict], tools: ToolPlan | None, kwargs: dict, special: bool = False
    ) -> list[int]:
        """A conversation's prompt ids: the chat template rendered with its tools. A 400 for
        `auto` tool choice where no parser reads this model's calls."""
        if tools is not None and tools.choice == "auto" and not self.tool_parser:
            raise ApiError(
                400,
                "tool_choice 'auto' needs a tool parser: this model's chat template is not one pdd knows "
                "(pdd serve --tool-call-parser, [model] tool_parser)",
                param="tool_choice",
            )
        for message in messages:
            unicode_text(message["content"], "messages")
        spec = [f.template_form() for f in tools.functions] if tools is not None else None
        try:
            text = await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, True, kwargs, spec)
        except Exception as e:  # a template's raise_exception, or a template bug
            param = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
            raise ApiError(400, f"cannot apply the chat template: {e}", param=param) from None
        return await self._encode(text, add_special_tokens=special)  # (vLLM's default: the template writes them)

    async def responses(
        self, req: ResponsesRequest, chat: ChatCompletionRequest, client: Request, slot: Slot, history: list[dict]
    ) -> Response:
        """/v1/responses: `req` run as `chat`, the chat completion it reads as after the
        conversation `history` it continues (`pdd.api.responses`); stored when it ends,
        unless `store` is false."""
        namespace = access_of(client.scope).api_key

        def keep(body: dict) -> None:
            if req.store and body["status"] in ("completed", "incomplete"):
                self.stored.put(namespace, body["id"], Stored(body, req.conversation(history, body["output"])))

        with named_as_responses():
            return await self.chat(chat, client, slot, ResponseForm(req, self.model_name, keep))

    def history(self, req: ResponsesRequest, client: Request) -> list[dict]:
        """The conversation the response `req` continues ends (none: []); a 404 naming
        `previous_response_id` where this API key has no such response stored."""
        if req.previous_response_id is None:
            return []
        stored = self.stored.get(access_of(client.scope).api_key, req.previous_response_id)
        if stored is None:
            raise ApiError(
                404,
                f"Response with id '{req.previous_response_id}' not found (evicted, deleted, never stored, or "
                "another key's): send the conversation in input instead",
                param="previous_response_id",
            )
        return stored.messages

    def assistant(self, req: _Common, tools: ToolPlan | None, prompt: list[int]) -> Assistant:
        """A reader of one choice's text into thinking, content and tool calls."""
        kwargs = getattr(req, "chat_template_kwargs", None) or {}
        return self.parsers.assistant(tools, prompt, kwargs, getattr(req, "include_reasoning", True))

    def _check_guide(self, req: _Common, guide: tuple[str, str]) -> None:
        """A 400 naming the field for a grammar that does not compile (checked here, once,
        before any instance is asked)."""
        if self.guides is None:
            raise ApiError(400, "this server's tokenizer was not read from a file: no grammar", param="response_format")
        try:
            self.guides.check(*guide)
        except GuideError as e:
            param = "response_format" if req.response_format is not None else "structured_outputs"
            if getattr(req, "tool_choice", None) not in (None, "none", "auto"):
                param = "tool_choice"
            raise ApiError(400, f"{param}: {e}", param=param) from None

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize on a worker thread: a long prompt takes seconds, and the event loop
        serves every other stream and /health meanwhile. A text too long for the context
        whatever its tokens is refused first (the tokenizer holds the GIL while it works)."""
        limit = self.source.max_context
        if len(text) > 2 * limit * self.tokenizer.longest_token_chars:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens; the prompt has "
                f"{len(text):,} characters, more than that many tokens can hold.",
                param="prompt",
            )
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "pdd",
                    "max_model_len": self.source.max_context,
                    # pdd's extension: what `pdd bench` draws prompt token IDs below
                    "vocab_size": self.tokenizer.vocab_size,
                }
            ],
        }
