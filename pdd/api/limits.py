"""A bound on request bodies, checked before anything parses them.

Without it, a multi-megabyte body is read, JSON-decoded and validated on the event
loop before any rule refuses it, and every stream and /health on that server waits
meanwhile. The limit is checked on the declared length and again on the bytes that
actually arrive (a chunked body declares none).
"""

from __future__ import annotations

from typing import Any

from pdd.api.protocol import ApiError

DEFAULT_MAX_BODY_BYTES = 4 << 20
DRAIN_FACTOR = 16  # a refused body up to this many times the limit is read (and dropped) before the 413


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes; the body is read (bounded)
    before the app runs, then replayed to it."""

    def __init__(self, app: Any, limit: int) -> None:
        if limit < 1:
            raise ValueError("the body limit must be at least 1 byte")
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._drain(receive, int(declared))
            await self._refuse(send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> dict:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _drain(self, receive: Any, declared: int) -> None:
        """Read a refused body to its end, unparsed and unkept, up to `DRAIN_FACTOR` times
        the limit: a connection closed on unread bytes is reset, and the reset can reach the
        client before the 413 it was sent (httpx: "peer closed connection without sending
        complete message body")."""
        if declared > DRAIN_FACTOR * self.limit:
            return
        while True:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body"):
                return

    async def _refuse(self, send: Any) -> None:
        message = f"the request body exceeds {self.limit:,} bytes"
        await ApiError(413, message, code="request_too_large", headers={"Connection": "close"}).respond(send)
