"""Mixed deployments: vLLM and the embedded engine in one `pdd up --mode pdd`, with their
own page sizes (vLLM's 32-token blocks, the embedded engine's 16-token pages). First P
on vLLM with RLD and MD embedded (vLLM's CPU-packed KV read out and re-paged into the
embedded engine's pool), then the reverse (the embedded engine's KV packed into vLLM's
blocks, on both paths). Greedy output equals a plain `vllm serve` through every
pipeline and handoff; seeded output equals the embedded engine's own (pdd's draw on
every producer, whichever engine); only the missed KV crosses."""

from __future__ import annotations

import pytest
from msgspec.structs import replace  # sampling params are a msgspec struct
from procs import HTTP, agent_session, kv_bytes_per_token, standalone, stream_completion, vllm_settled
from vllm_scenarios import assert_pdd_shapes, deployment, pdd_instances, pipelines, prompt

pytest.importorskip("vllm")

LAYOUTS = {  # which instances run vLLM
    "vllm-prefill": {"p0"},
    "vllm-decode": {"rld0", "md0"},
}
SEEDED = {"temperature": 25.0, "top_p": 0.95, "seed": 1234}
# with pdd's logit shaping, which counts the output so far wherever it was produced
SHAPED = {**SEEDED, "min_p": 0.2, "repetition_penalty": 2.0, "frequency_penalty": 1.0, "presence_penalty": 0.5}


def _instances(on_vllm: set[str]) -> str:
    return pdd_instances(dict.fromkeys(on_vllm, '[instances.engine]\nbackend = "vllm"\n'))


@pytest.fixture(scope="module", params=list(LAYOUTS))
def dep(request, tmp_path_factory):
    on_vllm = LAYOUTS[request.param]
    with deployment(tmp_path_factory, "pdd", instances=_instances(on_vllm), name=request.param) as d:
        d.on_vllm = on_vllm
        yield d


def _settled(dep) -> None:
    vllm_settled([dep.http[n] for n in sorted(dep.on_vllm)])
    for name in {"p0", "rld0", "md0"} - dep.on_vllm:
        kv = HTTP.get(f"{dep.http[name]}/pdd/stats").json()["kv"]
        assert kv["free"] + kv["cached"] == kv["pages"], (name, kv)


def test_every_pipeline_and_handoff_equals_plain_vllm_across_engines(dep, vllm_reference, tiny_model_dir):
    bpt = kv_bytes_per_token(tiny_model_dir)
    prompts, done = pipelines(dep, vllm_reference, seed=100)
    assert_pdd_shapes(done)
    md_page = 32 if "md0" in dep.on_vllm else 16
    for t, g in zip(prompts[3:6], done[3:6], strict=True):  # second turns: only what MD's own cache lacks crossed
        r = g["record"]
        missed = (len(t) - r["d_hit_tokens"]) * bpt
        assert r["d_hit_tokens"] % md_page == 0 and r["d_hit_tokens"] >= len(t) - 20 - md_page
        assert missed <= r["line_bytes"] <= 1.05 * missed, r
    _settled(dep)


def test_seeded_shaped_sampling_is_the_same_draw_on_either_engine(dep, tiny_model_dir):
    from pdd.engines.embedded.engine import Engine
    from pdd.engines.port import EngineConfig
    from pdd.sampling.params import SamplingParams

    engine = Engine(tiny_model_dir, EngineConfig())
    params = SamplingParams(max_tokens=120, ignore_eos=True, **SHAPED)
    # fresh prompts: P samples position 0, the relay the next, MD the rest. On a loaded machine
    # the relay may finish alone before MD is ready (the design's answer to a slow MD): that
    # request is still checked, and another is sent, a few times, until MD took over one
    for attempt in range(4):
        first = prompt(200 + 2 * attempt, 600)
        got = stream_completion(dep.url, first, 120, **SHAPED)
        assert got["ids"] == engine.generate([first], params)[0]
        if got["record"]["main_output_tokens"] > 0:
            break
    else:
        raise AssertionError(f"four requests in a row were not handed over to MD in time: {got['record']}")
    turn = first + got["ids"] + prompt(201, 20)  # a second turn: P, then MD
    got2 = stream_completion(dep.url, turn, 40, **SHAPED)
    print(f"\nseeded: {got['record']['pipeline']}/{got['record']['handoff']}, then {got2['record']['pipeline']}")
    assert got2["ids"] == engine.generate([turn], replace(params, max_tokens=40))[0]
    _settled(dep)


def test_a_scripted_agent_session_on_vllm_equals_the_embedded_engines(dep, tiny_model_dir):
    """Two turns of an agent (a required tool call held to its schema by the grammar on
    whichever engine produces each position, then the tool's result and an answer), greedy
    and seeded: the tokens the embedded engine alone gives."""
    got = [agent_session(dep.url, temperature=0), agent_session(dep.url, **SEEDED)]
    with standalone(tiny_model_dir) as url:
        want = [agent_session(url, temperature=0), agent_session(url, **SEEDED)]
    assert [[t["ids"] for t in a] for a in got] == [[t["ids"] for t in a] for a in want]
    print(f"\n{sorted(dep.on_vllm)} on vLLM: the call's producers (relay, MD tokens):",
          [(a[0]["record"]["relay_output_tokens"], a[0]["record"]["main_output_tokens"]) for a in got])
    _settled(dep)
