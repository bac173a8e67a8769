"""A chat message as a request gives it, and as the chat template then reads it.

A message takes what the pinned vLLM's does, with vLLM's meaning, and whatever pdd's own
answers carry (a client appends the assistant message it got back to the conversation):
- `name`, on every role, goes to the template as vLLM gives it (most templates ignore it);
- an assistant's `reasoning`, or its deprecated `reasoning_content` (vLLM renames the
  latter to the former), goes to the template under both names, as vLLM gives it;
- content as a list of text parts, on every role, is its texts joined by newlines, as
  vLLM joins them for a template that reads text;
- a call's arguments that are not a JSON object are an empty one, as vLLM reads them;
- an assistant's `refusal`, `audio`, `annotations` and a null `function_call` are
  accepted and not rendered, as vLLM does not render them; `tool_calls: []` is no call;
- a developer message's `tools` go to the template, as vLLM gives them.
Anything else is refused by name (`ChatCompletionRequest.refuse_unhonoured`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictStr

from pdd.api.errors import ApiError

ROLES = ("system", "user", "assistant", "tool", "developer")


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CalledFunction(_Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it back


class ToolCallIn(_Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # to name what is refused
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls, earlier in the conversation
    tool_call_id: StrictStr | None = None  # a tool message's: the call it answers
    reasoning: StrictStr | None = None  # an assistant's thinking, as pdd and vLLM answer it
    reasoning_content: StrictStr | None = None  # (its older name)
    # what an assistant's answer may carry and no template reads (accepted back, not rendered)
    refusal: StrictStr | None = None
    audio: dict[StrictStr, Any] | None = None
    annotations: list[dict[StrictStr, Any]] | None = None
    tools: list[dict[StrictStr, Any]] | None = None  # a developer message's (vLLM gives them to the template)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)

    def template_form(self, where: str) -> dict[str, Any]:
        """As chat templates read a message (`transformers`' shape: a call's arguments as
        an object), with what vLLM adds to it (module doc)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            if self.role != "assistant":
                raise ApiError(400, f"{where}tool_calls are an assistant's", param=f"{where}tool_calls")
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c)},
                }
                for c in self.tool_calls
            ]
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if self.role == "assistant" and reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
        if self.role == "tool":
            if self.tool_call_id is None:
                raise ApiError(400, f"{where}tool_call_id is required in a tool message", param=f"{where}tool_call_id")
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.role == "developer":
            out["tools"] = self.tools
        return out

    def refused(self, where: str) -> ApiError | None:
        """The error for a field of this message pdd does not take (module doc), or None."""
        for key, value in (self.model_extra or {}).items():
            if key == "function_call" and value is None:
                continue  # (what pdd's and OpenAI's answers carry: no call)
            said = "is not supported by pdd" if key == "function_call" else "is not a parameter pdd knows"
            return ApiError(400, f"{where}{key} {said} (README: what pdd honours)", param=f"{where}{key}")
        if self.tools is not None and self.role != "developer":
            return ApiError(400, f"{where}tools are a developer message's", param=f"{where}tools")
        return None


def _arguments(call: ToolCallIn) -> dict[str, Any]:
    """A call's arguments as the template reads them, an object: as vLLM reads them, an
    object that is not JSON (or JSON that is not an object) is an empty one, since a
    malformed call in the history would otherwise fail every later turn of the conversation."""
    try:
        parsed = json.loads(call.function.arguments) if call.function.arguments else {}
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
