"""`pdd netns up`: a two-site deployment on one Linux machine, one network namespace
per host, real kernel TCP over a tbf-shaped line between the sites (`pdd.lab.netns.lab`).

Unlike `pdd up`, nothing shares loopback: the router, P and RLD are hosts of site A,
MD a host of site B, each at its own address and all on the same ports, finding each
other from the deployment file exactly as separate machines would (`pdd serve --config
F --instance NAME` and `pdd router --config F`, each inside its host's namespace). The
line's rate is the kernel's; `--delay-ms`/`--jitter-ms` are a packet hop on the line
(`pdd.lab.netns.delay`), so the hosts' TCP sees the round trip, or with `--delay-by emulator` a
`pdd line` hop in the line namespace on every route into B, which ends TCP there (it
does not shape: the kernel does).
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
from pdd.lab.deploy import Launcher, PortTaken, wait_http
from pdd.lab.launch import Child
from pdd.lab.netns.delay import DelayError, LineDelay
from pdd.lab.netns.lab import Lab, LabError, lab, run_in
from pdd.lab.workload.scenarios import SCENARIOS
from pdd.process import LAUNCH_ENV

MODES = ("pdd", "pd-cross-dc")
HTTP_PORT, KV_PORT, ROUTER_PORT = 8100, 9100, 8000  # the same on every host: hosts differ by address
HOP_PORT, HOP_ADMIN_PORT = 7100, 7001  # the optional `pdd line` hop, in the line namespace
HOP_MBPS = 100_000.0  # the hop adds delay and jitter only; the kernel's tbf is the line's rate
CLIENT = "client"


def roles(mode: str, dep: cfg.Deployment) -> dict[str, tuple[str, str]]:
    """Instance name -> (role, datacenter) for a mode: P (and RLD) in A, MD in B."""
    a, b = dep.line.a, dep.line.b
    placed = {"p0": ("prefill", a), "rld0": ("relay", a), "md0": ("main", b)}
    return placed if mode == "pdd" else {k: v for k, v in placed.items() if k != "rld0"}


def hosts(mode: str, dep: cfg.Deployment) -> dict[str, str]:
    """Lab host -> site: one per instance, the router's and a client's in A."""
    return {"router": dep.router.dc, CLIENT: dep.router.dc, **{n: dc for n, (_, dc) in roles(mode, dep).items()}}


def lab_deployment(net: Lab, dep: cfg.Deployment, mode: str, hop: bool) -> cfg.Deployment:
    """The explicit deployment file of the lab's hosts; with `hop`, every instance outside
    the router's datacenter is advertised to it at the `pdd line` hop in the line namespace."""
    from pdd.model.store import resolve_model

    insts = []
    for k, (name, (role, dc)) in enumerate(roles(mode, dep).items()):
        reach = {dep.router.dc: f"{net.gateway(dep.router.dc)}:{HOP_PORT + k}"} if hop and dc != dep.router.dc else {}
        insts.append(cfg.InstanceSpec(name, role, dc, net.hosts[name].addr, HTTP_PORT, KV_PORT, reach, dep.engine))
    line = replace(dep.line, host=net.gateway(dep.router.dc), admin_port=HOP_ADMIN_PORT if hop else 0)
    router = replace(dep.router, host=net.hosts["router"].addr, port=ROUTER_PORT)
    model = replace(dep.model, path=str(resolve_model(dep.model.path)))
    return cfg.with_secret(replace(dep, mode=mode, instances=tuple(insts), line=line, router=router, model=model))


class LabLauncher(Launcher):
    """`pdd up`'s launcher, with every child in its host's namespace (the hop in the line's)."""

    def __init__(self, dep: cfg.Deployment, run_dir: Path, net: Lab) -> None:
        super().__init__(dep, run_dir)
        self.net = net

    def _popen(self, name: str, args: list[str], log: Path, nice: int) -> subprocess.Popen:
        """Started in its namespace (`ip netns exec`), not forked: a fork would stay in ours."""
        with open(log, "w") as out:
            return self.net.spawn(name, args, out, nice, {LAUNCH_ENV: self.launch})

    def line_shape(self) -> tuple[float, float, float]:
        return HOP_MBPS, self.dep.line.delay_ms, self.dep.line.jitter_ms

    def _wait_http(self, name: str, proc: Child, url: str) -> None:
        ns = self.net.line_ns if name == "line" else self.net.hosts[name].ns
        try:
            run_in(ns, lambda: wait_http(url, proc, 120.0, self.launch))
        except PortTaken as e:
            raise PortTaken(f"{name}: {e}") from None
        except RuntimeError as e:
            raise RuntimeError(f"{name}: {e}\n{self.tail(name)}") from None


def with_tls(dep: cfg.Deployment, net: Lab, out: Path) -> cfg.Deployment:
    """A pair for every host of the lab (its own CA), in the deployment's [tls]."""
    from pdd.transfer.tls import make_self_signed

    cert, key = make_self_signed(out, 1, [h.addr for h in net.hosts.values()])
    return replace(dep, tls=cfg.TLSSpec(str(cert), str(key), str(cert)))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("netns", help="a two-site deployment in network namespaces over a kernel-shaped line (root)")
    p.add_argument(
        "action",
        choices=("up", "bench"),
        help="up: serve until SIGINT/SIGTERM; bench: replay a demo "
        "scenario from the client host, print its table, stop",
    )
    p.add_argument("--config", help="deployment TOML for everything but the instances (default: the built-in one)")
    p.add_argument("--mode", choices=MODES, default="pdd")
    p.add_argument(
        "--bandwidth-mbps", type=float, help="the line's rate per direction, by tbf (default 50; bench: the scenario's)"
    )
    p.add_argument("--delay-ms", type=float, help="one-way delay (default 0; bench: the scenario's)")
    p.add_argument("--jitter-ms", type=float, help="one-way jitter bound (as --delay-ms)")
    p.add_argument(
        "--delay-by",
        choices=("kernel", "emulator"),
        default="kernel",
        help="kernel (default): a packet hop on the line holds every packet, so the hosts' TCP sees the round "
        "trip (pdd.lab.netns.delay); emulator: a `pdd line` hop, which ends TCP at the line",
    )
    p.add_argument("--mtu", type=int, default=9000, help="MTU of every interface (9000: jumbo frames on the line)")
    p.add_argument("--no-tls", action="store_true", help="plain TCP between instances")
    p.add_argument("--keep", action="store_true", help="keep the run directory (config, certificate, logs)")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="paper", help="bench: the demo scenario")
    p.add_argument("--requests", type=int, help="bench: turns (default: the scenario's)")
    p.add_argument("--rate", type=float, help="bench: session starts per second (default: the scenario's)")
    p.add_argument("--seed", type=int, default=0, help="bench: workload seed (the demo's default)")
    p.add_argument("--out", type=Path, help="bench: write summary, records and line bytes here (JSON)")
    p.set_defaults(func=run)


def _line(args: argparse.Namespace) -> tuple[float, float, float]:
    """(rate, delay, jitter) of the line: given, else the bench scenario's, else 50 Mbit/s and none."""
    sc = SCENARIOS[args.scenario] if args.action == "bench" else None
    rate = args.bandwidth_mbps or (sc.bandwidth_mbps if sc else 50.0)
    delay = args.delay_ms if args.delay_ms is not None else (sc.delay_ms if sc else 0.0)
    jitter = args.jitter_ms if args.jitter_ms is not None else (sc.jitter_ms if sc else 0.0)
    return rate, delay, jitter


def run(args: argparse.Namespace) -> int:
    rate, delay, jitter = _line(args)
    hop = (delay > 0 or jitter > 0) and args.delay_by == "emulator"
    kernel_delay = LineDelay(delay, jitter) if args.delay_by == "kernel" else LineDelay()
    run_dir = Path(tempfile.mkdtemp(prefix="pdd-netns-"))
    stop: list[bool] = []
    if args.action == "up":  # serve until asked to stop, then tear down
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
        signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    else:  # a bench stops where it is, and still tears down
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        base = cfg.load(args.config)
        base = replace(base, line=replace(base.line, bandwidth_mbps=rate, delay_ms=delay, jitter_ms=jitter))
        with lab(hosts(args.mode, base), rate, args.mtu, kernel_delay) as net:
            dep = lab_deployment(net, base, args.mode, hop)
            dep = dep if args.no_tls else with_tls(dep, net, run_dir / "tls")
            launcher = LabLauncher(dep, run_dir, net)
            hop_note = (
                f", a pdd line hop adds {delay:g} ms ± {jitter:g} ms one way"
                if hop
                else f", the line holds each packet {delay:g} ms + up to {jitter:g} ms one way"
                if kernel_delay.active
                else ", no delay"
            )
            print(
                f"pdd netns: mode {args.mode}, run directory {run_dir}; line {rate:g} Mbit/s each way (tbf)"
                f"{hop_note}, MTU {args.mtu}{', TLS' if not args.no_tls else ''}",
                flush=True,
            )
            for h in net.hosts.values():
                print(f"host {h.name}: {h.addr} (site {h.site}, netns {h.ns})", flush=True)
            try:
                launcher.start()
                client = net.hosts[CLIENT].ns
                if args.action == "bench":
                    return _bench(args, net, dep)
                print(
                    f"client: ip netns exec {client} COMMAND; line counters: ip netns exec {net.line_ns} "
                    f"cat /sys/class/net/to{{a,b}}/statistics/tx_bytes",
                    flush=True,
                )
                launcher.watch(stop)
            finally:
                launcher.stop()
                with contextlib.suppress(LabError):
                    print(f"pdd netns: the line carried {net.line_bytes()} bytes into each site", flush=True)
    except (cfg.ConfigError, LabError, DelayError, RuntimeError) as e:
        print(f"pdd netns: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, cfg.ConfigError) else 1
    finally:
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _bench(args: argparse.Namespace, net: Lab, dep: cfg.Deployment) -> int:
    """The demo's workload for one mode, sent from the client host; the line's kernel
    counters around it beside the bench's own line bytes."""
    import dataclasses
    import json
    import math

    from rich.console import Console

    from pdd.lab.bench.client import run_bench
    from pdd.lab.bench.summary import format_table, summarize
    from pdd.lab.workload.agentic import plan_sessions

    sc = SCENARIOS[args.scenario]
    requests, rate = args.requests or sc.requests, args.rate or sc.rate
    sessions = plan_sessions(dataclasses.replace(sc.workload, seed=args.seed), requests, rate)
    before = net.line_bytes()
    run = run_in(net.hosts[CLIENT].ns, lambda: run_bench(dep.router.url, sessions, timeout_s=120.0, quiet=True))
    line = {site: n - before[site] for site, n in net.line_bytes().items()}
    summary = summarize(
        run.records, line_bytes=run.line_bytes, slo_ttft_ms=dep.slo.ttft_ms, slo_tpot_ms=dep.slo.tpot_ms
    )
    Console().print(format_table({f"{args.mode} (netns)": summary}))
    print(
        f"line bytes at the kernel interfaces: {line} (total {sum(line.values()):,}); the bench's line bytes "
        f"{summary['line_bytes']:,}",
        flush=True,
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        config = {
            "scenario": sc.name,
            "requests": requests,
            "rate": rate if math.isfinite(rate) else None,
            "seed": args.seed,
            "mode": args.mode,
            "line": dataclasses.asdict(dep.line),
            "mtu": args.mtu,
        }
        args.out.write_text(
            json.dumps(
                {
                    "summary": summary,
                    "line_bytes": line,
                    "config": config,
                    "requests": [r.to_dict() for r in run.records],
                },
                indent=2,
            )
            + "\n"
        )
    return 0 if summary["completed"] else 1
