"""OpenAI request shapes and the OpenAI error shape.

Types are strict where OpenAI's are (a string max_tokens is an error, not a guess);
anything the engine cannot honour (n > 1, logprobs, echo) is refused up front rather
than silently ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)


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


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt = 1.0
    top_p: StrictFloat | StrictInt = 1.0
    top_k: StrictInt = 0
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    logprobs: StrictBool | StrictInt | None = None
    user: StrictStr | None = None
    cache_salt: StrictStr | None = None  # vLLM's: a prefix-cache namespace shared only by requests that give it

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
