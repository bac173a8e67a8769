"""OpenAI's Responses API (`/v1/responses`), what the Agents SDK calls by default: text and
function tools, whole and streamed in its event shapes.

A request is read into a chat completion (its `input` items as messages, its function
tools as chat tools) and runs exactly as one: the same template, tool parsers, grammar
and sampling. Only the shapes differ. A response is stored unless `store` is false
(`pdd.api.response_store`: bounded, each API key's its own), and a request that gives
`previous_response_id` continues that response's conversation, as vLLM's store does;
`conversation` (OpenAI's server-side conversations) is refused by name, as is any
parameter or item pdd does not honour. Reasoning items given back in `input` are not
rendered, as chat templates drop earlier turns' thinking.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from pdd.api.protocol import ApiError, ChatCompletionRequest, unhonoured
from pdd.api.response_events import EventStream, call_item, message_item, new_id, reasoning_item
from pdd.api.shaping import Outcome
from pdd.api.sse import Piece
from pdd.api.tools import Assistant

# the Responses API's parameters that change nothing here at these values (what clients send
# by default); any other value is refused by name
NEUTRAL: dict[str, Any] = {
    "include": ([], None),
    "truncation": ("disabled", None),
    "conversation": (None,),
    "background": (False, None),
    "prompt": (None,),
    "reasoning": (None, {}),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
    "stream_options": (None,),
    "prompt_cache_retention": (None,),
}
# a Responses parameter -> the chat completion's that carries it (errors name the former)
AS_CHAT = {
    "max_output_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stream": "stream",
    "parallel_tool_calls": "parallel_tool_calls",
    "user": "user",
    "metadata": "metadata",
    "service_tier": "service_tier",
    "prompt_cache_key": "prompt_cache_key",
    "safety_identifier": "safety_identifier",
}
# vLLM's extensions of a Responses request, each a chat completion's field of the same name
AS_CHAT |= {
    key: key
    for key in (
        "structured_outputs",
        "chat_template_kwargs",
        "include_reasoning",
        "seed",
        "stop",
        "stop_token_ids",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "ignore_eos",
        "cache_salt",
        "include_stop_str_in_output",
        "skip_special_tokens",
    )
}
PARAM_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}
FUNCTION_KEYS = ("name", "description", "parameters", "strict")  # a Responses function tool's, beside its type
# the keys of an input item pdd reads, and the bookkeeping an item given back carries (`id`,
# `status`): any other is refused (a reasoning item is not rendered at all)
ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
}


@contextlib.contextmanager
def named_as_responses() -> Iterator[None]:
    """An ApiError raised inside names its parameter as the Responses API does (a chat
    message's position is not an input item's: `input` alone)."""
    try:
        yield
    except ApiError as e:
        if e.param is not None:
            head = re.split(r"[.\[]", e.param, maxsplit=1)[0]
            e.param = PARAM_NAMES.get(head, head) + ("" if head == "messages" else e.param[len(head) :])
        raise


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # to name what is refused

    model: StrictStr
    input: StrictStr | list[dict[StrictStr, Any]]
    instructions: StrictStr | None = None
    tools: list[dict[StrictStr, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[StrictStr, Any] | None = None
    text: dict[StrictStr, Any] | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    stream: StrictBool = False
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool = True  # kept for GET and for a later previous_response_id (`pdd.api.response_store`)
    previous_response_id: StrictStr | None = None  # the stored response this one continues

    def as_chat(self, history: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
        """The chat completion this request runs as, after the conversation a previous
        response ended (`history`); a 400 naming what it cannot carry."""
        extra = {}
        for key, value in (self.model_extra or {}).items():
            if key in NEUTRAL:
                if value not in NEUTRAL[key]:
                    raise ApiError(400, f"{key} is not supported by pdd (README: what pdd honours)", param=key)
            elif key not in AS_CHAT:
                if error := unhonoured({key: value}):
                    raise error
            else:
                extra[key] = value
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages = [*system, *(history or []), *self.input_messages()]
        if not messages:
            raise ApiError(400, "input holds no message", param="input")
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        for key in self.model_fields_set & set(AS_CHAT):
            if (value := getattr(self, key)) is not None:
                body[AS_CHAT[key]] = value
        body |= {AS_CHAT[k]: v for k, v in extra.items()}
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.text is not None:
            body["response_format"] = _chat_format(self.text)
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise ApiError(400, f"{where}: {first['msg']}", param=PARAM_NAMES.get(where, where)) from None

    def input_messages(self) -> list[dict[str, Any]]:
        """The request's `input` as chat messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_as_messages(self.input)

    def conversation(self, history: list[dict[str, Any]] | None, output: list[dict[str, Any]]) -> list[dict]:
        """The conversation this request's response ends, as chat messages: what came
        before, its input, its output (thinking left out, as chat templates drop earlier
        turns'; instructions too, as they do not carry over to the next response)."""
        return [*(history or []), *self.input_messages(), *items_as_messages(output)]


def items_as_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses items (input or output) as chat messages; a 400 naming an item pdd cannot
    read."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if unknown := sorted(set(item) - ITEM_KEYS.get(kind, set(item))):
            where = f"input[{i}].{unknown[0]}"
            raise ApiError(400, f"{where} is not supported by pdd", param=where)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"input[{i}].role {role!r} is not a message's", param=f"input[{i}].role")
            messages.append({"role": role, "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", i),
                "type": "function",
                "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)},
            }
            if messages and messages[-1]["role"] == "assistant":  # (calls of one turn come in a row)
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"input[{i}].output")
            messages.append({"role": "tool", "content": output, "tool_call_id": _string(item, "call_id", i)})
        elif kind != "reasoning":  # (earlier thinking: not rendered, as chat templates drop it)
            raise ApiError(400, f"input[{i}].type {kind!r} is not supported by pdd", param=f"input[{i}].type")
    return messages


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"input[{i}].{key} must be a string", param=f"input[{i}].{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A message's or an output's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be text or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}[{j}] is not a text part pdd can render", param=f"{where}[{j}].type")
        texts.append(part["text"])
    return "".join(texts)


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ApiError(400, f"tools[{i}].type {tool.get('type')!r} is not supported by pdd", param=f"tools[{i}].type")
    function = {k: tool[k] for k in FUNCTION_KEYS if tool.get(k) is not None}
    if unknown := sorted(set(tool) - {"type", *FUNCTION_KEYS}):
        raise ApiError(400, f"tools[{i}].{unknown[0]} is not supported by pdd", param=f"tools[{i}].{unknown[0]}")
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ApiError(400, "tool_choice must be none, auto, required or a function's", param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _chat_format(text: dict[str, Any]) -> dict[str, Any]:
    if unknown := sorted(k for k, v in text.items() if k != "format" and v is not None):
        raise ApiError(400, f"text.{unknown[0]} is not supported by pdd", param=f"text.{unknown[0]}")
    fmt = text.get("format") or {"type": "text"}
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


class ResponseForm:
    """One response's shapes: the whole object, and its stream of events."""

    def __init__(
        self, req: ResponsesRequest, model: str, on_done: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        """`on_done`: given the finished response's body (whole or streamed), to store it."""
        self.id, self.created = new_id("resp"), int(time.time())
        self._req, self._model, self._on_done = req, model, on_done

    def _done(self, body: dict[str, Any]) -> dict[str, Any]:
        if self._on_done is not None:
            self._on_done(body)
        return body

    def body(self, status: str, output: list[dict], out: Outcome | None, prompt_len: int) -> dict[str, Any]:
        req = self._req
        incomplete = status == "incomplete"
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self._model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": None,
            "store": req.store,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "tools": req.tools or [],
            "truncation": "disabled",
            "metadata": (req.model_extra or {}).get("metadata") or {},
            "usage": None,
        }
        if out is not None:
            body["usage"] = {
                "input_tokens": prompt_len,
                "input_tokens_details": {"cached_tokens": out.cached_tokens},
                "output_tokens": len(out.token_ids),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt_len + len(out.token_ids),
            }
            body["pdd"] = out.served()
        return body

    @staticmethod
    def _status(out: Outcome) -> str:
        return "incomplete" if out.finish_reason == "length" else "completed"

    def whole(self, out: Outcome, assistant: Assistant, prompt_len: int) -> dict[str, Any]:
        """The response of a finished generation: thinking, text, calls, in that order."""
        assistant.feed("".join(out.text), final=True, ids=out.token_ids)
        output = []
        reasoning, content = "".join(assistant.reasoning), "".join(assistant.content)
        if reasoning:
            output.append(reasoning_item(new_id("rs"), reasoning))
        if content.strip() or not assistant.calls:
            output.append(message_item(new_id("msg"), content, "completed"))
        output += [call_item(new_id("fc"), c.id, c.name, c.arguments, "completed") for c in assistant.calls]
        return self._done(self.body(self._status(out), output, out, prompt_len))

    async def events(
        self, pieces: AsyncGenerator[tuple[int, Piece], None], out: Outcome, assistant: Assistant, prompt_len: int
    ) -> AsyncIterator[str]:
        """The generation as the Responses API's server-sent events."""
        stream = EventStream()
        try:
            yield stream.event("response.created", response=self.body("in_progress", [], None, prompt_len))
            yield stream.event("response.in_progress", response=self.body("in_progress", [], None, prompt_len))
            async for _, (delta, ids, _lp) in pieces:
                for event in stream.feed(*assistant.feed(delta, final=out.finish_reason is not None, ids=ids)):
                    yield event
            for event in stream.feed(*assistant.feed("", final=True)):  # (what a parser still held)
                yield event
            for event in stream.close(bool(assistant.calls)):
                yield event
            status = self._status(out)
            final = self._done(self.body(status, stream.output, out, prompt_len))
            yield stream.event(f"response.{status}", response=final)
        except ApiError as e:
            yield stream.event("error", code=e.code, message=e.message, param=e.param)
        finally:
            await pieces.aclose()
