"""Tools: a request's functions rendered by the chat template, and the output turned back
into OpenAI's `tool_calls`, whole and streamed.

What `tool_choice` does (as vLLM does it):
- `none`: the template shows the tools; the output is content, never parsed.
- `auto`: the model may call them; its output is parsed by the model's tool parser, named
  as vLLM's `--tool-call-parser` (`TOOL_PARSERS`; `[model] tool_parser`, defaulted from
  the chat template by `default_tool_parser`).
- `required`, or a named function: the output is held by a grammar (`pdd.sampling.guide`), so a
  valid call comes whatever the weights. Required: a JSON array of `{"name", "parameters"}`
  (one item when `parallel_tool_calls` is false); named: the function's arguments object.
  These are read as JSON, whatever the parser.

The grammar is the request's guide like any other: every producer of a position (P, the
relay, MD) holds its output to it, so a call begun on the relay is finished on MD.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdd.api.reasoning import ThinkSplitter, partial_suffix
from pdd.names import TOOL_PARSERS


@dataclass(frozen=True)
class Function:
    """A function a request offers (`tools[i]`)."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None

    def template_form(self) -> dict[str, Any]:
        """As chat templates read a tool (`transformers`' shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.arguments_schema
        return {"type": "function", "function": function}

    @property
    def arguments_schema(self) -> dict[str, Any]:
        """The JSON Schema of its arguments (none given: any object)."""
        return self.parameters if self.parameters is not None else {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and what it asked of them: `choice` is none, auto, required, or
    the name of the function it must call."""

    functions: tuple[Function, ...]
    choice: str
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def grammar(self) -> tuple[str, str] | None:
        """The guide (kind, spec) that holds the output to a call, where one is forced."""
        if not self.forced:
            return None
        if self.choice != "required":
            (function,) = [f for f in self.functions if f.name == self.choice]
            return "json_schema", json.dumps(function.arguments_schema)
        items = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [f.name]}, "parameters": f.arguments_schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in self.functions
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            array["maxItems"] = 1
        return "json_schema", json.dumps(array)

    def output(self, parser: str) -> ToolOutput | None:
        """A choice's reader of calls (None: the output is all content)."""
        if self.choice == "none":
            return None
        if self.choice == "required":
            return RequiredCalls(self.parallel)
        if self.choice == "auto":
            return TOOL_PARSER_CLASSES[parser](self.parallel)
        return NamedCall(self.choice)


@dataclass
class CallDelta:
    """A piece of one tool call, as OpenAI streams it: the first piece of a call names it
    (`id`, `name`), the rest add to its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": "function"}
        function = {"name": self.name} if self.name is not None else {}
        out["function"] = function | {"arguments": self.arguments}
        return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolOutput(ABC):
    """One choice's output text, read into content and tool calls as it comes."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []

    @abstractmethod
    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        """The content and the call pieces `text` adds (with `final`: nothing held back)."""

    def _call(self, name: str, arguments: str) -> CallDelta:
        call = ToolCall(call_id(), name, arguments)
        self.calls.append(call)
        return CallDelta(len(self.calls) - 1, arguments, call.id, name)


class NamedCall(ToolOutput):
    """`tool_choice` naming a function: the whole output is its arguments (a grammar holds
    it to the function's schema), streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        if not self.calls:
            return "", [self._call(self._name, text)]
        self.calls[0].arguments += text
        return "", [CallDelta(0, text)] if text else []


class RequiredCalls(ToolOutput):
    """`tool_choice: required`: the output is a JSON array of {"name", "parameters"}; each
    call is sent when its object is whole (one cut short by max_tokens comes as content)."""

    def __init__(self, parallel: bool) -> None:
        super().__init__()
        self._parallel = parallel
        self._held = ""
        self._decoder = json.JSONDecoder()

    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        self._held += text
        deltas = []
        while True:
            rest = self._held.lstrip().lstrip("[,").lstrip()
            try:
                item, end = self._decoder.raw_decode(rest)
            except json.JSONDecodeError:
                break
            self._held = rest[end:]
            if isinstance(item, dict) and isinstance(item.get("name"), str) and (self._parallel or not self.calls):
                arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
                deltas.append(self._call(item["name"], arguments))
        if final and self._held.strip(" \n\t]"):  # a call cut short (max_tokens): its text, not lost
            held, self._held = self._held, ""
            return held, deltas
        return "", deltas


class ToolParser(ToolOutput):
    """`tool_choice: auto`: a model's own call syntax, read out of its text."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__()
        self.parallel = parallel


class HermesParser(ToolParser):
    """Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3 and the tiny model's template):
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as many as the model
    writes. Text before the first call is content, text after it is not (as vLLM's `hermes`
    reads it); a block that is not a call (no JSON object with a name) stays content, as
    vLLM's leaves it; without `parallel`, what follows the first call is dropped, as one
    call is all the client asked for."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._held = ""
        self._inside = False

    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        text, self._held = self._held + text, ""
        content: list[str] = []
        deltas: list[CallDelta] = []
        while text:
            if self.calls and not self.parallel:
                break
            if not self._inside:
                start = text.find(self.OPEN)
                said = not self.calls  # (after a call, the text between and after calls is not content)
                if start < 0:
                    keep = 0 if final else partial_suffix(text, self.OPEN)
                    content.append(text[: len(text) - keep] if said else "")
                    self._held = text[len(text) - keep :]
                    break
                content.append(text[:start] if said else "")
                self._inside, text = True, text[start + len(self.OPEN) :]
                continue
            end = text.find(self.CLOSE)
            if end < 0 and not final:
                self._held = text
                break
            block, text = (text, "") if end < 0 else (text[:end], text[end + len(self.CLOSE) :])
            self._inside = False
            if (delta := self._read(block)) is not None:
                deltas.append(delta)
            else:
                content.append(self.OPEN + block + (self.CLOSE if end >= 0 else ""))
        return "".join(content), deltas

    def _read(self, block: str) -> CallDelta | None:
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        return self._call(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


TOOL_PARSER_CLASSES: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str, cls: type[ToolParser]) -> None:
    """Add a parser under vLLM's name for it; a name taken already is an error."""
    if name in TOOL_PARSER_CLASSES:
        raise ValueError(f"tool parser {name!r} is registered already")
    TOOL_PARSER_CLASSES[name] = cls


register_tool_parser("hermes", HermesParser)
assert set(TOOL_PARSER_CLASSES) == set(TOOL_PARSERS)

# a chat template's mark of the call syntax it teaches -> the parser that reads it
TEMPLATE_PARSERS = (("<tool_call>", "hermes"),)


def default_tool_parser(chat_template: str | None) -> str:
    """The parser for a model's chat template ("": none known, so `auto` is refused)."""
    for mark, name in TEMPLATE_PARSERS:
        if chat_template and mark in chat_template:
            return name
    return ""


@dataclass
class Assistant:
    """One choice's text as an assistant's parts: thinking (a reasoning parser), content,
    tool calls (`tools`); fed piece by piece, or once whole. `include_reasoning` (vLLM's
    request field): false leaves the thinking out of what is said."""

    splitter: ThinkSplitter | None = None
    tools: ToolOutput | None = None
    include_reasoning: bool = True
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)

    @property
    def reasons(self) -> bool:
        """Whether a reasoning parser reads this choice (its answer then says `reasoning`)."""
        return self.splitter is not None

    def feed(self, text: str, final: bool, ids: Sequence[int] = ()) -> tuple[str, str, list[CallDelta]]:
        """The (reasoning, content, call pieces) that `text` (of token `ids`) adds."""
        reasoning, content = self.splitter.feed(text, final) if self.splitter else ("", text)
        deltas: list[CallDelta] = []
        if self.tools is not None:
            content, deltas = self.tools.feed(content, final)
        return self._said(reasoning, content, deltas)

    def _said(self, reasoning: str, content: str, deltas: list[CallDelta]) -> tuple[str, str, list[CallDelta]]:
        reasoning = reasoning if self.include_reasoning else ""
        self.reasoning.append(reasoning)
        self.content.append(content)
        return reasoning, content, deltas

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: a generation that ended by itself with calls in it ends in them."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def message(self) -> dict[str, Any]:
        """The whole choice's `message`: content None where only calls came; `reasoning`
        (as the pinned vLLM names it) where a reasoning parser reads it."""
        content = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.calls:
            message["content"] = content if content.strip() else None
            message["tool_calls"] = [c.openai() for c in self.calls]
        elif self.reasons and not content:  # (all of it was thinking: no content, as vLLM says it)
            message["content"] = None
        if self.reasons:
            message["reasoning"] = "".join(self.reasoning) if self.include_reasoning else None
        return message
