"""`pdd bench transfer`: pdd's KV connections over a long line, against iperf3 on the same path.

Two hosts in network namespaces (`pdd.netns.lab`), one per site, joined by a line of
`--bandwidth-mbps` each way (tbf) whose packet hop holds every packet half of each
`--rtt-ms` (`pdd.netns.delay`): the hosts' TCP sees the round trip. On each, pdd's KV
path sends `--mbytes` of KV_LAYER frames from a PeerPool in A (as P sends them, on its
urgent KV connection, authenticated) to a framed server in B, and iperf3 (Debian's
package) sends for as long with one stream, then with `--streams` if more. It prints
MB/s for each and their ratio. Needs root; numbers are printed, never asserted.

`--loopback` measures the frame layer alone instead, between two processes on this
machine: raw TCP, then pdd's frames with and without authentication (`--frame-kib`
frames after the handshake, as a KV connection sends them), MB/s at the receiver.
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
    p.add_argument("--loopback", action="store_true", help="the frame layer alone, two processes on loopback")
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


def _receiver(kind: str, frames: int, frame_bytes: int, ready, result) -> None:
    """A process that takes one connection and reports the MB/s it received at."""

    async def main() -> None:
        from pdd.transfer.wire import serve, server_handshake

        done = asyncio.Event()

        async def framed(conn) -> None:
            await server_handshake(conn)
            await conn.next_frame()
            began = time.monotonic()  # from the first frame: the handshake is not the rate
            for _ in range(frames - 1):
                await conn.next_frame()
            result.put((frames - 1) * frame_bytes / (time.monotonic() - began) / 1e6)
            done.set()

        async def raw(reader: asyncio.StreamReader, _writer) -> None:
            first = got = len(await reader.read(1 << 22))
            began = time.monotonic()
            while got < frames * frame_bytes:
                got += len(await reader.read(1 << 22))
            result.put((got - first) / (time.monotonic() - began) / 1e6)
            done.set()

        if kind == "raw":
            server = await asyncio.start_server(raw, "127.0.0.1", 0, limit=1 << 24)
        else:
            server = await serve(framed, "127.0.0.1", 0, KEY if kind == "auth" else None)
        ready.put(server.sockets[0].getsockname()[1])
        await done.wait()
        server.close()

    asyncio.run(main())


def _loopback_mb_per_s(kind: str, frames: int, frame_bytes: int) -> float:
    import multiprocessing

    from pdd.transfer.messages import Hello, to_dict
    from pdd.transfer.wire import MsgType, connect

    ctx = multiprocessing.get_context("spawn")
    ready, result = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(kind, frames, frame_bytes, ready, result))
    proc.start()
    port, blob = ready.get(timeout=60), b"\x01" * frame_bytes

    async def send() -> None:
        if kind == "raw":
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(frames):
                writer.write(blob)
                await writer.drain()
            writer.close()
            return
        hello = Hello("prefill", "bench", channel="urgent")
        conn, _ = await connect("127.0.0.1", port, KEY if kind == "auth" else None, lambda v: to_dict(hello, v))
        for _ in range(frames):
            await conn.send(MsgType.KV_LAYER, blob)
        conn.close()

    try:
        asyncio.run(send())
        return float(result.get(timeout=300))
    finally:
        proc.join(30)


def _loopback(args: argparse.Namespace) -> int:
    frame_bytes = args.frame_kib * 1024
    frames = max(1, args.mbytes * 1_000_000 // frame_bytes)
    rates = {kind: _loopback_mb_per_s(kind, frames, frame_bytes) for kind in ("raw", "auth", "plain")}
    title = f"The frame layer on loopback, two processes ({args.mbytes} MB of {args.frame_kib} KiB frames)"
    table = Table(title=title)
    for col in ("", "MB/s", "x raw TCP"):
        table.add_column(col, justify="right")
    for kind, label in (("raw", "raw TCP"), ("auth", "pdd frames, authenticated"), ("plain", "pdd frames, no key")):
        table.add_row(label, f"{rates[kind]:.0f}", f"{rates[kind] / rates['raw']:.2f}")
    Console().print(table)
    if args.out:
        args.out.write_text(json.dumps({"loopback_mb_s": rates, "frame_kib": args.frame_kib}, indent=2) + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    from pdd.netns.delay import LineDelay
    from pdd.netns.lab import lab

    if args.loopback:
        return _loopback(args)
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
