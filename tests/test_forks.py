"""`pdd up`'s children are forks of one server that imported torch and pdd's serving stack
once (`pdd.lab.forks`): each is a real process of its own, with its own output, environment
and exit code, in the launcher's process group; the server holds torch before any fork."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from procs import free_port, wait_until

from pdd.lab.forks import Forks
from pdd.lab.launch import wait_http


def _mapped(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_a_forked_child_has_its_own_log_environment_and_exit_code(tmp_path):
    forks = Forks()
    log = tmp_path / "bad.log"
    child = forks.start("bad", ["serve", "/nonexistent-model", "--port", "0"], log, {**os.environ, "PDD_LOG": "ERROR"})
    assert child.wait(120) == 2  # a model mistake, as `pdd serve` exits from a shell
    assert "/nonexistent-model" in log.read_text() and "Traceback" not in log.read_text()
    assert child.poll() == 2 and child.returncode == 2
    # the environment given is the child's own: a level pdd refuses is its mistake alone
    env = {**os.environ, "PDD_LOG": "LOUD"}
    refused = forks.start("env", ["serve", "/nonexistent-model"], tmp_path / "env.log", env)
    assert refused.wait(60) == 2 and "PDD_LOG='LOUD'" in (tmp_path / "env.log").read_text()


def test_a_forked_child_is_killed_and_reaped_like_a_process_and_the_server_preloaded_torch(tmp_path):
    forks = Forks()
    port, hop, target = free_port(), free_port(), free_port()
    line = forks.start("line", ["line", f"--route=127.0.0.1:{hop}=127.0.0.1:{target}", f"--admin=127.0.0.1:{port}"],
                       tmp_path / "line.log", dict(os.environ))
    wait_http(f"http://127.0.0.1:{port}/health", line, 60)
    server = int(Path(f"/proc/{line.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the child's parent
    assert server != os.getpid() and "libtorch_cpu" in _mapped(server)  # torch came in before the fork
    assert os.getpgid(line.pid) == os.getpgid(0)  # stopping the launcher's group stops it too
    line.send_signal(signal.SIGKILL)
    wait_until(lambda: line.poll() is not None, 30, "the killed child to be reaped")
    assert line.returncode == -signal.SIGKILL
    t0 = time.monotonic()
    assert line.wait(5) == -signal.SIGKILL and time.monotonic() - t0 < 5
