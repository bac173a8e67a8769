"""Hosts as Linux network namespaces, sites joined by one line: a real multi-host
deployment on one machine, with the kernel's TCP between hosts instead of loopback.

Each site has a switch (a namespace holding a bridge) that its hosts hang off by veth
pairs; a line namespace routes between the switches and shapes each direction at the
line's rate with `tc ... tbf` on its egress towards each site. Delay, jitter and loss
come from a packet-level hop in the line namespace (`pdd.lab.netns.delay`: netem is missing
from some kernels), so the kernels at both ends see the round trip; a `pdd line` hop
there adds them instead where TCP should end at the line. Site i is 10.77.i.0/24: the
line is .1 there, hosts .10 up. Nothing has a route out of the lab, so no packet of it
can reach another network.

Hosts do no segmentation offload (`gso_max_segs 1`): every packet is a wire frame, so
the line's counters count headers as a real line carries them. Namespace names carry
the creating process's id; `remove_stale` deletes those a dead run left behind. Needs
root (CAP_NET_ADMIN).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TypeVar

from pdd.lab.deploy import PDD_COMMAND, start
from pdd.lab.netns.delay import DEVICE, TABLE, LineDelay, binary

PREFIX = "pddns-"
TCP_MAX_BYTES = 128 << 20  # hosts' TCP buffer ceiling (net.ipv4.tcp_rmem/tcp_wmem's third value)
NET = "10.77"
FIRST_HOST = 10
_CLONE_NEWNET = 0x40000000
_NAME = re.compile(r"[a-z][a-z0-9]{0,11}")
T = TypeVar("T")
_LABS = itertools.count()


class LabError(RuntimeError):
    """The lab cannot be built here (no root, no `ip`/`tc`, a kernel without veth or tbf)."""


@dataclass(frozen=True)
class Host:
    name: str
    site: str
    ns: str
    addr: str


def _ip(*args: str) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as e:
        raise LabError(f"{args[0]} is not installed: {e}") from None
    if done.returncode:
        raise LabError(f"`{' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("ip", "netns", "list").splitlines() if line.strip()]


def _delete_namespace(ns: str) -> None:
    """Kill what runs in `ns` (only lab processes run there), then delete it: its veths go with it."""
    for pid in _ip("ip", "netns", "pids", ns).split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(LabError):
        _ip("ip", "netns", "delete", ns)


def remove_stale() -> list[str]:
    """Delete the namespaces of labs whose creating process is gone (a crashed run)."""
    stale = [
        ns
        for ns in _namespaces()
        if ns.startswith(PREFIX) and ns.split("-")[1].isdigit() and not _alive(int(ns.split("-")[1]))
    ]
    for ns in stale:
        _delete_namespace(ns)
    return stale


def enter(ns: str) -> None:
    """Move the calling thread into network namespace `ns` (for good: use a thread of its own)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise LabError(f"setns into {ns}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def run_in(ns: str, fn: Callable[[], T]) -> T:
    """`fn()` on a thread inside `ns`; its result, or its exception raised here."""
    out: list = []

    def body() -> None:
        try:
            enter(ns)
            out.append((True, fn()))
        except BaseException as e:  # handed to the caller's thread
            out.append((False, e))

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


class Lab:
    """Hosts (name -> site) in sites joined by one line of `line_mbps` per direction."""

    def __init__(
        self, hosts: Mapping[str, str], line_mbps: float, mtu: int = 9000, delay: LineDelay = LineDelay()
    ) -> None:
        sites = sorted(set(hosts.values()))
        bad = [h for h in hosts if not _NAME.fullmatch(h) or h == "line"]
        if bad or len(sites) < 2 or len(sites) > 9 or not line_mbps > 0:
            raise ValueError("need host names of [a-z0-9] (not 'line'), 2 to 9 sites, a positive line rate")
        self.tag = f"{PREFIX}{os.getpid()}-{next(_LABS)}-"  # unique on this machine while this process lives
        self.line_ns = self.tag + "line"
        self.sites = {site: i + 1 for i, site in enumerate(sites)}
        self.line_mbps, self.mtu, self.delay = line_mbps, mtu, delay
        self.hop: subprocess.Popen | None = None  # the delay hop, while the line has one
        self.hosts: dict[str, Host] = {}
        for site, i in self.sites.items():
            for k, name in enumerate(sorted(h for h, s in hosts.items() if s == site)):
                self.hosts[name] = Host(name, site, self.tag + name, f"{NET}.{i}.{FIRST_HOST + k}")

    # ---- build and tear down -----------------------------------------------------------
    def gateway(self, site: str) -> str:
        """The line's address in `site` (where a hop in the line namespace listens)."""
        return f"{NET}.{self.sites[site]}.1"

    def up(self) -> Lab:
        if os.geteuid() != 0:
            raise LabError("network namespaces need root")
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        _ip("ip", "netns", "add", self.line_ns)
        self._device_up(self.line_ns, "lo")
        _ip("ip", "netns", "exec", self.line_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        rate = f"{self.line_mbps:g}mbit"
        burst = str(max(32 * 1024, int(self.line_mbps * 125_000 * 0.002)))  # 2 ms of line, at least 32 KiB
        for site in self.sites:
            switch = self.tag + f"sw{site.lower()}"
            _ip("ip", "netns", "add", switch)
            _ip("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
            self._device_up(switch, "br0")
            side = f"to{site.lower()}"
            self._veth(self.line_ns, side, switch, "line")
            _ip("ip", "-n", self.line_ns, "addr", "add", f"{self.gateway(site)}/24", "dev", side)
            # the line into this site: its rate, a queue of 20 ms (as `pdd line`'s)
            _ip(
                "ip",
                "netns",
                "exec",
                self.line_ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                side,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "latency",
                "20ms",
            )
            for k, host in enumerate(h for h in self.hosts.values() if h.site == site):
                _ip("ip", "netns", "add", host.ns)
                self._device_up(host.ns, "lo")
                self._veth(host.ns, "eth0", switch, f"h{k}")
                _ip("ip", "-n", host.ns, "link", "set", "eth0", "gso_max_segs", "1")
                _ip("ip", "-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
                _ip("ip", "-n", host.ns, "route", "add", f"{NET}.0.0/16", "via", self.gateway(site))
                # TCP may grow its windows to a long fat line's bandwidth-delay product
                # (10 Gbit/s x 50 ms is 62 MB; the default ceiling, 4-6 MiB, caps it far below)
                for key, low in (("rmem", 131072), ("wmem", 16384)):
                    limits = f"net.ipv4.tcp_{key}=4096 {low} {TCP_MAX_BYTES}"
                    _ip("ip", "netns", "exec", host.ns, "sysctl", "-qw", limits)
        if self.delay.active:
            self._delay_hop()

    def _delay_hop(self) -> None:
        """Every packet the line forwards goes through the delay hop and back: what comes in
        from a site routes into the hop's TUN device, what the hop gives back routes on to
        its site by the main table (packets for the line itself are delivered first)."""
        hop, ns = binary(), self.line_ns
        _ip("ip", "-n", ns, "tuntap", "add", "dev", DEVICE, "mode", "tun")
        _ip("ip", "-n", ns, "link", "set", DEVICE, "mtu", str(self.mtu), "txqueuelen", "10000", "up")
        _ip("ip", "-n", ns, "route", "add", "default", "dev", DEVICE, "table", TABLE)
        for site in self.sites:
            _ip("ip", "-n", ns, "rule", "add", "iif", f"to{site.lower()}", "lookup", TABLE)
        for key in ("all", "default", DEVICE):  # what comes back from the hop has a site's source
            _ip("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.conf.{key}.rp_filter=0")
        self.hop = subprocess.Popen(
            ["ip", "netns", "exec", ns, str(hop), *self.delay.args()],
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def _veth(self, ns_a: str, name_a: str, switch: str, port: str) -> None:
        """A veth pair from `ns_a` to a port of `switch`'s bridge, both ends up."""
        _ip(
            "ip",
            "link",
            "add",
            name_a,
            "netns",
            ns_a,
            "mtu",
            str(self.mtu),
            "type",
            "veth",
            "peer",
            "name",
            port,
            "netns",
            switch,
            "mtu",
            str(self.mtu),
        )
        _ip("ip", "-n", switch, "link", "set", port, "master", "br0")
        self._device_up(switch, port)
        self._device_up(ns_a, name_a)

    @staticmethod
    def _device_up(ns: str, dev: str) -> None:
        _ip("ip", "-n", ns, "link", "set", dev, "up")

    def down(self) -> None:
        """Delete every namespace of this lab, killing what still runs there (a launcher
        has stopped its children gracefully before)."""
        with contextlib.suppress(LabError):
            for ns in _namespaces():
                if ns.startswith(self.tag):
                    _delete_namespace(ns)

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---- use ---------------------------------------------------------------------------
    def spawn(
        self, host: str, args: Sequence[str], log: IO | None = None, nice: int = 0, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """`python -m pdd.cli ARGS` on `host` ("line": the line's namespace, where `pdd line`
        runs), in a process group of its own, with `env` added to this process's environment."""
        ns = self.line_ns if host == "line" else self.hosts[host].ns
        return start(["ip", "netns", "exec", ns, *PDD_COMMAND, *args], log or subprocess.DEVNULL, env, nice)

    def line_bytes(self) -> dict[str, int]:
        """Bytes the line has carried into each site (its tbf-shaped egress: what crossed)."""
        out = {}
        for site in self.sites:
            path = f"/sys/class/net/to{site.lower()}/statistics/tx_bytes"
            out[site] = int(_ip("ip", "netns", "exec", self.line_ns, "cat", path))
        return out

    def blackhole(self, on: bool) -> None:
        """Drop, silently, every packet the line would forward (TCP stays open and hears nothing)."""
        for i in self.sites.values():
            _ip("ip", "-n", self.line_ns, "route", "add" if on else "del", "blackhole", f"{NET}.{i}.0/25")


@contextlib.contextmanager
def lab(hosts: Mapping[str, str], line_mbps: float, mtu: int = 9000, delay: LineDelay = LineDelay()) -> Iterator[Lab]:
    """A lab, up for the `with` block and torn down after it, whatever happens."""
    remove_stale()
    with Lab(hosts, line_mbps, mtu, delay) as built:
        yield built
