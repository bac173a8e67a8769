"""`pdd up` on GPUs and on large checkpoints, without either: `--devices NAME=DEVICES` puts
an instance on its GPUs (on vLLM one tensor-parallel rank a GPU, unless the file chose),
refused by name where it cannot run; the start-up wait lasts as long as a child's log shows
progress and fails after a stall, not after a fixed total (`pdd.lab.launch.wait_http`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from procs import free_port

from pdd import config as cfg
from pdd.engines.port import EngineConfig, for_backend
from pdd.errors import Mistake
from pdd.lab.deploy import with_devices
from pdd.lab.launch import PORTS_ENV, log_progress, port_range, wait_http
from pdd.lab.launch import free_port as draw


def _dep(backend: str, **vllm) -> cfg.Deployment:
    engine = for_backend(EngineConfig(backend=backend, vllm=vllm), backend)
    return cfg.Deployment(instances=(cfg.InstanceSpec("p0", "prefill", "A", engine=engine),
                                     cfg.InstanceSpec("md0", "main", "B", engine=engine)))


def test_devices_put_an_instance_on_its_gpus():
    dep = with_devices(_dep("vllm"), ["p0=cuda:0,1", "md0=cuda:2"])
    p0, md0 = dep.instances
    assert (p0.engine.device, p0.engine.vllm["tensor_parallel_size"]) == ("cuda:0,1", 2)
    assert md0.engine.device == "cuda:2" and "tensor_parallel_size" not in md0.engine.vllm
    assert with_devices(_dep("vllm"), []) == _dep("vllm")
    refused = {
        ("vllm", "p0=cuda:0,1", 4): "names 2 GPU",  # the file's 4 ranks on 2 GPUs
        ("embedded", "p0=cuda:0,1", None): "runs on one device",
        ("vllm", "p9=cuda:0", None): "not instances of this deployment",
        ("vllm", "p0", None): "NAME=DEVICES",
        ("vllm", "p0=gpu0", None): "engine device must be",
    }
    for (backend, given, ranks), said in refused.items():
        dep = _dep(backend, **({"tensor_parallel_size": ranks} if ranks else {}))
        with pytest.raises(Mistake, match=said):
            with_devices(dep, [given])


def test_ports_are_drawn_from_pdd_ports(monkeypatch):
    """`$PDD_PORTS` bounds every draw; a held port in it is passed over, a range with none
    free or a malformed range is a Mistake. Each xdist worker draws from a share of its own."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        low, high = (int(p) for p in os.environ[PORTS_ENV].split("-"))
        monkeypatch.delenv(PORTS_ENV)
        whole = port_range()
        assert whole[0] <= low < high < whole[1] and high - low + 1 < whole[1] - whole[0]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        monkeypatch.setenv(PORTS_ENV, f"{port}-{port + 3}")
        drawn = {draw() for _ in range(20)}
        assert drawn and drawn <= {port + 1, port + 2, port + 3}
        monkeypatch.setenv(PORTS_ENV, f"{port}-{port}")
        with pytest.raises(Mistake, match="no free port"):
            draw()
    for bad in ("20000", "2-3", "30000-20000", "x-y"):
        monkeypatch.setenv(PORTS_ENV, bad)
        with pytest.raises(Mistake, match=PORTS_ENV):
            draw()


SERVER = """
import http.server, sys, time
log = open(sys.argv[1], "a")
for i in range(int(sys.argv[3])):  # "loading": a line every 0.3 s
    log.write(f"shard {i}\\n"); log.flush(); time.sleep(0.3)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def _child(tmp_path, shards: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(tmp_path / "child.log"), str(port), str(shards)],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}/"


def test_the_start_up_wait_follows_the_log_not_a_fixed_total(tmp_path):
    """A child that logs for 2.4 s before it answers is waited for with a 1 s stall limit;
    without the log to follow, the same limit gives up on it."""
    for follow, ok in ((True, True), (False, False)):
        proc, url = _child(tmp_path, 8)
        try:
            progress = log_progress(tmp_path / "child.log") if follow else None
            if ok:
                wait_http(url, proc, 1.0, progress=progress)
            else:
                with pytest.raises(RuntimeError, match="did not answer within 1 s"):
                    wait_http(url, proc, 1.0, progress=progress)
        finally:
            proc.kill()
            proc.wait()
        (tmp_path / "child.log").unlink()


def test_a_child_that_stops_making_progress_is_given_up(tmp_path):
    (tmp_path / "quiet.log").write_text("loaded half\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(RuntimeError, match="with no progress in its log"):
            wait_http(f"http://127.0.0.1:{free_port()}/", proc, 0.5, progress=log_progress(tmp_path / "quiet.log"))
    finally:
        proc.kill()
        proc.wait()
