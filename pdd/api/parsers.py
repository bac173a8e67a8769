"""Which reasoning and tool-call parsers a server runs, by vLLM's names, and the reader of
one choice's text they make.

A name given (`--reasoning-parser`, `--tool-call-parser`, `[model] reasoning_parser`,
`tool_parser`) is any in vLLM's registries (`ReasoningParserManager`, `ToolParserManager`)
when vLLM is installed, and then vLLM's own parser classes read the output, composed as
vLLM's server composes them (`ParserManager.get_parser`), whole (`parse`) and streamed
(`parse_delta`, over each piece's text and token IDs). An out-of-tree parser is loaded
first from `--tool-parser-plugin` (a file or module, as vLLM's flag of that name). Without
vLLM, pdd's own `hermes`, `qwen3` and `deepseek_r1` (`pdd.api.tools`, `pdd.api.reasoning`)
read it, and give what vLLM's give on the same text (tests/test_parsers.py). No name given:
no reasoning parser, and pdd's own tool parser for the call syntax the chat template
teaches, if it knows it.

`required` and named tool choices are held to JSON by pdd's grammar from the first token
whatever the parser, so such an output is all call, no thinking: it is read as JSON
(`pdd.api.tools.RequiredCalls`, `NamedCall`), with no reasoning parser. (vLLM starts the
grammar after the thinking; pdd's producers hold every position to the one grammar.)

A name that is in no registry is one line naming the known ones.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdd.api.reasoning import splitter
from pdd.api.tools import Assistant, CallDelta, ToolCall, ToolPlan, call_id, default_tool_parser
from pdd.errors import Mistake
from pdd.names import REASONING_PARSERS, TOOL_PARSERS

REASONING_FLAG = "--reasoning-parser ([model] reasoning_parser)"
TOOL_FLAG = "--tool-call-parser ([model] tool_parser)"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True)
class Parsers:
    """A server's parsers: their names, and vLLM's composed parser class and tokenizer
    where vLLM's run them (None: pdd's own)."""

    reasoning: str = ""
    tool: str = ""
    vllm_class: Any = None
    vllm_tokenizer: Any = None

    def assistant(
        self, plan: ToolPlan | None, prompt: Sequence[int], kwargs: dict[str, Any], include_reasoning: bool
    ) -> Assistant:
        """A reader of one choice's text into thinking, content and calls. `kwargs`: the
        request's chat_template_kwargs (Qwen3's `enable_thinking: false` says the output
        starts after the thinking)."""
        forced = plan.output(self.tool) if plan is not None and plan.forced else None
        if forced is not None:  # (held by the grammar from its first token: no thinking to split)
            return Assistant(None, forced, include_reasoning)
        if self.vllm_class is None:
            think = splitter(self.reasoning, kwargs) if self.reasoning else None
            tools = plan.output(self.tool) if plan is not None else None
            return Assistant(think, tools, include_reasoning)
        return VllmAssistant(self, plan, list(prompt), kwargs, include_reasoning)


def choose_parsers(
    reasoning: str, tool: str, plugin: str, model_dir: Path | None, chat_template: str | None
) -> Parsers:
    """The parsers a server runs (module doc); a `Mistake` naming the known ones for a name
    nobody registers, or one the model's tokenizer cannot serve (a parser whose special
    tokens it lacks)."""
    if not (reasoning or tool or plugin):
        return Parsers("", default_tool_parser(chat_template))
    if not vllm_installed():
        if plugin:
            raise Mistake("--tool-parser-plugin needs vLLM (the extra pdd-serving[vllm])")
        _known(REASONING_FLAG, reasoning, REASONING_PARSERS, " (vLLM's others: the extra pdd-serving[vllm])")
        _known(TOOL_FLAG, tool, TOOL_PARSERS, " (vLLM's others: the extra pdd-serving[vllm])")
        return Parsers(reasoning, tool or default_tool_parser(chat_template))
    from vllm.parser.parser_manager import ParserManager
    from vllm.reasoning import ReasoningParserManager
    from vllm.tokenizers import get_tokenizer
    from vllm.tool_parsers import ToolParserManager

    if plugin:
        from vllm.utils.import_utils import import_plugin  # (what ToolParserManager.import_tool_parser runs)

        try:  # a module name, or a file's path
            loaded = import_plugin(plugin)
        except Exception as e:  # (the module's own error)
            raise Mistake(f"--tool-parser-plugin {plugin}: cannot load it ({e})") from None
        if loaded is None:  # (vLLM's loader logs why)
            raise Mistake(f"--tool-parser-plugin {plugin}: cannot load it (no such module or file)")
    _known(REASONING_FLAG, reasoning, ReasoningParserManager.list_registered())
    _known(TOOL_FLAG, tool, ToolParserManager.list_registered())
    tool = tool or default_tool_parser(chat_template)
    if model_dir is None:
        raise Mistake("vLLM's parsers need the model's tokenizer files")
    tokenizer = get_tokenizer(str(model_dir))
    try:
        cls = ParserManager.get_parser(
            tool_parser_name=tool or None,
            reasoning_parser_name=reasoning or None,
            enable_auto_tools=bool(tool),
            tokenizer=tokenizer,
        )
    except (TypeError, KeyError, RuntimeError, ValueError) as e:
        raise Mistake(str(e).replace("\n", " ")) from None
    return Parsers(reasoning, tool, cls, tokenizer)


def _known(flag: str, name: str, known: Sequence[str], more: str = "") -> None:
    if name and name not in known:
        raise Mistake(f"{flag} {name!r} is not a parser pdd knows; it knows {', '.join(sorted(known))}{more}")


class VllmAssistant(Assistant):
    """One choice read by vLLM's parser: thinking by its reasoning parser, calls by its tool
    parser under `auto` (`none`: all content); with
    `parallel_tool_calls: false` only the first call, as vLLM's server keeps it. Fed once
    whole (`parse`) or piece by piece (`parse_delta`); nothing after the last piece."""

    def __init__(
        self,
        parsers: Parsers,
        plan: ToolPlan | None,
        prompt: list[int],
        kwargs: dict[str, Any],
        include_reasoning: bool,
    ) -> None:
        super().__init__(None, None, include_reasoning)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        choice = plan.choice if plan is not None else "none"
        functions = [f.template_form() for f in plan.functions] if plan is not None else None
        self._request = ChatCompletionRequest.model_validate(
            {"messages": [], "tools": functions, "tool_choice": choice, "include_reasoning": include_reasoning}
        )
        self._parser = parsers.vllm_class(parsers.vllm_tokenizer, self._request.tools, chat_template_kwargs=kwargs)
        self._reasons = bool(parsers.reasoning)
        self._parallel = plan is None or plan.parallel
        self._prompt = prompt
        self._auto: list[ToolCall] = []
        self._state = "new"  # new -> streaming -> done

    @property
    def reasons(self) -> bool:
        return self._reasons

    @property
    def calls(self) -> list[ToolCall]:
        return self._auto

    def feed(self, text: str, final: bool, ids: Sequence[int] = ()) -> tuple[str, str, list[CallDelta]]:
        if self._state == "done":
            return "", "", []
        whole, self._state = self._state == "new" and final, "done" if final else "streaming"
        if whole:
            self._parser.set_prompt_token_ids(self._prompt)
            reasoning, content, found = self._parser.parse(
                text, self._request, enable_auto_tools=True, model_output_token_ids=list(ids)
            )
            deltas = [self._whole_call(c.id, c.name, c.arguments) for c in found or []]
        else:
            said = self._parser.parse_delta(text, list(ids), self._request, self._prompt, finished=final)
            reasoning, content = (said.reasoning, said.content) if said is not None else ("", "")
            deltas = [d for t in (said.tool_calls if said is not None else []) if (d := self._streamed_call(t))]
        if not self._parallel:
            deltas = [d for d in deltas if d.index == 0]
            del self._auto[1:]
        return self._said(reasoning or "", content or "", deltas)

    def _whole_call(self, id_: str | None, name: str, arguments: str) -> CallDelta:
        self._auto.append(ToolCall(id_ or call_id(), name, arguments))
        return CallDelta(len(self._auto) - 1, arguments, self._auto[-1].id, name)

    def _streamed_call(self, delta: Any) -> CallDelta | None:
        """A call piece of vLLM's stream (`DeltaToolCall`) as pdd's; the call kept."""
        function = delta.function
        name, arguments = (function.name, function.arguments or "") if function is not None else (None, "")
        if delta.index >= len(self._auto):
            self._auto.append(ToolCall(delta.id or call_id(), name or "", arguments))
            return CallDelta(delta.index, arguments, self._auto[-1].id, name or "")
        call = self._auto[delta.index]
        call.arguments += arguments
        return CallDelta(delta.index, arguments) if arguments else None
