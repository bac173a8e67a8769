"""`pdd up`: a whole deployment on one machine — WAN emulator, instances, router.

Two "datacenters" live on loopback; everything that crosses between them goes through
`pdd wan`: every cross-datacenter route is advertised at one of the emulator's ports
(`InstanceSpec.advertise`), which relays it to where the instance listens. The
launcher expands the config for the chosen mode, picks free ports, writes the
resolved deployment file every child reads, starts the children, prints
`router: http://HOST:PORT` once all answer, and stops them all on SIGINT/SIGTERM. A
child that dies is reported, not fatal: the router must ride out a dead instance.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

import httpx

from pdd import config as cfg
from pdd.addresses import parse_addr
from pdd.engine_port import engine_names
from pdd.errors import Mistake
from pdd.names import HARDWARE, HARDWARE_HELP, RoleName
from pdd.process import LAUNCH_ENV, listen

READY_TIMEOUT_S = 300.0  # vLLM instances, started together on a few shared cores, take a minute or more


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a whole local deployment (router, instances, WAN emulator)")
    p.add_argument("--config", help="deployment TOML (default: the embedded demo deployment)")
    p.add_argument("--mode", choices=cfg.MODES, help="deployment mode (default: the config's mode, pdd if it has none)")
    p.add_argument(
        "--model",
        help="model directory or hub name (ORG/NAME) in the local Hugging Face cache "
        "(default: the config's [model] path, else the embedded tiny model)",
    )
    p.add_argument("--port", type=int, help="router port (0: any free port)")
    p.add_argument(
        "--engine",
        choices=engine_names(),
        help="run every instance on this engine backend (default: the config's [engine] backend)",
    )
    p.add_argument(
        "--drc", choices=("on", "off"), help="decode-side radix cache: send only the KV the decode side lacks"
    )
    p.add_argument("--bandwidth-mbps", type=float, help="override the WAN line's bandwidth")
    p.add_argument("--delay-ms", type=float, help="override the WAN line's one-way delay")
    p.add_argument("--jitter-ms", type=float, help="override the WAN line's one-way jitter bound")
    p.add_argument(
        "--hardware",
        choices=HARDWARE,
        help=f"{HARDWARE_HELP} (default: the config's [topology] hardware, native)",
    )
    p.add_argument(
        "--dilation",
        type=float,
        help="emulated time runs this many times slower than the chips "
        "(the line and the latency budget are stretched alike)",
    )
    p.add_argument("--prefill", type=int, help="prefill instances (default: the config's [topology])")
    p.add_argument("--main", type=int, help="main decode instances (default: the config's [topology])")
    p.add_argument("--relay", type=int, help="relay decode instances, pdd mode (default: the config's [topology])")
    p.add_argument("--keep", action="store_true", help="keep the run directory (config, logs) after stopping")
    p.add_argument(
        "--api-key",
        default=None,
        help="the router requires `Authorization: Bearer KEY` on /v1/* (default: [router] api_key, else $PDD_API_KEY)",
    )
    p.set_defaults(func=run)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(taken: set[int] | None = None) -> int:
    """A port free to listen on now, for a child to bind a moment later, and not in
    `taken` (to which it is added: one launch's ports, drawn before any is bound, are
    then all distinct; 8 draws from 16,384 collide once in about 600 launches, and a
    CI run launches hundreds). Drawn below the ephemeral range: a port the kernel hands
    out there is also what every outgoing connection takes its local port from, so
    another process's connect() could take it in between; below it only another
    listener could, and the draw is random."""
    taken = set() if taken is None else taken
    low, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 16384), low)
        if port in taken:
            continue
        taken.add(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded machine: what the kernel picks
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    taken.add(port)
    return port


def check_ports(dep: cfg.Deployment) -> None:
    """Mistake, naming the process and the port, if a port the deployment's processes will
    listen on is held now: found before anything starts (a port given in the file or by
    --port, such as vLLM's 8000; drawn ones were free when drawn)."""
    wanted = [("router", dep.router.host, dep.router.port)]
    for inst in dep.instances:
        wanted += [(inst.name, inst.host, inst.port), (inst.name, inst.host, inst.kv_port)]
    if dep.link.admin_port:
        wanted.append(("wan", dep.link.host, dep.link.admin_port))
    for inst in dep.instances:  # the emulator's hops (on this machine: the ones on the link's host)
        hops = (parse_addr(a) for a in inst.advertise.values())
        wanted += [("wan", host, port) for host, port in hops if host == dep.link.host]
    for name, host, port in wanted:
        try:
            listen(host, port).close()
        except Mistake as e:
            raise Mistake(f"{name}: {e}") from None


PDD_COMMAND = (sys.executable, "-m", "pdd.cli")  # `pdd`, as this interpreter runs it
STOP_GRACE_S = 15.0  # a server's time to stop after SIGTERM, before SIGKILL


def start(
    argv: Sequence[str],
    output: IO | int | None = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    nice: int = 0,
    own_group: bool = True,
    text: bool = False,
) -> subprocess.Popen:
    """Every process the lab starts, started one way: `argv` with its stdout and stderr to
    `output` (a file, PIPE, DEVNULL), no stdin, `env` over this process's environment and
    Python unbuffered (a log shows what happened up to a kill), at `nice`. `own_group`: in a
    process group of its own, which `stop_group` stops whole, its children with it; a
    deployment's children stay in the deployment's, so stopping `pdd up` stops them too."""
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        preexec_fn=(lambda: os.nice(nice)) if nice else None,
        start_new_session=own_group,
        text=text,
        errors="replace" if text else None,
    )


class PortTaken(RuntimeError):
    """A server of another launch answers where a child of this one should."""


def wait_http(url: str, proc: subprocess.Popen, timeout: float, launch: str = "") -> None:
    """Return once `url` answers 200; RuntimeError if `proc` exits first or time runs out,
    or, given the `launch` id `proc` was started with, at once when a server of another
    launch answers (`pdd.process`: the port is someone else's)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode} before {url} answered")
        try:
            r = httpx.get(url, timeout=1.0)
        except httpx.HTTPError:
            r = None
        if r is not None and launch and _launch_of(r) != launch:
            port = urlsplit(url).port
            raise PortTaken(f"port {port} is held by another server (its {url} is not this launch's)")
        if r is not None and r.status_code == 200:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def _launch_of(response: httpx.Response) -> object:
    try:
        said = response.json()
    except ValueError:
        return None
    return said.get("launch") if isinstance(said, dict) else None


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
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


def pacing_line(dep: cfg.Deployment) -> str:
    """What pacing the deployment's instances run under, for every report to print."""
    top = dep.topology
    if top.hardware == "native":
        return "pacing: native (every instance at this machine's speed, sharing its CPU)"
    chips = ", ".join(f"{i.name} on {i.engine.hardware}" for i in dep.instances)
    return (
        f"pacing: emulated accelerators ({chips}; the spec's A for compute, B for bandwidth and memory): real "
        f"tokens in emulated time, {top.dilation:g}x slower than the chips; the line and the latency budget "
        f"stretched alike ({dep.link.bandwidth_mbps:g} Mbit/s, {dep.link.delay_ms:g} ms one-way)"
    )


def resolve(dep: cfg.Deployment, mode: str, router_port: int | None) -> cfg.Deployment:
    """The explicit deployment for this machine: instances placed, every port chosen, the
    model found (FileNotFoundError) and readable (UnsupportedCheckpoint) before anything starts."""
    from pdd.model.config import ModelConfig
    from pdd.model.store import resolve_model

    dep = cfg.with_secret(replace(dep, mode=mode))
    instances = dep.instances or cfg.instances_for_mode(dep, mode)
    sender_dcs = {i.dc for i in instances if i.role in (RoleName.PREFILL, RoleName.RELAY)}  # they send KV, handoffs
    taken = {p for i in instances for p in (i.port, i.kv_port) if p} | {dep.link.admin_port, dep.router.port}
    taken |= {parse_addr(a)[1] for i in instances for a in i.advertise.values()}
    if router_port:
        taken.add(router_port)
    draw = functools.partial(free_port, taken)
    placed = []
    for inst in instances:
        # one emulated hop per route that crosses the line: from the router's datacenter,
        # and (decode side) from those of the instances that send it KV or handoffs
        callers = {dep.router.dc} | (sender_dcs if inst.role == RoleName.MAIN else set())
        hops = {dc: inst.advertise.get(dc) or f"{dep.link.host}:{draw()}" for dc in sorted(callers - {inst.dc})}
        placed.append(replace(inst, port=inst.port or draw(), kv_port=inst.kv_port or draw(), advertise=hops))
    remote = any(i.advertise for i in placed)
    link = replace(dep.link, admin_port=(dep.link.admin_port or draw()) if remote else 0)
    port = dep.router.port if router_port is None else router_port
    router = replace(dep.router, port=port or draw())
    model_dir = resolve_model(dep.model.path)
    if any(i.engine.backend == "embedded" for i in placed):  # (the embedded engine's gate; vLLM reads the model)
        ModelConfig.from_dir(model_dir)
    model = replace(dep.model, path=str(model_dir), name=dep.model.served_name)
    return replace(dep, instances=tuple(placed), link=link, router=router, model=model)


class Launcher:
    def __init__(self, dep: cfg.Deployment, run_dir: Path) -> None:
        self.dep = dep
        self.run_dir = run_dir
        self.config_path = run_dir / "deployment.toml"
        self.children: list[tuple[str, subprocess.Popen]] = []
        # in every child's environment, and said back on its /health: a server that does not
        # say it is not this launch's
        self.launch = secrets.token_hex(8)

    def _spawn(self, name: str, args: list[str], nice: int = 0) -> subprocess.Popen:
        log = open(self.run_dir / f"{name}.log", "w")
        proc = self._popen(name, args, log, nice)
        log.close()
        self.children.append((name, proc))
        print(f"process {name}: pid {proc.pid}, log {self.run_dir / (name + '.log')}", flush=True)
        return proc

    def _popen(self, name: str, args: list[str], log: IO, nice: int) -> subprocess.Popen:
        """`pdd ARGS` as child `name` (here: on this host)."""
        return start([*PDD_COMMAND, *args], log, {LAUNCH_ENV: self.launch}, nice, own_group=False)

    def wan_line(self) -> tuple[float, float, float]:
        """What the emulator enforces: (Mbit/s, one-way delay ms, jitter ms); here, the line's."""
        link = self.dep.link
        return link.bandwidth_mbps, link.delay_ms, link.jitter_ms

    def wan_args(self) -> list[str]:
        """The emulator's command line: a route per advertised hop, the line's settings."""
        link, (mbps, delay, jitter) = self.dep.link, self.wan_line()
        routes = [f"--route={hop}={i.host}:{i.kv_port}" for i in self.dep.instances for hop in i.advertise.values()]
        return [
            "wan",
            *routes,
            f"--bandwidth-mbps={mbps}",
            f"--delay-ms={delay}",
            f"--jitter-ms={jitter}",
            f"--admin={link.host}:{link.admin_port}",
        ]

    def _wait_http(self, name: str, proc: subprocess.Popen, url: str) -> None:
        try:
            wait_http(url, proc, READY_TIMEOUT_S, self.launch)
        except PortTaken as e:
            raise PortTaken(f"{name}: {e}") from None
        except RuntimeError as e:
            raise RuntimeError(f"{name}: {e}\n{self.tail(name)}") from None

    def tail(self, name: str, lines: int = 20) -> str:
        path = self.run_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def start(self) -> None:
        self.config_path.write_text(cfg.dump(self.dep))
        self.config_path.chmod(0o600)  # it holds the deployment's secret
        dep, conf = self.dep, str(self.config_path)
        link = dep.link
        if link.admin_port:
            proc = self._spawn("wan", self.wan_args())
            self._wait_http("wan", proc, f"http://{link.host}:{link.admin_port}/health")
            mbps, delay, jitter = self.wan_line()
            print(
                f"wan: {mbps:g} Mbit/s, {delay:g} ms ± {jitter:g} ms one-way, "
                f"admin http://{link.host}:{link.admin_port}",
                flush=True,
            )
        for inst in dep.instances:
            # natively, prefill would take decode's CPU; an emulated chip paces itself
            nice = (
                dep.topology.prefill_nice if inst.role == RoleName.PREFILL and inst.engine.hardware == "native" else 0
            )
            proc = self._spawn(inst.name, ["serve", "--config", conf, "--instance", inst.name], nice)
            print(
                f"instance {inst.name} ({inst.role}, datacenter {inst.dc}): http://{inst.host}:{inst.port}", flush=True
            )
        for name, proc in list(self.children):
            if name != "wan":
                inst = dep.instance(name)
                self._wait_http(name, proc, f"http://{inst.host}:{inst.port}/health")
        proc = self._spawn("router", ["router", "--config", conf])
        url = f"http://{dep.router.host}:{dep.router.port}"
        self._wait_http("router", proc, f"{url}/health")
        print(f"router: {url}", flush=True)

    def watch(self, stop: list[bool]) -> None:
        """Report children that die, until asked to stop."""
        reported: set[str] = set()
        while not stop:
            for name, proc in self.children:
                if proc.poll() is not None and name not in reported:
                    reported.add(name)
                    print(f"pdd up: {name} exited with code {proc.returncode}", file=sys.stderr, flush=True)
            time.sleep(0.2)

    def stop(self, grace: float = 10.0) -> None:
        for _, proc in reversed(self.children):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace
        for _, proc in self.children:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run(args: argparse.Namespace) -> int:
    dep = cfg.load(args.config, backend=args.engine)
    mode = args.mode or dep.mode
    policy = dep.policy if args.drc is None else replace(dep.policy, decode_radix_cache=args.drc == "on")
    given = (("bandwidth_mbps", args.bandwidth_mbps), ("delay_ms", args.delay_ms), ("jitter_ms", args.jitter_ms))
    link = replace(dep.link, **{k: v for k, v in given if v is not None})
    placed = {"hardware": args.hardware, "dilation": args.dilation, "prefill": args.prefill, "relay": args.relay}
    placed["main"] = args.main
    try:
        topology = replace(dep.topology, **{k: v for k, v in placed.items() if v is not None})
    except ValueError as e:
        raise Mistake(str(e)) from None
    dep = cfg.in_emulated_time(replace(dep, topology=topology, link=link, policy=policy))
    router = dep.router if args.api_key is None else replace(dep.router, api_key=args.api_key)
    model = dep.model if args.model is None else replace(dep.model, path=args.model)
    try:
        dep = resolve(replace(dep, router=router, model=model), mode, args.port)
    except (FileNotFoundError, ValueError) as e:  # no such model, or one pdd cannot run
        raise Mistake(str(e)) from None
    check_ports(dep)
    run_dir = Path(tempfile.mkdtemp(prefix="pdd-up-"))
    launcher = Launcher(dep, run_dir)
    stop: list[bool] = []

    def on_signal(signum, frame) -> None:
        stop.append(True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        print(f"pdd up: mode {mode}, run directory {run_dir}", flush=True)
        print(pacing_line(dep), flush=True)
        launcher.start()
        launcher.watch(stop)
    except PortTaken as e:  # a mistake in the deployment's ports, not a failure of pdd's
        print(f"pdd up: {e}", file=sys.stderr, flush=True)
        code = 2
    except RuntimeError as e:
        print(f"pdd up: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        launcher.stop()
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    return code
