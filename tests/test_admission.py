"""Admission control: a bounded queue at the router and in each instance; past it,
429 with Retry-After in OpenAI's error shape, and no accepted request is lost."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from procs import HTTP, metrics, pdd_up, standalone
from prometheus_client import CollectorRegistry

from pdd.api.admission import AdmissionGate
from pdd.api.protocol import ApiError
from pdd.policy.admission import RUN, SHED, WAIT, Limits, admit, retry_after_s


def test_admit_runs_then_queues_then_sheds():
    limits = Limits(max_running=2, max_waiting=1)
    assert admit(0, 0, limits) == RUN and admit(1, 0, limits) == RUN
    assert admit(2, 0, limits) == WAIT
    assert admit(1, 1, Limits(2, 2)) == WAIT  # a free slot does not let a newcomer jump the line
    assert admit(2, 1, limits) == SHED
    assert admit(0, 0, Limits(1, 0)) == RUN and admit(1, 0, Limits(1, 0)) == SHED


def test_retry_after_is_the_time_the_line_takes_to_clear():
    assert retry_after_s(waiting=3, max_running=2, mean_service_s=1.0) == 2  # 4 requests, 2 at a time
    assert retry_after_s(waiting=0, max_running=8, mean_service_s=0.01) == 1  # never below HTTP's unit
    assert retry_after_s(waiting=10_000, max_running=1, mean_service_s=5.0) == 60


def test_the_gate_is_fifo_and_a_client_leaving_the_line_gives_up_its_place():
    async def go() -> None:
        gate = AdmissionGate(Limits(1, 2), CollectorRegistry())
        first = await gate.enter()
        order: list[str] = []

        async def wait(name: str) -> None:
            slot = await gate.enter()
            order.append(name)
            slot.release()

        b = asyncio.ensure_future(wait("b"))
        c = asyncio.ensure_future(wait("c"))
        await asyncio.sleep(0)
        assert gate.waiting == 2
        with pytest.raises(ApiError) as shed:
            await gate.enter()
        assert shed.value.status == 429 and int(shed.value.headers["Retry-After"]) >= 1 and gate.shed == 1
        b.cancel()  # b's client left while waiting
        await asyncio.sleep(0)
        first.release()
        first.release()  # released twice: counted once
        await c
        assert order == ["c"] and gate.running == 0 and gate.waiting == 0

    asyncio.run(go())


def _flood(url: str, n: int, max_tokens: int = 24) -> list[httpx.Response]:
    body = {"model": "tiny", "prompt": "the line between datacenters", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: HTTP.post(f"{url}/v1/completions", json=body, timeout=120), range(n)))


def _check_flood(responses: list[httpx.Response], max_tokens: int = 24) -> tuple[int, int]:
    """Only 200 and 429; every 429 in OpenAI's shape with Retry-After; every 200 whole.
    The (accepted, shed) counts."""
    shed = [r for r in responses if r.status_code == 429]
    ok = [r for r in responses if r.status_code == 200]
    assert len(shed) + len(ok) == len(responses), sorted({r.status_code for r in responses})
    for r in shed:
        assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["type"] == "rate_limit_exceeded", r.text
    assert all(r.json()["usage"]["completion_tokens"] == max_tokens for r in ok)
    return len(ok), len(shed)




def _config(tmp_path: Path, **sections: dict) -> str:
    lines = ['mode = "pd-cross-dc"']
    for name, table in sections.items():
        lines += [f"[{name}]", *(f"{k} = {json.dumps(v)}" for k, v in table.items())]
    (tmp_path / "dep.toml").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "dep.toml")


def test_a_flood_past_the_routers_line_gets_429_and_loses_nothing(tmp_path):
    conf = _config(tmp_path, router={"max_running": 2, "max_waiting": 2})
    with pdd_up("--config", conf) as dep:
        responses = _flood(dep.url, 24)
        accepted, shed = _check_flood(responses)
        assert shed > 0 and accepted >= 4
        assert metrics(dep.url)["pdd_admission_shed_total"] == shed
        assert metrics(dep.url)["pdd_admission_running"] == 0 and metrics(dep.url)["pdd_admission_waiting"] == 0
        after = _flood(dep.url, 1)  # the line has cleared: served again
    print(f"\nflood of 24 at a router holding 2 + 2: {accepted} served, {shed} shed")
    assert after[0].status_code == 200


def test_the_router_sends_a_decode_instance_no_more_than_it_may_hold(tmp_path):
    """An instance past `max_requests` would refuse as busy; the router holds the rest
    in its own line instead, so every admitted request completes."""
    conf = _config(tmp_path, engine={"max_requests": 1})
    with pdd_up("--config", conf) as dep:
        accepted, shed = _check_flood(_flood(dep.url, 8))
        assert (accepted, shed) == (8, 0)
        assert HTTP.get(f"{dep.http['md0']}/pdd/stats", timeout=5).json()["node"]["peak_held"] == 1


def test_a_standalone_instance_bounds_its_own_api(tiny_model_dir):
    with standalone(tiny_model_dir, "--max-requests", "2") as url:
        accepted, shed = _check_flood(_flood(url, 10, max_tokens=48), max_tokens=48)
        assert shed > 0 and accepted >= 2
        assert metrics(url)["pdd_admission_shed_total"] == shed
