"""Hostile input to the OpenAI API: clean 4xx, never a 500, never a stalled server.

Found by trying a deployment as a hostile user would (issue: operable and hard to
break): a huge `seed`, a lone UTF-16 surrogate, bodies of megabytes."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request
from procs import HTTP, metrics, standalone

from pdd.api.limits import BodyLimit


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with standalone(tiny_model_dir) as url:
        yield url


@pytest.mark.parametrize("seed", [2**64, 2**200, -(2**70)])
def test_any_integer_seed_samples_and_repeats(server, seed):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 1.0, "seed": seed}
    first = HTTP.post(f"{server}/v1/completions", json=body, timeout=30)
    assert first.status_code == 200, first.text
    again = HTTP.post(f"{server}/v1/completions", json=body, timeout=30).json()
    assert first.json()["choices"][0]["token_ids"] == again["choices"][0]["token_ids"]
    streamed = HTTP.post(f"{server}/v1/completions", json=body | {"stream": True}, timeout=30)
    assert streamed.status_code == 200 and "server_error" not in streamed.text


@pytest.mark.parametrize("path,raw", [
    ("/v1/completions", '{"model": "tiny", "prompt": "\\ud800abc", "max_tokens": 2}'),
    ("/v1/chat/completions",
     '{"model": "tiny", "messages": [{"role": "user", "content": "x\\udfffy"}], "max_tokens": 2}'),
])
def test_a_lone_surrogate_is_a_client_error(server, path, raw):
    r = HTTP.post(f"{server}{path}", content=raw.encode(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "Unicode" in r.json()["error"]["message"]


def test_a_body_over_the_limit_is_refused_before_parsing(server):
    """Ten times: the 413 arrives whole (closed on the unread body, the connection was reset
    before its answer in 26 of 40 tries)."""
    big = {"model": "tiny", "prompt": "a " * 2_500_000, "max_tokens": 1}  # 5 MB, over the 4 MiB default
    for _ in range(10):
        r = HTTP.post(f"{server}/v1/completions", json=big, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_prompt_no_context_can_hold_is_refused_without_tokenizing(server):
    r = HTTP.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": "a " * 1_500_000, "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    assert HTTP.get(f"{server}/health", timeout=5).status_code == 200


def _echo_app(limit: int) -> BodyLimit:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    return BodyLimit(app, limit)


def test_body_limit_counts_declared_and_streamed_bytes():
    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=_echo_app(100))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            async def chunks():
                for _ in range(3):
                    yield b"x" * 40  # no content-length: counted as it arrives

            at_limit = await client.post("/echo", content=b"x" * 100)
            over = await client.post("/echo", content=b"x" * 101)
            streamed = await client.post("/echo", content=chunks())
            assert at_limit.json() == {"bytes": 100}
            return [at_limit.status_code, over.status_code, streamed.status_code]

    assert asyncio.run(run()) == [200, 413, 413]




def test_an_idle_instance_reports_its_cache_as_cached_not_used(server):
    body = {"model": "tiny", "prompt": list(range(20, 400)), "max_tokens": 4}
    assert HTTP.post(f"{server}/v1/completions", json=body, timeout=30).status_code == 200
    kv = HTTP.get(f"{server}/pdd/stats").json()["kv"]
    m = metrics(server)
    assert m["pdd_prefix_cache_pages"] > 0  # the prompt stays cached for the next turn...
    assert m["pdd_kv_cache_usage"] == 0.0 and m["pdd_kv_used_pages"] == 0  # ...but nothing runs
    assert m["pdd_kv_free_pages"] + m["pdd_prefix_cache_pages"] == kv["pages"]


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    with standalone(tiny_model_dir, "--api-key", "s3cret", pages=64) as url:
        yield url


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}])
def test_without_the_api_key_the_api_is_closed(keyed, headers):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    r = HTTP.post(f"{keyed}/v1/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert HTTP.get(f"{keyed}/v1/models", headers=headers).status_code == 401
    assert HTTP.get(f"{keyed}/health").status_code == 200  # the load balancer's probe stays open


def test_with_the_api_key_it_serves(keyed):
    r = HTTP.post(f"{keyed}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                   headers={"Authorization": "Bearer s3cret"}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


def test_the_router_takes_its_key_from_pdd_up():
    from procs import pdd_up

    with pdd_up("--mode", "colocated", "--api-key", "k3y") as dep:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        assert HTTP.post(f"{dep.url}/v1/completions", json=body, timeout=30).status_code == 401
        ok = HTTP.post(f"{dep.url}/v1/completions", json=body, headers={"Authorization": "Bearer k3y"}, timeout=30)
        assert ok.status_code == 200
