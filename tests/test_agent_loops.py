"""The agent frameworks' own loops, unchanged, through `pdd up --mode pdd` with every
request handed over from the relay to MD: the OpenAI Agents SDK (a chat-completions model
and a Responses model, the latter continuing its conversation by `previous_response_id`),
LangChain (`ChatOpenAI(...).bind_tools(...)`, its messages carrying `name`) and LiteLLM
(`completion` with tools, streamed). Two tools, three turns each, vLLM's `qwen3`
reasoning parser and `qwen3_xml` tool parser on: what each framework sends back of an answer
(its thinking, its calls, their results) is taken.

The random model writes whatever its weights say, so the output is held by the grammar:
a forced call's (`tool_choice: required`, the frameworks' first model call of a turn), and
a regex guide's for the answer after it (thinking, then words)."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Literal

import jsonschema
import openai
import pytest
from parser_model import marker_model
from procs import HTTP, pdd_up
from test_tool_parsers import NO_THINKING, two_calls, write_config

pytest.importorskip("vllm")  # (the deployment runs vLLM's parsers by name)

# an auto turn: thinking, then words (long enough that MD takes it over from the relay)
ANSWER = r"<think>([a-z]{3,8} ){5}[a-z]{3,8}</think>([a-z]{3,8} ){7}[a-z]{3,8}"
GUIDE = {"structured_outputs": {"regex": ANSWER}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "the time", "parameters": ZONE}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": ZONE}
ASKED = ["Weather in Paris?", "And the time there?", "Thanks, and in Oslo?"]


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    return marker_model(tiny_model_dir, tmp_path_factory.getbasetemp() / "marker-model")


@pytest.fixture(scope="module")
def dep(model, tmp_path_factory):
    """A Qwen3-like deployment: vLLM's qwen3 reasoning parser and its qwen3_xml tool parser."""
    conf = write_config(tmp_path_factory.mktemp("loops") / "pdd.toml", model, reasoning_parser="qwen3",
                        tool_parser="qwen3_xml")
    with pdd_up("--config", conf) as d:
        yield d


def test_qwen3_xml_calls_beside_the_qwen3_reasoning_parser_through_a_handoff(dep, model):
    """vLLM's third format here (tests/test_tool_parsers.py has the others): two XML calls,
    whole and streamed, as vLLM's own parsers read them, with the thinking switched off."""
    two_calls(dep.url, "qwen3_xml", model, reasoning="qwen3")


def _served(dep) -> tuple[int, int, int]:
    """(requests the router finished, of them through the relay, of them handed over to MD)."""
    stats = HTTP.get(f"{dep.url}/pdd/stats", timeout=10).json()
    done = sum(v for k, v in stats.items() if k.startswith("pipeline:"))
    return done, stats.get("pipeline:P-RLD-MD", 0), stats.get("handoff:catch_up", 0)


def _all_handed_over(dep, before: tuple[int, int, int], requests: int) -> None:
    """Every request went through the relay, and most were handed over to MD mid-answer:
    a short turn (a tool call of a few tokens) may end on the relay before MD's copy of
    its KV lands, which on two loaded cores happens to one turn in several."""
    done, relayed, handed = (a - b for a, b in zip(_served(dep), before, strict=True))
    assert done == requests and relayed == requests and 2 * handed > requests, (done, relayed, handed, requests)


def test_the_agents_sdk_runs_three_turns_with_two_tools_on_both_apis(dep):
    """Each turn: the SDK's first call must call a tool (required: the grammar makes the
    random model do it), the SDK runs it with arguments that follow its schema, and (its
    tool choice reset, as the SDK does) the next call answers, thinking first. Chat model:
    the next turn sends the whole history back (with the thinking); Responses model: only
    the new message, after the last response's id (pdd's store holds the rest)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen: list[tuple[str, dict]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"], days: int) -> str:
        """The forecast for a city."""
        seen.append(("get_weather", {"city": city, "days": days}))
        return "sunny"

    @agents.function_tool
    def get_time(tz: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        seen.append(("get_time", {"tz": tz}))
        return "noon"

    settings = agents.ModelSettings(tool_choice="required", max_tokens=120, temperature=0, extra_body=GUIDE)

    async def three_turns(api: type) -> list:
        client = openai.AsyncOpenAI(base_url=f"{dep.url}/v1", api_key="none", max_retries=0)
        agent = agents.Agent(name="planner", instructions="Be brief.", tools=[get_weather, get_time],
                             model=api("tiny", client), model_settings=settings)
        results, history, last = [], [], None
        try:
            for asked in ASKED:
                if api is agents.OpenAIResponsesModel and last is not None:  # the store holds the rest
                    result = await agents.Runner.run(agent, asked, max_turns=3, previous_response_id=last)
                else:
                    result = await agents.Runner.run(agent, [*history, {"role": "user", "content": asked}],
                                                     max_turns=3)
                results.append(result)
                history, last = result.to_input_list(), result.last_response_id
        finally:
            await client.close()
        return results

    for api in (agents.OpenAIChatCompletionsModel, agents.OpenAIResponsesModel):
        before = _served(dep)
        results = asyncio.run(three_turns(api))
        for result in results:
            kinds = [item.type for item in result.new_items]
            assert kinds[0] == "tool_call_item" and kinds[-2:] == ["reasoning_item", "message_output_item"], kinds
            assert result.final_output and " " in result.final_output
        _all_handed_over(dep, before, 2 * len(ASKED))
    assert len(seen) >= 6
    own = {t.name: t.params_json_schema for t in (get_weather, get_time)}  # (the SDK's schemas of its tools)
    for name, arguments in seen:
        jsonschema.validate(arguments, own[name])


def test_a_langchain_loop_sends_names_and_runs_its_tools(dep):
    """`ChatOpenAI(...).bind_tools(...)`: the first call must call (tool_choice required),
    LangChain's own tools run on its ToolCalls, their ToolMessages go back with the
    AIMessage (and a HumanMessage's `name`), for three turns of the conversation."""
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "Oslo"], days: int) -> str:
        """The forecast for a city."""
        return "sunny"

    @tool
    def get_time(tz: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        return "noon"

    tools = {t.name: t for t in (get_weather, get_time)}
    llm = lc.ChatOpenAI(model="tiny", base_url=f"{dep.url}/v1", api_key="none", temperature=0, max_tokens=120,
                        max_retries=0, extra_body=GUIDE)
    # (strict: LangChain closes the schemas, else the grammar lets the random model add keys)
    calling = llm.bind_tools(list(tools.values()), tool_choice="required", strict=True)
    answering = llm.bind_tools(list(tools.values()), strict=True)
    messages: list = [SystemMessage("Be brief.")]
    before = _served(dep)
    for asked in ASKED:
        messages.append(HumanMessage(asked, name="alice"))
        called = calling.invoke(messages)
        assert isinstance(called, AIMessage) and called.tool_calls, called
        messages.append(called)
        for call in called.tool_calls:
            jsonschema.validate(call["args"], SCHEMAS[call["name"]])
            messages.append(tools[call["name"]].invoke(call))  # (a ToolMessage, its call's id)
        answered = answering.invoke(messages)
        assert not answered.tool_calls and " " in answered.content, answered
        messages.append(answered)
    _all_handed_over(dep, before, 2 * len(ASKED))


def test_a_litellm_loop_streams_calls_and_answers(dep):
    """`litellm.completion` with tools, streamed: the chunks put together by LiteLLM hold the
    forced calls; the assistant message and the tools' results (with their `name`, as
    LiteLLM's docs write them) go back, and the streamed answer follows, three times."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (no fetch of its price list)
    litellm = pytest.importorskip("litellm")
    # thinking off (Qwen3's switch), words only: streamed, vLLM's engine-based qwen3 parsers find the
    # end of the thinking by its token's ID, and the random model may spell `</think>` in pieces
    words = {"structured_outputs": {"regex": r"([a-z]{3,8} ){15}[a-z]{3,8}"}, "chat_template_kwargs": NO_THINKING}
    ask = {"model": "openai/tiny", "api_base": f"{dep.url}/v1", "api_key": "none", "temperature": 0,
           "max_tokens": 120, "tools": TOOLS, "extra_body": words, "stream": True}
    messages: list[dict] = [{"role": "system", "content": "Be brief."}]
    before = _served(dep)
    for asked in ASKED:
        messages.append({"role": "user", "content": asked})
        chunks = list(litellm.completion(messages=messages, tool_choice="required", **ask))
        called = litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message
        assert called.tool_calls, called
        messages.append(called.model_dump(exclude_none=True))
        for call in called.tool_calls:
            arguments = json.loads(call.function.arguments)
            jsonschema.validate(arguments, SCHEMAS[call.function.name])
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": "sunny" if call.function.name == "get_weather" else "noon"})
        text = "".join(c.choices[0].delta.content or "" for c in litellm.completion(messages=messages, **ask)
                       if c.choices)
        assert " " in text, text
        messages.append({"role": "assistant", "content": text})
    _all_handed_over(dep, before, 2 * len(ASKED))
