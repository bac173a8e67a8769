"""Bearer keys: the API key on the OpenAI routes (as OpenAI and vLLM ask), and the
deployment's admin token on the router's membership routes.

/health and /metrics stay open to the load balancer and the monitoring that sit inside
the operator's network. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from typing import Any

from pdd.api.protocol import ApiError
from pdd.transfer.wire import link_key

ADMIN_PREFIX = "/pdd/admin/"


def admin_token(secret: str) -> str:
    """The bearer token of the membership routes: derived from the deployment's secret,
    so every instance (which joins) and operator (who drains) holding the config has it."""
    return link_key(secret, "admin").hex()


class RequireApiKey:
    """ASGI middleware: 401 for a request under `prefix` without the key."""

    def __init__(self, app: Any, key: str, prefix: str = "/v1/") -> None:
        if not key:
            raise ValueError("an API key must not be empty")
        self.app, self._expected, self._prefix = app, f"Bearer {key}".encode(), prefix

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self._prefix):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                message = "a valid API key is required: Authorization: Bearer KEY"
                refusal = ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await refusal.respond(send)
                return
        await self.app(scope, receive, send)
