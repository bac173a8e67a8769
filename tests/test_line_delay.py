"""The lab line's delay hop (`pdd.lab.netns.delay`): real delay on a real kernel path.

Through a lab line with a one-way delay, `ping` shows the round trip; the kernels' TCP
sees it, so a connection whose window is capped carries no more than that window per
round trip while one left to autotuning grows past it; a loss rate drops that share of
packets. Needs root (network namespaces); in CI a skip is a failure (conftest.py).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time

import pytest

from pdd.lab.netns.delay import LineDelay
from pdd.lab.netns.lab import lab, run_in

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

ONE_WAY_MS = 10.0
CAPPED_SNDBUF = 64 * 1024  # as pdd's KV connections set it today; Linux doubles it: 128 KiB in flight at most
SEND_S = 2.0


def _ping(ns: str, addr: str, count: int, interval: float, which: str = "avg") -> tuple[float, int]:
    """ping's `which` round trip (min or avg) in ms, and how many of `count` were answered."""
    run = subprocess.run(["ip", "netns", "exec", ns, "ping", "-q", "-c", str(count), "-i", str(interval), addr],
                         capture_output=True, text=True, timeout=60)
    out, found = run.stdout, re.search(r"(\d+) received", run.stdout)
    assert found, run.stdout + run.stderr  # (ping itself is Debian's iputils-ping: scripts/test.sh installs it)
    received = int(found.group(1))
    rtt = re.search(r"= ([\d.]+)/([\d.]+)/", out)
    return (float(rtt.group(1 if which == "min" else 2)) if rtt else float("nan")), received


def _rate(lab_, sndbuf: int | None) -> float:
    """MB/s one TCP connection from a to b carries for SEND_S, its send buffer capped or not."""
    a, b = lab_.hosts["a"], lab_.hosts["b"]
    server = run_in(b.ns, lambda: socket.create_server((b.addr, 0)))
    port = server.getsockname()[1]
    received = [0]

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1 << 20):
                received[0] += len(data)

    reader = threading.Thread(target=sink, daemon=True)
    reader.start()

    def send() -> float:
        sock = socket.socket()
        if sndbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        sock.connect((b.addr, port))
        chunk, began = b"\0" * (1 << 20), time.monotonic()
        while time.monotonic() - began < SEND_S:
            sock.sendall(chunk)
        sock.close()
        return time.monotonic() - began

    try:
        took = run_in(a.ns, send)
        reader.join(30)
    finally:
        server.close()
    return received[0] / took / 1e6


def test_the_line_delays_every_packet_and_tcp_sees_the_round_trip():
    with lab({"a": "A", "b": "B"}, line_mbps=2000.0, delay=LineDelay(delay_ms=ONE_WAY_MS)) as built:
        a, b = built.hosts["a"], built.hosts["b"]
        _ping(a.ns, b.addr, 1, 0.05)  # (the path's first packet waits for neighbour discovery)
        rtt_ms, received = _ping(a.ns, b.addr, 10, 0.05, "min")
        capped, tuned = _rate(built, CAPPED_SNDBUF), _rate(built, None)
    window_rate = 2 * CAPPED_SNDBUF / (2 * ONE_WAY_MS / 1000) / 1e6  # a window per round trip, MB/s
    print(f"\nping {rtt_ms:.2f} ms at least; one connection: {capped:.1f} MB/s with a {2 * CAPPED_SNDBUF >> 10} "
          f"KiB window (window / RTT = {window_rate:.1f}), {tuned:.1f} MB/s autotuned")
    # the fastest round trip: a busy machine can delay the hop's process, never speed it
    assert received == 10 and 2 * ONE_WAY_MS <= rtt_ms <= 2 * ONE_WAY_MS + 3, (rtt_ms, received)
    assert capped <= 1.3 * window_rate, "a capped window carried more than a window per round trip: no delay seen"
    assert tuned >= 3 * capped, "autotuning did not grow the window past the cap"


def test_the_line_drops_its_share_and_jitter_keeps_the_order():
    with lab({"a": "A", "b": "B"}, line_mbps=1000.0, delay=LineDelay(delay_ms=1.0, jitter_ms=2.0, loss=0.1)) as built:
        a, b = built.hosts["a"], built.hosts["b"]
        rtt_ms, received = _ping(a.ns, b.addr, 300, 0.005)
        built.hop.terminate()
        said = built.hop.communicate(timeout=10)[1]
    forwarded, dropped = (int(n) for n in re.search(r"(\d+) forwarded, (\d+) dropped", said).groups())
    share = dropped / (forwarded + dropped)
    print(f"\nping {rtt_ms:.2f} ms over 1 ms + up to 2 ms each way, {received} of 300 answered; "
          f"the hop dropped {dropped} of {forwarded + dropped} ({share:.1%})")
    assert 0.05 <= share <= 0.15, said  # 10 % of ~540 packets
    assert 2.0 <= rtt_ms <= 6.5 + 1.0, rtt_ms  # (2 x 1 ms, plus jitter's mean 2 x 1 ms, kept in order)
    assert 300 * 0.7 <= received <= 300 * 0.9  # a reply needs both ways: 0.9 x 0.9 of them
