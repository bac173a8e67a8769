"""Tenants on one server: named API keys from a keys file, $PDD_API_KEYS and --api-key;
each request counted under its key's name and logged in one line (`pdd.access`); the
latency histograms count from arrival; a keys file with a mistake stops the server."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest
from procs import HTTP, free_port, metrics, stop_group, wait_http

KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789", "carol": "sk-carol-0123456789",
        "default": "sk-default-0123456789"}


@pytest.fixture(scope="module")
def tenants(tmp_path_factory, tiny_model_dir):
    where = tmp_path_factory.mktemp("tenants")
    (where / "keys.toml").write_text(f'[keys]\nalice = "{KEYS["alice"]}"\nbob = "{KEYS["bob"]}"\n')
    log = where / "serve.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDD_API_KEYS": f"carol={KEYS['carol']}"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pdd.cli", "serve", str(tiny_model_dir), "--port", str(port),
                                 "--served-model-name", "tiny", "--num-pages", "128", "--api-key", KEYS["default"],
                                 "--api-keys-file", str(where / "keys.toml")],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"{url}/health", proc, 60)
        yield url, log
    finally:
        stop_group(proc, 5)


def _complete(url: str, key: str | None, max_tokens: int) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "prompt": list(range(50, 90)), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    return HTTP.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def test_each_key_is_counted_and_logged_under_its_name(tenants):
    url, log = tenants
    asked = {"alice": 3, "bob": 1, "carol": 2, "default": 1}  # requests per key
    for name, n in asked.items():
        for i in range(n):
            r = _complete(url, KEYS[name], 4 + i)
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"][0]["token_ids"]) == 4 + i
    assert _complete(url, "sk-mallory", 4).status_code == 401
    assert _complete(url, None, 4).status_code == 401
    m = metrics(url)
    for name, n in asked.items():
        assert m[f'pdd_api_key_requests_total{{api_key="{name}",status="200"}}'] == n, m
        assert m[f'pdd_api_key_prompt_tokens_total{{api_key="{name}"}}'] == 40 * n
        assert m[f'pdd_api_key_generation_tokens_total{{api_key="{name}"}}'] == sum(4 + i for i in range(n))
    assert m['pdd_api_key_requests_total{api_key="unknown",status="401"}'] == 2
    # from arrival: every admitted request waited (a little) and ended; tokens after the first are gaps
    served = sum(asked.values())
    assert m["pdd_request_queue_time_seconds_count"] == m["pdd_e2e_request_latency_seconds_count"] == served
    assert m["pdd_time_to_first_token_seconds_count"] == served
    assert m["pdd_inter_token_latency_seconds_count"] == sum(3 + i for n in asked.values() for i in range(n))
    lines = [line for line in log.read_text().splitlines() if "pdd.access" in line]
    assert len(lines) == served + 2, lines
    alice = [line for line in lines if " key=alice " in line]
    assert len(alice) == 3 and all(re.search(
        r"key=alice POST /v1/completions 200 prompt=40 completion=\d finish=length pipeline=colocated ttft_ms=[\d.]+ "
        r"e2e_ms=[\d.]+ rid=cmpl-[0-9a-f]+$", line) for line in alice), alice
    assert sum(" key=unknown POST /v1/completions 401 prompt=0 completion=0 " in line for line in lines) == 2
    assert not any(key in log.read_text() for key in KEYS.values())  # names, never the keys


def test_without_a_salt_each_key_has_a_cache_of_its_own(tenants):
    """A server of several keys keeps each key's prefixes apart unless requests give the
    same cache_salt, which they then share (as on vLLM); a salt never names a key's cache."""
    url, _ = tenants
    prompt = list(range(600, 700))

    def cached(key: str, **salt: str) -> int:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, **salt}
        r = HTTP.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[key]}"},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice") == 0 and cached("alice") > 0  # its own second request hits
    assert cached("bob") == 0  # the same prompt, another key: nothing of alice's shows
    assert cached("bob", cache_salt="key:alice") == 0  # a salt is a salt, not a key's namespace
    assert cached("alice", cache_salt="team") == 0 and cached("bob", cache_salt="team") > 0  # shared on purpose


@pytest.mark.parametrize("keys_file, env, says", [
    ('[keys]\nalice = "k1"\nbob = "k1"\n', "", "keys 'alice' and 'bob' are the same key"),
    ('[keys]\nalice = "k1"\n', "alice=k2", "$PDD_API_KEYS: key name 'alice' is given twice"),
    ('[keys]\n"al ice" = "k1"\n', "", "key name 'al ice' is not"),
    ('alice = "k1"\n', "", 'a keys file is one [keys] table of NAME = "KEY"'),
    ("", "alice", "$PDD_API_KEYS: 'alice' is not NAME=KEY"),
])
def test_a_keys_mistake_is_one_line(tmp_path, tiny_model_dir, keys_file, env, says):
    path = tmp_path / "keys.toml"
    path.write_text(keys_file)
    args = ["--api-keys-file", str(path)] if keys_file else []
    out = subprocess.run([sys.executable, "-m", "pdd.cli", "serve", str(tiny_model_dir), "--port", "0", *args],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PDD_API_KEYS": env})
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and says in out.stderr, out.stderr
