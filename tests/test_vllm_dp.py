"""A data-parallel group as pdd members: `pdd up --mode pdd --engine vllm` with MD as a DP 2
group of the dense tiny model (`[engine.vllm] data_parallel_size = 2` on one
`[[instances]]` entry), each rank an instance process of its own around one vLLM engine
(`pdd.config.groups`). Greedy output equals a plain `vllm serve` on the same weights (each
rank a whole copy of the dense model, as each of `vllm serve --data-parallel-size 2`'s is)
through P -> RLD -> MD and P -> MD; the router shows the ranks under their
group and plans requests onto both; a session's second turn goes to the rank that holds
its first turn's KV and moves only what that rank lacks. One deployment for all."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from procs import HTTP, stream_completion, vllm_mirrored, vllm_settled
from vllm_scenarios import deployment, engine_stats, pdd_instances, prompt

pytest.importorskip("vllm")

GROUP = pdd_instances({"md0": "[instances.engine.vllm]\ndata_parallel_size = 2\n"})
RANKS = ["md0-dp0", "md0-dp1"]
OUTPUT = 24


@pytest.fixture(scope="module")
def dep(tmp_path_factory, vllm_reference):
    with deployment(tmp_path_factory, "pdd", "--engine", "vllm", instances=GROUP, name="dp") as d:
        yield d


def test_the_ranks_are_members_under_their_group(dep):
    router = HTTP.get(f"{dep.url}/pdd/stats").json()
    assert router["groups"] == {"md0": RANKS}
    groups = {n: i["group"] for n, i in router["instances"].items()}
    assert groups == {"p0": "", "rld0": "", **dict.fromkeys(RANKS, "md0")}
    assert all(router["instances"][r]["healthy"] and router["instances"][r]["pages"] > 0 for r in RANKS)


def test_sessions_land_on_both_ranks_and_equal_plain_vllm(dep, vllm_reference):
    """A long fresh prompt through the relay (P -> RLD -> MD); four fresh prompts at once
    (through the relay, or straight from P where the policy finds the line quick enough);
    then each one's second turn straight from P (P -> MD). Every output equals plain
    vLLM's; the router spreads the fresh prompts over both ranks (by load: nothing is
    cached yet); each second turn goes to the rank that served its first (prefix
    affinity), whose vLLM hits the first turn's KV, so only the delta crosses."""
    before = {r: engine_stats(dep, r) for r in RANKS}
    alone = prompt(99, 600)
    relayed = stream_completion(dep.url, alone, OUTPUT)
    assert relayed["record"]["pipeline"] == "P-RLD-MD"  # (its KV is long to cross: the relay starts)
    fresh = [prompt(100 + i, 400) for i in range(4)]
    with ThreadPoolExecutor(len(fresh)) as pool:  # at once: the ranks' loads differ
        first = list(pool.map(lambda p: stream_completion(dep.url, p, OUTPUT), fresh))
    turns = [p + g["ids"] + prompt(200 + i, 16) for i, (p, g) in enumerate(zip(fresh, first, strict=True))]
    vllm_settled([dep.http[r] for r in RANKS])
    vllm_mirrored(dep.url, {r: dep.http[r] for r in RANKS})  # the router has heard where the first turns are
    second = [stream_completion(dep.url, t, OUTPUT) for t in turns]
    for g, p in zip([relayed, *first, *second], [alone, *fresh, *turns], strict=True):
        assert g["error"] is None and g["ids"] == vllm_reference.greedy(p, OUTPUT), g["record"]
    served = [g["record"]["instances"]["main"] for g in first]
    print("\nfirst turns served by", served, "; pipelines",
          [(g["record"]["pipeline"], g["record"]["instances"]["main"], g["record"]["d_hit_tokens"])
           for g in first + second])
    assert set(served) == set(RANKS)  # both ranks took work, as each rank's vLLM counts it
    assert all(engine_stats(dep, r)["generation_tokens"] > before[r]["generation_tokens"] for r in RANKS)
    assert [g["record"]["pipeline"] for g in second] == ["P-MD"] * 4
    assert [g["record"]["instances"]["main"] for g in second] == served  # each to the rank holding its first turn
    for t, g in zip(turns, second, strict=True):
        assert g["record"]["d_hit_tokens"] >= len(t) - 16 - OUTPUT - 32, g["record"]  # the first turn's KV, hit
    for r in RANKS:
        hit = sum(g["record"]["d_hit_tokens"] for g in second if g["record"]["instances"]["main"] == r)
        assert engine_stats(dep, r)["prefix_cache_hits"] - before[r]["prefix_cache_hits"] >= hit > 0
    vllm_settled([dep.http[n] for n in ("p0", "rld0", *RANKS)])
