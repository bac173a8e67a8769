"""`/v1/responses` with state, as vLLM keeps it (`pdd.api.response_store`): a response is
stored unless `store` is false, read back by GET, removed by DELETE, and continued by a
later request's `previous_response_id`, whose prompt is then the whole conversation; each
API key's responses are its own; the store is bounded, the oldest evicted first, and its
bound is in /pdd/stats."""

from __future__ import annotations

import json

import httpx
from procs import HTTP, standalone

from pdd.api.response_store import ResponseStore, Stored

KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789"}
TOOL = [{"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC"]}}, "required": ["tz"],
    "additionalProperties": False}}]


def test_the_store_keeps_each_namespace_apart_and_evicts_the_oldest_first():
    store = ResponseStore(kept=2)
    for i in range(3):
        store.put("alice", f"resp_{i}", Stored({"id": f"resp_{i}"}, [{"role": "user", "content": str(i)}]))
    assert store.get("alice", "resp_0") is None and store.get("alice", "resp_2").body == {"id": "resp_2"}
    assert store.get("bob", "resp_2") is None and not store.delete("bob", "resp_2")
    assert store.delete("alice", "resp_2") and store.get("alice", "resp_2") is None
    assert store.stats() == {"kept": 2, "stored": 1, "evicted": 1}
    ResponseStore(kept=0).put("alice", "resp_9", Stored({}, []))  # (a bound of 0 keeps nothing)


def _post(url: str, key: str, **body) -> httpx.Response:
    return HTTP.post(f"{url}/v1/responses", headers={"Authorization": f"Bearer {KEYS[key]}"},
                      json={"model": "tiny", "max_output_tokens": 4, "temperature": 0, **body}, timeout=60)


def test_a_response_is_stored_read_continued_and_deleted_per_key(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text("[keys]\n" + "".join(f'{name} = "{key}"\n' for name, key in KEYS.items()))
    with standalone(tiny_model_dir, "--api-keys-file", str(keys)) as url:
        alice = {"Authorization": f"Bearer {KEYS['alice']}"}
        bob = {"Authorization": f"Bearer {KEYS['bob']}"}
        called = _post(url, "alice", input="Time?", instructions="Be brief.", tools=TOOL, tool_choice="required",
                       max_output_tokens=40)
        assert called.status_code == 200, called.text
        first = called.json()
        assert first["store"] is True and first["output"][0]["type"] == "function_call"
        assert HTTP.get(f"{url}/v1/responses/{first['id']}", headers=alice).json() == first
        assert HTTP.get(f"{url}/v1/responses/{first['id']}", headers=bob).status_code == 404  # another key's
        # continued: the prompt is the conversation (the call and its output) with the new input
        call = first["output"][0]
        answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "noon"}
        then = _post(url, "alice", input=[answer], previous_response_id=first["id"], tools=TOOL).json()
        turn = [{"role": "user", "content": "Time?"}, {"type": "function_call", "call_id": call["call_id"],
                                                        "name": call["name"], "arguments": call["arguments"]}, answer]
        # the same conversation sent whole: without the instructions, which do not carry over (as OpenAI's
        # and vLLM's), the same prompt and the same answer; with them, a longer prompt
        without = _post(url, "alice", tools=TOOL, input=turn).json()
        whole = _post(url, "alice", tools=TOOL, input=turn, instructions="Be brief.").json()
        assert then["previous_response_id"] == first["id"] and then["status"] == without["status"]
        assert then["usage"]["input_tokens"] == without["usage"]["input_tokens"] < whole["usage"]["input_tokens"]
        assert [o.get("content") for o in then["output"]] == [o.get("content") for o in without["output"]]
        lost = _post(url, "bob", input="hi", previous_response_id=first["id"])
        assert lost.status_code == 404 and lost.json()["error"]["param"] == "previous_response_id"
        with HTTP.stream("POST", f"{url}/v1/responses", headers=alice, timeout=60, json={
                "model": "tiny", "input": "hi", "max_output_tokens": 4, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        streamed = json.loads(events[-1][6:])["response"]  # (a streamed response is stored when it ends)
        assert HTTP.get(f"{url}/v1/responses/{streamed['id']}", headers=alice).json() == streamed
        unstored = _post(url, "alice", input="hi", store=False).json()
        assert HTTP.get(f"{url}/v1/responses/{unstored['id']}", headers=alice).status_code == 404
        gone = HTTP.delete(f"{url}/v1/responses/{first['id']}", headers=alice).json()
        assert gone == {"id": first["id"], "object": "response.deleted", "deleted": True}
        assert HTTP.get(f"{url}/v1/responses/{first['id']}", headers=alice).status_code == 404
        assert HTTP.delete(f"{url}/v1/responses/{first['id']}", headers=alice).status_code == 404
        stats = HTTP.get(f"{url}/pdd/stats").json()["responses"]
        assert stats == {"kept": 1024, "stored": 4, "evicted": 0}, stats  # (then, without, whole, streamed)
