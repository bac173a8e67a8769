"""The router's OpenAI API in front of a pdd-mode deployment, for what the README says
it does beyond generating: the key from $PDD_API_KEY, a body over `max_body_bytes`
refused with 413 before it is parsed, `top_k` and `stop_token_ids` honoured by every
instance that produces a position (P, the relay, MD after the handoff), and a 429's
Retry-After computed from the service times it measured. One deployment serves the
module: every request crosses P, the relay and MD (P-RLD-MD pinned, handed over)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import signal
import time

import dashboard
import httpx
import pytest
from procs import HTTP, handed_over_within, metrics, pdd_up, wait_until

from pdd import config as cfg

API_KEY = "k3y-from-the-environment"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY_BYTES = 65536
CONFIG = f"""mode = "pdd"
[router]
max_body_bytes = {MAX_BODY_BYTES}
max_running = 1
max_waiting = 2
[policy]
pipeline = "P-RLD-MD"
[line]
bandwidth_mbps = 200.0
delay_ms = 2.0
jitter_ms = 0.5
"""
PROMPT = list(range(700, 1000))
HOT = {"temperature": 25.0, "seed": 7}  # the tiny model is decisive: it takes heat to sample off greedy


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    conf = tmp_path_factory.mktemp("router") / "d.toml"
    conf.write_text(CONFIG)
    with pdd_up("--config", str(conf), env={"PDD_API_KEY": API_KEY}) as dep:
        yield dep


@pytest.fixture(scope="module")
def router(deployment):
    return deployment.url


def test_the_dashboard_reads_what_the_processes_export(deployment, router):
    """Without root (test_sites does it across namespaces): after a request, every series
    the dashboard queries is on a /metrics page, with the labels its legends show, and no
    label clashes with those Prometheus adds on the scrape."""
    _complete(router, 8)
    pages = [HTTP.get(f"{url}/metrics", timeout=10).text for url in [router, *deployment.http.values()]]
    assert dashboard.check(pages) >= 20


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus (scripts/test.sh installs it)")
def test_prometheus_stores_what_every_panel_and_alert_reads(deployment, router, tmp_path):
    """A real Prometheus scrapes the live deployment as deploy/prometheus/prometheus.yml
    does (its jobs and target labels) and loads alerts.yml: after some traffic, every
    dashboard query returns series with finite values and the labels its legend shows
    (an instance's own name, not the router's address), and every alert's quantity
    returns series with the labels its summary names, every rule evaluating cleanly."""
    dep, targets = _scrape_targets(deployment)
    with dashboard.prometheus(targets, tmp_path) as prom:
        _all_up(prom, dep)
        for i in range(4):  # over a few scrapes, so every rate() has an increase in its window
            _complete_handed_over(router, 24, prompt=[900 + i, *PROMPT])  # (the handoff panels read these)
        done = metrics(router)["pdd_router_finished_prompt_tokens_total"]
        wait_until(lambda: float(dashboard.query(prom, "sum(pdd_router_finished_prompt_tokens_total)")[0]["value"][1])
                   == done, 30, "the last request scraped")
        time.sleep(2 * dashboard.SCRAPE_S)
        names = {"router", *deployment.http}
        bad = []
        for title, expr, legend in dashboard.panel_queries():
            series = dashboard.query(prom, expr)
            shown = re.findall(r"\{\{\s*(\w+)\s*\}\}", legend)
            bad += [f"{title}: {expr} returns nothing"] if not series else []
            for s in series:
                labels, value = s["metric"], float(s["value"][1])
                bad += [f"{title}: {expr} = {value}"] if not math.isfinite(value) else []
                bad += [f"{title}: {legend!r} lacks {label} in {labels}" for label in shown if not labels.get(label)]
                bad += [f"{title}: {label}={labels[label]!r} is not a process of the deployment"
                        for label in ("name", "member") if label in shown and labels[label] not in names]
        for rule in dashboard.alert_rules():
            series = dashboard.query(prom, dashboard.unthresholded(rule["expr"]))
            named = set(re.findall(r"\$labels\.(\w+)", rule["annotations"]["summary"]))
            bad += [f"alert {rule['alert']}: {rule['expr']} has no series"] if not series else []
            bad += [f"alert {rule['alert']}: {s['metric']} lacks {named - set(s['metric'])}"
                    for s in series if named - set(s["metric"])]
        assert not bad, "\n".join(bad)
        health = wait_until(lambda: (h := dashboard.rule_health(prom)) and "unknown" not in h.values() and h, 10,
                            "every rule evaluated")
        assert set(health) == {r["alert"] for r in dashboard.alert_rules()}
        assert set(health.values()) == {"ok"}, health


def _scrape_targets(deployment) -> tuple[cfg.Deployment, dict]:
    """The deployment's file and Prometheus' targets for it, labelled as prometheus.yml labels them."""
    dep = cfg.load(str(deployment.run_dir / "deployment.toml"))
    address = {name: url.split("//")[1] for name, url in {"router": deployment.url, **deployment.http}.items()}
    targets = {"pdd-router": {address["router"]: {"name": "router", "role": "router", "site": dep.line.a}},
               "pdd-instances": {address[i.name]: {"name": i.name, "role": str(i.role), "site": i.dc}
                                 for i in dep.instances}}
    return dep, targets


def _all_up(prom: str, dep: cfg.Deployment) -> None:
    wait_until(lambda: dashboard.query(prom, "count(up == 1)") and
               dashboard.query(prom, "count(up == 1)")[0]["value"][1] == str(1 + len(dep.instances)), 30,
               "every target scraped")


def _idle(url: str) -> None:
    """No request holds or waits for a slot (the last one's end has reached the router)."""
    wait_until(lambda: metrics(url)["pdd_admission_running"] == 0 == metrics(url)["pdd_admission_waiting"], 10,
               "the router idle")


def _complete(url: str, max_tokens: int, **extra) -> dict:
    _idle(url)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = HTTP.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _handed_over(body: dict, before: int | None = None) -> bool:
    """Both the relay and MD produced some of it (MD from position `before` at the latest)."""
    record = body["pdd"]
    handed = record["pipeline"] == "P-RLD-MD" and record["handoff"] and record["main_output_tokens"] > 0
    return bool(handed) and (before is None or record["handoff_tokens"] <= before)


def _complete_handed_over(url: str, max_tokens: int, before: int | None = None, **extra) -> dict:
    """A request both producers served: the premise of a test that each applies a parameter."""
    return handed_over_within(lambda: _complete(url, max_tokens, **extra), lambda body: _handed_over(body, before))


def test_the_api_key_comes_from_the_environment(router):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = HTTP.post(f"{router}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert HTTP.post(f"{router}/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    assert HTTP.get(f"{router}/health").status_code == 200  # the load balancer's probe needs no key


def test_a_body_over_the_limit_is_413_at_the_router(router):
    big = json.dumps({"model": "tiny", "prompt": "a " * MAX_BODY_BYTES, "max_tokens": 1}).encode()
    r = HTTP.post(f"{router}/v1/completions", content=big, headers={**AUTH, "content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    # no content-length: counted as it arrives
    r = HTTP.post(f"{router}/v1/completions", content=iter([big[:40000], big[40000:]]),
                   headers={**AUTH, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 413, r.text


def test_top_k_reaches_every_producer(router):
    """At a temperature that samples far off greedy, top_k=1 leaves only the greedy
    token: every position equals greedy only if each producer applied it."""
    greedy = _complete_handed_over(router, 60, ignore_eos=True)
    hot = _complete_handed_over(router, 60, ignore_eos=True, **HOT)
    top1 = _complete_handed_over(router, 60, ignore_eos=True, top_k=1, **HOT)
    ids = [b["choices"][0]["token_ids"] for b in (greedy, hot, top1)]
    assert ids[1] != ids[0]  # the premise: this heat does sample
    assert ids[2] == ids[0]


def test_stop_token_ids_reach_every_producer(router):
    greedy = _complete(router, 60)["choices"][0]["token_ids"]
    # a token that first appears late, after the relay has handed over
    at = next(i for i in range(30, len(greedy)) if greedy[i] not in greedy[:i])
    stopped = _complete_handed_over(router, 60, before=at, stop_token_ids=[greedy[at]])  # MD produced the stop
    assert stopped["choices"][0]["token_ids"] == greedy[: at + 1]
    assert stopped["choices"][0]["finish_reason"] == "stop"


async def _shed_after_slow_service(url: str, hold_s: float, slow: int) -> httpx.Response:
    """`slow` requests that each hold the router's only slot for `hold_s` (the client
    reads a token, waits, leaves), then the slot and both places in line taken: the next
    request is shed, and its 429 is returned."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as client:

        async def hold(seconds: float) -> None:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()  # (leaving an `async for` would close the response at once)
                while not (await anext(lines)).startswith("data: {"):
                    pass
                await asyncio.sleep(seconds)  # connected, reading nothing: the slot stays taken
                await lines.aclose()

        for _ in range(slow):
            await hold(hold_s)
            await asyncio.to_thread(_idle, url)
        holders = [asyncio.ensure_future(hold(60)) for _ in range(3)]  # one runs, two wait in the queue
        try:
            await asyncio.to_thread(wait_until, lambda: metrics(url)["pdd_admission_waiting"] == 2, 30, "a full line")
            return await client.post("/v1/completions", json={**body, "stream": False})
        finally:
            for h in holders:
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)


def test_retry_after_follows_the_service_times_the_router_measured(router):
    """Three requests held for 3 s each pull the router's running mean of service times
    (new weight 0.2) to at least 3 - 3 x 0.8^3 = 1.46 s, whatever came before; a request
    shed behind one running and two waiting is told to come back once the line would
    have cleared: (2 + 1) x that mean / 1 slot, at least 5 s (its prior of 1 s alone
    would say 3)."""
    _idle(router)
    started = time.monotonic()
    shed = asyncio.run(_shed_after_slow_service(router, 3.0, 3))
    print(f"\nshed after {time.monotonic() - started:.0f} s of slow service: "
          f"Retry-After {shed.headers.get('retry-after')}")
    assert shed.status_code == 429 and shed.json()["error"]["type"] == "rate_limit_exceeded", shed.text
    assert int(shed.headers["retry-after"]) >= 5
    _idle(router)


def test_a_cache_salt_is_a_namespace_of_its_own(deployment, router):
    """Two tenants with the same prompt: the salted one's second request hits its own
    prefix at P and at MD (what the router's mirror predicted), the other salt and the
    shared cache find none of it; an empty salt is refused."""
    prompt = list(range(3000, 3200))  # no other test sends it
    page = cfg.load(str(deployment.run_dir / "deployment.toml")).engine.page_size

    def mirrored() -> int:
        """The pages the router's mirror says MD holds."""
        return HTTP.get(f"{router}/pdd/stats", timeout=10).json()["instances"]["md0"]["mirror_pages"]

    def ask(**salt: str) -> tuple[int, int, int]:
        _idle(router)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **salt}
        r = HTTP.post(f"{router}/v1/completions", json=body, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert len(out["choices"][0]["token_ids"]) == 4
        record = out["pdd"]
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], record["d_hit_tokens"], record["d_hit_predicted"]

    before = mirrored()
    assert ask(cache_salt="alice") == (0, 0, 0)
    # the relay answered; MD's copy lands after, and the router's mirror learns it from MD's events
    wait_until(lambda: mirrored() >= before + len(prompt) // page, 30, "the router's mirror to hold the first turn")
    cached, d_hit, predicted = ask(cache_salt="alice")
    assert cached >= 160 and d_hit >= 160 and predicted == d_hit, (cached, d_hit, predicted)
    assert ask(cache_salt="bob") == (0, 0, 0)
    assert ask() == (0, 0, 0)
    r = HTTP.post(f"{router}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                     "cache_salt": ""}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus (scripts/test.sh installs it)")
def test_a_stopped_instance_sets_its_alerts_pending(deployment, tmp_path):
    """Last in the module: it kills the relay. A real Prometheus loading alerts.yml as
    shipped (thresholds and all, not rewritten) sees rld0's scrape fail and the router lose
    it: PddProcessDown and PddInstanceUnreachable go pending for rld0 alone, with the labels
    their summaries name; nothing was pending while every process answered."""
    dep, targets = _scrape_targets(deployment)
    with dashboard.prometheus(targets, tmp_path) as prom:
        _all_up(prom, dep)
        time.sleep(3 * dashboard.SCRAPE_S)
        assert dashboard.query(prom, 'ALERTS{alertname=~"PddProcessDown|PddInstanceUnreachable"}') == []
        os.kill(deployment.pids["rld0"], signal.SIGKILL)

        def pending() -> dict[str, dict]:
            found = dashboard.query(prom, 'ALERTS{alertstate="pending"}')
            return {s["metric"]["alertname"]: s["metric"] for s in found}

        alerts = wait_until(lambda: (p := pending()) and {"PddProcessDown", "PddInstanceUnreachable"} <= set(p) and p,
                            30, "both alerts pending")
        down, lost = alerts["PddProcessDown"], alerts["PddInstanceUnreachable"]
        assert (down["name"], down["role"], down["site"], down["severity"]) == ("rld0", "relay", "A", "page"), down
        assert (lost["member"], lost["member_role"], lost["dc"]) == ("rld0", "relay", "A"), lost
        assert len(dashboard.query(prom, 'ALERTS{alertname="PddProcessDown"}')) == 1
