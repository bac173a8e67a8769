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
machine: raw TCP (a `recv_into` loop into one buffer), then pdd's frames with and
without authentication (`--frame-kib` frames after the handshake, as a KV connection
sends them), and the whole KV path (a prompt's KV exported and encoded as P does, framed,
decoded and imported as MD does), MB/s at the receiver. `--compress` measures lossless codecs on the KV the
tiny model computes (whether they pay on a 1 or 10 Gbit/s line); `--lossy`, what
`[link] lossy_kv = "int8"` changes (greedy tokens, logprobs, bytes). Those two need no root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from pdd.lab.bench import options

KEY = b"k" * 32


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
        "--compress",
        action="store_true",
        help="lossless codecs (zlib; zstd and lz4 where installed) on KV the tiny model computes, fp32 and bf16",
    )
    p.add_argument(
        "--lossy",
        action="store_true",
        help="what [link] lossy_kv = int8 changes: greedy tokens, the next token's logprobs, bytes (tiny model)",
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=1024, help="--loopback's KV path, --compress, --lossy: tokens a prompt"
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

    with _Receiver("auth", frames, frame_bytes, ns=b.ns, host=b.addr) as far:
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

    with _Receiver("order", background + urgent, frame_bytes, ns=b.ns, host=b.addr) as far:
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


def _receive(
    kind: str, frames: int, frame_bytes: int, ns: str | None, host: str, prompt_tokens: int, ready, result
) -> None:
    """A process that takes connections on `host` (in namespace `ns`) until `frames`
    frames of `frame_bytes` are in, and reports the MB/s it received them at, from the
    first frame on (the handshake is not the rate). `raw`: plain TCP read into one
    preallocated buffer (`recv_into`), what the kernel hands one process; `auth` and
    `plain`: pdd's frames, with and without a key; `kv`: authenticated frames of a
    `prompt_tokens` prompt's KV, each decoded and imported as MD does; `order`: which
    channel each frame came on ("u"rgent, "b"ackground), in order of arrival."""
    if ns:
        from pdd.lab.netns.lab import enter

        enter(ns)
    if kind == "raw":
        listen = socket.create_server((host, 0))
        ready.put(listen.getsockname()[1])
        conn, _ = listen.accept()
        buf = memoryview(bytearray(4 << 20))
        got = first = conn.recv_into(buf)
        began = time.monotonic()
        while got < frames * frame_bytes:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n
        result.put((got - first) / (time.monotonic() - began) / 1e6)
        conn.close()
        return

    async def main() -> None:
        from pdd.transfer.wire import serve, server_handshake

        done, count, began, open_conns = asyncio.Event(), [0], [0.0], [0]
        land = _importer(prompt_tokens) if kind == "kv" else None
        order: list[str] = []  # `order`: each frame's channel, "u" or "b", in order of arrival

        async def framed(conn) -> None:
            open_conns[0] += 1
            try:
                channel = (await server_handshake(conn)).get("channel", "")[:1]
                while True:  # until the sender closes its end
                    frame = await conn.next_frame()
                    if land is not None:
                        land(frame.payload)
                    order.append(channel)
                    count[0] += 1
                    if count[0] == 1:
                        began[0] = time.monotonic()
                    elif count[0] == frames:
                        done.set()
            finally:
                open_conns[0] -= 1

        server = await serve(framed, host, 0, None if kind == "plain" else KEY)
        ready.put(server.sockets[0].getsockname()[1])
        await done.wait()
        result.put(
            "".join(order) if kind == "order" else (frames - 1) * frame_bytes / (time.monotonic() - began[0]) / 1e6
        )
        server.close()
        for _ in range(1000):  # the sender closes its connections: their handlers end
            if not open_conns[0]:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())


def _importer(prompt_tokens: int) -> Any:
    """What MD does with a KV frame of a `prompt_tokens` prompt, as a function of its
    payload: decode it and import it into a reservation (then abort it, freeing its pages)."""
    import torch

    from pdd.kv import codec
    from pdd.sampling import SamplingParams

    torch.set_num_threads(1)  # (one core a process, as the frame layer: two of torch's threads each ran at 0.17x)
    engine = _engine(prompt_tokens // 16 + 8)
    prompt, count = _prompt(prompt_tokens), [0]

    def land(payload: Any) -> None:
        rid = f"r{count[0]}"
        count[0] += 1
        engine.reserve(rid, prompt, SamplingParams(max_tokens=1), use_cache=False)
        engine.import_kv(rid, codec.decode(payload))
        engine.abort(rid)

    return land


class _Receiver:
    """`_receive` in a process of its own, stopped on the way out."""

    def __init__(
        self,
        kind: str,
        frames: int,
        frame_bytes: int,
        ns: str | None = None,
        host: str = "127.0.0.1",
        prompt_tokens: int = 0,
    ):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._ready, self._result = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(
            target=_receive, args=(kind, frames, frame_bytes, ns, host, prompt_tokens, self._ready, self._result)
        )

    def __enter__(self) -> _Receiver:
        self._proc.start()
        self.port = int(self._ready.get(timeout=60))
        return self

    def mb_per_s(self) -> float:
        return float(self._result.get(timeout=300))

    def order(self) -> str:
        return str(self._result.get(timeout=300))

    def __exit__(self, *_exc: object) -> None:
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def _loopback_mb_per_s(kind: str, mbytes: int, frame_bytes: int, prompt_tokens: int) -> float:
    """MB/s at the receiver of `kind`'s frames (see `_receive`) on loopback. `kv`: each
    frame is the KV of a `prompt_tokens` prompt, exported from an engine and encoded as P
    does it (so the frame's size is the KV's)."""
    from pdd.kv import codec
    from pdd.transfer.messages import Hello, to_dict
    from pdd.transfer.wire import MsgType, connect

    export = None
    if kind == "kv":
        import torch

        torch.set_num_threads(1)  # (see `_importer`)
        engine, prompt = _prefilled(prompt_tokens)

        def export() -> bytes:
            return codec.encode(engine.export_kv("kv", 0, len(prompt)))

        frame_bytes = len(export())
    frames = max(2, mbytes * 1_000_000 // frame_bytes)
    blob = b"\x01" * frame_bytes

    def send_raw(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for _ in range(frames):
                sock.sendall(blob)

    async def send(port: int) -> None:
        hello = Hello("prefill", "bench", channel="urgent")
        conn, _ = await connect("127.0.0.1", port, None if kind == "plain" else KEY, lambda v: to_dict(hello, v))
        for _ in range(frames):
            await conn.send(MsgType.KV_LAYER, blob if export is None else export())
        conn.close()
        await conn.wait_closed()

    with _Receiver(kind, frames, frame_bytes, prompt_tokens=prompt_tokens) as far:
        if kind == "raw":
            send_raw(far.port)
        else:
            asyncio.run(send(far.port))
        return far.mb_per_s()


def _prompt(tokens: int) -> list[int]:
    """The benchmark's prompt: random token IDs, the same in every process."""
    import random

    rng = random.Random(0)
    return [rng.randrange(16, 4000) for _ in range(tokens)]


def _engine(pages: int) -> Any:
    """The default tiny model's embedded engine (fp32), of `pages` 16-token pages."""
    from pdd.engine.engine import Engine
    from pdd.engine_port import EngineConfig
    from pdd.model.store import resolve_model

    return Engine(resolve_model(""), EngineConfig(page_size=16, num_pages=pages))


def _prefilled(prompt_tokens: int, pages: int = 8) -> tuple[Any, list[int]]:
    """The default tiny model's engine (fp32) and a prompt of random token IDs whose KV
    it holds (request "kv"), with `pages` pages to spare."""
    from pdd.sampling import SamplingParams

    engine = _engine(prompt_tokens // 16 + pages)
    prompt = _prompt(prompt_tokens)
    seq = engine.add_request("kv", prompt, SamplingParams(max_tokens=1), hold=True)
    while seq.num_computed < len(prompt):
        engine.step()
    return engine, prompt


def _kv_pages(prompt_tokens: int) -> bytes:
    """The KV (all layers, K then V) the default tiny model computes for a prompt of random
    token IDs: the bytes a KV_LAYER frame carries, fp32."""
    engine, prompt = _prefilled(prompt_tokens)
    blob = engine.export_kv("kv", 0, len(prompt))
    return blob.k.contiguous().numpy().tobytes() + blob.v.contiguous().numpy().tobytes()


def _codecs() -> dict[str, tuple[Any, Any]]:
    """name -> (compress, decompress), for what is installed."""
    import zlib

    out: dict[str, tuple[Any, Any]] = {"zlib-1": (lambda b: zlib.compress(b, 1), zlib.decompress)}
    try:
        import zstandard

        for level in (1, 3):
            c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
            out[f"zstd-{level}"] = (c.compress, d.decompress)
    except ImportError:
        pass
    try:
        import lz4.frame

        out["lz4"] = (lz4.frame.compress, lz4.frame.decompress)
    except ImportError:
        pass
    return out


def _compress(args: argparse.Namespace) -> int:
    """Whether lossless compression pays on the line: for each codec, the ratio, one core's
    compress and decompress MB/s, and the rate a 1 and a 10 Gbit/s line then carries KV
    at (the slowest of compressing, the line times the ratio, and decompressing, as a
    pipeline) against the line alone."""
    import torch

    fp32 = _kv_pages(args.prompt_tokens)
    bf16 = torch.frombuffer(bytearray(fp32), dtype=torch.float32).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    rows: list[dict[str, Any]] = []
    for dtype, data in (("float32", fp32), ("bfloat16", bf16)):
        for name, (comp, decomp) in _codecs().items():
            began = time.perf_counter()
            packed = comp(data)
            c_s = time.perf_counter() - began
            began = time.perf_counter()
            assert decomp(packed) == data
            d_s = time.perf_counter() - began
            ratio, c_mb_s, d_mb_s = len(data) / len(packed), len(data) / c_s / 1e6, len(data) / d_s / 1e6
            carried = {gbit: min(c_mb_s, gbit * 125 * ratio, d_mb_s) for gbit in (1, 10)}
            rows.append(
                {
                    "dtype": dtype,
                    "codec": name,
                    "ratio": ratio,
                    "compress_mb_s": c_mb_s,
                    "decompress_mb_s": d_mb_s,
                    "kv_mb_s_at_1_gbit": carried[1],
                    "kv_mb_s_at_10_gbit": carried[10],
                }
            )
    title = f"Lossless codecs on {len(fp32) / 1e6:.1f} MB of the tiny model's KV ({args.prompt_tokens} tokens)"
    table = Table(title=title)
    for col in (
        "dtype",
        "codec",
        "ratio",
        "compress MB/s",
        "decompress MB/s",
        "KV MB/s at 1 Gbit/s (125)",
        "at 10 Gbit/s (1250)",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["dtype"],
            r["codec"],
            f"{r['ratio']:.3f}",
            f"{r['compress_mb_s']:.0f}",
            f"{r['decompress_mb_s']:.0f}",
            f"{r['kv_mb_s_at_1_gbit']:.0f}",
            f"{r['kv_mb_s_at_10_gbit']:.0f}",
        )
    Console().print(table)
    if args.out:
        args.out.write_text(json.dumps({"prompt_tokens": args.prompt_tokens, "rows": rows}, indent=2) + "\n")
    return 0


def _lossy(args: argparse.Namespace) -> int:
    """Each prompt prefilled once (P), its KV then imported, as MD imports it, once exact
    and once through int8, and decoded greedily from P's first token: how often the tokens
    stay equal, how far the first decoded position's logprobs move (of the exact run's
    token, and the largest over the vocabulary), and the bytes the KV took on the line."""
    import random

    import torch

    from pdd.kv import codec
    from pdd.sampling import SamplingParams

    engine = _engine(3 * (args.prompt_tokens + args.output_tokens) // 16 + 8)
    rng = random.Random(0)
    forms = ("", "int8")
    equal, token_dlp, max_dlp, line_bytes = 0, [], [], dict.fromkeys(forms, 0)
    for i in range(args.prompts):
        prompt = [rng.randrange(16, 4000) for _ in range(args.prompt_tokens)]
        p = engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1), hold=True)
        while p.num_computed < len(prompt) or not p.output:
            engine.step()
        first, blob = p.output[0], engine.export_kv(f"p{i}", 0, len(prompt))
        engine.release(f"p{i}")
        outputs, logprobs = {}, {}
        for form in forms:
            data = codec.encode(blob, form)
            line_bytes[form] += len(data)
            rid = f"{form or 'exact'}{i}"
            engine.reserve(rid, prompt, SamplingParams(max_tokens=args.output_tokens), use_cache=False)
            engine.import_kv(rid, codec.decode(data))
            seq = engine.start(rid, [first])
            seq.want_logits = True
            while engine.has_work():
                engine.step()
            outputs[form] = list(seq.output)
            assert seq.step_logits is not None  # (the first step after the import computed them)
            logprobs[form] = torch.log_softmax(seq.step_logits[-1].double(), dim=-1)
        engine.flush_cache()
        equal += outputs[""] == outputs["int8"]
        token = outputs[""][1]  # (the output's first token is P's)
        token_dlp.append(abs(float(logprobs[""][token] - logprobs["int8"][token])))
        max_dlp.append(float((logprobs[""] - logprobs["int8"]).abs().max()))
    title = (
        f"link.lossy_kv = int8 on the tiny model: {args.prompts} prompts of {args.prompt_tokens} tokens, "
        f"{args.output_tokens} greedy tokens each"
    )
    table = Table(title=title)
    for col in ("figure", "value"):
        table.add_column(col, justify="right")
    table.add_row("prompts whose greedy tokens are all equal", f"{equal} of {args.prompts}")
    table.add_row(
        "|logprob difference| of the exact token, mean / max",
        f"{sum(token_dlp) / len(token_dlp):.2e} / {max(token_dlp):.2e}",
    )
    table.add_row("largest |logprob difference| over the vocabulary", f"{max(max_dlp):.2e}")
    table.add_row("KV bytes on the line, exact (fp32) / int8", f"{line_bytes['']:,} / {line_bytes['int8']:,}")
    table.add_row(
        "bytes saved", f"{1 - line_bytes['int8'] / line_bytes['']:.1%} ({line_bytes[''] / line_bytes['int8']:.2f}x)"
    )
    Console().print(table)
    if args.out:
        out = {"equal": equal, "prompts": args.prompts, "token_dlp": token_dlp, "max_dlp": max_dlp, "bytes": line_bytes}
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _loopback(args: argparse.Namespace) -> int:
    import statistics

    frame_bytes = args.frame_kib * 1024
    labels = {
        "raw": "raw TCP (recv_into)",
        "auth": "pdd frames, authenticated",
        "plain": "pdd frames, no key",
        "kv": f"whole KV path: export, encode, frames (authenticated), decode, import ({args.prompt_tokens} tokens)",
    }
    rates = {
        kind: statistics.median(
            _loopback_mb_per_s(kind, args.mbytes, frame_bytes, args.prompt_tokens) for _ in range(args.repeats)
        )
        for kind in labels
    }
    title = (
        f"The frame layer on loopback, two processes ({args.mbytes} MB of {args.frame_kib} KiB frames; "
        f"the median of {args.repeats} runs)"
    )
    table = Table(title=title)
    for col in ("", "MB/s", "x raw TCP"):
        table.add_column(col, justify="right")
    for kind, label in labels.items():
        table.add_row(label, f"{rates[kind]:.0f}", f"{rates[kind] / rates['raw']:.2f}")
    Console().print(table)
    if args.out:
        args.out.write_text(json.dumps({"loopback_mb_s": rates, "frame_kib": args.frame_kib}, indent=2) + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    from pdd.lab.netns.delay import LineDelay
    from pdd.lab.netns.lab import lab

    if args.loopback:
        return _loopback(args)
    if args.compress:
        return _compress(args)
    if args.lossy:
        return _lossy(args)
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
