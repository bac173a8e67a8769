"""`pdd serve --role standalone` as a real process, driven over HTTP."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from procs import HTTP, metrics, standalone

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there!"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with standalone(tiny_model_dir) as url:
        yield url


def _kv(url: str) -> dict:
    return HTTP.get(f"{url}/pdd/stats").json()["kv"]


def _settled(url: str, timeout: float = 10.0) -> dict:
    """Wait until nothing runs; every page is then free or held by the prefix cache."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kv = _kv(url)
        if kv["free"] + kv["cached"] == kv["pages"]:
            return kv
        time.sleep(0.05)
    raise AssertionError(f"pages still in use: {kv}")


def test_openai_client_streams_chat(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    stream = client.chat.completions.create(
        model="tiny", messages=CHAT,
        max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["length"], ["stop"])
    assert chunks[-1].usage.completion_tokens >= 1 and chunks[-1].usage.prompt_tokens > 5
    full = client.chat.completions.create(
        model="tiny", messages=CHAT,
        max_tokens=12, temperature=0)
    assert full.choices[0].message.content == text
    _settled(server)




def test_the_start_up_heap_is_frozen(server):
    """Torch and the engine built, the process's heap is out of the cyclic collector's
    sight: a full collection would otherwise walk it all, stalling every stream."""
    assert HTTP.get(f"{server}/pdd/stats").json()["gc_frozen_objects"] > 50_000


def test_shared_prefix_is_reported_cached(server):
    hits_before = metrics(server)["pdd_prefix_cache_hit_tokens_total"]
    prefix = list(range(200, 520))
    body = {"model": "tiny", "prompt": prefix + [7, 8, 9], "max_tokens": 4, "temperature": 0}
    first = HTTP.post(f"{server}/v1/completions", json=body, timeout=60).json()
    second = HTTP.post(f"{server}/v1/completions", json={**body, "prompt": prefix + [11] * 30}, timeout=60).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 320
    assert len(second["choices"][0]["token_ids"]) == 4
    assert metrics(server)["pdd_prefix_cache_hit_tokens_total"] - hits_before == 320
    assert metrics(server)["pdd_time_to_first_token_seconds_count"] >= 2


def test_stop_string_truncates(server):
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = HTTP.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert len(full) > 6
    stop = full[3:6]
    cut = HTTP.post(f"{server}/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full[: full.index(stop)]


@pytest.mark.parametrize("body,status", [
    ({"model": "nope", "prompt": "hi"}, 404),
    ({"model": "tiny", "prompt": "hi", "max_tokens": -5}, 400),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 10**9}, 400),
    ({"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, 400),
    ({"model": "tiny", "prompt": [1] * 5000}, 400),
    ({"model": "tiny", "prompt": [99999999]}, 400),
    ({"model": "tiny"}, 400),
    ({"model": "tiny", "prompt": "hi", "n": 17}, 400),
    ({"model": "tiny", "messages": []}, 400),
])
def test_bad_input_gets_openai_errors(server, body, status):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = HTTP.post(f"{server}{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize("extra,param", [
    ({"functions": [TOOL["function"]]}, "functions"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}}, "structured_outputs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"five": 10}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"min_tokens": 3}, "min_tokens"),  # above max_tokens (2)
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"messages": [*CHAT, {"role": "user", "content": None, "tool_calls": [CALL]}]}, "messages[2].tool_calls"),
    ({"messages": [*CHAT, {"role": "tool", "content": "sunny"}]}, "messages[2].tool_call_id"),
    ({"messages": [*CHAT, {"role": "assistant", "content": "hi", "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages[2].function_call"),
    ({"messages": [*CHAT, {"role": "user", "content": "hi", "tools": []}]}, "messages[2].tools"),
    ({"max_tokens": "ten"}, "max_tokens"),
])
def test_what_is_not_honoured_is_refused_by_name(server, extra, param):
    """A silent drop is a bug: a parameter pdd would not honour, or that nobody knows, is a
    400 in OpenAI's shape naming it in `param`; the value at which it changes nothing passes."""
    r = HTTP.post(f"{server}/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 2, **extra},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param.split(".")[-1] in r.json()["error"]["message"], r.text


def test_penalties_bias_min_p_and_min_tokens_are_honoured(server, tiny_model_dir):
    """Each shaping parameter is taken and changes what a decisive model says where it
    should: a bias of -100 on the greedy answer's first token removes it; min_tokens
    with EOS biased up holds the end back exactly that long; a token beyond the
    vocabulary is a 400 naming logit_bias."""
    body = {"model": "tiny", "prompt": [5, 9, 77, 1000, 31], "max_tokens": 12, "temperature": 0}
    plain = HTTP.post(f"{server}/v1/completions", json=body, timeout=30).json()["choices"][0]["token_ids"]
    banned = HTTP.post(f"{server}/v1/completions", json={**body, "logit_bias": {str(plain[0]): -100}},
                        timeout=30).json()["choices"][0]["token_ids"]
    assert plain[0] not in banned
    eos = json.loads((tiny_model_dir / "config.json").read_text())["eos_token_id"]
    early = {**body, "logit_bias": {str(eos): 100}}
    assert HTTP.post(f"{server}/v1/completions", json=early, timeout=30).json()["choices"][0]["token_ids"] == [eos]
    held = HTTP.post(f"{server}/v1/completions", json={**early, "min_tokens": 5}, timeout=30).json()["choices"][0]
    assert len(held["token_ids"]) == 6 and held["token_ids"][5] == eos and eos not in held["token_ids"][:5], held
    assert held["finish_reason"] == "stop"
    for extra in ({"presence_penalty": 1.5, "frequency_penalty": 2, "repetition_penalty": 1.5}, {"min_p": 0.5}):
        r = HTTP.post(f"{server}/v1/completions", json={**body, **extra}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    r = HTTP.post(f"{server}/v1/completions", json={**body, "logit_bias": {"999999": 1}}, timeout=30)
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"], r.text


def test_a_chat_without_max_tokens_may_take_the_rest_of_the_context(server):
    """As vLLM: no max_tokens on a chat completion is the context left after the prompt."""
    messages = [{"role": "user", "content": "word " * 1950}]
    r = HTTP.post(f"{server}/v1/chat/completions", json={"model": "tiny", "messages": messages, "ignore_eos": True},
                   timeout=120)
    usage = r.json()["usage"]
    limit = HTTP.get(f"{server}/v1/models").json()["data"][0]["max_model_len"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == limit, usage
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_n_choices_are_single_requests_with_one_seed_each(server):
    """n = 3: three choices, choice i equal to a single request seeded seed + i (vLLM's
    rule), whole and streamed (each choice's chunks carry its index and its own finish);
    usage counts the prompt once and every choice's tokens; the prompt is computed once;
    n outside 1-16 is a 400."""
    body = {"model": "tiny", "prompt": [5, 9, 77, 1000, 31], "max_tokens": 10, "temperature": 25.0, "top_p": 0.95,
            "seed": 40, "ignore_eos": True}
    single = [HTTP.post(f"{server}/v1/completions", json={**body, "seed": 40 + i}, timeout=30).json()
              ["choices"][0]["token_ids"] for i in range(3)]
    assert len({tuple(s) for s in single}) == 3
    whole = HTTP.post(f"{server}/v1/completions", json={**body, "n": 3}, timeout=30).json()
    assert [c["token_ids"] for c in sorted(whole["choices"], key=lambda c: c["index"])] == single
    assert whole["usage"]["completion_tokens"] == 30 and whole["usage"]["prompt_tokens"] == 5
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    streamed: dict[int, list[int]] = {}
    finished = {}
    openai_body = {k: v for k, v in body.items() if k != "ignore_eos"}
    for chunk in client.completions.create(**openai_body, n=3, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.model_extra["token_ids"])
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert [streamed[i] for i in range(3)] == single and finished == {0: "length", 1: "length", 2: "length"}
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, n=2, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content  # greedy
    # the choices share the prompt: the first's prefill is in the prefix cache before the others
    # start, so they compute only their last page (n x 200 tokens computed without sharing)
    fresh, before = list(range(300, 500)), _engine(server)["prefill_tokens"]
    r = HTTP.post(f"{server}/v1/completions", json={**body, "prompt": fresh, "n": 3, "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert _engine(server)["prefill_tokens"] - before <= 200 + 2 * 16
    for n in (0, 17):
        r = HTTP.post(f"{server}/v1/completions", json={**body, "n": n}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    _settled(server)


def test_logprobs_in_openais_shapes_chat_and_completions_whole_and_streamed(server):
    """Chat: `logprobs: true` with `top_logprobs`: each token, its raw log-probability, its
    bytes and the likeliest tokens (greedy: the chosen one is the likeliest); completions:
    `logprobs: k`, the parallel lists. Streamed, the same figures chunk by chunk."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert c.logprob == c.top_logprobs[0].logprob
        assert c.logprob <= 0 and c.bytes == list(c.token.encode()) and c.top_logprobs[1].logprob <= c.logprob
    streamed = []
    for chunk in client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=3, stream=True,
                                                extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    body = {"model": "tiny", "prompt": [5, 9, 77, 1000, 31], "max_tokens": 5, "temperature": 25.0, "seed": 3,
            "logprobs": 2, "ignore_eos": True}
    done = HTTP.post(f"{server}/v1/completions", json=body, timeout=30).json()["choices"][0]
    lp = done["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    for top, value in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True):
        assert len(top) <= 2 and max(top.values()) >= value
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    plain = HTTP.post(f"{server}/v1/completions", json={**body, "logprobs": None}, timeout=30).json()["choices"][0]
    assert plain["logprobs"] is None and plain["token_ids"] == done["token_ids"]  # (sampled from the same draw)
    for extra, param in (({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs")):
        r = HTTP.post(f"{server}/v1/completions", json={**body, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = HTTP.post(f"{server}/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "top_logprobs": 2},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


def test_structured_output_json_schema_json_object_regex_and_choice(server):
    """The random model's output, held to the request's grammar: a JSON Schema (OpenAI's
    response_format, through the official client, and vLLM's structured_outputs.json),
    any JSON object, a regex, a choice; each parses and ends with finish_reason "stop"."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
              "required": ["name", "tags"], "additionalProperties": False}
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    value = json.loads(chat.choices[0].message.content)
    assert chat.choices[0].finish_reason == "stop" and set(value) == {"name", "tags"}
    assert set(value["tags"]) <= {"a", "b"} and len(value["name"]) <= 8
    body = {"model": "tiny", "prompt": [5, 9, 77, 1000, 31], "max_tokens": 60, "temperature": 0}
    for guide, check in (
        ({"structured_outputs": {"json": schema}}, lambda t: set(json.loads(t)) == {"name", "tags"}),
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: len(t) == 6 and t[3] == "-"),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ):
        r = HTTP.post(f"{server}/v1/completions", json={**body, **guide}, timeout=60).json()["choices"][0]
        assert r["finish_reason"] == "stop" and check(r["text"]), (guide, r)
    # any JSON object: its strings are unbounded, so the random model may not close it in time
    r = HTTP.post(f"{server}/v1/completions", json={**body, "response_format": {"type": "json_object"}},
                   timeout=60).json()["choices"][0]
    assert r["text"].startswith("{") and (r["finish_reason"] == "length" or isinstance(json.loads(r["text"]), dict))


def test_a_reasoning_parser_moves_thinking_into_reasoning(tiny_model_dir):
    """`--reasoning-parser qwen3`: the output (held by a regex to open with a <think> block,
    whatever the weights) comes back with the thinking in `reasoning` (the pinned vLLM's
    name) and the rest in content, whole and streamed alike; `include_reasoning: false`
    leaves the thinking out."""
    with standalone(tiny_model_dir, "--reasoning-parser", "qwen3") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        ask = {"model": "tiny", "messages": CHAT, "max_tokens": 40, "temperature": 0,
               "extra_body": {"structured_outputs": {"regex": "<think>[a-z]{2,6}</think>[a-z]{2,6}"}}}
        whole = client.chat.completions.create(**ask).choices[0].message
        reasoning = whole.model_extra["reasoning"]
        assert 2 <= len(reasoning) <= 6 and reasoning.isalpha() and 2 <= len(whole.content) <= 6, whole
        said = {"reasoning": "", "content": ""}
        for chunk in client.chat.completions.create(**ask, stream=True):
            for c in chunk.choices:
                said["content"] += c.delta.content or ""
                said["reasoning"] += (c.delta.model_extra or {}).get("reasoning") or ""
        assert said == {"reasoning": reasoning, "content": whole.content}
        ask["extra_body"]["include_reasoning"] = False
        hidden = client.chat.completions.create(**ask).choices[0].message
        assert hidden.model_extra["reasoning"] is None and hidden.content == whole.content
        for chunk in client.chat.completions.create(**ask, stream=True):
            assert not any((c.delta.model_extra or {}).get("reasoning") for c in chunk.choices)


def test_echo_and_prompt_logprobs_cover_the_prompt_computed_past_the_cache(server):
    """`echo` puts the prompt before the completion, and with `logprobs` its tokens' (the
    first's null) before the output's, whole and streamed; vLLM's `prompt_logprobs` gives
    each prompt token's by id, on completions and chat. Asked twice, the same prompt is
    computed again (cached_tokens 0): the cache holds KV, not logits."""
    body = {"model": "tiny", "prompt": "The cat sat on", "max_tokens": 3, "temperature": 0, "echo": True,
            "logprobs": 1}
    whole = HTTP.post(f"{server}/v1/completions", json=body, timeout=30).json()
    choice, n_prompt = whole["choices"][0], whole["usage"]["prompt_tokens"]
    lps = choice["logprobs"]
    assert choice["text"].startswith("The cat sat on") and len(lps["tokens"]) == n_prompt + 3
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lps["token_logprobs"][1:])
    streamed = stream_text(server, body)
    assert streamed == choice["text"]
    ids = [5, 9, 77, 1000, 31] * 8  # (two pages: a cached prefix would be found)
    seen = []
    for _ in range(2):
        r = HTTP.post(f"{server}/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}).json()
        plp = r["choices"][0]["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids) and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert all(len(e) in (1, 2) and 1 in [v["rank"] for v in e.values()] for e in plp[1:]), plp
        seen.append([e[str(t)]["logprob"] for t, e in zip(ids[1:], plp[1:], strict=True)])
    assert seen[0] == seen[1]
    chat = HTTP.post(f"{server}/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None


def stream_text(url: str, body: dict) -> str:
    text = ""
    with HTTP.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


def test_what_changes_nothing_is_served(server):
    """Client libraries' defaults (no tools, zero penalties, text format) and bookkeeping
    (user, metadata, store, service_tier) are accepted; the completions endpoint refuses its
    own unhonoured ones (suffix, echo) by name too, and the OpenAI client sees the param."""
    inert = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "presence_penalty": 0,
             "frequency_penalty": 0.0, "response_format": {"type": "text"}, "logit_bias": {}, "user": "u1",
             "metadata": {"run": "7"}, "store": False, "service_tier": "auto"}
    r = HTTP.post(f"{server}/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 2, **inert},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    for extra, param in (({"suffix": "end"}, "suffix"), ({"best_of": 2}, "best_of"), ({"prompt_logprobs": 21},
                                                                                     "prompt_logprobs")):
        r = HTTP.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, functions=[TOOL["function"]])
    assert refused.value.param == "functions"


def test_malformed_json_and_unknown_route(server):
    r = HTTP.post(f"{server}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert HTTP.get(f"{server}/v1/nothing").status_code == 404
    assert HTTP.get(f"{server}/health").status_code == 200


def _engine(url: str) -> dict:
    return HTTP.get(f"{url}/pdd/stats").json()["engine"]


def test_disconnect_mid_stream_aborts_and_frees_pages(server):
    """The request is stopped by the disconnect, not by its end: it was far from its
    3,000 tokens (ignore_eos), and the engine counts an abort."""
    body = {"model": "tiny", "prompt": list(range(300, 700)), "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    before = _engine(server)
    with HTTP.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += len(json.loads(line[6:])["choices"][0]["token_ids"])
            if seen >= 3:
                break
    kv = _settled(server, timeout=20)
    after = _engine(server)
    assert after["aborted"] == before["aborted"] + 1
    assert after["decode_tokens"] - before["decode_tokens"] < 3000
    assert metrics(server)["pdd_requests_running"] == 0
    assert kv["cached"] < kv["pages"]


def test_disconnect_while_waiting_for_a_full_response_aborts(server):
    """A non-streamed request whose client gives up: the engine counts an abort (a
    request that ran to its end would not), and it stopped far short of its tokens."""
    body = {"model": "tiny", "prompt": list(range(300, 500)), "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    before = _engine(server)
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(f"{server}/v1/completions", json=body, timeout=1.0)
    _settled(server, timeout=20)
    after = _engine(server)
    assert after["aborted"] == before["aborted"] + 1
    assert after["decode_tokens"] - before["decode_tokens"] < 3000
    assert metrics(server)["pdd_requests_running"] == 0
