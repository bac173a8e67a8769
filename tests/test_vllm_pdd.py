"""`pdd up --mode pdd --engine vllm` on the user's own model: a mixture-of-experts
checkpoint (Mixtral, written by transformers), which pdd's embedded engine cannot run,
with P, RLD and MD all on vLLM, real processes, the line emulator between the
datacenters. vLLM reads the checkpoint and sizes each instance's KV cache itself from a
memory budget (no `num_pages`: "auto"); pdd takes the KV geometry and the sizes from it,
and the router plans with the block counts the instances report. Greedy output equals a
plain `vllm serve` on the same weights through P -> MD and P -> RLD -> MD with one-shot
and catch-up handoffs (the policy picks them: a second turn's small delta goes P -> MD, a
fresh prompt through the relay, one stalled on the line long enough to hand over by
catch-up); a second turn moves only the KV MD's vLLM lacks and MD's vLLM computes only
what it must; turns queued at MD behind a landing fill never wait for each other; client
disconnects and a dead relay give every vLLM block back. An MLA model (DeepSeek-style)
is refused on CPU, where vLLM runs it without a prefix cache. (The dense tiny model runs
pdd mode on vLLM beside the embedded engine in `test_vllm_mixed`.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from checkpoints import save_moe_of, save_random_mla
from procs import HTTP, kv_bytes_per_token, plain_vllm, session_turns, stream_completion, vllm_settled, wait_until
from vllm_scenarios import (
    LINE,
    assert_pdd_shapes,
    assert_second_turns_move_only_what_md_lacks,
    deployment,
    engine_stats,
    pipelines,
    prompt,
)

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tiny_model_dir):
    return save_moe_of(tiny_model_dir, tmp_path_factory.mktemp("moe") / "tiny-moe")


@pytest.fixture(scope="module")
def moe_reference(moe_dir):
    with plain_vllm(moe_dir) as ref:
        yield ref


@pytest.fixture(scope="module")
def dep(tmp_path_factory, moe_dir):
    model = f'[model]\npath = "{moe_dir}"\nname = "tiny"\n'
    with deployment(tmp_path_factory, "pdd", "--engine", "vllm", instances=model, name="moe") as d:
        yield d


def _node(url: str) -> dict:
    return HTTP.get(f"{url}/pdd/stats").json()["node"]


def test_the_embedded_engine_refuses_the_moe_by_name(moe_dir):
    """The checkpoint gate is the embedded engine's alone: there it names the field."""
    out = subprocess.run([sys.executable, "-m", "pdd.cli", "serve", str(moe_dir), "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr  # a model mistake
    assert "model_type" in out.stderr and "'mixtral' is not supported" in out.stderr


def test_an_mla_model_on_cpu_is_refused_at_start_saying_why(tmp_path, tiny_model_dir):
    """A DeepSeek-V2-style checkpoint (latent attention, routed experts), which plain vLLM
    on CPU serves without its prefix cache under its reference MLA backend (CPU_MLA, what
    it runs where the CPU has no AMX; asked for by name, as vLLM's own flag passed through,
    so that an AMX machine runs it too): pdd's decode side is that cache, so pdd on vLLM
    refuses it at start, before any weight loads, in one line that says why."""
    mla = save_random_mla(tmp_path / "tiny-mla", tiny_model_dir)
    out = subprocess.run([sys.executable, "-m", "pdd.cli", "serve", str(mla), "--engine", "vllm", "--dtype",
                          "float32", "--attention-backend", "CPU_MLA", "--port", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"pdd serve: vLLM cannot serve {mla}: vLLM turned its prefix cache off for this model (it does for MLA "
        "models on CPU without AMX), and pdd's decode-side cache, reservations and cache events are vLLM's "
        "prefix cache: serve it on a GPU")


def test_vllm_sizes_each_instance_and_the_router_plans_with_it(dep):
    stats = {n: engine_stats(dep, n) for n in ("p0", "rld0", "md0")}
    router = HTTP.get(f"{dep.url}/pdd/stats").json()
    for name, s in stats.items():
        # vLLM's own count from the budget it was given (256 MiB: `vllm_scenarios.ENGINE`), less its null block
        assert s["num_blocks"] == 2047 and s["max_model_len"] == 4096 and s["dtype"] == "float32", s
        assert router["instances"][name]["pages"] == s["num_blocks"]
        assert router["instances"][name]["max_context"] == s["max_model_len"]
    assert router["max_context"] == 4096


def test_pipelines_and_handoffs_all_equal_plain_vllm(dep, moe_reference, moe_dir):
    hits_before = engine_stats(dep, "md0")["prefix_cache_hits"]
    prompts, done = pipelines(dep, moe_reference)
    assert_pdd_shapes(done)
    assert_second_turns_move_only_what_md_lacks(dep, prompts, done, kv_bytes_per_token(moe_dir), hits_before)
    vllm_settled([dep.http[n] for n in ("p0", "rld0", "md0")])
    assert _node(dep.http["p0"])["kv_frames_in_prefill"] > 0  # (P's vLLM streamed layers as it computed them)


def test_client_disconnects_give_vllms_blocks_back(dep):
    """Three clients leave after 5 of 600 tokens: each request is aborted in vLLM at
    whichever instance was producing (the engine's count of requests it aborted while they
    ran), vLLM's own count of generated tokens stops far short of 3 x 600, and every
    block comes back."""
    names = ("p0", "rld0", "md0")
    before = [engine_stats(dep, n) for n in names]
    with ThreadPoolExecutor(3) as pool:
        cut = list(pool.map(lambda i: stream_completion(dep.url, prompt(30 + i, 500), 600, stop_after=5), range(3)))
    assert all(len(c["ids"]) >= 5 for c in cut)
    stats = vllm_settled([dep.http[n] for n in names])
    assert all(s["used_blocks"] == 0 for s in stats)
    aborted = [a["aborted"] - b["aborted"] for a, b in zip(stats, before, strict=True)]
    produced = [a["generation_tokens"] - b["generation_tokens"] for a, b in zip(stats, before, strict=True)]
    print(f"\nafter 3 disconnects: vLLM aborts {aborted}, tokens generated {produced}")
    assert sum(aborted) >= 3  # the producers ended all three by abort...
    assert sum(produced) < 3 * 600 / 2  # ...far short of their 600 tokens each


def test_turns_waiting_at_md_for_a_landing_fill_never_wait_for_each_other(dep, moe_reference):
    """Three turns of a session, each sent as the last ends, all finished by the relay
    while the first one's KV still crawls to MD (4 Mbit/s: five seconds): at MD the second
    waits for the first to land, the third for the second. When the first lands, the
    second must not wait for the third, whose prompt holds all of its own: the two sat
    out MD's bound on such waits (`PREFIX_WAIT_S`, 10 s) each, waiting for each other
    (the 10 s first tokens of `pdd bench serve` against vLLM, for the P -> MD turn after)."""
    md = dep.http["md0"]
    expired = _node(md)["prefix_waits_expired"]
    HTTP.post(f"{dep.line_admin}/line", json={"bandwidth_mbps": 4.0}, timeout=5).raise_for_status()
    try:
        prompts, done = session_turns(dep.url, prompt(50, 600), [prompt(51, 64), prompt(52, 64)], 16)
        wait_until(lambda: not _node(md)["held"], 60, "MD to take in the three turns' KV and fills")
    finally:
        HTTP.post(f"{dep.line_admin}/line", json={"bandwidth_mbps": LINE["bandwidth_mbps"]},
                   timeout=5).raise_for_status()
    for g, p in zip(done, prompts, strict=True):
        assert g["error"] is None and g["ids"] == moe_reference.greedy(p, 16), g["record"]
    assert [(g["record"]["pipeline"], g["record"]["main_output_tokens"]) for g in done] == [("P-RLD-MD", 0)] * 3, [
        g["record"] for g in done]
    assert _node(md)["prefix_waits_expired"] == expired
    vllm_settled([dep.http[n] for n in ("p0", "rld0", "md0")])


def test_a_dead_relay_gives_way_to_md_and_takes_its_vllm_with_it(dep, moe_reference):
    import psutil

    relay = psutil.Process(dep.pids["rld0"])
    engine_core = relay.children(recursive=True)
    assert engine_core, "rld0 runs vLLM's engine core as a child"
    # a slow line (4 Mbit/s: the prompt's KV takes five seconds to cross): the relay produces when it dies
    HTTP.post(f"{dep.line_admin}/line", json={"bandwidth_mbps": 4.0}, timeout=5).raise_for_status()
    long_prompt = prompt(40, 600)
    got = {"ids": []}
    body = {"model": "tiny", "prompt": long_prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with HTTP.stream("POST", f"{dep.url}/v1/completions", json=body, timeout=180) as r:
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
    assert got.get("error") is None and got["ids"] == moe_reference.greedy(long_prompt, 300)
    assert "relay_lost" in got["record"]["fallbacks"] and got["record"]["main_output_tokens"] > 0
    vllm_settled([dep.http["p0"], dep.http["md0"]])
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engine_core), 15,
               "the dead relay's vLLM processes to go")
