"""Bearer keys: the API key on the OpenAI routes (as OpenAI and vLLM ask), and the
deployment's admin token on the router's membership routes.

/health and /metrics stay open to the load balancer and the monitoring that sit inside
the operator's network. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

from pdd.api.access import access_of
from pdd.api.protocol import ApiError
from pdd.transfer.wire import connection_key

ADMIN_PREFIX = "/pdd/admin/"


def admin_token(secret: str) -> str:
    """The bearer token of the membership routes: derived from the deployment's secret,
    so every instance (which joins) and operator (who drains) holding the config has it."""
    return connection_key(secret, "admin").hex()


class RequireApiKey:
    """ASGI middleware: 401 for a request under `prefix` without one of the `keys`
    (name -> key); the name of the one it carries goes into its `Access`."""

    def __init__(self, app: Any, keys: Mapping[str, str], prefix: str = "/v1/") -> None:
        if not keys or not all(keys.values()):
            raise ValueError("API keys must not be empty")
        self.app, self._prefix = app, prefix
        self._expected = [(name, f"Bearer {key}".encode()) for name, key in keys.items()]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self._prefix):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            # every key compared, each in constant time: the answer's time says nothing of which matched
            matched = [name for name, expected in self._expected if hmac.compare_digest(given, expected)]
            if not matched:
                message = "a valid API key is required: Authorization: Bearer KEY"
                refusal = ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await refusal.respond(send)
                return
            access_of(scope).api_key = matched[0]
        await self.app(scope, receive, send)
