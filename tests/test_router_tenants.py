"""Named API keys through the router of a pdd-mode deployment (tests/test_tenants.py holds
`pdd serve`'s): each key's prefixes are a namespace of their own at P and at MD, every request
crossing P, the relay and MD (P-RLD-MD pinned); a key's second request hits its own prefix,
another key's same prompt finds none of it; the router counts each request under its key's
name, and refuses a key it does not hold."""

from __future__ import annotations

import pytest
from procs import HTTP, metrics, pdd_up, wait_until

KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789"}
CONFIG = """mode = "pdd"
[policy]
pipeline = "P-RLD-MD"
[line]
bandwidth_mbps = 200.0
delay_ms = 2.0
jitter_ms = 0.5
"""
PROMPT = list(range(800, 960))


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    conf = tmp_path_factory.mktemp("tenants") / "d.toml"
    conf.write_text(CONFIG)
    keys = ",".join(f"{name}={key}" for name, key in KEYS.items())
    with pdd_up("--config", str(conf), env={"PDD_API_KEYS": keys}) as dep:
        yield dep.url


def _ask(url: str, key: str) -> dict:
    wait_until(lambda: metrics(url)["pdd_admission_running"] == 0, 10, "the router idle")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    r = HTTP.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_each_key_is_a_namespace_at_p_and_md_and_counted_by_name(router):
    first = _ask(router, KEYS["alice"])["pdd"]
    assert first["pipeline"] == "P-RLD-MD" and (first["p_hit_tokens"], first["d_hit_tokens"]) == (0, 0), first
    again = _ask(router, KEYS["alice"])["pdd"]
    assert again["p_hit_tokens"] >= 128 and again["d_hit_tokens"] >= 128, again  # its own prefix, at P and at MD
    other = _ask(router, KEYS["bob"])["pdd"]
    assert (other["p_hit_tokens"], other["d_hit_tokens"]) == (0, 0), other  # the same prompt, another key
    assert _ask(router, KEYS["bob"])["pdd"]["d_hit_tokens"] >= 128  # bob's own, now
    m = metrics(router)
    assert m['pdd_api_key_requests_total{api_key="alice",status="200"}'] == 2, m
    assert m['pdd_api_key_requests_total{api_key="bob",status="200"}'] == 2, m
    assert m['pdd_api_key_prompt_tokens_total{api_key="alice"}'] == 2 * len(PROMPT)
    refused = HTTP.post(f"{router}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1},
                         headers={"Authorization": "Bearer sk-mallory-0123456789"}, timeout=30)
    assert refused.status_code == 401
    assert metrics(router)['pdd_api_key_requests_total{api_key="unknown",status="401"}'] == 1
