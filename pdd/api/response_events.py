"""The Responses API's output items and their stream of events: what `/v1/responses`
answers, built as a chat completion's choice is read (`pdd.api.responses`)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from pdd.api.tools import CallDelta


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    parts = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": parts}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class EventStream:
    """The output items as they open, grow and close: one open at a time (thinking, a
    message, a call), each closed when another kind of text comes. Whitespace between calls
    opens no message."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []  # the closed items
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being written, its text so far in "text"
        self._blank = ""  # whitespace not yet in a message

    def event(self, kind: str, **fields: Any) -> str:
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self._seq - 1, **fields})}\n\n"

    def feed(self, reasoning: str, content: str, calls: list[CallDelta]) -> list[str]:
        events: list[str] = []
        if reasoning:
            events += self._write("reasoning", reasoning)
        if content:
            if self._open is None or self._open["type"] != "message":
                if not (self._blank + content).strip():
                    self._blank += content
                    content = ""
                else:
                    content, self._blank = self._blank + content, ""
            if content:
                events += self._write("message", content)
        for call in calls:
            if call.id is not None:
                events += self._close()
                events += self._opened(call_item(new_id("fc"), call.id, call.name or "", "", "in_progress"))
            events += self._write("function_call", call.arguments)
        return events

    def close(self, called: bool) -> list[str]:
        """The last item closed; a message (empty if need be) where nothing else was said."""
        events = []
        if not called and not any(item["type"] == "message" for item in self.output) and self._open is None:
            events += self._write("message", self._blank)
        return events + self._close()

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["item"]["id"], "output_index": len(self.output)}

    def _opened(self, item: dict[str, Any]) -> list[str]:
        self._open = {"type": item["type"], "item": item, "text": ""}
        events = [self.event("response.output_item.added", output_index=len(self.output), item=item)]
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def _write(self, kind: str, text: str) -> list[str]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            item = (
                reasoning_item(new_id("rs"), "")
                if kind == "reasoning"
                else message_item(new_id("msg"), "", "in_progress")
            )
            events += self._opened(item)
        assert self._open is not None
        self._open["text"] += text
        if kind == "function_call":
            events.append(self.event("response.function_call_arguments.delta", **self._where(), delta=text))
        elif kind == "message":
            events.append(
                self.event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])
            )
        else:
            events.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text))
        return events

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        where, kind, text, item = self._where(), self._open["type"], self._open["text"], self._open["item"]
        events = []
        if kind == "function_call":
            item = {**item, "arguments": text, "status": "completed"}
            events.append(
                self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=text)
            )
        elif kind == "message":
            item = message_item(item["id"], text, "completed")
            events.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=item["content"][0]))
        else:
            item = reasoning_item(item["id"], text)
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
        events.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self._open = None
        return events
