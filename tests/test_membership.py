"""Decoupled lifecycles as real processes: a decode instance joins a running pdd-mode
deployment and gets work (and, asked to, serves the OpenAI API itself); another is
drained while it streams, finishes every request and leaves, and the router sends it
nothing meanwhile, though by load it would; the membership routes need the admin token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from procs import HTTP, free_port, join_main, pdd_process, pdd_up, wait_until

import pdd
from pdd import config as cfg
from pdd.api.auth import admin_token
from pdd.sampling.params import SamplingParams
from pdd.transfer import wire

PROMPT = list(range(100, 260))
ONLY_MD0 = list(range(1000, 1400))  # served before md1 joins: only md0 holds it
LINE = ["--bandwidth-mbps", "200", "--delay-ms", "2", "--jitter-ms", "0.5"]


def _complete(url: str, max_tokens: int, prompt: list[int] = PROMPT) -> dict:
    r = HTTP.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    return {"ids": body["choices"][0]["token_ids"], "main": body.get("pdd", {}).get("instances", {}).get("main")}


def _instances(url: str) -> dict:
    return HTTP.get(f"{url}/pdd/stats", timeout=10).json()["instances"]




def _md1_serves(dep, reference: list[int]) -> None:
    """Once the router is connected to the joined md1, it gets some of 8 requests at once,
    and every one gives the reference tokens."""
    wait_until(lambda: _instances(dep.url).get("md1", {}).get("healthy"), 30, "the router connects to md1")
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: _complete(dep.url, 40), range(8)))
    assert all(r["ids"] == reference for r in results)
    assert "md1" in {r["main"] for r in results}, "the new instance should get work"


def _admin_refused(dep) -> None:
    """The membership routes without the admin token, or with a wrong one: 401, and
    nothing joins or drains."""
    intruder = {"name": "intruder", "role": "main", "dc": "B", "host": "127.0.0.1", "port": free_port(),
                "kv_port": free_port(), "advertise": {"A": f"127.0.0.1:{free_port()}"}}
    for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": admin_token("other secret")}):
        joined = HTTP.post(f"{dep.url}/pdd/admin/instances", json=intruder, headers=headers, timeout=10)
        drained = HTTP.post(f"{dep.url}/pdd/admin/instances/md0/drain", headers=headers, timeout=10)
        assert (joined.status_code, drained.status_code) == (401, 401), (joined.text, drained.text)
    instances = _instances(dep.url)
    assert "intruder" not in instances and not instances["md0"]["draining"]


def _main_of(url: str, max_tokens: int, prompt: list[int]) -> str:
    return _complete(url, max_tokens, prompt)["main"]


def _weigh_on(url: str, max_tokens: int, prompt: list[int], release: threading.Event) -> None:
    """A streamed request left open until `release`, then abandoned (its client leaves):
    until then it counts as queued work where it runs."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with HTTP.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # (leaving a `for` over it would close the response at once)
        while not next(lines).startswith("data: {"):
            pass
        release.wait(120)


def test_a_main_instance_joins_then_another_is_drained_without_failing_a_request(tmp_path):
    with pdd_up("--mode", "pdd", *LINE) as dep:
        reference = _complete(dep.url, 40)["ids"]
        assert _complete(dep.url, 4, ONLY_MD0)["main"] == "md0"
        _admin_refused(dep)
        joining, conf, md1_http = join_main(dep, tmp_path, "md1")
        with joining as md1:
            _md1_serves(dep, reference)
            # --openai-api: the joined decode instance serves the API itself, with the same tokens
            assert [m["id"] for m in HTTP.get(f"{md1_http}/v1/models", timeout=10).json()["data"]] == ["tiny"]
            assert _complete(md1_http, 40)["ids"] == reference
            assert HTTP.get(f"{dep.http['md0']}/v1/models", timeout=10).status_code == 404  # not asked to

            with ThreadPoolExecutor(2) as pool:
                # md0 holds one long request (its prefix cached there alone); md1, more queued
                # work: by load the router would pick md0 next, so only the drain keeps work off it
                on_md0 = pool.submit(_complete, dep.url, 1000, ONLY_MD0 + PROMPT[:10])
                wait_until(lambda: _instances(dep.url)["md0"]["queued_tokens"] > 0, 30, "md0 has work")
                release = threading.Event()
                on_md1 = pool.submit(_weigh_on, dep.url, 1400, PROMPT[:120], release)
                wait_until(lambda: _instances(dep.url)["md1"]["queued_tokens"] > 0, 30, "md1 has work")
                queued = {n: i["queued_tokens"] for n, i in _instances(dep.url).items() if i["role"] == "main"}
                assert queued["md1"] > queued["md0"] > 0, queued
                drain = subprocess.Popen([sys.executable, "-m", "pdd.cli", "drain", "md0", "--config", conf],
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                try:
                    wait_until(lambda: _instances(dep.url).get("md0", {"draining": True})["draining"], 10, "draining")
                    during = [_main_of(dep.url, 8, PROMPT[: 60 + 20 * i]) for i in range(3)]
                    still = _instances(dep.url).get("md0", {})
                    release.set()  # md1's weight has done its part
                    out, _ = drain.communicate(timeout=180)
                finally:
                    release.set()
                    drain.kill()
                finished = on_md0.result(timeout=180)
                on_md1.result(timeout=30)
            assert still.get("draining"), "md0 left before the requests planned during its drain: nothing was tested"
            assert during == ["md1"] * 3, during  # planned while md0 drained: never onto it
            assert drain.returncode == 0 and "md0 drained and left" in out, out
            assert finished["main"] == "md0" and len(finished["ids"]) == 1000  # md0 finished what it held
            assert "md0" not in _instances(dep.url)
            wait_until(lambda: _pid_gone(dep.pids["md0"]), 10, "md0's process exits")
            assert HTTP.get(f"{dep.url}/health").status_code == 200
            assert _complete(dep.url, 40)["ids"] == reference
            assert md1.poll() is None


def test_an_instance_of_the_release_before_joins_and_serves_the_same_tokens(tmp_path):
    """A rolling upgrade's middle: md1 speaks only the protocol before (`PDD_PROTOCOL`, so on
    the wire it is that release: HELLO in its version, no field of the newer). The router
    and P find it closes on their HELLO, say it again in its version, and serve through it
    the tokens they serve through md0."""
    old = str(wire.OLDEST_PROTOCOL)
    with pdd_up("--mode", "pdd", *LINE) as dep:
        reference = _complete(dep.url, 40)["ids"]
        joining, _, _ = join_main(dep, tmp_path, "md1", env={wire.PROTOCOL_ENV: old})
        with joining as md1:
            _md1_serves(dep, reference)
            seen = {n: (i["protocol"], i["software"]) for n, i in _instances(dep.url).items()}
            assert seen["md1"] == (wire.OLDEST_PROTOCOL, "") and seen["md0"] == (wire.PROTOCOL_VERSION, pdd.__version__)
            # md1's KV came from P in the old version (the relay connects to md1 the same way, `Peers.get`,
            # but only when it hands a request off to md1, which not every run does: 1 in 6 here did not)
            log = (dep.run_dir / "p0.log").read_text()
            assert f"closed on protocol {wire.PROTOCOL_VERSION}'s HELLO" in log, log[-2000:]
            assert f"HELLO: trying {old}" in log, log[-2000:]
            # protocol 4 keeps no cache_salt apart: salted requests are planned around md1
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "cache_salt": "alice"}
            with ThreadPoolExecutor(4) as pool:
                salted = list(pool.map(lambda _: HTTP.post(f"{dep.url}/v1/completions", json=body, timeout=60),
                                       range(4)))
            assert all(r.status_code == 200 for r in salted), [r.text for r in salted]
            assert {r.json()["pdd"]["instances"]["main"] for r in salted} == {"md0"}
            assert md1.poll() is None


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie of `pdd up` (not yet reaped) has exited too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def _stream_until_cut(url: str, max_tokens: int, started: threading.Event) -> dict:
    """A streamed greedy request: its token ids, and the error that cut it, if one did."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    ids, error = [], None
    try:
        with HTTP.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices") or []:
                        ids += choice.get("token_ids") or []
                    started.set()
    except httpx.HTTPError as e:
        error = e
    return {"ids": ids, "error": error}


def test_two_routers_plan_onto_one_deployment_and_one_dies_with_requests_in_flight():
    """A second `pdd router --config F` on the deployment `pdd up` started: both serve the
    same tokens, also at once. Killed (SIGKILL) while it streams: its own requests are cut,
    every request on the other router completes whole, new ones keep flowing, and the
    instances free what the dead router's requests held."""
    with pdd_up("--mode", "pdd", *LINE) as dep:
        port = free_port()
        second = f"http://127.0.0.1:{port}"
        args = ["router", "--config", str(dep.run_dir / "deployment.toml"), "--port", str(port)]
        with pdd_process(args, f"{second}/health") as router2:
            wait_until(lambda: all(i["healthy"] for i in _instances(second).values()), 30, "router 2 connects")
            reference = _complete(dep.url, 300)["ids"]
            with ThreadPoolExecutor(8) as pool:
                both = list(pool.map(lambda u: _complete(u, 300)["ids"], [dep.url, second] * 3))
            assert all(ids == reference for ids in both)
            with ThreadPoolExecutor(8) as pool:
                started = [threading.Event() for _ in range(3)]
                cut = [pool.submit(_stream_until_cut, second, 300, s) for s in started]
                kept = [pool.submit(_complete, dep.url, 300) for _ in range(3)]
                for s in started:
                    assert s.wait(60), "router 2's streams never started"
                os.killpg(router2.pid, 9)
                cut_results = [f.result(timeout=120) for f in cut]
                kept_results = [f.result(timeout=120) for f in kept]
            assert all(r["ids"] == reference for r in kept_results)
            assert all(r["error"] is not None and 0 < len(r["ids"]) < 300 for r in cut_results), cut_results
            assert all(_complete(dep.url, 40)["ids"] == reference[:40] for _ in range(2))
            for name, http in dep.http.items():  # what the dead router's requests held is freed
                wait_until(lambda h=http: _running(h) == 0, 30, f"{name} ends the dead router's requests")


def _running(http: str) -> float:
    lines = HTTP.get(f"{http}/metrics", timeout=5).text.splitlines()
    return sum(float(line.split()[1]) for line in lines if line.startswith(("pdd_requests_running ",
                                                                            "pdd_kv_used_pages ")))


def test_the_release_before_todays_joins_and_what_it_cannot_honour_goes_elsewhere(tmp_path):
    """md1 pinned to the protocol before today's (the release before's wire): /pdd/stats
    shows its version, its tokens are md0's, a request setting a field of today's protocol
    (prompt_logprobs: 7) is planned onto md0 every time; once md0 is drained, onto the relay
    alone (pdd mode's way without an MD); once the relay is drained too, that request gets a
    503 naming the field and md1, and a plain one is served by md1."""
    before = wire.PROTOCOL_VERSION - 1
    newer = {"prompt_logprobs": 1}
    assert SamplingParams(**newer).needs_protocol() == (wire.PROTOCOL_VERSION, "prompt_logprobs")
    assert SamplingParams(presence_penalty=0.5).needs_protocol() == (6, "presence_penalty")
    assert SamplingParams().needs_protocol() == (0, "")
    with pdd_up("--mode", "pdd", *LINE) as dep:
        reference = _complete(dep.url, 40)["ids"]
        joining, conf, _ = join_main(dep, tmp_path, "md1", env={wire.PROTOCOL_ENV: str(before)})
        with joining as md1:
            _md1_serves(dep, reference)
            seen = {n: (i["protocol"], i["software"]) for n, i in _instances(dep.url).items()}
            assert seen["md1"] == (before, pdd.__version__) and seen["md0"][0] == wire.PROTOCOL_VERSION
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **newer}
            with ThreadPoolExecutor(4) as pool:
                asked = list(pool.map(lambda _: HTTP.post(f"{dep.url}/v1/completions", json=body, timeout=60),
                                      range(6)))
            assert all(r.status_code == 200 for r in asked), [r.text for r in asked]
            assert {r.json()["pdd"]["instances"]["main"] for r in asked} == {"md0"}
            _drain(conf, "md0")  # no MD of today's protocol: the relay of today's serves it alone
            alone = HTTP.post(f"{dep.url}/v1/completions", json=body, timeout=60)
            assert alone.status_code == 200 and alone.json()["pdd"]["pipeline"] == "P-RLD", alone.text
            _drain(conf, "rld0")  # none left that speaks it
            refused = HTTP.post(f"{dep.url}/v1/completions", json=body, timeout=60)
            said = refused.json()["error"]["message"]
            assert refused.status_code == 503 and "prompt_logprobs needs protocol" in said and "md1" in said, said
            assert _complete(dep.url, 40)["ids"] == reference and _main_of(dep.url, 4, PROMPT) == "md1"
            assert md1.poll() is None


def _drain(conf: str, name: str) -> None:
    drained = subprocess.run([sys.executable, "-m", "pdd.cli", "drain", name, "--config", conf],
                             capture_output=True, text=True, timeout=120)
    assert drained.returncode == 0, drained.stdout + drained.stderr


def test_int8_and_zstd_kv_go_only_to_peers_that_speak_them():
    """P's choice of the forms KV crosses the line in (`PrefillRole._forms`), per peer and the
    version its connection speaks: int8 and zstd to a remote peer of protocol 6 or later; exact,
    uncompressed KV to one of 5 or 4 (which would refuse the pages) and to a peer of P's site."""
    from types import SimpleNamespace

    from pdd.instance.prefill import PrefillRole

    line = cfg.LineSpec(lossy_kv="int8", compress_kv="zstd")
    p = SimpleNamespace(peers=SimpleNamespace(remote=lambda peer: peer != "rld0"),
                        node=SimpleNamespace(dep=cfg.Deployment(line=line)))
    for version in range(wire.OLDEST_PROTOCOL, wire.PROTOCOL_VERSION + 1):
        spoken = ("int8", "zstd") if version >= wire.LOSSY_KV_SINCE else ("", "")
        assert PrefillRole._forms(p, "md0", version) == spoken, version
        assert PrefillRole._forms(p, "rld0", version) == ("", ""), version
    assert wire.LOSSY_KV_SINCE == 6
