"""API tests that fail when their feature breaks. Each logit-shaping parameter on its own
(`presence_penalty`, `frequency_penalty`, `repetition_penalty`, `min_p`, `logit_bias`): the
token IDs the API returns, chat and completions, equal the embedded engine's
`Engine.generate` with that one setting, and differ from the run without it (so a
parameter dropped on its way to the sampler fails here). A regex guide's output matches
its regex whole (`re.fullmatch`). The tools' prompt is, character for character, what
`transformers` renders with the same template."""

from __future__ import annotations

import json
import re

import pytest
from procs import HTTP, standalone

from pdd.engines.embedded.engine import Engine
from pdd.engines.port import EngineConfig
from pdd.model.tokenizer import Tokenizer
from pdd.sampling.params import SamplingParams

PROMPT = [17, 230, 901, 17, 230, 901, 17, 230, 901, 55, 1024, 333, 17, 230, 901, 2048, 77, 78, 79, 80] * 3
MAX = 40
SAMPLED = {"temperature": 3.0, "seed": 4321}  # a hot, seeded draw: where a penalty acts on a decisive model
# one setting each: (the request's, the engine's); the penalties and min_p on the seeded draw, whose
# greedy choice the tiny model makes by a margin no penalty in range overturns
SETTINGS = {
    "presence_penalty": ({**SAMPLED, "presence_penalty": -2.0}, {**SAMPLED, "presence_penalty": -2.0}),
    "frequency_penalty": ({"frequency_penalty": 1.0}, {"frequency_penalty": 1.0}),
    "repetition_penalty": ({**SAMPLED, "repetition_penalty": 1.6}, {**SAMPLED, "repetition_penalty": 1.6}),
    "min_p": ({**SAMPLED, "min_p": 0.5}, {**SAMPLED, "min_p": 0.5}),
    "logit_bias": ({"logit_bias": {"2817": -100, "1651": 6.0}}, {"logit_bias": ((1651, 6.0), (2817, -100.0))}),
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with standalone(tiny_model_dir) as url:
        yield url


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine(tiny_model_dir, EngineConfig(page_size=16, num_pages=256))


def _engine_ids(engine: Engine, prompt: list[int], **setting) -> list[int]:
    params = SamplingParams(max_tokens=MAX, ignore_eos=True, **setting)
    return engine.generate([prompt], params)[0]


def _api_ids(url: str, **setting) -> list[int]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX, "temperature": 0, "ignore_eos": True, **setting}
    r = HTTP.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == MAX, choice
    return choice["token_ids"]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_shaping_parameter_reaches_the_sampler_alone(name, server, engine, tiny_model_dir):
    asked, own = SETTINGS[name]
    plain = _engine_ids(engine, PROMPT, **({k: v for k, v in own.items() if k in ("temperature", "seed")}))
    shaped = _engine_ids(engine, PROMPT, **own)
    assert shaped != plain, f"{name} changes nothing here: no test of it"
    assert _api_ids(server, **asked) == shaped
    # the same through chat completions, over the chat template's prompt
    messages = [{"role": "user", "content": "Repeat after me: one two one two one two."}]
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX, "temperature": 0, "ignore_eos": True, **asked}
    r = HTTP.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == _engine_ids(engine, prompt, **own)


def test_a_regex_guide_holds_the_whole_output(server):
    pattern = r"(yes|no), [a-z]{3,6} [0-9]{2}!"
    for endpoint, ask in (("completions", {"prompt": "Answer:"}),
                          ("chat/completions", {"messages": [{"role": "user", "content": "Answer?"}]})):
        body = {"model": "tiny", "max_tokens": 30, "temperature": 0, "structured_outputs": {"regex": pattern}, **ask}
        choice = HTTP.post(f"{server}/v1/{endpoint}", json=body, timeout=60).json()["choices"][0]
        text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
        assert choice["finish_reason"] == "stop" and re.fullmatch(pattern, text), choice


def test_the_tools_prompt_is_transformers_text(server, tiny_model_dir):
    """The chat template rendered with the tools, an assistant's calls, the tool's answer,
    and a `name` and `reasoning` vLLM gives the template: exactly `transformers`' text."""
    transformers = pytest.importorskip("transformers")
    tools = [{"type": "function", "function": {"name": "get_time", "description": "the time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Time?", "name": "alice"},
               {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "a clock"},
               {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    r = HTTP.post(f"{server}/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": history, "tools": tools, "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    as_read = [{**m, "content": m["content"] or ""} for m in history]  # (as vLLM gives them to the template)
    as_read[2] = {**as_read[2], "reasoning_content": "a clock", "tool_calls": [
        {**call, "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]}
    expected = hf.apply_chat_template(as_read, tools=tools, add_generation_prompt=True, tokenize=False)
    # the prompt's token IDs, as the answer's prompt_logprobs name them (the first has none: it is BOS)
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    prompt = [tokenizer.bos_token_id] + [int(next(iter(e))) for e in r.json()["prompt_logprobs"][1:]]
    assert tokenizer.decode(prompt, skip_special_tokens=False) == expected


def _vllm_fields(endpoint: str) -> dict[str, object]:
    """The pinned vLLM's request fields of `endpoint`, each with its default value."""
    pytest.importorskip("vllm")
    from pydantic_core import PydanticUndefined
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    model = {"chat/completions": ChatCompletionRequest, "completions": CompletionRequest,
             "responses": ResponsesRequest}[endpoint]
    fields = {}
    for name, field in model.model_fields.items():
        if field.default_factory is not None:
            fields[name] = field.default_factory()
        elif field.default is not PydanticUndefined:
            fields[name] = field.default
    return fields


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions", "responses"])
def test_every_field_vllm_takes_is_taken_or_refused_by_name(server, endpoint):
    """Each field of the pinned vLLM's request, at vLLM's default: pdd serves it (with
    vLLM's meaning), or refuses it with a 400 naming it; never a 500, never another name."""
    base = {"chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            "completions": {"prompt": "hi", "max_tokens": 2},
            "responses": {"input": "hi", "max_output_tokens": 2}}[endpoint]
    said = {}
    for name, default in _vllm_fields(endpoint).items():
        if name in ("model", *base):
            continue
        try:
            body = json.loads(json.dumps({"model": "tiny", **base, name: default}, default=str))
        except TypeError:
            continue
        r = HTTP.post(f"{server}/v1/{endpoint}", json=body, timeout=60)
        said[name] = r.status_code if r.status_code == 200 else (r.status_code, r.json()["error"]["param"])
    wrong = {k: v for k, v in said.items() if v != 200 and not (v[0] == 400 and (v[1] or "").split(".")[0] == k)}
    assert not wrong, wrong
    print(endpoint, "served:", sorted(k for k, v in said.items() if v == 200))
    print(endpoint, "refused by name:", sorted(k for k, v in said.items() if v != 200))
