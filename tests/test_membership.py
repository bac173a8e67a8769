"""Decoupled lifecycles as real processes: a decode instance joins a running pdd-mode
deployment and gets work; another is drained while it streams, finishes every request
and leaves, and the router sends it nothing meanwhile."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from procs import free_port, pdd_process, pdd_up, wait_until

from pdd import config as cfg

PROMPT = list(range(100, 260))
LINE = ["--bandwidth-mbps", "200", "--delay-ms", "2", "--jitter-ms", "0.5"]


def _complete(url: str, max_tokens: int, prompt: list[int] = PROMPT) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    return {"ids": body["choices"][0]["token_ids"], "main": body["pdd"]["instances"]["main"]}


def _instances(url: str) -> dict:
    return httpx.get(f"{url}/pdd/stats", timeout=10).json()["instances"]




def _join_main(dep, tmp_path: Path, name: str):
    """Start a new MD in datacenter B on the running deployment: a route across the
    emulated line, a config that lists it, and `pdd serve --join`."""
    conf = cfg.load(dep.run_dir / "deployment.toml")
    hop = f"127.0.0.1:{free_port()}"  # callers in A reach it through the emulator
    spec = cfg.InstanceSpec(name, "main", conf.link.b, port=free_port(), kv_port=free_port(),
                            advertise={conf.link.a: hop}, engine=conf.engine)
    route = f"{hop}=127.0.0.1:{spec.kv_port}"
    httpx.post(f"{dep.wan_admin}/routes", json={"route": route}, timeout=5).raise_for_status()
    path = tmp_path / "joined.toml"
    path.write_text(cfg.dump(dataclasses.replace(conf, instances=(*conf.instances, spec))))
    return pdd_process(["serve", "--config", str(path), "--instance", name, "--join"],
                       f"http://127.0.0.1:{spec.port}/health"), str(dep.run_dir / "deployment.toml")


def test_a_main_instance_joins_then_another_is_drained_without_failing_a_request(tmp_path):
    with pdd_up("--mode", "pdd", *LINE) as dep:
        reference = _complete(dep.url, 40)["ids"]
        joining, conf = _join_main(dep, tmp_path, "md1")
        with joining as md1:
            wait_until(lambda: _instances(dep.url).get("md1", {}).get("healthy"), 30, "the router connects to md1")
            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda _: _complete(dep.url, 40), range(8)))
            assert all(r["ids"] == reference for r in results)
            assert "md1" in {r["main"] for r in results}, "the new instance should get work"

            with ThreadPoolExecutor(4) as pool:
                # four long requests, some of them on md0; then md0 is drained under them
                running = [pool.submit(_complete, dep.url, 300, PROMPT[:100 + 10 * i]) for i in range(4)]
                wait_until(lambda: _instances(dep.url)["md0"]["queued_tokens"] > 0, 30, "md0 has work")
                drain = subprocess.Popen([sys.executable, "-m", "pdd.cli", "drain", "md0", "--config", conf],
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                try:
                    wait_until(lambda: _instances(dep.url).get("md0", {"draining": True})["draining"], 10, "draining")
                    during = _complete(dep.url, 20)  # planned while md0 drains: it must go to md1
                    out, _ = drain.communicate(timeout=120)
                finally:
                    drain.kill()
                finished = [f.result(timeout=120) for f in running]
            assert drain.returncode == 0 and "md0 drained and left" in out, out
            assert during["main"] == "md1"
            assert all(len(f["ids"]) == 300 for f in finished)
            assert "md0" not in _instances(dep.url)
            wait_until(lambda: _pid_gone(dep.pids["md0"]), 10, "md0's process exits")
            assert httpx.get(f"{dep.url}/health").status_code == 200
            assert _complete(dep.url, 40)["ids"] == reference
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
