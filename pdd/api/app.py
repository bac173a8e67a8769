"""The OpenAI-compatible HTTP front end, shared by `pdd serve` and `pdd router`.

It owns everything about the API — validation, tokenization, chat templates, stop
strings, SSE framing, usage, metrics — and nothing about where tokens come from: that
is the `TokenSource`. Every failure leaves as OpenAI's error JSON with a 4xx/5xx status.
This module builds the app (`pdd.api.server` answers the requests, `shaping` and `sse`
give them OpenAI's shapes).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdd.api.access import AccessLog, KeyMetrics, access_of
from pdd.api.auth import RequireApiKey
from pdd.api.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
from pdd.api.parsers import Parsers
from pdd.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from pdd.api.response_store import Stored
from pdd.api.responses import ResponsesRequest, named_as_responses
from pdd.api.server import OpenAIServer
from pdd.api.shaping import validation_error
from pdd.api.source import TokenSource
from pdd.model.tokenizer import Tokenizer
from pdd.policy.admission import Limits
from pdd.process import identity

log = logging.getLogger(__name__)


def build_app(
    source: TokenSource,
    tokenizer: Tokenizer,
    model_name: str,
    registry: CollectorRegistry | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    api_keys: Mapping[str, str] = {},
    openai_api: bool = True,
    admission: Limits = Limits(256, 256),
    parsers: Parsers = Parsers(),
) -> FastAPI:
    """The HTTP app; without `openai_api`, only /health, /metrics and /pdd/stats (a P/D
    instance: requests reach it from the router, over the framed protocol)."""
    server = OpenAIServer(
        source,
        tokenizer,
        model_name,
        registry,
        admission,
        tenants=len(api_keys) > 1,
        parsers=parsers,
    )
    app = FastAPI(title="pdd", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_keys:  # added after the body limit, so it runs first: no body is read for a caller without a key
        app.add_middleware(RequireApiKey, keys=api_keys)
    app.add_middleware(AccessLog, metrics=KeyMetrics(server.metrics.registry), keyed=bool(api_keys))  # outermost
    app.state.server = server

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error(exc).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(ApiError(500, f"internal error: {exc}", "server_error").body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        state = source.health()
        return JSONResponse({**state, **identity()}, status_code=200 if state["status"] == "ok" else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        state = source.ready()
        return JSONResponse({**state, **identity()}, status_code=200 if state["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/pdd/stats")
    async def stats() -> dict:
        # (with the stored responses' bound: `pdd.api.response_store`)
        return {**await source.stats(), "responses": server.stored.stats()}

    if openai_api:
        _openai_routes(app, server)
    return app


def _openai_routes(app: FastAPI, server: OpenAIServer) -> None:
    @app.get("/v1/models")
    async def models() -> dict:
        return server.models()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, client: Request) -> Response:
        req.refuse_unhonoured()  # before a slot is taken
        return await server.admitted(client, lambda slot: server.completions(req, client, slot))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, client: Request) -> Response:
        req.refuse_unhonoured()
        return await server.admitted(client, lambda slot: server.chat(req, client, slot))

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, client: Request) -> Response:
        history = server.history(req, client)
        with named_as_responses():
            chat = req.as_chat(history)
            chat.refuse_unhonoured()
        return await server.admitted(client, lambda slot: server.responses(req, chat, client, slot, history))

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, client: Request) -> dict:
        return _stored(server, response_id, client).body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, client: Request) -> dict:
        _stored(server, response_id, client)
        server.stored.delete(access_of(client.scope).api_key, response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _stored(server: OpenAIServer, response_id: str, client: Request) -> Stored:
    """This API key's stored response `response_id`; a 404 where there is none."""
    stored = server.stored.get(access_of(client.scope).api_key, response_id)
    if stored is None:
        raise ApiError(404, f"Response with id '{response_id}' not found.", param="response_id")
    return stored
