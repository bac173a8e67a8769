"""What every vLLM-backed deployment under test is put through, whatever runs where.

`pipelines` sends fresh prompts (their KV takes ~100 ms to cross: P -> RLD -> MD, handed
over one-shot), their second turns (a small delta: P -> MD), and one request behind a
stalled line long enough for the relay to hand over by catch-up; every output must equal
a plain `vllm serve`'s. A deployment's policy: one-shot up to 64 relay tokens (the spec's
threshold), catch-up chunks of 32.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

from procs import HTTP, VLLM_START_S, Deployment, pdd_up, stream_completion

LINE = {"bandwidth_mbps": 200.0, "delay_ms": 2.0, "jitter_ms": 0.5}
POLICY = {"handoff_threshold": 64, "catch_up_chunk": 32}
CATCH_UP_TOKENS = 200  # relay tokens a stall should let the relay produce: well past the threshold
OUTPUT = 120
# the references are fp32 (`plain_vllm`); on vLLM the dtype is vLLM's own unless chosen, and
# vLLM's "auto" casts an fp32 checkpoint down to bf16. vLLM sizes each instance's cache itself,
# from a budget: 256 MiB here (2,048 blocks of the tiny model), not pdd's CPU default of 1 GiB,
# which every instance of every deployment would allocate and touch
ENGINE = '[engine]\ndtype = "float32"\n[engine.vllm]\nkv_cache_memory_bytes = 268435456\n'
# `pipelines` stalls the line up to 5 s (a slow machine's full stall), and the router's
# connections to B's instances cross it: silence counts from a heartbeat up to 1 s before the
# stall, so under the default liveness limit (5 s) a full stall could drop MD. The limit sits
# well above the stall: the line is late, never lost.
LIVENESS = "[liveness]\ndead_after_s = 15.0\n"


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 4096) for _ in range(n)]


def pdd_instances(tables: dict[str, str]) -> str:
    """`[[instances]]` for P and RLD in A, MD in B, each followed by its TOML in `tables`."""
    return "".join(f'[[instances]]\nname = "{name}"\nrole = "{role}"\ndc = "{dc}"\n' + tables.get(name, "")
                   for name, role, dc in (("p0", "prefill", "A"), ("rld0", "relay", "A"), ("md0", "main", "B")))


def write_config(path: Path, mode: str, instances: str = "") -> str:
    path.write_text(f'mode = "{mode}"\n[line]\n' + "".join(f"{k} = {json.dumps(v)}\n" for k, v in LINE.items())
                    + "[policy]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in POLICY.items())
                    + ENGINE + LIVENESS + instances)
    return str(path)


@contextlib.contextmanager
def deployment(tmp_path_factory, mode: str, *args: str, instances: str = "", name: str = "") -> Iterator[Deployment]:
    """`pdd up` of `mode` under this module's line and policy, given vLLM's time to start."""
    conf = write_config(tmp_path_factory.mktemp(name or mode) / "pdd.toml", mode, instances)
    with pdd_up("--config", conf, *args, timeout=VLLM_START_S) as d:
        yield d


def pipelines(dep, reference, seed: int = 0) -> tuple[list[list[int]], list[dict]]:
    """(prompts, results): three fresh prompts, their second turns, one stalled request."""
    fresh = [prompt(seed + i, 600) for i in range(3)]
    first = [stream_completion(dep.url, p, OUTPUT) for p in fresh]
    turns = [p + g["ids"] + prompt(seed + 10 + i, 20) for i, (p, g) in enumerate(zip(fresh, first, strict=True))]
    second = [stream_completion(dep.url, t, OUTPUT) for t in turns]
    # the line holds everything long enough for the relay to produce CATCH_UP_TOKENS (at
    # this machine's pace, from the second turns), and the request runs four times longer
    step_s = min(g["elapsed_s"] for g in second) / OUTPUT
    stall_s = min(5.0, max(0.3, CATCH_UP_TOKENS * step_s))
    long = min(3000, int(4 * stall_s / step_s))
    if dep.line_admin:
        dep.fault(stall_s=stall_s)
    last = prompt(seed + 20, 600)
    stalled = stream_completion(dep.url, last, long)
    prompts, done = fresh + turns + [last], first + second + [stalled]
    assert [g["error"] for g in done] == [None] * len(done)
    # every one whole: all its tokens, ended by its length (ignore_eos), not cut short
    assert [(len(g["ids"]), g["finish_reason"]) for g in done] == [(OUTPUT, "length")] * 6 + [(long, "length")]
    print(f"\nstall {stall_s:.2f} s for a {long}-token output; (pipeline, handoff, relay tokens, MD tokens, "
          "reserved hit, predicted hit):",
          [(g["record"]["pipeline"], g["record"]["handoff"], g["record"]["relay_output_tokens"],
            g["record"]["main_output_tokens"], g["record"]["d_hit_tokens"], g["record"]["d_hit_predicted"])
           for g in done])
    for g, p in zip(done, prompts, strict=True):
        assert g["error"] is None and g["ids"] == reference.greedy(p, len(g["ids"])), g["record"]
    return prompts, done


def shapes(done: list[dict]) -> list[tuple[str, str | None]]:
    return [(g["record"]["pipeline"], g["record"]["handoff"]) for g in done]


def assert_pdd_shapes(done: list[dict]) -> None:
    """Fresh prompts through the relay one-shot, second turns P -> MD, the stalled one by catch-up."""
    got = shapes(done)
    assert got[:3] == [("P-RLD-MD", "one_shot")] * 3, got
    assert got[3:6] == [("P-MD", None)] * 3, got
    assert got[6] == ("P-RLD-MD", "catch_up") and done[6]["record"]["handoff_chunks"] >= 2, got
    assert all(g["record"]["main_output_tokens"] > 0 for g in done)


def rid(got: dict) -> str:
    """The id the router gave the request at the instances."""
    return f"{got['id']}.{got['record']['retries']}"


def engine_stats(dep, name: str) -> dict:
    return HTTP.get(f"{dep.http[name]}/pdd/stats").json()["engine"]


def assert_second_turns_move_only_what_md_lacks(dep, prompts: list[list[int]], done: list[dict],
                                                 kv_bytes_per_token: int, md_hits_before: int) -> None:
    """`pipelines`' second turns: only the KV MD's vLLM lacks crosses (the line bytes within
    5 % of it), the router's mirror (fed by vLLM's KV events under pdd's hashes) predicted
    exactly the hit vLLM reserved, and MD's vLLM scheduler computed the prompt's last token
    (vLLM's rule), P's first token and one token a step after it: none of the hit, none of
    the imported tail; P computed what its own cache lacked; MD's prefix cache counted the hits."""
    p0, md0 = engine_stats(dep, "p0"), engine_stats(dep, "md0")
    for t, g in zip(prompts[3:6], done[3:6], strict=True):
        r = g["record"]
        missed = (len(t) - r["d_hit_tokens"]) * kv_bytes_per_token
        assert r["d_hit_tokens"] >= len(t) - 20 - 32 and missed <= r["line_bytes"] <= 1.05 * missed, r
        assert r["d_hit_predicted"] == r["d_hit_tokens"]
        assert md0["computed_by_request"][rid(g)] == OUTPUT
        assert p0["computed_by_request"][rid(g)] == len(t) - r["p_hit_tokens"]
    assert md0["prefix_cache_hits"] - md_hits_before >= sum(g["record"]["d_hit_tokens"] for g in done[3:6])
