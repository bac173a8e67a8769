"""What agents call, on `pdd serve` as a real process: chat tools and tool calls (required,
named, auto, none; whole and streamed), the Responses API, and the OpenAI Agents SDK on both."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from procs import HTTP, standalone
from pydantic import BaseModel

from pdd.model.tokenizer import Tokenizer

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": ZONE}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with standalone(tiny_model_dir) as url:
        yield url


def stream_chat(client: openai.OpenAI, **ask) -> dict:
    """A streamed chat completion put together: content, calls by index, finish, record."""
    said: dict = {"content": "", "calls": {}, "finish": None, "record": None}
    for chunk in client.chat.completions.create(**ask, stream=True):
        said["record"] = (chunk.model_extra or {}).get("pdd") or said["record"]
        for c in chunk.choices:
            said["content"] += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                call = said["calls"].setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or t.id
                call["name"] += t.function.name or ""
                call["arguments"] += t.function.arguments or ""
            said["finish"] = c.finish_reason or said["finish"]
    return said


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_a_forced_call_follows_its_schema_whole_and_streamed(server):
    """`required` (one call, as parallel_tool_calls is false) and a named function: the
    grammar forces a call whatever the random weights; its arguments validate against the
    function's schema, with finish_reason "tool_calls", and the stream's deltas add up to
    the whole response."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, extra in (("required", {"parallel_tool_calls": False}), (named, {})):
        ask = {"model": "tiny", "messages": CHAT, "tools": TOOLS, "tool_choice": choice, "max_tokens": 100,
               "temperature": 0, **extra}
        whole = client.chat.completions.create(**ask).choices[0]
        calls = _calls(whole.message)
        assert whole.finish_reason == "tool_calls" and whole.message.content is None and len(calls) == 1, whole
        name, arguments = calls[0]
        assert choice == "required" or name == "get_weather"
        jsonschema.validate(arguments, SCHEMAS[name])
        streamed = stream_chat(client, **ask)
        assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == calls
        assert all(c["id"].startswith("call_") for c in streamed["calls"].values())


def test_auto_calls_are_parsed_out_of_the_text_and_none_leaves_them(server):
    """`auto`: the Hermes parser (chosen from the tiny model's template) reads calls out of
    the text, whole and streamed; here a regex makes the model write one call after some
    content. `none`: the same text stays content. Without a call, auto is all content."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    ask = {"model": "tiny", "messages": CHAT, "tools": TOOLS, "max_tokens": 60, "temperature": 0,
           "extra_body": {"structured_outputs": {"regex": "[a-z]{2,5} " + re.escape(call)}}}
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls" and _calls(whole.message) == [("get_time", {"tz": "UTC"})], whole
    content = whole.message.content
    assert re.fullmatch("[a-z]{2,5} ", content), content
    streamed = stream_chat(client, **ask)
    assert streamed["content"] == content and streamed["finish"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == _calls(whole.message)
    left = client.chat.completions.create(**ask, tool_choice="none").choices[0]
    assert left.finish_reason == "stop" and left.message.tool_calls is None and left.message.content.endswith(call)
    plain = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=8, temperature=0)
    assert plain.choices[0].finish_reason == "length" and plain.choices[0].message.tool_calls is None


def test_tools_and_a_call_history_reach_the_template(server, tiny_model_dir):
    """The prompt is the chat template rendered with the tools, the assistant's calls and the
    tool's result, exactly as `transformers` renders it."""
    transformers = pytest.importorskip("transformers")
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = HTTP.post(f"{server}/v1/chat/completions", json={"model": "tiny", "messages": history, "tools": TOOLS,
                                                          "max_tokens": 1, "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    history[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": 2}  # (as transformers reads it)
    expected = hf.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\nsunny\n</tool_response>" in expected and '"arguments": {"city": "Paris"' in expected
    assert r.json()["usage"]["prompt_tokens"] == len(Tokenizer.from_dir(tiny_model_dir).encode(expected))
    # and without tools, the template renders what it did before it knew of them
    plain = Tokenizer.from_dir(tiny_model_dir).apply_chat_template(CHAT)
    assert plain == ("<|begin_of_text|><|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n"
                     "Weather in Paris?<|im_end|>\n<|im_start|>assistant\n")


class Sky(BaseModel):
    sky: Literal["sunny", "rainy"]


RESPONSE_TOOLS = [{"type": "function", "name": "get_weather", "description": "forecast", "parameters": WEATHER,
                   "strict": True}]


def test_responses_text_and_function_tools_whole_and_streamed(server):
    """/v1/responses through the official client: text (cut at max_output_tokens: status
    incomplete), a required function call whose arguments follow the schema, its output
    given back in the next turn, and the same as streamed events, in OpenAI's order."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    text = client.responses.create(model="tiny", input="hello", max_output_tokens=10, temperature=0)
    assert text.status == "incomplete" and text.incomplete_details.reason == "max_output_tokens"
    assert text.usage.output_tokens == 10 and text.output_text
    ask = {"model": "tiny", "input": "Weather?", "instructions": "Be brief.", "tools": RESPONSE_TOOLS,
           "tool_choice": "required", "max_output_tokens": 60, "temperature": 0}
    called = client.responses.create(**ask)
    (call,) = called.output
    assert called.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    turn = [{"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    answer = client.responses.create(model="tiny", input=turn, tools=RESPONSE_TOOLS, max_output_tokens=5, temperature=0)
    assert answer.output[0].type == "message" and answer.usage.input_tokens > text.usage.input_tokens
    chat = HTTP.post(f"{server}/v1/chat/completions", timeout=30, json={
        "model": "tiny", "max_tokens": 5, "temperature": 0, "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "forecast", "parameters": WEATHER, "strict": True}}],
        "messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
                     {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]}).json()
    assert answer.output_text == chat["choices"][0]["message"]["content"]  # the same turn, as a chat completion
    with client.responses.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * (len(kinds) - 6),
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [(o.name, o.arguments) for o in final.output] == [(call.name, call.arguments)]
    r = HTTP.post(f"{server}/v1/responses", json={"model": "tiny", "input": "hi", "stream": True,
                                                   "max_output_tokens": 4}, timeout=30)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["usage"]["output_tokens"] == 4
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == events[-1]["response"]["output"][0]["content"][0]["text"]


@pytest.mark.parametrize("body,param", [
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": "hi", "name": "bob"}]}, "input[0].name"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x", "extra": 1}]}, "input[0].extra"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_responses_refuse_what_they_do_not_honour_by_name(server, body, param):
    r = HTTP.post(f"{server}/v1/responses", json={"model": "tiny", "input": "hi", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_agents_sdk_runs_a_tool_using_turn_on_both_apis(server):
    """The OpenAI Agents SDK, on the Responses API (its default) and on chat completions:
    the first turn must call the tool (the grammar makes the random model do it), the SDK
    runs it with arguments that follow its schema, and the next turn answers."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen: list[dict] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"], unit: Literal["C", "F"]) -> str:
        """The forecast for a city."""
        seen.append({"city": city, "unit": unit})
        return "sunny"

    settings = agents.ModelSettings(tool_choice="required", max_tokens=60, temperature=0)

    async def run(api: type) -> agents.RunResult:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none")
        # the answer is held to its schema too, so the random model ends it
        agent = agents.Agent(name="forecaster", instructions="Be brief.", tools=[get_weather],
                             model=api("tiny", client), model_settings=settings, output_type=Sky)
        try:
            return await agents.Runner.run(agent, "Weather in Paris?", max_turns=3)
        finally:
            await client.close()

    for api in (agents.OpenAIResponsesModel, agents.OpenAIChatCompletionsModel):
        result = asyncio.run(run(api))
        kinds = [item.type for item in result.new_items]
        assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
        assert result.final_output.sky in ("sunny", "rainy")
    assert len(seen) == 2 and all(s["city"] in ("Paris", "Oslo") and s["unit"] in ("C", "F") for s in seen)
