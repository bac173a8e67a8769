"""An instance whose vLLM engine died: `pdd serve --engine vllm` answers /health and /ready
200 while vLLM runs; once its engine-core process is killed, both answer 503 saying the
engine died (a supervisor restarts it; a load balancer sends it nothing), a request gets
an error, and the server process itself lives on to say so. The instance's node tells
its routers at the same moment (`pdd.instance.node`: tests/test_lifecycle.py shows a
router planning around an instance that refuses work)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from procs import HTTP, VLLM_ENV, VLLM_START_S, free_port, pdd_process, wait_until

pytest.importorskip("vllm")


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid`, with their command lines."""
    out = {}
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out[int(p.name)] = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_an_instance_whose_vllm_engine_died_is_neither_alive_nor_ready(tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "--model", str(tiny_model_dir), "--port", str(port), "--served-model-name", "tiny",
            "--engine", "vllm"]
    with pdd_process(args, f"{url}/health", timeout=VLLM_START_S, env=VLLM_ENV) as server:
        assert [HTTP.get(f"{url}/{p}", timeout=10).status_code for p in ("health", "ready")] == [200, 200]
        cores = {pid: cmd for pid, cmd in _children(server.pid).items() if "EngineCore" in cmd}
        assert len(cores) == 1, _children(server.pid)
        os.kill(next(iter(cores)), signal.SIGKILL)
        said = wait_until(lambda: (r := HTTP.get(f"{url}/ready", timeout=10)).status_code == 503 and r.json(), 30,
                          "/ready fails")
        assert "vLLM engine died" in said["reason"], said
        health = HTTP.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and "vLLM engine died" in health.json()["reason"], health.text
        r = HTTP.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4},
                       timeout=60)
        assert r.status_code >= 500, r.text
        assert server.poll() is None  # alive to say it: the supervisor restarts it on /health
