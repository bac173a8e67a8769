"""The deployment under soak: `pdd up`'s launcher, plus kill, restart, RSS and pages.

A restart runs the same `pdd serve --config deployment.toml --instance NAME` again, so
the instance comes back on its own ports with the deployment's secret, as an operator's
supervisor would bring it back; the router and the peers must find it by themselves.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pdd import config as cfg
from pdd.lab.deploy import Launcher
from pdd.lab.launch import Child


@dataclass
class Crash:
    """A child that exited without being killed by the soak."""

    name: str
    code: int | None
    at: float
    log_tail: str


class Cluster(Launcher):
    def __init__(self, dep: cfg.Deployment, run_dir: Path) -> None:
        super().__init__(dep, run_dir)
        self.peak_rss_kib: dict[str, int] = {}
        self.lives: dict[str, int] = {}
        self.crashes: list[Crash] = []
        self._killed: set[int] = set()  # pids the soak killed on purpose

    @property
    def router_url(self) -> str:
        return f"http://{self.dep.router.host}:{self.dep.router.port}"

    @property
    def line_admin(self) -> str | None:
        line = self.dep.line
        return f"http://{line.host}:{line.admin_port}" if line.admin_port else None

    def instance_url(self, name: str) -> str:
        inst = self.dep.instance(name)
        return f"http://{inst.host}:{inst.port}"

    def proc(self, name: str) -> Child:
        return next(p for n, p in reversed(self.children) if n == name)

    def _spawn(self, name: str, args: list[str], nice: int = 0) -> Child:
        """Keep an earlier life's log (`NAME.life1.log`, ...) before the next one starts."""
        self.lives[name] = self.lives.get(name, 0) + 1
        log = self.run_dir / f"{name}.log"
        if log.exists():
            log.rename(self.run_dir / f"{name}.life{self.lives[name] - 1}.log")
        self.children = [(n, p) for n, p in self.children if n != name]
        return super()._spawn(name, args, nice)

    # ---- chaos ---------------------------------------------------------------------------
    def kill(self, name: str) -> None:
        """kill -9: no goodbye to peers, as a crashed host gives none."""
        proc = self.proc(name)
        self.sample_rss()  # VmHWM of this life is gone with the process
        self._killed.add(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def restart(self, name: str) -> None:
        inst = self.dep.instance(name)
        nice = self.dep.topology.prefill_nice if inst.role == "prefill" else 0
        self._spawn(name, ["serve", "--config", str(self.config_path), "--instance", name], nice)

    async def wait_rejoined(self, name: str, timeout_s: float) -> bool:
        """True once the instance answers /health and the router counts it healthy again."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                try:
                    own = await client.get(f"{self.instance_url(name)}/health")
                    if own.status_code == 200 and await self._router_healthy(client, name):
                        return True
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        return False

    async def _router_healthy(self, client: httpx.AsyncClient, name: str) -> bool:
        stats = (await client.get(f"{self.router_url}/pdd/stats")).json()
        return bool(stats.get("instances", {}).get(name, {}).get("healthy"))

    async def all_healthy(self, timeout_s: float) -> bool:
        """Wait until the router counts every instance healthy."""
        checks = [self.wait_rejoined(i.name, timeout_s) for i in self.dep.instances]
        return all(await asyncio.gather(*checks))

    # ---- watching ------------------------------------------------------------------------
    def sample_rss(self) -> None:
        """Fold each live child's peak resident set (VmHWM: this life's high-water mark) in."""
        for name, proc in self.children:
            peak = _vm_hwm_kib(proc.pid)
            if peak is not None:
                self.peak_rss_kib[name] = max(self.peak_rss_kib.get(name, 0), peak)

    def check_crashes(self, now: float) -> list[Crash]:
        """Children that exited on their own since the last check (each reported once)."""
        found = []
        for name, proc in self.children:
            if proc.poll() is not None and proc.pid not in self._killed:
                self._killed.add(proc.pid)  # reported
                found.append(Crash(name, proc.returncode, now, self.tail(name, 40)))
        self.crashes += found
        return found

    async def pages(self) -> dict[str, dict[str, Any]]:
        """Each instance's KV pool: pages, free, cached, and held (by requests); or the error
        that kept it from answering."""
        out: dict[str, dict[str, Any]] = {}
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            for inst in self.dep.instances:
                try:
                    kv = (await client.get(f"{self.instance_url(inst.name)}/pdd/stats")).json()["kv"]
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    out[inst.name] = {"error": f"{type(exc).__name__}: {exc}"}
                    continue
                out[inst.name] = {**kv, "held": kv["pages"] - kv["free"] - kv["cached"]}
        return out

    async def settled_pages(self, timeout_s: float) -> tuple[dict[str, dict[str, Any]], float]:
        """Pages once no request holds any, or what is still held when time runs out
        (after every request has ended, a held page is a leaked page); and how long
        they took to come back."""
        start = time.monotonic()
        while True:
            pages = await self.pages()
            waited = time.monotonic() - start
            if all(p.get("held") == 0 for p in pages.values()) or waited > timeout_s:
                return pages, waited
            await asyncio.sleep(0.5)


def _vm_hwm_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def self_peak_rss_kib() -> int:
    """The soak client's own peak (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
