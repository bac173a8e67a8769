"""How the lab starts and stops its processes, shared by `pdd up`, `pdd demo`, the benches
and the network-namespace lab: ports drawn free and checked before anything starts, a child
started one way, waited for on its HTTP port (as long as it makes progress), stopped whole.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Protocol
from urllib.parse import urlsplit

import httpx

from pdd import config as cfg
from pdd.addresses import parse_addr
from pdd.errors import Mistake
from pdd.process import listen

PORTS_ENV = "PDD_PORTS"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def port_range() -> tuple[int, int]:
    """Where ports are drawn, `low <= port < high`: `$PDD_PORTS` (`LOW-HIGH`, both
    included: the opening a firewall leaves, or one share of a machine that runs several
    launches at once), else the 16,384 ports below the kernel's ephemeral range. A port
    the kernel hands out there is also what every outgoing connection takes its local
    port from, so another process's connect() could take it between the draw and the
    child's bind; below it only another listener could. A malformed value is a `Mistake`."""
    given = os.environ.get(PORTS_ENV, "").strip()
    if not given:
        low, _ = _ephemeral_range()
        return max(1024, low - 16384), low
    try:
        low, high = (int(part) for part in given.split("-"))
    except ValueError:
        raise Mistake(f"{PORTS_ENV}={given!r}: give LOW-HIGH (20000-20999)") from None
    if not 1024 <= low <= high <= 65535:
        raise Mistake(f"{PORTS_ENV}={given!r}: give 1024 <= LOW <= HIGH <= 65535")
    return low, high + 1


def free_port(taken: set[int] | None = None) -> int:
    """A port of `port_range()` free to listen on now, for a child to bind a moment later,
    and not in `taken` (to which it is added: one launch's ports, drawn before any is
    bound, are then all distinct; 8 draws from 16,384 collide once in about 600 launches,
    and a CI run launches hundreds). Drawn at random, then (a crowded range) in order;
    none free is a `Mistake` naming the range."""
    taken = set() if taken is None else taken
    low, high = port_range()
    rng = random.SystemRandom()
    for port in [rng.randrange(low, high) for _ in range(200)] + list(range(low, high)):
        if port in taken:
            continue
        taken.add(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise Mistake(f"no free port in {low}-{high - 1} ({PORTS_ENV} sets the range)")


def check_ports(dep: cfg.Deployment) -> None:
    """Mistake, naming the process and the port, if a port the deployment's processes will
    listen on is held now: found before anything starts (a port given in the file or by
    --port, such as vLLM's 8000; drawn ones were free when drawn)."""
    wanted = [("router", dep.router.host, dep.router.port)]
    for inst in dep.instances:
        wanted += [(inst.name, inst.host, inst.port), (inst.name, inst.host, inst.kv_port)]
    if dep.line.admin_port:
        wanted.append(("line", dep.line.host, dep.line.admin_port))
    for inst in dep.instances:  # the emulator's hops (on this machine: the ones on the line's host)
        hops = (parse_addr(a) for a in inst.advertise.values())
        wanted += [("line", host, port) for host, port in hops if host == dep.line.host]
    for name, host, port in wanted:
        try:
            listen(host, port).close()
        except Mistake as e:
            raise Mistake(f"{name}: {e}") from None


PDD_COMMAND = (sys.executable, "-m", "pdd.cli")  # `pdd`, as this interpreter runs it
STOP_GRACE_S = 15.0  # a server's time to stop after SIGTERM, before SIGKILL


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A child's environment: `env` over this process's, Python unbuffered (a log shows what
    happened up to a kill)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


def start(
    argv: Sequence[str],
    output: IO | int | None = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    nice: int = 0,
    own_group: bool = True,
    text: bool = False,
) -> subprocess.Popen:
    """Every process the lab starts, started one way: `argv` with its stdout and stderr to
    `output` (a file, PIPE, DEVNULL), no stdin, in `child_env(env)`, at `nice`. `own_group`: in a
    process group of its own, which `stop_group` stops whole, its children with it; a
    deployment's children stay in the deployment's, so stopping `pdd up` stops them too."""
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT,
        env=child_env(env),
        preexec_fn=(lambda: os.nice(nice)) if nice else None,
        start_new_session=own_group,
        text=text,
        errors="replace" if text else None,
    )


class Child(Protocol):
    """What the lab uses of a child it started: a `subprocess.Popen`, or a forked one
    (`pdd.lab.forks.Forked`)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class PortTaken(RuntimeError):
    """A server of another launch answers where a child of this one should."""


def log_progress(path: Path) -> Callable[[], object]:
    """A child's progress as its log shows it: the log's size (a model that loads writes as it
    goes: vLLM its shards and its profiling, pdd its steps)."""
    return lambda: path.stat().st_size if path.exists() else 0


def wait_http(
    url: str, proc: Child, timeout: float, launch: str = "", progress: Callable[[], object] | None = None
) -> None:
    """Return once `url` answers 200; RuntimeError if `proc` exits first or time runs out,
    or, given the `launch` id `proc` was started with, at once when a server of another
    launch answers (`pdd.process`: the port is someone else's). With `progress`, time runs
    out only after `timeout` without a change in what it returns: a large checkpoint loads
    as long as it loads, a child stuck says so after `timeout`."""
    deadline = time.monotonic() + timeout
    last = progress() if progress else None
    # one client for every poll: a client's TLS context costs tens of ms of CPU to build
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if progress is not None and (now := progress()) != last:
                last, deadline = now, time.monotonic() + timeout
            if proc.poll() is not None:
                raise RuntimeError(f"exited with code {proc.returncode} before {url} answered")
            try:
                r = client.get(url)
            except httpx.HTTPError:
                r = None
            if r is not None and launch and _launch_of(r) != launch:
                port = urlsplit(url).port
                raise PortTaken(f"port {port} is held by another server (its {url} is not this launch's)")
            if r is not None and r.status_code == 200:
                return
            time.sleep(0.1)
    quiet = " with no progress in its log" if progress else ""
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s{quiet}")


def _launch_of(response: httpx.Response) -> object:
    try:
        said = response.json()
    except ValueError:
        return None
    return said.get("launch") if isinstance(said, dict) else None


def stop_group(proc: Child, grace_s: float) -> None:
    """SIGTERM `proc`'s process group (it was started in a session of its own: its
    children with it), SIGKILL what is left of it after `grace_s`, and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
