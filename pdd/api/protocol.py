"""OpenAI request shapes and the OpenAI error shape.

Types are strict where OpenAI's are (a string max_tokens is an error, not a guess).
Nothing is dropped in silence: a parameter pdd does not honour is refused by name with a
400 (`param` set) unless its value is the one at which it changes nothing, and a
parameter nobody knows is refused too; the few that change nothing here whatever their
value (`INERT`: what clients send by default) are accepted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
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

from pdd.api.errors import ApiError
from pdd.api.messages import ChatMessage
from pdd.api.tools import Function, ToolPlan

__all__ = ["ApiError", "ChatMessage"]  # (where the API's modules have always found them)


def _neutral(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


def _empty(v: Any) -> bool:
    return not v


# OpenAI's and vLLM's parameters pdd does not honour, each with the test that its value
# changes nothing (a client library's default): such a value is served, any other refused
NOT_HONOURED: dict[str, Callable[[Any], bool]] = {
    "tools": _empty,  # (on completions; chat declares its own)
    "functions": _empty,  # (OpenAI's deprecated forms of tools and tool_choice)
    "tool_choice": _neutral(None, "none", "auto"),  # (with no tools: nothing to choose)
    "function_call": _neutral(None, "none", "auto"),
    "best_of": _neutral(None, 1),
    "suffix": _neutral(None, ""),
    "reasoning_effort": _neutral(None),
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _neutral(None),
    "prediction": _neutral(None),
    "web_search_options": _neutral(None),
    "include_stop_str_in_output": _neutral(None, False),
    "skip_special_tokens": _neutral(None, True),
    # vLLM's own, each at the value at which it changes nothing (what its clients send by default)
    "echo": _neutral(None, False),  # (on chat; completions' echo is honoured)
    "add_generation_prompt": _neutral(None, True),
    "continue_final_message": _neutral(None, False),
    "spaces_between_special_tokens": _neutral(None, True),
    "use_beam_search": _neutral(None, False),
    "length_penalty": _neutral(None, 1, 1.0),
    "priority": _neutral(None, 0),
    "bad_words": _empty,
    "allowed_token_ids": _neutral(None),
    "logprob_token_ids": _neutral(None),
    "return_tokens_as_token_ids": _neutral(None, False),
    "return_token_offsets": _neutral(None, False),
    "return_prompt_text": _neutral(None, False),
    "return_mm_kwargs": _neutral(None, False),
    "truncate_prompt_tokens": _neutral(None),
    "truncation_side": _neutral(None),
    "thinking_token_budget": _neutral(None),
    "repetition_detection": _neutral(None),
    "documents": _neutral(None),
    "chat_template": _neutral(None),
    "media_io_kwargs": _neutral(None),
    "mm_processor_kwargs": _neutral(None),
    "mm_payload": _neutral(None),
    "prompt_embeds": _neutral(None),
    "vllm_xargs": _neutral(None),
    "kv_transfer_params": _neutral(None),
    "ec_transfer_params": _neutral(None),
    "routed_experts_prompt_start": _neutral(None),
    "watermarking": _neutral(None, False),
    "enable_response_messages": _neutral(None, False),
    "previous_input_messages": _neutral(None),
    "stream_interval": _neutral(None, 1),
}
# what changes nothing here whatever its value: bookkeeping a client sends by default, and
# vLLM's `return_token_ids` (pdd puts `token_ids` on every choice and chunk regardless)
INERT = frozenset(
    {
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "prompt_cache_key",
        "safety_identifier",
        "return_token_ids",
        "session_id",  # (vLLM's: a conversation's identity, for its routing and logs)
    }
)


def unhonoured(extra: dict[str, Any] | None, where: str = "") -> ApiError | None:
    """The error for the first of `extra` (fields a request model does not declare) that
    pdd does not honour at its value, or knows nothing of; None if they change nothing."""
    for key, value in (extra or {}).items():
        if key in INERT or (key in NOT_HONOURED and NOT_HONOURED[key](value)):
            continue
        said = "is not supported by pdd" if key in NOT_HONOURED else "is not a parameter pdd knows"
        return ApiError(400, f"{where}{key} {said} (README: what pdd honours)", param=f"{where}{key}")
    return None


MAX_N = 16  # choices a request may ask for (each is a generation of its own)


def _response_format(fmt: dict[str, Any]) -> tuple[str, str] | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", ""
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(
                400, "response_format.json_schema.schema must be a JSON Schema object", param="response_format"
            )
        return "json_schema", json.dumps(schema)
    raise ApiError(
        400, f"response_format type {kind!r} is not text, json_object or json_schema", param="response_format"
    )


def _structured_outputs(so: dict[str, Any]) -> tuple[str, str]:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""
    given = {k: v for k, v in so.items() if v is not None and v is not False}
    if len(given) != 1 or next(iter(given)) not in ("json", "regex", "choice", "grammar", "json_object"):
        raise ApiError(
            400, "structured_outputs takes one of json, regex, choice, grammar, json_object", param="structured_outputs"
        )
    (key, value), where = next(iter(given.items())), "structured_outputs"
    if key == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        if not isinstance(schema, dict):
            raise ApiError(400, "structured_outputs.json must be a JSON Schema", param=where)
        return "json_schema", json.dumps(schema)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ApiError(400, "structured_outputs.choice must be a list of strings", param=where)
        return "choice", json.dumps(value)
    if key == "json_object":
        return "json_object", ""
    if not isinstance(value, str):
        raise ApiError(400, f"structured_outputs.{key} must be a string", param=where)
    return key, value


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # to name what is refused (`refuse_unhonoured`)

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt | None = None  # (None: the model's default, else 1)
    top_p: StrictFloat | StrictInt | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    logprobs: StrictBool | StrictInt | None = None
    prompt_logprobs: StrictInt | None = None  # vLLM's: each prompt token's, and this many top ones beside it
    user: StrictStr | None = None
    cache_salt: StrictStr | None = None  # vLLM's: a prefix-cache namespace shared only by requests that give it
    # vLLM's: the tokenizer's own special tokens (a BOS) added to the prompt's text (None: a
    # completion's are, a chat's are not, as the chat template writes its own)
    add_special_tokens: StrictBool | None = None
    # logit shaping (`pdd.sampling.params.SamplingParams`): OpenAI's, and vLLM's extensions
    presence_penalty: StrictFloat | StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None
    repetition_penalty: StrictFloat | StrictInt | None = None
    logit_bias: dict[StrictStr, StrictFloat | StrictInt] | None = None  # token id (as a string) -> bias
    min_p: StrictFloat | StrictInt | None = None
    min_tokens: StrictInt | None = None
    # constrained decoding (`pdd.sampling.guide`): OpenAI's response_format, vLLM's structured_outputs
    response_format: dict[StrictStr, Any] | None = None
    structured_outputs: dict[StrictStr, Any] | None = None

    def guide(self) -> tuple[str, str] | None:
        """The request's guide (kind, spec) for `SamplingParams.guide`; None without one.
        ApiError 400 naming the field for a shape pdd does not know."""
        if self.response_format is not None and self.structured_outputs:
            raise ApiError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        if self.response_format is not None:
            return _response_format(self.response_format)
        if self.structured_outputs:
            return _structured_outputs(self.structured_outputs)
        return None

    def refuse_unhonoured(self) -> None:
        """ApiError 400 for what this request asks and pdd would not do (module doc)."""
        if not 1 <= self.n <= MAX_N:
            raise ApiError(400, f"n must be 1 to {MAX_N}", param="n")
        if error := unhonoured(self.model_extra):
            raise error

    def top_logprobs_asked(self) -> int | None:
        """How many top tokens beside each chosen one, where logprobs are asked (None: off)."""
        raise NotImplementedError

    def prompt_logprobs_asked(self) -> int | None:
        """How many top tokens beside each prompt token, where the prompt's are asked."""
        return self.prompt_logprobs

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool = False

    def top_logprobs_asked(self) -> int | None:
        """Completions' `logprobs`: how many top tokens beside each chosen one (None: off)."""
        if self.logprobs is None or isinstance(self.logprobs, bool):
            if self.logprobs:
                raise ApiError(400, "logprobs is a number of top tokens on completions", param="logprobs")
            return None
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        """vLLM's `prompt_logprobs`; or with `echo`, `logprobs` covers the prompt too."""
        if self.echo and self.prompt_logprobs is None:
            return self.top_logprobs_asked()
        return self.prompt_logprobs


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDef(_Strict):
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[StrictStr, Any] | None = None  # a JSON Schema of the arguments
    strict: StrictBool | None = None  # (the arguments always follow it where a call is forced)


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    top_logprobs: StrictInt | None = None
    chat_template_kwargs: dict[StrictStr, Any] | None = None  # the template's own variables (vLLM's)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    include_reasoning: StrictBool = True  # vLLM's: false leaves a reasoning parser's thinking out of the answer

    def tool_plan(self) -> ToolPlan | None:
        """The request's tools and what it asks of them (None: no tools); a 400 for a
        choice that names no tool it gives."""
        choice = self.tool_choice
        name = choice.function.name if isinstance(choice, NamedToolChoice) else choice
        return tool_plan(
            [(t.function.name, t.function.description, t.function.parameters) for t in self.tools or []],
            name,
            self.parallel_tool_calls,
        )

    def guide(self) -> tuple[str, str] | None:
        """The output's grammar: a forced tool call's, or else the response format's (which
        holds text, and a forced call writes none: as OpenAI's, both may be given)."""
        plan = self.tool_plan()
        if plan is not None and plan.forced:
            super().guide()  # (still checked)
            return plan.grammar()
        return super().guide()

    def top_logprobs_asked(self) -> int | None:
        """Chat's `logprobs` (true/false) and `top_logprobs` (how many beside each token)."""
        if not isinstance(self.logprobs, bool | None):
            raise ApiError(400, "logprobs is true or false on chat completions", param="logprobs")
        if self.top_logprobs and not self.logprobs:  # (0, vLLM's default, asks nothing)
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def refuse_unhonoured(self) -> None:
        super().refuse_unhonoured()
        self.tool_plan()
        for i, message in enumerate(self.messages):
            if error := message.refused(f"messages[{i}]."):
                raise error


def tool_plan(
    functions: list[tuple[str, str | None, dict[str, Any] | None]], choice: str | None, parallel: bool | None
) -> ToolPlan | None:
    """A request's `ToolPlan` from its functions (name, description, parameters) and its
    tool_choice (none, auto, required or a function's name; None: auto where tools are
    given); a 400 naming `tool_choice` for one that cannot be."""
    if not functions:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        return None
    names = [name for name, _, _ in functions]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools must have distinct names", param="tools")
    choice = choice or "auto"
    if choice not in ("none", "auto", "required") and choice not in names:
        raise ApiError(400, f"tool_choice names {choice!r}, which is not among the tools", param="tool_choice")
    return ToolPlan(tuple(Function(*f) for f in functions), choice, parallel is not False)
