"""`pdd up`: a whole deployment on one machine — line emulator, instances, router.

Two "datacenters" live on loopback; everything that crosses between them goes through
`pdd line`: every cross-datacenter route is advertised at one of the emulator's ports
(`InstanceSpec.advertise`), which relays it to where the instance listens. The
launcher expands the config for the chosen mode, picks free ports, writes the
resolved deployment file every child reads, starts the children, prints
`router: http://HOST:PORT` once all answer, and stops them all on SIGINT/SIGTERM. A
child that dies is reported, not fatal: the router must ride out a dead instance.
"""

from __future__ import annotations

import argparse
import functools
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from pdd import config as cfg
from pdd.addresses import parse_addr
from pdd.config import groups
from pdd.engines.port import devices, engine_names
from pdd.errors import Mistake
from pdd.lab.forks import Forks
from pdd.lab.launch import (  # (the lab's other tools import these from here too)
    PDD_COMMAND as PDD_COMMAND,
)
from pdd.lab.launch import (
    STOP_GRACE_S as STOP_GRACE_S,
)
from pdd.lab.launch import (
    Child,
    check_ports,
    child_env,
    free_port,
    log_progress,
    wait_http,
)
from pdd.lab.launch import (
    PortTaken as PortTaken,
)
from pdd.lab.launch import (
    start as start,
)
from pdd.lab.launch import (
    stop_group as stop_group,
)
from pdd.names import HARDWARE, HARDWARE_HELP, RoleName
from pdd.process import LAUNCH_ENV

# a child's start-up may take as long as its log shows progress (weights loading, vLLM profiling):
# it fails after this long with none (`launch.wait_http`), not after a fixed total
STALL_TIMEOUT_S = 300.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a whole local deployment (router, instances, line emulator)")
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
    p.add_argument("--bandwidth-mbps", type=float, help="override the line's bandwidth")
    p.add_argument("--delay-ms", type=float, help="override the line's one-way delay")
    p.add_argument("--jitter-ms", type=float, help="override the line's one-way jitter bound")
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
    p.add_argument(
        "--devices",
        action="append",
        default=[],
        metavar="NAME=DEVICES",
        help="an instance's devices (repeatable): p0=cuda:0,1 runs p0 on GPUs 0 and 1 (on vLLM, one "
        "tensor-parallel rank each); default: the config's [engine] device, per instance where it says",
    )
    p.add_argument("--keep", action="store_true", help="keep the run directory (config, logs) after stopping")
    p.add_argument(
        "--api-key",
        default=None,
        help="the router requires `Authorization: Bearer KEY` on /v1/* (default: [router] api_key, else $PDD_API_KEY)",
    )
    p.set_defaults(func=run)


def pacing_line(dep: cfg.Deployment) -> str:
    """What pacing the deployment's instances run under, for every report to print."""
    top = dep.topology
    if top.hardware == "native":
        return "pacing: native (every instance at this machine's speed, sharing its CPU)"
    chips = ", ".join(f"{i.name} on {i.engine.hardware}" for i in dep.instances)
    return (
        f"pacing: emulated accelerators ({chips}; the spec's A for compute, B for bandwidth and memory): real "
        f"tokens in emulated time, {top.dilation:g}x slower than the chips; the line and the latency budget "
        f"stretched alike ({dep.line.bandwidth_mbps:g} Mbit/s, {dep.line.delay_ms:g} ms one-way)"
    )


def resolve(dep: cfg.Deployment, mode: str, router_port: int | None) -> cfg.Deployment:
    """The explicit deployment for this machine: instances placed, every port chosen, the
    model found (FileNotFoundError) and readable (UnsupportedCheckpoint) before anything starts."""
    from pdd.model.config import ModelConfig
    from pdd.model.store import resolve_model

    dep = cfg.with_secret(replace(dep, mode=mode))
    instances = dep.instances or cfg.instances_for_mode(dep, mode)
    sender_dcs = {i.dc for i in instances if i.role in (RoleName.PREFILL, RoleName.RELAY)}  # they send KV, handoffs
    taken = {p for i in instances for p in (i.port, i.kv_port) if p} | {dep.line.admin_port, dep.router.port}
    taken |= {parse_addr(a)[1] for i in instances for a in i.advertise.values()}
    if router_port:
        taken.add(router_port)
    draw = functools.partial(free_port, taken)
    placed = []
    for inst in instances:
        # one emulated hop per route that crosses the line: from the router's datacenter,
        # and (decode side) from those of the instances that send it KV or handoffs
        callers = {dep.router.dc} | (sender_dcs if inst.role == RoleName.MAIN else set())
        hops = {dc: inst.advertise.get(dc) or f"{dep.line.host}:{draw()}" for dc in sorted(callers - {inst.dc})}
        placed.append(replace(inst, port=inst.port or draw(), kv_port=inst.kv_port or draw(), advertise=hops))
    placed = list(groups.with_rpc_ports(tuple(placed), draw))  # (a group's ranks meet at rank 0's port)
    remote = any(i.advertise for i in placed)
    line = replace(dep.line, admin_port=(dep.line.admin_port or draw()) if remote else 0)
    port = dep.router.port if router_port is None else router_port
    router = replace(dep.router, port=port or draw())
    model_dir = resolve_model(dep.model.path)
    if any(i.engine.backend == "embedded" for i in placed):  # (the embedded engine's gate; vLLM reads the model)
        ModelConfig.from_dir(model_dir)
    model = replace(dep.model, path=str(model_dir), name=dep.model.served_name)
    return replace(dep, instances=tuple(placed), line=line, router=router, model=model)


def with_devices(dep: cfg.Deployment, given: list[str]) -> cfg.Deployment:
    """`dep` with each `NAME=DEVICES` of `--devices` on its instance: on vLLM, as many
    tensor-parallel ranks as devices unless the file chose a number (checked as the file's
    own `device` is: `cfg.check_devices`). A name no instance has is a `Mistake`."""
    chosen: dict[str, str] = {}
    for pair in given:
        name, sep, device = pair.partition("=")
        if not sep or not device:
            raise Mistake(f"--devices {pair!r}: give NAME=DEVICES (p0=cuda:0,1)")
        chosen[name] = device
    names = {i.name for i in dep.instances}
    if unknown := sorted(set(chosen) - names):
        raise Mistake(f"--devices names {unknown}, which are not instances of this deployment ({sorted(names)})")
    placed = []
    for inst in dep.instances:
        engine = inst.engine
        if inst.name in chosen:
            try:
                engine = replace(engine, device=chosen[inst.name])
                ranks = len(devices(engine.device))
                if engine.backend == "vllm" and ranks > 1 and "tensor_parallel_size" not in engine.vllm:
                    engine = replace(engine, vllm={**engine.vllm, "tensor_parallel_size": ranks})
                cfg.check_devices(engine, f"--devices {inst.name}")
            except ValueError as e:  # (ConfigError is one)
                raise Mistake(f"--devices {inst.name}: {e}" if "--devices" not in str(e) else str(e)) from None
        placed.append(replace(inst, engine=engine))
    return replace(dep, instances=tuple(placed))


class Launcher:
    def __init__(self, dep: cfg.Deployment, run_dir: Path) -> None:
        self.dep = dep
        self.run_dir = run_dir
        self.config_path = run_dir / "deployment.toml"
        self.children: list[tuple[str, Child]] = []
        self.forks = Forks(vllm=any(i.engine.backend == "vllm" for i in dep.instances))
        # in every child's environment, and said back on its /health: a server that does not
        # say it is not this launch's
        self.launch = secrets.token_hex(8)

    def _spawn(self, name: str, args: list[str], nice: int = 0) -> Child:
        log = self.run_dir / f"{name}.log"
        log.write_bytes(b"")
        proc = self._popen(name, args, log, nice)
        self.children.append((name, proc))
        print(f"process {name}: pid {proc.pid}, log {log}", flush=True)
        return proc

    def _popen(self, name: str, args: list[str], log: Path, nice: int) -> Child:
        """`pdd ARGS` as child `name` (here: forked, on this host), its output to `log`."""
        return self.forks.start(name, args, log, child_env({LAUNCH_ENV: self.launch}), nice)

    def line_shape(self) -> tuple[float, float, float]:
        """What the emulator enforces: (Mbit/s, one-way delay ms, jitter ms); here, the line's."""
        line = self.dep.line
        return line.bandwidth_mbps, line.delay_ms, line.jitter_ms

    def emulator_args(self) -> list[str]:
        """The emulator's command line: a route per advertised hop, the line's settings."""
        line, (mbps, delay, jitter) = self.dep.line, self.line_shape()
        routes = [f"--route={hop}={i.host}:{i.kv_port}" for i in self.dep.instances for hop in i.advertise.values()]
        return [
            "line",
            *routes,
            f"--bandwidth-mbps={mbps}",
            f"--delay-ms={delay}",
            f"--jitter-ms={jitter}",
            f"--admin={line.host}:{line.admin_port}",
        ]

    def _wait_http(self, name: str, proc: Child, url: str) -> None:
        try:
            wait_http(url, proc, STALL_TIMEOUT_S, self.launch, log_progress(self.run_dir / f"{name}.log"))
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
        line = dep.line
        if line.admin_port:
            proc = self._spawn("line", self.emulator_args())
            self._wait_http("line", proc, f"http://{line.host}:{line.admin_port}/health")
            mbps, delay, jitter = self.line_shape()
            print(
                f"line: {mbps:g} Mbit/s, {delay:g} ms ± {jitter:g} ms one-way, "
                f"admin http://{line.host}:{line.admin_port}",
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
            if name != "line":
                inst = dep.instance(name)
                self._wait_http(name, proc, f"http://{inst.host}:{inst.port}/health")
        proc = self._spawn("router", ["router", "--config", conf])
        url = f"http://{dep.router.host}:{dep.router.port}"
        self._wait_http("router", proc, f"{url}/ready")  # (/health: alive; /ready: every role reached)
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
    line = replace(dep.line, **{k: v for k, v in given if v is not None})
    placed = {"hardware": args.hardware, "dilation": args.dilation, "prefill": args.prefill, "relay": args.relay}
    placed["main"] = args.main
    try:
        topology = replace(dep.topology, **{k: v for k, v in placed.items() if v is not None})
    except ValueError as e:
        raise Mistake(str(e)) from None
    dep = cfg.in_emulated_time(replace(dep, topology=topology, line=line, policy=policy))
    router = dep.router if args.api_key is None else replace(dep.router, api_key=args.api_key)
    model = dep.model if args.model is None else replace(dep.model, path=args.model)
    try:
        dep = resolve(replace(dep, router=router, model=model), mode, args.port)
    except (FileNotFoundError, ValueError) as e:  # no such model, or one pdd cannot run
        raise Mistake(str(e)) from None
    dep = with_devices(dep, args.devices)
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
