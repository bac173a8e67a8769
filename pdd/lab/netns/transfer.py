"""`pdd bench transfer`: pdd's KV connections over a long line, against iperf3 on the same path.

Two hosts in network namespaces (`pdd.lab.netns.lab`), one per site, joined by a line of
`--bandwidth-mbps` each way (tbf) whose packet hop holds every packet half of each
`--rtt-ms` (`pdd.lab.netns.delay`): the hosts' TCP sees the round trip. On each, pdd's KV
path sends `--mbytes` of KV_LAYER frames from a PeerPool in A (as P sends them, on its
urgent KV connections, authenticated, striped over each of `--streams`) to a framed
server in a process of its own in B, and iperf3 (Debian's package) sends for about as
long with as many streams. It prints MB/s for each and their ratio, and, on the same
line, how many background KV frames reached B while urgent KV did (background KV
flowing, then a quarter as much urgent KV). Needs root; numbers are printed, never
asserted.

`--loopback` measures the frame layer alone instead, between two processes on this
machine (`pdd.lab.netns.transfer_loopback`): raw TCP, pdd's frames with and without
authentication, and the whole KV path (a prompt's KV exported, encoded, framed, decoded
and imported) on the tiny model and on realistic pages (`--model-shape`), MB/s at the
receiver. `--compress` and `--lossy` (`pdd.lab.netns.transfer_lossy`) measure lossless
codecs and int8 KV on the tiny model's KV. Those three need no root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from pdd.config import PolicySpec
from pdd.lab.bench import options
from pdd.lab.netns.transfer_loopback import SHAPES
from pdd.lab.netns.transfer_receiver import KEY, Receiver


def _floats(value: str) -> list[float]:
    return [float(v) for v in value.split(",") if v.strip()]


def _ints(value: str) -> list[int]:
    out = [int(v) for v in value.split(",") if v.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"stream counts are integers of at least 1, not {value!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bandwidth-mbps", type=float, default=10_000.0, help="the line's rate each way (default 10000)")
    p.add_argument("--rtt-ms", type=_floats, default=[0.0, 5.0, 20.0, 50.0], help="round trips (default 0,5,20,50)")
    p.add_argument("--mbytes", type=int, default=256, help="KV sent per measurement, MB (default 256)")
    p.add_argument("--frame-kib", type=int, default=1024, help="one KV_LAYER frame's payload, KiB (default 1024)")
    p.add_argument(
        "--streams",
        type=_ints,
        default=[1, 4],
        help="TCP streams: pdd's KV connections (stripes) and iperf3's -P, each count in turn (default 1,4)",
    )
    p.add_argument("--loopback", action="store_true", help="the frame layer alone, two processes on loopback")
    p.add_argument(
        "--intra",
        choices=("mooncake",),
        help="with --loopback: instead, KV frames placed through that transfer engine, beside its own benchmark tool",
    )
    p.add_argument(
        "--compress",
        action="store_true",
        help="lossless codecs (zlib; zstd and lz4 where installed) on KV the tiny model computes, fp32 and bf16",
    )
    p.add_argument(
        "--lossy",
        action="store_true",
        help="what [line] lossy_kv = int8 changes: greedy tokens, the next token's logprobs, bytes (tiny model)",
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=1024, help="--loopback's KV path, --compress, --lossy: tokens a prompt"
    )
    p.add_argument(
        "--model-shape",
        choices=(*SHAPES, "both"),
        default="both",
        help="--loopback's KV path: the tiny model (fp32, 4 KiB of KV a token), realistic pages "
        "(Qwen2.5-0.5B's KV geometry, random weights, bf16, 12 KiB a token), or both (default)",
    )
    p.add_argument(
        "--kv-chunk-tokens",
        type=int,
        default=PolicySpec.kv_chunk_tokens,
        help=f"--loopback's KV path: tokens a chunk (its layers a frame, up to 1 MiB), as P's [policy] kv_chunk_tokens "
        f"(default {PolicySpec.kv_chunk_tokens}, P's)",
    )
    p.add_argument("--repeats", type=int, default=3, help="--loopback: runs of each, their median (default 3)")
    p.add_argument("--prompts", type=int, default=32, help="--lossy: prompts (random token IDs, default 32)")
    p.add_argument("--output-tokens", type=int, default=32, help="--lossy: greedy tokens decoded each (default 32)")
    options.out(p)


def _kv_mb_per_s(net, args: argparse.Namespace, streams: int) -> float:
    """MB/s of KV frames from host a's PeerPool (P's urgent KV connections) to a framed
    server in a process of its own on host b, as MD receives them."""
    from pdd.lab.netns.lab import run_in
    from pdd.policy.transfer import Priority

    a, b = net.hosts["a"], net.hosts["b"]
    frame_bytes = args.frame_kib * 1024
    frames = max(1, args.mbytes * 1_000_000 // frame_bytes)
    blob = b"\x01" * frame_bytes

    async def send(port: int) -> None:
        pool = _pool(a.addr, b.addr, port, streams)
        try:
            for _ in range(frames):
                await pool.send_bulk("md0", Priority.URGENT, kv=("r", blob))
        finally:
            await pool.aclose()

    with Receiver("auth", frames, frame_bytes, ns=b.ns, host=b.addr) as far:
        run_in(a.ns, lambda: asyncio.run(send(far.port)))
        return far.mb_per_s()


def _background_during_urgent(net, args: argparse.Namespace, streams: int) -> tuple[int, int]:
    """Background KV frames that reached host b between its first and last urgent frame
    (and after the last: background was still flowing, so the first count means something),
    where P's PeerPool sends `--mbytes` of background KV and, once that flows, a quarter
    as much urgent KV striped over `streams` (what `tests/test_peers.py` asserts on a
    slow line, on this one)."""
    from pdd.lab.netns.lab import run_in
    from pdd.policy.transfer import Priority

    a, b = net.hosts["a"], net.hosts["b"]
    frame_bytes = args.frame_kib * 1024
    background, urgent = _overtaking_frames(args)
    blob = b"\x01" * frame_bytes

    async def send(port: int) -> None:
        pool = _pool(a.addr, b.addr, port, streams)
        sent = [0]

        async def kv(priority: Priority, frames: int) -> None:
            for _ in range(frames):
                await pool.send_bulk("md0", priority, kv=("r", blob))
                sent[0] += 1

        try:
            flowing = asyncio.ensure_future(kv(Priority.BACKGROUND, background))
            while sent[0] < 8 and not flowing.done():  # background fills the line first
                await asyncio.sleep(0.001)
            await kv(Priority.URGENT, urgent)
            await flowing
        finally:
            await pool.aclose()

    with Receiver("order", background + urgent, frame_bytes, ns=b.ns, host=b.addr) as far:
        run_in(a.ns, lambda: asyncio.run(send(far.port)))
        order = far.order()
    first, last = order.index("u"), order.rindex("u")
    return order[first:last].count("b"), order[last:].count("b")


def _overtaking_frames(args: argparse.Namespace) -> tuple[int, int]:
    """Background and urgent frames `_background_during_urgent` sends."""
    background = max(8, args.mbytes * 1_000_000 // (args.frame_kib * 1024))
    return background, max(2, background // 4)


def _pool(a_addr: str, b_addr: str, port: int, streams: int) -> Any:
    """P's PeerPool on host a (P0 in A), to MD0 on host b (in B) at `port`, `streams` urgent stripes."""
    from pdd import config as cfg
    from pdd.instance.peers import PeerPool

    async def ignore(_peer: str, _body: object) -> None:
        pass

    p0 = cfg.InstanceSpec("p0", "prefill", "A", host=a_addr)
    md0 = cfg.InstanceSpec("md0", "main", "B", host=b_addr, kv_port=port)
    dep = cfg.Deployment(instances=(p0, md0))
    return PeerPool(p0, lambda: dep, KEY, ignore, lambda _peer: None, stripes=streams)


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
    from pdd.lab.netns.delay import LineDelay
    from pdd.lab.netns.lab import lab

    if args.loopback and args.intra:
        from pdd.lab.netns.transfer_intra import intra

        return intra(args)
    if args.loopback:
        from pdd.lab.netns.transfer_loopback import loopback

        return loopback(args)
    if args.compress or args.lossy:
        from pdd.lab.netns.transfer_lossy import compress, lossy

        return compress(args) if args.compress else lossy(args)
    if shutil.which("iperf3") is None:
        print("pdd bench transfer: needs iperf3 (apt-get install iperf3)")
        return 2
    rows = []
    for rtt in args.rtt_ms:
        with lab({"a": "A", "b": "B"}, args.bandwidth_mbps, delay=LineDelay(delay_ms=rtt / 2)) as net:
            for n in args.streams:
                kv = _kv_mb_per_s(net, args, n)
                iperf = _iperf_mb_per_s(net, max(3.0, args.mbytes / max(kv, 1.0)), n)
                during, after = _background_during_urgent(net, args, n)
                row = {
                    "rtt_ms": rtt,
                    "streams": n,
                    "kv_mb_s": kv,
                    "iperf3_mb_s": iperf,
                    "background_during_urgent": during,
                    "background_after": after,
                }
                rows.append(row)
                print(
                    f"rtt {rtt:g} ms, {n} streams: pdd KV {kv:.1f} MB/s, iperf3 {iperf:.1f}, "
                    f"background frames during urgent {during} ({after} after)",
                    flush=True,
                )
    title = f"KV over a {args.bandwidth_mbps:g} Mbit/s line ({args.mbytes} MB, {args.frame_kib} KiB frames)"
    table = Table(title=title)
    background, urgent = _overtaking_frames(args)
    overtaking = f"background frames during {urgent} urgent (after; of {background})"
    for col in ("RTT ms", "streams", "pdd KV MB/s", "iperf3 MB/s", "KV / iperf3", overtaking):
        table.add_column(col, justify="right")
    for r in rows:
        ratio = r["kv_mb_s"] / r["iperf3_mb_s"] if r["iperf3_mb_s"] else float("nan")
        table.add_row(
            f"{r['rtt_ms']:g}",
            str(r["streams"]),
            f"{r['kv_mb_s']:.1f}",
            f"{r['iperf3_mb_s']:.1f}",
            f"{ratio:.2f}",
            f"{r['background_during_urgent']} ({r['background_after']})",
        )
    Console().print(table)
    if args.out:
        args.out.write_text(
            json.dumps({"config": {k: str(v) for k, v in vars(args).items() if k != "func"}, "rows": rows}, indent=2)
            + "\n"
        )
    return 0
