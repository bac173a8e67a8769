"""The parsers by name (`pdd.api.parsers`): pdd's own `hermes`, `qwen3` and `deepseek_r1`
(for installs without vLLM) give what the pinned vLLM's give on the same text, whole and
streamed token by token; a name nobody registers is one line naming the known ones; an
out-of-tree parser loads from `--tool-parser-plugin` as vLLM loads it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from parser_model import marker_model

from pdd.api.parsers import Parsers, choose_parsers
from pdd.api.protocol import tool_plan
from pdd.errors import Mistake

vllm = pytest.importorskip("vllm")

ZONE = {"type": "object", "properties": {"tz": {"type": "string"}}}
FUNCTIONS = [("get_time", None, ZONE), ("get_weather", "forecast", {"type": "object"})]
# texts vLLM reads the same whole and streamed (its own edge cases differ between the two:
# deepseek_r1's whole reading of a <think> after text keeps only what follows it)
REASONING_TEXTS = ["<think>a b</think>c d", "a b</think>c d", "<think>a b</think>c", "a b", "a\n</think>\n\nb",
                   "x <think> y</think>z", ""]
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
HERMES_TEXTS = ["no call", f"hi {CALL}", f"{CALL}{CALL.replace('UTC', 'CET')}", f"a {CALL} b {CALL}c"]
MARKERS = ("<|python_tag|>", "<think>", "</think>", "<tool_call>", "</tool_call>")


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return marker_model(tiny_model_dir, tmp_path_factory.getbasetemp() / "marker-model")


def _read(parsers: Parsers, tokenizer, text: str, kwargs: dict, whole: bool) -> dict:
    """One choice's text read by `parsers`, whole or token by token: what it says."""
    plan = tool_plan(FUNCTIONS, "auto", True) if parsers.tool else None
    reader = parsers.assistant(plan, [1, 2], kwargs, True)
    ids = _encode(tokenizer, text)
    if whole or not ids:
        reader.feed(text, final=True, ids=ids)
    else:
        before = ""
        for i in range(len(ids)):
            now = tokenizer.decode(ids[: i + 1])
            reader.feed(now[len(before) :], final=i == len(ids) - 1, ids=ids[i : i + 1])
            before = now
    message = reader.message()
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    return {"reasoning": message.get("reasoning") or "", "content": message["content"] or "", "calls": calls}


def _encode(tokenizer, text: str) -> list[int]:
    """`text`'s token IDs as a model with the marker tokens writes it: each marker one token
    (vLLM's streaming parsers find them by ID)."""
    ids: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, MARKERS)) + ")", text):
        if part in MARKERS:
            ids.append(tokenizer.get_vocab()[part])
        elif part:
            ids += tokenizer.encode(part, add_special_tokens=False)
    return ids


@pytest.mark.parametrize("reasoning,tool,texts", [
    ("qwen3", "", REASONING_TEXTS), ("deepseek_r1", "", REASONING_TEXTS[:-2] + [""]), ("", "hermes", HERMES_TEXTS)])
def test_pdds_own_parsers_give_what_vllms_give(model, reasoning, tool, texts):
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(model))
    theirs = choose_parsers(reasoning, tool, "", model, None)
    assert theirs.vllm_class is not None  # (vLLM is installed: its own classes run)
    ours = Parsers(reasoning, tool)
    for text in texts:
        for kwargs in ({}, {"enable_thinking": False}):
            for whole in (True, False):
                want = _read(theirs, tokenizer, text, kwargs, whole)
                assert _read(ours, tokenizer, text, kwargs, whole) == want, (text, kwargs, whole)


def test_an_unknown_parser_is_one_line_naming_the_known_ones(model):
    cases = [(("qwen9", "", ""), "--reasoning-parser", ("qwen3", "deepseek_r1")),
             (("", "hermes2", ""), "--tool-call-parser", ("hermes", "llama3_json", "pythonic", "qwen3_xml"))]
    for args, flag, known in cases:
        with pytest.raises(Mistake) as e:
            choose_parsers(*args, model, None)
        said = str(e.value)
        assert "\n" not in said and said.startswith(f"{flag} (") and "is not a parser pdd knows" in said
        assert all(name in said for name in known), said


def test_a_tool_parser_plugin_registers_a_parser_by_its_name(model, tmp_path):
    """`--tool-parser-plugin FILE`: vLLM's loader runs the file, whose parser registers
    itself with vLLM's manager; its name is then one pdd takes, and its class reads."""
    plugin = tmp_path / "shout_parser.py"
    plugin.write_text('''
from vllm.entrypoints.generate.base.protocol import ExtractedToolCallInformation, FunctionCall, ToolCall
from vllm.tool_parsers import ToolParser, ToolParserManager


@ToolParserManager.register_module("shout")
class ShoutParser(ToolParser):
    """A call is a line `CALL name`; anything else is content."""

    def extract_tool_calls(self, model_output, request):
        calls = [ToolCall(function=FunctionCall(name=line[5:], arguments="{}"))
                 for line in model_output.splitlines() if line.startswith("CALL ")]
        return ExtractedToolCallInformation(tools_called=bool(calls), tool_calls=calls,
                                            content=None if calls else model_output)
''')
    with pytest.raises(Mistake, match="'shout' is not a parser pdd knows"):
        choose_parsers("", "shout", "", model, None)
    parsers = choose_parsers("", "shout", str(plugin), model, None)
    reader = parsers.assistant(tool_plan(FUNCTIONS, "auto", True), [1], {}, True)
    reader.feed("CALL get_time", final=True)
    assert [(c.name, c.arguments) for c in reader.calls] == [("get_time", "{}")]
    with pytest.raises(Mistake, match="--tool-parser-plugin .*cannot load it"):
        choose_parsers("", "", str(tmp_path / "missing.py"), model, None)


def test_without_vllm_pdds_own_parsers_serve_and_name_theirs(model, monkeypatch):
    """An install without vLLM: pdd's own parsers by the same names, and a name only vLLM
    has is one line naming pdd's own and how to get vLLM's."""
    import pdd.api.parsers as parsers_module

    monkeypatch.setattr(parsers_module, "vllm_installed", lambda: False)
    own = choose_parsers("deepseek_r1", "hermes", "", model, None)
    assert own == Parsers("deepseek_r1", "hermes")
    reader = own.assistant(tool_plan(FUNCTIONS, "auto", True), [1], {}, True)
    reader.feed(f"a b</think>c {CALL}", final=True)
    assert reader.message()["reasoning"] == "a b" and [c.name for c in reader.calls] == ["get_time"]
    with pytest.raises(Mistake, match=r"'llama3_json' is not a parser pdd knows; it knows hermes \(vLLM's others"):
        choose_parsers("", "llama3_json", "", model, None)
    with pytest.raises(Mistake, match="--tool-parser-plugin needs vLLM"):
        choose_parsers("", "", "x.py", model, None)
