"""`pdd up --mode pd-cross-dc --engine vllm`: plain cross-datacenter PD on vLLM, P in A, D
in B behind the line emulator, no relay. Greedy output equals a plain `vllm serve`; the
decode side's vLLM keeps earlier turns, so a second turn moves only the KV it lacks;
its vLLM computes no prompt token but the last."""

from __future__ import annotations

import pytest
from procs import HTTP, kv_bytes_per_token, vllm_mirrored, vllm_settled, wait_until
from vllm_scenarios import deployment, pipelines, rid, shapes

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    with deployment(tmp_path_factory, "pd-cross-dc", "--engine", "vllm") as d:
        yield d


def test_cross_dc_pd_on_vllm_equals_plain_vllm(dep, vllm_reference, tiny_model_dir):
    bpt = kv_bytes_per_token(tiny_model_dir)
    prompts, done = pipelines(dep, vllm_reference, seed=300)
    assert shapes(done) == [("P-MD", None)] * len(done)
    md0 = HTTP.get(f"{dep.http['md0']}/pdd/stats").json()["engine"]
    for p, g in zip(prompts, done, strict=True):
        r = g["record"]
        missed = (len(p) - r["d_hit_tokens"]) * bpt
        assert missed <= r["line_bytes"] <= 1.05 * missed, r
        assert md0["computed_by_request"][rid(g)] == len(g["ids"])  # the prompt's last token, then one a step
    assert all(g["record"]["d_hit_tokens"] >= len(p) - 20 - 32 for p, g in zip(prompts[3:6], done[3:6], strict=True))
    vllm_settled([dep.http["p0"], dep.http["md0"]])


def test_a_vllm_instance_serves_vllms_own_metrics_beside_pdds(dep):
    """vLLM's series (in prometheus_client's process-wide registry) on the instance's
    /metrics under their own names, counting what that instance's vLLM did."""
    for name in ("p0", "md0"):
        page = HTTP.get(f"{dep.http[name]}/metrics", timeout=10).text
        values = {line.split(" ")[0]: float(line.split(" ")[-1]) for line in page.splitlines()
                  if line.startswith("vllm:") and " " in line}
        assert "pdd_kv_free_pages" in page, name
        prompts = sum(v for k, v in values.items() if k.startswith("vllm:prompt_tokens_total"))
        assert prompts > 0 and any(k.startswith("vllm:num_requests_running") for k in values), (name, sorted(values))


def test_a_cache_salt_is_a_namespace_of_its_own_on_vllm(dep):
    """vLLM keeps the salt's blocks apart (pdd gives it the salt); MD's reservation finds
    the salted tenant's own prefix and the router's mirror predicted it (from vLLM's
    events, the salt in the first block's extra keys); another salt and the shared
    cache find none of it."""
    prompt = list(range(3000, 3200))

    def ask(**salt: str) -> tuple[int, int]:
        vllm_settled([dep.http["p0"], dep.http["md0"]])
        vllm_mirrored(dep.url, {n: dep.http[n] for n in ("p0", "md0")})  # the last request's blocks are in it
        wait_until(lambda: HTTP.get(f"{dep.url}/ready").status_code == 200, 30, "the router to reach every instance")
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **salt}
        r = HTTP.post(f"{dep.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        record = r.json()["pdd"]
        return record["d_hit_tokens"], record["d_hit_predicted"]

    def cached_blocks() -> int:
        return HTTP.get(f"{dep.http['md0']}/pdd/stats").json()["engine"]["cached_blocks"]

    held = cached_blocks()
    assert ask(cache_salt="alice") == (0, 0)
    # vLLM's event of the blocks it stored (one, for the request's blocks) reaches MD after the
    # request ends: counted before it does, MD's blocks and the router's mirror agree on the
    # cache as it was (a clean clone predicted 0 of 192 so)
    wait_until(lambda: cached_blocks() > held, 30, "MD's event of the salted prompt's blocks")
    d_hit, predicted = ask(cache_salt="alice")
    assert d_hit >= 160 and predicted == d_hit, (d_hit, predicted)
    assert ask(cache_salt="bob") == (0, 0)
    assert ask() == (0, 0)
