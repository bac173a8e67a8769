"""`pdd up --mode pdd --engine vllm`: P, RLD and MD all on vLLM, real processes, the WAN
emulator between the datacenters. Greedy output equals a plain `vllm serve` on the same
weights through P -> MD and P -> RLD -> MD with one-shot and catch-up handoffs (the
policy picks them: a second turn's small delta goes P -> MD, a fresh prompt through
the relay, one stalled on the line long enough to hand over by catch-up); a second
turn moves only the KV MD's vLLM lacks and MD's vLLM computes only what it must;
client disconnects and a dead relay give every vLLM block back."""

from __future__ import annotations

import json
import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from procs import VLLM_START_S, kv_bytes_per_token, pdd_up, stream_completion, vllm_settled, wait_until

pytest.importorskip("vllm")

LINE = {"bandwidth_mbps": 200.0, "delay_ms": 2.0, "jitter_ms": 0.5}
# one-shot up to 64 relay tokens (the spec's threshold); a fresh prompt's KV crosses in
# about 100 ms, a stalled line's when the stall ends
POLICY = {"handoff_threshold": 64, "catch_up_chunk": 32}
CATCH_UP_TOKENS = 200  # relay tokens a stall should let the relay produce: well past the threshold


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 4096) for _ in range(n)]


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    conf = tmp_path_factory.mktemp("vllm-pdd") / "pdd.toml"
    conf.write_text('mode = "pdd"\n[link]\n' + "".join(f"{k} = {json.dumps(v)}\n" for k, v in LINE.items())
                    + "[policy]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in POLICY.items()))
    with pdd_up("--config", str(conf), "--engine", "vllm", timeout=VLLM_START_S) as d:
        yield d


def _engine(dep, name: str) -> dict:
    return httpx.get(f"{dep.http[name]}/pdd/stats").json()["engine"]


def _rid(got: dict) -> str:
    return f"{got['id']}.{got['record']['retries']}"  # the id the router gave the request at the instances


def test_pipelines_and_handoffs_all_equal_plain_vllm(dep, vllm_reference, tiny_model_dir):
    bpt = kv_bytes_per_token(tiny_model_dir)
    fresh = [_prompt(i, 600) for i in range(3)]
    first = [stream_completion(dep.url, p, 120) for p in fresh]
    before = {n: _engine(dep, n) for n in ("p0", "md0")}
    turns = [p + g["ids"] + _prompt(10 + i, 20) for i, (p, g) in enumerate(zip(fresh, first))]
    second = [stream_completion(dep.url, t, 120) for t in turns]
    # the line holds everything long enough for the relay to produce CATCH_UP_TOKENS (at
    # this machine's pace, from the second turns), and the request runs four times longer
    step_s = min(g["elapsed_s"] for g in second) / 120
    stall_s = min(5.0, max(0.3, CATCH_UP_TOKENS * step_s))
    long = min(3000, int(4 * stall_s / step_s))
    dep.fault(stall_s=stall_s)
    stalled = stream_completion(dep.url, _prompt(20, 600), long)
    done = first + second + [stalled]
    prompts = fresh + turns + [_prompt(20, 600)]
    for g, p in zip(done, prompts):
        assert g["error"] is None and g["ids"] == vllm_reference.greedy(p, len(g["ids"])), g["record"]
    shapes = [(g["record"]["pipeline"], g["record"]["handoff"]) for g in done]
    print(f"\nstall {stall_s:.2f} s for a {long}-token output; (pipeline, handoff, relay tokens, MD tokens, "
          "reserved hit, predicted hit):",
          [(*s, g["record"]["rld_output_tokens"], g["record"]["md_output_tokens"], g["record"]["d_hit_tokens"],
            g["record"]["d_hit_predicted"]) for s, g in zip(shapes, done)])
    assert shapes[:3] == [("P-RLD-MD", "one_shot")] * 3
    assert shapes[3:6] == [("P-MD", None)] * 3
    assert shapes[6] == ("P-RLD-MD", "catch_up") and done[6]["record"]["handoff_chunks"] >= 2
    assert all(g["record"]["md_output_tokens"] > 0 for g in done)

    # a second turn: only the KV MD's vLLM lacks crosses, and the router's mirror (fed by
    # vLLM's KV events under pdd's hashes) predicted exactly the hit vLLM reserved
    p0, md0 = _engine(dep, "p0"), _engine(dep, "md0")
    for t, g in zip(turns, second):
        r = g["record"]
        missed = (len(t) - r["d_hit_tokens"]) * bpt
        assert r["d_hit_tokens"] >= len(t) - 20 - 32 and missed <= r["wan_bytes"] <= 1.05 * missed, r
        assert r["d_hit_predicted"] == r["d_hit_tokens"]
        # MD's vLLM scheduler computed the prompt's last token (vLLM's rule), P's first
        # token and one token a step after it: none of the hit, none of the imported tail
        assert md0["computed_by_request"][_rid(g)] == 120
        assert p0["computed_by_request"][_rid(g)] == len(t) - r["p_hit_tokens"]
    assert md0["prefix_cache_hits"] - before["md0"]["prefix_cache_hits"] >= sum(
        g["record"]["d_hit_tokens"] for g in second)
    vllm_settled([dep.http[n] for n in ("p0", "rld0", "md0")])


def test_client_disconnects_give_vllms_blocks_back(dep):
    with ThreadPoolExecutor(3) as pool:
        cut = list(pool.map(lambda i: stream_completion(dep.url, _prompt(30 + i, 500), 600, stop_after=5), range(3)))
    assert all(len(c["ids"]) >= 5 for c in cut)
    stats = vllm_settled([dep.http[n] for n in ("p0", "rld0", "md0")])
    assert all(s["used_blocks"] == 0 for s in stats)
    aborted = httpx.get(f"{dep.url}/pdd/stats").json()
    print(f"\nafter 3 disconnects: {[(s['used_blocks'], s['aborted']) for s in stats]}, router {aborted.get('aborted')}")


def test_a_dead_relay_gives_way_to_md_and_takes_its_vllm_with_it(dep, vllm_reference):
    import psutil

    relay = psutil.Process(dep.pids["rld0"])
    engine_core = relay.children(recursive=True)
    assert engine_core, "rld0 runs vLLM's engine core as a child"
    # a slow line (4 Mbit/s: the prompt's KV takes five seconds to cross): the relay produces when it dies
    httpx.post(f"{dep.wan_admin}/link", json={"bandwidth_mbps": 4.0}, timeout=5).raise_for_status()
    prompt = _prompt(40, 600)
    got = {"ids": []}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{dep.url}/v1/completions", json=body, timeout=180) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                before = len(got["ids"])
                got["ids"] += choice.get("token_ids") or []
                if before < 5 <= len(got["ids"]):
                    os.kill(relay.pid, signal.SIGKILL)
            got["record"] = chunk.get("pdd") or got.get("record")
            got["error"] = chunk.get("error") or got.get("error")
    assert got.get("error") is None and got["ids"] == vllm_reference.greedy(prompt, 300)
    assert "relay_lost" in got["record"]["fallback"] and got["record"]["md_output_tokens"] > 0
    vllm_settled([dep.http["p0"], dep.http["md0"]])
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engine_core), 15,
               "the dead relay's vLLM processes to go")
