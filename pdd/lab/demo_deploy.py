"""One `pdd up --mode MODE` process tree for `pdd demo` (and `pdd sim calibrate`): started
in its own process group, its announced router and instance URLs read from its output,
stopped whole.

`up_command` is the one place the launcher's command line is built, so a test (or a
user's wrapper) can substitute another launcher that keeps the same contract.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import re
import signal
import subprocess
import threading
from pathlib import Path

from pdd.lab.deploy import PDD_COMMAND, STOP_GRACE_S, start, stop_group
from pdd.names import mode_options

START_TIMEOUT_S = 360.0  # (longer than `pdd up` gives its instances: it reports which one did not start)
# `pdd up` gets this long after SIGTERM to stop its instances before they are killed.
_TAIL_LINES = 30
_ROUTER_LINE = re.compile(r"router:\s+(https?://\S+)")
_INSTANCE_LINE = re.compile(r"instance (\S+) \(.*\): (https?://\S+)")
_MODE_CHOICES = re.compile(r"--mode[ =]\{([^}]*)\}")


class DeployError(RuntimeError):
    """A deployment could not be started (or `pdd up` itself is unusable)."""


def up_command(*args: str) -> list[str]:
    """The command line of `pdd up ARGS`.

    A module-level function so tests (and a user's wrapper) can substitute another
    launcher that keeps the same contract: `--help` lists `--mode {...}` choices, and a
    deployment prints `router: http://HOST:PORT` once it serves.
    """
    return [*PDD_COMMAND, "up", *args]


def accepted_modes() -> frozenset[str] | None:
    """The modes the installed `pdd up` accepts, from its `--help`; None if it lists none.

    Asking the installed command, rather than hard-coding a list, lets the demo run on
    a build where a mode (e.g. `pdd` itself) is not there yet, and say so.
    """
    try:
        done = subprocess.run(
            up_command("--help"), capture_output=True, text=True, errors="replace", timeout=START_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DeployError(f"cannot run `pdd up --help`: {exc}") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-_TAIL_LINES:])
        raise DeployError(f"`pdd up --help` failed with exit code {done.returncode}:\n{tail}")
    match = _MODE_CHOICES.search(done.stdout)
    if match is None:
        return None
    return frozenset(m.strip() for m in match.group(1).split(",") if m.strip())


class DemoDeployment:
    """One running `pdd up --mode MODE`, in its own process group.

    A thread reads the process's output from the start: it spots the router line and
    keeps draining afterwards, so a chatty deployment never blocks on a full pipe.
    """

    def __init__(self, mode: str, config: Path | None, line: list[str] | tuple[str, ...] = ()) -> None:
        base, options = mode_options(mode)
        args = ["--mode", base, "--port", "0", *line]
        for key, value in options:  # "pd-cross-dc:drc=off" -> --mode pd-cross-dc --drc off
            args += [f"--{key}", value]
        if config is not None:
            args += ["--config", str(config)]
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.instances: dict[str, str] = {}  # name -> HTTP URL, as `pdd up` announces them
        self.pacing = ""  # `pdd up`'s pacing line
        self._url: queue.Queue[str | None] = queue.Queue()
        self.proc = start(up_command(*args), subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._drain, name=f"pdd-up-{mode}", daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        found = False
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            instance = _INSTANCE_LINE.fullmatch(line.strip())
            if instance is not None:
                self.instances[instance.group(1)] = instance.group(2)
            elif line.startswith("pacing: "):
                self.pacing = line.strip()
            match = None if found else _ROUTER_LINE.fullmatch(line.strip())
            if match is not None:
                found = True
                self._url.put(match.group(1))
        if not found:
            self._url.put(None)

    def wait_router(self, timeout_s: float) -> str:
        """The router URL once the deployment announces it; DeployError if it never does."""
        try:
            url = self._url.get(timeout=timeout_s)
        except queue.Empty:
            raise DeployError(f"no `router:` line within {timeout_s:g} s{self._tail_text()}") from None
        if url is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5.0)
            code = self.proc.poll()
            raise DeployError(f"`pdd up` exited (code {code}) before serving{self._tail_text()}")
        return url

    def _tail_text(self) -> str:
        lines = list(self.tail)
        return "; its last output:\n  " + "\n  ".join(lines) if lines else " (no output)"

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the whole group, SIGKILL what is left after `grace_s`, reap it."""
        if self.proc.poll() is None:
            stop_group(self.proc, grace_s)
        # Instances the launcher left behind would hold ports and CPU for the next mode.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._reader.join(5.0)
