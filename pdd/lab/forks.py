"""A deployment's children forked from one process that has already imported what they run.

Every child of `pdd up` is `pdd serve`, `pdd router` or `pdd line`, and an instance spends
most of its start importing torch and pdd's serving stack (about 2.5 s of CPU, the same
in every instance). A fork server (Python's `multiprocessing` "forkserver") imports them
once; each child is a fork of it, and runs `pdd.cli` (as `python -m` would) with its own
arguments, log, environment and niceness. The children are real processes with their own
pids, in the launcher's process group (stopping `pdd up` stops them, as before). The fork
server runs no Python thread when it forks (it only imports; the idle native threads that
torch and vLLM start at import do not cross a fork), and vLLM, which starts its engine core
by spawning a fresh interpreter, is not affected.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

COMMAND = "pdd.cli"  # what each child runs, as `python -m pdd.cli ARGV` would

# what `pdd serve` imports to serve (`pdd.instance.cli._serve` and below), the heaviest
# first; the router and the line emulator use a part of it
PRELOAD = (
    "torch",
    "uvicorn",
    "pdd.api.app",
    "pdd.instance.node",
    "pdd.instance.roles",
    "pdd.instance.join",
    "pdd.instance.local_source",
    "pdd.transfer.wire",
    "pdd.engines.embedded.engine",
    "pdd.model.tokenizer",
    "pdd.router.cli",
    "pdd.lab.line.cli",
)
# and what an instance on vLLM imports besides (vLLM's front end: about 9 s of CPU), where a
# deployment has one (its engine core is a fresh interpreter: vLLM spawns it on CPU and CUDA)
VLLM_PRELOAD = ("vllm.engine.arg_utils", "vllm.v1.engine.async_llm", "pdd.engines.vllm.engine")


class Forked:
    """A forked child, answering as much of `subprocess.Popen` as the launcher uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid: int = process.pid or 0
        self.args = process.name

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # (it exited in between, as Popen allows)
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forks:
    """The fork server of one launcher: started (and `PRELOAD` imported, with
    `VLLM_PRELOAD` where `vllm`) at the first `start`, gone when the launcher exits."""

    def __init__(self, vllm: bool = False) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([*PRELOAD, *(VLLM_PRELOAD if vllm else ())])

    def start(self, name: str, argv: Sequence[str], log: Path, env: dict[str, str], nice: int = 0) -> Forked:
        """`pdd ARGV` as child `name`: stdout and stderr to `log` (appended), `env` over the
        launcher's environment, at `nice`."""
        process = self._context.Process(target=_run, args=(list(argv), str(log), env, nice), name=name)
        process.start()
        return Forked(process)


def _run(argv: list[str], log: str, env: dict[str, str], nice: int) -> None:
    """In the child: its output to `log`, its environment and niceness, then `pdd ARGV`,
    its exit code and its interpreter's exit (atexit) as `python -m pdd.cli` would have them."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    os.environ.update(env)
    if nice:
        os.nice(nice)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [COMMAND, *argv]
    try:
        runpy.run_module(COMMAND, run_name="__main__", alter_sys=True)  # exits with pdd's code
    finally:
        atexit._run_exitfuncs()
