"""The OpenAI error shape, raised anywhere in the API and answered as OpenAI's error JSON."""

from __future__ import annotations

import json
from typing import Any


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers  # e.g. Retry-After on a 429

    def body(self) -> dict:
        # a message may quote the client (a model name with a lone surrogate): keep it encodable as UTF-8
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}

    async def respond(self, send: Any) -> None:
        """Answer with this error on a raw ASGI `send`: for middleware that refuses a
        request before any framework sees it."""
        body = json.dumps(self.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in (self.headers or {}).items()]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
