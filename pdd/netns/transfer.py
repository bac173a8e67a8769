"""`pdd bench transfer`: pdd's KV connections over a long line, against iperf3 on the same path.

Two hosts in network namespaces (`pdd.netns.lab`), one per site, joined by a line of
`--bandwidth-mbps` each way (tbf) whose packet hop holds every packet half of each
`--rtt-ms` (`pdd.netns.delay`): the hosts' TCP sees the round trip. On each, pdd's KV
path sends `--mbytes` of KV_LAYER frames from a PeerPool in A (as P sends them, on its
urgent KV connection, authenticated) to a framed server in B, and iperf3 (Debian's
package) sends for as long with one stream, then with `--streams` if more. It prints
MB/s for each and their ratio. Needs root; numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import time

from rich.console import Console
from rich.table import Table

from pdd.bench import options

KEY = b"k" * 32


def _floats(value: str) -> list[float]:
    return [float(v) for v in value.split(",") if v.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bandwidth-mbps", type=float, default=10_000.0, help="the line's rate each way (default 10000)")
    p.add_argument("--rtt-ms", type=_floats, default=[0.0, 5.0, 20.0, 50.0], help="round trips (default 0,5,20,50)")
    p.add_argument("--mbytes", type=int, default=256, help="KV sent per measurement, MB (default 256)")
    p.add_argument("--frame-kib", type=int, default=1024, help="one KV_LAYER frame's payload, KiB (default 1024)")
    p.add_argument("--streams", type=int, default=4, help="iperf3's parallel streams beside one (default 4)")
    options.out(p)


def _kv_mb_per_s(net, args: argparse.Namespace) -> float:
    """MB/s of KV frames from host a's PeerPool (P's urgent KV connection) to a framed
    server on host b: one event loop in a's namespace, the server's socket made in b's."""
    from pdd import config as cfg
    from pdd.instance.peers import PeerPool
    from pdd.netns.lab import run_in
    from pdd.policy.transfer import Priority
    from pdd.transfer.wire import MsgType, serve, server_handshake

    a, b = net.hosts["a"], net.hosts["b"]
    listen = run_in(b.ns, lambda: socket.create_server((b.addr, 0)))
    frames = max(1, args.mbytes * 1_000_000 // (args.frame_kib * 1024))
    blob = b"\x01" * (args.frame_kib * 1024)

    async def main() -> float:
        done, received = asyncio.Event(), [0]

        async def far_end(conn) -> None:
            await server_handshake(conn)
            while True:
                if (await conn.next_frame()).type == MsgType.KV_LAYER:
                    received[0] += 1
                    if received[0] == frames:
                        done.set()

        async def ignore(_peer: str, _body: object) -> None:
            pass

        server = await serve(far_end, "", 0, KEY, sock=listen)
        p0 = cfg.InstanceSpec("p0", "prefill", "A", host=a.addr)
        md0 = cfg.InstanceSpec("md0", "main", "B", host=b.addr, kv_port=listen.getsockname()[1])
        dep = cfg.Deployment(instances=(p0, md0))
        pool = PeerPool(p0, lambda: dep, KEY, ignore, lambda _peer: None)
        try:
            await pool.get("md0", Priority.URGENT)
            began = time.monotonic()
            for _ in range(frames):
                await pool.send_bulk("md0", Priority.URGENT, kv=("r", blob))
            await done.wait()
            return time.monotonic() - began
        finally:
            pool.close()
            server.close()

    return frames * len(blob) / run_in(a.ns, lambda: asyncio.run(main())) / 1e6


def _iperf_mb_per_s(net, seconds: float, streams: int) -> float:
    a, b = net.hosts["a"], net.hosts["b"]
    server = subprocess.Popen(
        ["ip", "netns", "exec", b.ns, "iperf3", "-s", "-1", "-B", b.addr],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.3)
        out = subprocess.run(
            ["ip", "netns", "exec", a.ns, "iperf3", "-c", b.addr, "-J", "-t", f"{seconds:g}", "-P", str(streams)],
            capture_output=True,
            text=True,
            timeout=seconds + 30,
        )
        return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 8e6
    finally:
        server.kill()
        server.wait()


def run(args: argparse.Namespace) -> int:
    from pdd.netns.delay import LineDelay
    from pdd.netns.lab import lab

    if shutil.which("iperf3") is None:
        print("pdd bench transfer: needs iperf3 (apt-get install iperf3)")
        return 2
    rows = []
    for rtt in args.rtt_ms:
        with lab({"a": "A", "b": "B"}, args.bandwidth_mbps, delay=LineDelay(delay_ms=rtt / 2)) as net:
            kv = _kv_mb_per_s(net, args)
            seconds = max(3.0, args.mbytes / max(kv, 1.0))
            one = _iperf_mb_per_s(net, seconds, 1)
            many = _iperf_mb_per_s(net, seconds, args.streams) if args.streams > 1 else one
        rows.append({"rtt_ms": rtt, "kv_mb_s": kv, "iperf3_1_mb_s": one, "iperf3_n_mb_s": many})
        print(
            f"rtt {rtt:g} ms: pdd KV {kv:.1f} MB/s, iperf3 {one:.1f} (1 stream), {many:.1f} ({args.streams})",
            flush=True,
        )
    title = f"KV over a {args.bandwidth_mbps:g} Mbit/s line ({args.mbytes} MB, {args.frame_kib} KiB frames)"
    table = Table(title=title)
    for col in ("RTT ms", "pdd KV MB/s", "iperf3 1 stream", f"iperf3 {args.streams} streams", "KV / iperf3 (1)"):
        table.add_column(col, justify="right")
    for r in rows:
        ratio = r["kv_mb_s"] / r["iperf3_1_mb_s"] if r["iperf3_1_mb_s"] else float("nan")
        table.add_row(
            f"{r['rtt_ms']:g}",
            f"{r['kv_mb_s']:.1f}",
            f"{r['iperf3_1_mb_s']:.1f}",
            f"{r['iperf3_n_mb_s']:.1f}",
            f"{ratio:.2f}",
        )
    Console().print(table)
    if args.out:
        args.out.write_text(
            json.dumps({"config": {k: str(v) for k, v in vars(args).items() if k != "func"}, "rows": rows}, indent=2)
            + "\n"
        )
    return 0
