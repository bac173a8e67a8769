"""vLLM's tool parsers by name, through a handoff: `pdd up --mode pdd` with `[model]
tool_parser` set to one of vLLM's names, on the tiny model with the marker tokens those
parsers look up (`parser_model`). A regex guide makes the random model write two calls in
the parser's own syntax (llama3_json and pythonic here; qwen3_xml, beside vLLM's qwen3
reasoning parser, on tests/test_agent_loops.py's deployment); the answer's calls, whole
and streamed (indices 0 and 1), equal what vLLM's parser reads out of the same text (its
token IDs decoded), and with
`parallel_tool_calls: false` only the first is kept, as vLLM's server keeps it."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from parser_model import marker_model
from procs import handed_over_within, pdd_up
from test_agent_api import stream_chat

vllm = pytest.importorskip("vllm")

LINE = {"bandwidth_mbps": 200.0, "delay_ms": 2.0, "jitter_ms": 0.5}
# every request handed over from the relay to MD, in chunks of 2 (tests/test_pdd.py's catch-up-2)
HANDOFF = {"pipeline": "P-RLD-MD", "handoff": "catch_up", "catch_up_chunk": 2, "handoff_threshold": 2}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city", "days"]}
ZONE = {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}]
CHAT = [{"role": "user", "content": "Weather in Paris, and the time?"}]
NO_THINKING = {"enable_thinking": False}
# each format's two calls, as the regex that forces them
FORMATS = {
    "llama3_json": r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Oslo)", "days": [1-7]\}\}; '
                   r'\{"name": "get_time", "parameters": \{"tz": "(UTC|CET)"\}\}',
    "pythonic": r'\[get_weather\(city="(Paris|Oslo)", days=[1-7]\), get_time\(tz="(UTC|CET)"\)\]',
    "qwen3_xml": r"<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Oslo)\n</parameter>\n"
                 r"<parameter=days>\n[1-7]\n</parameter>\n</function>\n</tool_call>\n"
                 r"<tool_call>\n<function=get_time>\n<parameter=tz>\n(UTC|CET)\n</parameter>\n</function>\n"
                 r"</tool_call>",
}


def write_config(path: Path, model: Path, **model_keys: str) -> str:
    """A pdd-mode deployment of `model` whose every request is handed over."""
    lines = ['mode = "pdd"', "[model]", f"path = {json.dumps(str(model))}", 'name = "tiny"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in model_keys.items()]
    lines += ["[line]", *(f"{k} = {json.dumps(v)}" for k, v in LINE.items())]
    lines += ["[policy]", *(f"{k} = {json.dumps(v)}" for k, v in HANDOFF.items())]
    # two test workers on two cores can starve an instance's heartbeats past the default
    # bound (5 s: P was once dropped "silent for 5.5 s"); what is tested here is the parsers
    lines += ["[liveness]", "dead_after_s = 15.0"]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def handed_over(record: dict) -> bool:
    return record["relay_output_tokens"] > 0 and record["main_output_tokens"] > 0


def vllm_reading(fmt: str, model: Path, ids: list[int], reasoning: str = "") -> tuple[dict, dict]:
    """What vLLM's own parser `fmt` (and `reasoning`) reads out of the text of `ids`
    (special tokens skipped, as vLLM decodes), whole and streamed token by token: content
    and calls, each; with a reasoning parser, for a request that turns the thinking off."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(model))
    cls = ParserManager.get_parser(tool_parser_name=fmt, reasoning_parser_name=reasoning or None,
                                   enable_auto_tools=True, tokenizer=tokenizer)
    kwargs = {"chat_template_kwargs": NO_THINKING} if reasoning else {}
    request = ChatCompletionRequest.model_validate({"messages": CHAT, "tools": TOOLS, "tool_choice": "auto"})
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    ids = [t for t in ids if t not in special]
    _, content, calls = cls(tokenizer, request.tools, **kwargs).parse(tokenizer.decode(ids), request,
                                                                        enable_auto_tools=True)
    whole = {"content": content or None, "calls": [(c.name, json.loads(c.arguments)) for c in calls or []]}
    parser, said, pieces, before = cls(tokenizer, request.tools, **kwargs), "", {}, ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1])
        delta = parser.parse_delta(text[len(before) :], ids[i : i + 1], request, [], finished=i == len(ids) - 1)
        before = text
        said += (delta.content or "") if delta else ""
        for t in (delta.tool_calls or []) if delta else []:
            call = pieces.setdefault(t.index, ["", ""])
            call[0] += (t.function.name or "") if t.function else ""
            call[1] += (t.function.arguments or "") if t.function else ""
    stream = {"content": said or None, "calls": [(n, json.loads(a)) for n, a in pieces.values()]}
    return whole, stream


def two_calls(url: str, fmt: str, model: Path, reasoning: str = "") -> None:
    """The deployment at `url` (tool parser `fmt`, reasoning parser `reasoning`) reads the two
    calls a guide forces as vLLM's own parser reads the same token IDs, whole and streamed;
    with parallel_tool_calls false, the first alone. The whole and streamed ones handed over."""
    extra = {"structured_outputs": {"regex": FORMATS[fmt]}}
    if reasoning:  # (Qwen3's switch: the output starts after the thinking, as the template closes it)
        extra["chat_template_kwargs"] = NO_THINKING
    ask = {"model": "tiny", "messages": CHAT, "tools": TOOLS, "max_tokens": 240, "temperature": 0,
           "extra_body": extra}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    # (a 40-token guided output: on a loaded machine the relay may finish one alone)
    whole = handed_over_within(lambda: client.chat.completions.create(**ask),
                               lambda r: handed_over(r.model_extra["pdd"]))
    stream = handed_over_within(lambda: stream_chat(client, **ask), lambda r: handed_over(r["record"]))
    single = client.chat.completions.create(**ask, parallel_tool_calls=False).choices[0]
    single_stream = stream_chat(client, **ask, parallel_tool_calls=False)
    choice = whole.choices[0]
    want, want_stream = vllm_reading(fmt, model, choice.model_extra["token_ids"], reasoning)
    calls = want["calls"]
    assert [name for name, _ in calls] == ["get_weather", "get_time"], want
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    assert {"content": choice.message.content or None, "calls": got} == want, choice
    assert choice.finish_reason == "tool_calls", whole
    assert sorted(stream["calls"]) == [0, 1] and stream["finish"] == "tool_calls", stream
    got = [(c["name"], json.loads(c["arguments"])) for c in stream["calls"].values()]
    assert {"content": stream["content"] or None, "calls": got} == want_stream, (stream, want_stream)
    assert want_stream["calls"] == calls and all(c["id"] for c in stream["calls"].values())
    # parallel_tool_calls false: the first call alone, whole and streamed
    assert [(c.function.name, json.loads(c.function.arguments)) for c in single.message.tool_calls] == calls[:1]
    assert [(c["name"], json.loads(c["arguments"])) for c in single_stream["calls"].values()] == calls[:1]


@pytest.mark.parametrize("fmt", ["llama3_json", "pythonic"])  # (qwen3_xml: tests/test_agent_loops.py's deployment)
def test_a_vllm_tool_parser_by_name_reads_two_calls_through_a_handoff(fmt, tiny_model_dir, tmp_path_factory):
    model = marker_model(tiny_model_dir, tmp_path_factory.getbasetemp() / "marker-model")
    conf = write_config(tmp_path_factory.mktemp(fmt) / "pdd.toml", model, tool_parser=fmt)
    with pdd_up("--config", conf) as dep:
        two_calls(dep.url, fmt, model)
