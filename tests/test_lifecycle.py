"""SIGTERM as Kubernetes sends it, to real processes with a stream in flight through them
(`pdd.shutdown`): the process fails /ready at once and keeps /health up, takes no new
work (a router's new request gets a 503 naming why; an instance's routers plan around it),
finishes the stream it serves (every token, finish_reason "length") and exits 0. And the
deployment's two routers as one: a member that joined through one, and its drain, reach the
other, also one that started after it joined. One pdd-mode deployment serves the module;
its md0 is the last thing the module stops."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from procs import HTTP, free_port, join_main, pdd_process, pdd_up, stream_completion, wait_until

LINE = ["--bandwidth-mbps", "200", "--delay-ms", "2", "--jitter-ms", "0.5"]
PROMPT = list(range(300, 420))
LONG = 1200  # tokens: the stream outlives the signal by seconds on the tiny model


@pytest.fixture(scope="module")
def dep():
    with pdd_up("--mode", "pdd", *LINE) as d:
        yield d


def _status(url: str) -> tuple[int, int]:
    """(/ready's status, /health's status)."""
    return HTTP.get(f"{url}/ready", timeout=5).status_code, HTTP.get(f"{url}/health", timeout=5).status_code


def _stats(url: str) -> dict:
    return HTTP.get(f"{url}/pdd/stats", timeout=10).json()


def _complete(url: str, max_tokens: int = 8) -> httpx.Response:
    return HTTP.post(f"{url}/v1/completions", timeout=60, json={"model": "tiny", "prompt": PROMPT[:40],
                                                                 "max_tokens": max_tokens, "temperature": 0})


def test_a_router_finishes_its_stream_after_sigterm_and_exits_0(dep):
    """A second router of the deployment (as Kubernetes runs two) streams 1200 tokens; on
    SIGTERM its /ready is 503 at once, /health stays 200, a new request gets a 503 that
    says it shuts down, the stream completes and the process exits 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    conf = str(dep.run_dir / "deployment.toml")
    with pdd_process(["router", "--config", conf, "--port", str(port)], f"{url}/ready") as router, \
            ThreadPoolExecutor(1) as pool:
        assert _status(url) == (200, 200)
        running = pool.submit(stream_completion, url, PROMPT, LONG)
        wait_until(lambda: _stats(url)["dispatch_waiting"] == 0 and _stats(url)["instances"]["md0"]["queued_tokens"],
                   30, "the stream planned")
        router.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert _status(url) == (503, 200)
        assert HTTP.get(f"{url}/ready", timeout=5).json()["reason"] == "shutting down"
        refused = _complete(url)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"], refused.text
        got = running.result(timeout=120)
        assert got["error"] is None and got["finish_reason"] == "length" and len(got["ids"]) == LONG, got["error"]
        assert router.wait(30) == 0
    print(f"\nrouter: stream ended {got['elapsed_s']:.1f} s after it began, exit 0 "
          f"{time.monotonic() - signalled:.1f} s after SIGTERM")
    assert _complete(dep.url).status_code == 200  # the deployment's own router served on


def test_a_router_that_starts_later_learns_who_joined_and_hears_of_a_drain(dep, tmp_path):
    """md1 joins through the deployment's router; a second router started after it learns
    md1 from the instances it connects to (not from its file, which lacks md1); `pdd drain
    md1` asks the first router, and the second stops planning onto md1 at once (md1 tells
    every router), then sees it gone; md1 exits 0."""
    joining, conf, _ = join_main(dep, tmp_path, "md1")
    with joining as md1:
        wait_until(lambda: _stats(dep.url)["instances"].get("md1", {}).get("healthy"), 30, "md1 joined")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with pdd_process(["router", "--config", conf, "--port", str(port)], f"{url}/ready"):
            wait_until(lambda: _stats(url)["instances"].get("md1", {}).get("healthy"), 10, "the later router knows md1")
            assert _stats(url)["membership"]["joined"] == 1
            drain = subprocess.Popen([sys.executable, "-m", "pdd.cli", "drain", "md1", "--config", conf],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                wait_until(lambda: _stats(url)["instances"]["md1"]["refusing"], 10, "the later router hears the drain")
                out, _ = drain.communicate(timeout=60)
            finally:
                drain.kill()
            assert drain.returncode == 0 and "md1 drained and left" in out, out
            wait_until(lambda: not _stats(url)["instances"]["md1"]["healthy"], 10, "the later router sees md1 gone")
            assert _complete(url).status_code == 200  # through md0
        assert md1.wait(30) == 0


def test_an_instance_finishes_its_stream_after_sigterm_and_exits_0(dep):
    """md0 (the only MD) streams 1200 tokens; on SIGTERM its /ready is 503 at once while
    /health stays 200, the router hears it and plans around it (a new request runs on the
    relay alone, pdd mode's way without an MD), the stream completes with every token, and
    md0 exits 0."""
    md0 = dep.http["md0"]
    assert _status(md0) == (200, 200)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_completion, dep.url, PROMPT, LONG)
        wait_until(lambda: _stats(md0)["node"]["held"] > 0, 30, "md0 holds the request")
        os.kill(dep.pids["md0"], signal.SIGTERM)
        signalled = time.monotonic()
        assert _status(md0) == (503, 200)
        assert HTTP.get(f"{md0}/ready", timeout=5).json()["reason"] == "shutting down"
        wait_until(lambda: _stats(dep.url)["instances"]["md0"]["refusing"], 5, "the router hears md0 refuses work")
        around = _complete(dep.url)  # (pdd mode: the relay alone serves while no MD takes work)
        assert around.status_code == 200 and around.json()["pdd"]["pipeline"] == "P-RLD", around.text
        assert "md0" not in around.json()["pdd"]["instances"].values()
        assert _stats(md0)["node"]["held"] > 0  # (md0 still had the stream: the test tested something)
        got = running.result(timeout=120)
    assert got["error"] is None and got["finish_reason"] == "length" and len(got["ids"]) == LONG, got["error"]
    assert got["record"]["instances"]["main"] == "md0" and got["record"]["main_output_tokens"] > 0, got["record"]
    code = wait_until(lambda: dep.exit_code("md0") is not None and (dep.exit_code("md0"),), 30, "md0 exits")
    assert code == (0,)
    print(f"\nmd0: exit 0 {time.monotonic() - signalled:.1f} s after SIGTERM, its stream complete")


def test_what_outlives_the_grace_ends_with_an_error_saying_so(tiny_model_dir):
    """A standalone `pdd serve --shutdown-grace-s 1` streaming 3900 tokens (more than a
    second's worth): on SIGTERM the stream goes on for the grace, then ends with an error
    event saying the grace ran out (not a cut connection), and the process exits 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "--model", str(tiny_model_dir), "--port", str(port), "--served-model-name", "tiny",
            "--shutdown-grace-s", "1"]
    with pdd_process(args, f"{url}/health") as server, ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_completion, url, PROMPT, 3900)
        wait_until(lambda: _stats(url)["engine"]["decode_tokens"] >= 20, 30, "the stream running")
        server.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        got = running.result(timeout=60)
        assert server.wait(30) == 0
    ended = time.monotonic() - signalled
    assert got["finish_reason"] is None and 0 < len(got["ids"]) < 3900, (got["finish_reason"], len(got["ids"]))
    assert "its grace of 1 s ran out" in got["error"]["message"], got["error"]
    assert ended < 10, ended


def test_an_instance_whose_engine_dies_tells_every_router_at_once():
    """The node's watch (`Node._watch_engine`, every `WATCH_S`): an engine that reports itself
    dead (vLLM's AsyncLLM `errored`, as tests/test_vllm_lifecycle.py makes it for real) makes
    the instance refuse work and send every router a DRAIN, which each plans around (the md0
    test above shows a router doing so)."""
    from types import SimpleNamespace

    from pdd import config as cfg
    from pdd.instance.liveness import WATCH_S
    from pdd.instance.node import InstanceNode
    from pdd.transfer import messages as m

    engine = SimpleNamespace(llm=SimpleNamespace(errored=False))
    node = InstanceNode(cfg.InstanceSpec("md0", "main", "B"), cfg.Deployment(), engine, b"k" * 32,
                lambda host: SimpleNamespace(held=lambda: 0))
    sent: list[tuple[str, object]] = []

    async def send(conn, body) -> bool:
        sent.append((conn, body))
        return True

    node.send = send  # (what the routers' connections would carry)
    node.routers = {"r1": "conn-of-r1", "r2": "conn-of-r2"}

    async def scenario() -> float:
        watch = asyncio.ensure_future(node._watch_engine())
        await asyncio.sleep(WATCH_S * 1.5)
        assert not node.refusing and not sent  # alive: nothing said
        engine.llm.errored = True
        died = time.monotonic()
        while not sent or len(sent) < 2:
            await asyncio.sleep(0.05)
            assert time.monotonic() - died < 3 * WATCH_S
        await watch
        return time.monotonic() - died

    took = asyncio.run(scenario())
    assert "vLLM engine died" in node.refusing
    assert sorted(conn for conn, _ in sent) == ["conn-of-r1", "conn-of-r2"]
    assert all(isinstance(body, m.Drain) for _, body in sent)
    assert took <= 2 * WATCH_S, took
