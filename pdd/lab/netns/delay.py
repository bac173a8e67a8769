"""The lab line's delay, jitter and loss: a packet-level hop in C (`delay.c`) on a TUN
device in the line namespace, compiled here on first use with the system's C compiler
(cached by its source's hash). Each packet the line forwards passes through it, so the
kernels at both ends see the round trip: TCP's windows, slow start and congestion
control are theirs, as on a real long line. (This kernel has no netem qdisc, and a hop
that ends TCP, as `pdd line` does, hides the round trip from the sender.)"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("delay.c")
DEVICE = "dly0"
TABLE = "100"  # the line's routing table that sends forwarded packets into the hop


class DelayError(RuntimeError):
    """The hop cannot be built here (no C compiler, a compile error)."""


@dataclass(frozen=True)
class LineDelay:
    """What the hop holds each packet for, one way: `delay_ms` plus a uniform draw in
    [0, `jitter_ms`] (the order kept), and the share of packets it drops."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or not 0 <= self.loss < 1:
            raise ValueError("delay and jitter must be >= 0 ms, loss in [0, 1)")

    @property
    def active(self) -> bool:
        return bool(self.delay_ms or self.jitter_ms or self.loss)

    def args(self) -> list[str]:
        """The hop's command line after its binary."""
        us = (round(self.delay_ms * 1000), round(self.jitter_ms * 1000))
        return [DEVICE, str(us[0]), str(us[1]), str(round(self.loss * 1_000_000)), str(self.seed)]


def binary() -> Path:
    """The compiled hop, built once per version of its source."""
    source = SOURCE.read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdd"
    path = cache / f"pdd-delay-{hashlib.sha256(source).hexdigest()[:16]}"
    if path.exists():
        return path
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise DelayError("the lab's delay hop needs a C compiler (cc or gcc)")
    cache.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}")
    done = subprocess.run(
        [cc, "-O2", "-Wall", "-Werror", "-o", str(partial), str(SOURCE)], capture_output=True, text=True, timeout=120
    )
    if done.returncode:
        raise DelayError(f"cannot compile {SOURCE.name}: {done.stderr.strip()}")
    partial.replace(path)  # whole or not at all, for a concurrent lab
    return path
