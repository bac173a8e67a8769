"""`pdd netns up`: a two-site deployment on one Linux machine, one network namespace
per host, real kernel TCP over a tbf-shaped line between the sites (`pdd.netns.lab`).

Unlike `pdd up`, nothing shares loopback: the router, P and RLD are hosts of site A,
MD a host of site B, each at its own address and all on the same ports, finding each
other from the deployment file exactly as separate machines would (`pdd serve --config
F --instance NAME` and `pdd router --config F`, each inside its host's namespace). The
line's rate is the kernel's; with `--delay-ms`/`--jitter-ms`, a `pdd wan` hop in the
line namespace adds those on every route into B (it does not shape: the kernel does).
TLS is on by default, with a pair from `pdd cert`'s maker. Needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from pdd import config as cfg
from pdd.deploy import Launcher, wait_http
from pdd.netns.lab import Lab, LabError, lab, run_in

MODES = ("pdd", "pd-cross-dc")
HTTP_PORT, KV_PORT, ROUTER_PORT = 8100, 9100, 8000  # the same on every host: hosts differ by address
HOP_PORT, HOP_ADMIN_PORT = 7100, 7001  # the optional `pdd wan` hop, in the line namespace
HOP_MBPS = 100_000.0  # the hop adds delay and jitter only; the kernel's tbf is the line's rate
CLIENT = "client"


def roles(mode: str, dep: cfg.Deployment) -> dict[str, tuple[str, str]]:
    """Instance name -> (role, datacenter) for a mode: P (and RLD) in A, MD in B."""
    a, b = dep.link.a, dep.link.b
    placed = {"p0": ("prefill", a), "rld0": ("relay", a), "md0": ("main", b)}
    return placed if mode == "pdd" else {k: v for k, v in placed.items() if k != "rld0"}


def hosts(mode: str, dep: cfg.Deployment) -> dict[str, str]:
    """Lab host -> site: one per instance, the router's and a client's in A."""
    return {"router": dep.router.dc, CLIENT: dep.router.dc, **{n: dc for n, (_, dc) in roles(mode, dep).items()}}


def lab_deployment(net: Lab, dep: cfg.Deployment, mode: str, hop: bool) -> cfg.Deployment:
    """The explicit deployment file of the lab's hosts; with `hop`, every instance outside
    the router's datacenter is advertised to it at the `pdd wan` hop in the line namespace."""
    from pdd.model.store import resolve_model

    insts = []
    for k, (name, (role, dc)) in enumerate(roles(mode, dep).items()):
        reach = {dep.router.dc: f"{net.gateway(dep.router.dc)}:{HOP_PORT + k}"} if hop and dc != dep.router.dc else {}
        insts.append(cfg.InstanceSpec(name, role, dc, net.hosts[name].addr, HTTP_PORT, KV_PORT, reach, dep.engine))
    link = replace(dep.link, host=net.gateway(dep.router.dc), admin_port=HOP_ADMIN_PORT if hop else 0)
    router = replace(dep.router, host=net.hosts["router"].addr, port=ROUTER_PORT)
    model = replace(dep.model, path=str(resolve_model(dep.model.path)))
    return cfg.with_secret(replace(dep, mode=mode, instances=tuple(insts), link=link, router=router, model=model))


class LabLauncher(Launcher):
    """`pdd up`'s launcher, with every child in its host's namespace (the hop in the line's)."""

    def __init__(self, dep: cfg.Deployment, run_dir: Path, net: Lab) -> None:
        super().__init__(dep, run_dir)
        self.net = net

    def _host(self, name: str) -> str:
        return "line" if name == "wan" else name

    def _popen(self, name: str, args: list[str], log, nice: int) -> subprocess.Popen:
        return self.net.spawn(self._host(name), args, log, nice)

    def wan_args(self) -> list[str]:
        return [a if not a.startswith("--bandwidth-mbps=") else f"--bandwidth-mbps={HOP_MBPS:g}"
                for a in super().wan_args()]

    def _wait_http(self, name: str, proc: subprocess.Popen, url: str) -> None:
        ns = self.net.line_ns if name == "wan" else self.net.hosts[name].ns
        try:
            run_in(ns, lambda: wait_http(url, proc, 120.0))
        except RuntimeError as e:
            raise RuntimeError(f"{name}: {e}\n{self.tail(name)}") from None


def with_tls(dep: cfg.Deployment, net: Lab, out: Path) -> cfg.Deployment:
    """A pair for every host of the lab (its own CA), in the deployment's [tls]."""
    from pdd.transfer.tls import make_self_signed

    cert, key = make_self_signed(out, 1, [h.addr for h in net.hosts.values()])
    return replace(dep, tls=cfg.TLSSpec(str(cert), str(key), str(cert)))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("netns", help="a two-site deployment in network namespaces over a kernel-shaped line (root)")
    p.add_argument("action", choices=("up",))
    p.add_argument("--config", help="deployment TOML for everything but the instances (default: the built-in one)")
    p.add_argument("--mode", choices=MODES, default="pdd")
    p.add_argument("--bandwidth-mbps", type=float, default=50.0, help="the line's rate per direction (tbf)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay: adds a `pdd wan` hop")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="one-way jitter bound (with the hop)")
    p.add_argument("--mtu", type=int, default=9000, help="MTU of every link (9000: jumbo frames on the line)")
    p.add_argument("--no-tls", action="store_true", help="plain TCP between instances")
    p.add_argument("--keep", action="store_true", help="keep the run directory (config, certificate, logs)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        base = cfg.load(args.config)
    except cfg.ConfigError as e:
        print(f"pdd netns: {e}", file=sys.stderr)
        return 2
    hop = args.delay_ms > 0 or args.jitter_ms > 0
    base = replace(base, link=replace(base.link, bandwidth_mbps=args.bandwidth_mbps, delay_ms=args.delay_ms,
                                      jitter_ms=args.jitter_ms))
    run_dir = Path(tempfile.mkdtemp(prefix="pdd-netns-"))
    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    try:
        with lab(hosts(args.mode, base), args.bandwidth_mbps, args.mtu) as net:
            dep = lab_deployment(net, base, args.mode, hop)
            dep = dep if args.no_tls else with_tls(dep, net, run_dir / "tls")
            launcher = LabLauncher(dep, run_dir, net)
            print(f"pdd netns: mode {args.mode}, run directory {run_dir}; line {args.bandwidth_mbps:g} Mbit/s each way "
                  f"(tbf), MTU {args.mtu}{', TLS' if not args.no_tls else ''}", flush=True)
            for h in net.hosts.values():
                print(f"host {h.name}: {h.addr} (site {h.site}, netns {h.ns})", flush=True)
            try:
                launcher.start()
                print(f"client: ip netns exec {net.hosts[CLIENT].ns} COMMAND; line counters: ip netns exec "
                      f"{net.line_ns} cat /sys/class/net/to{{a,b}}/statistics/tx_bytes", flush=True)
                launcher.watch(stop)
            finally:
                launcher.stop()
                with contextlib.suppress(LabError):
                    print(f"pdd netns: the line carried {net.line_bytes()} bytes into each site", flush=True)
    except (LabError, RuntimeError) as e:
        print(f"pdd netns: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 0
