"""`pdd bench transfer --loopback`: the frame layer alone, between two processes on this machine.

Rows: raw TCP (a `recv_into` loop into one buffer), pdd's frames with and without
authentication (`--frame-kib` frames after the handshake, as a KV connection sends them),
and the whole KV path (a prompt's KV exported and sent as P sends it, one layer of one
`--kv-chunk-tokens` chunk a frame, its parts framed and authenticated without a copy;
decoded, put back together and imported chunk by chunk as MD does) on each `--model-shape`: the default tiny model
(fp32, 4 layers: 4 KiB of KV a token), and realistic pages, a checkpoint of random weights
with Qwen2.5-0.5B's KV geometry (24 layers x 2 KV heads x 64, bf16: 12 KiB a token) in
16-token pages. MB/s at the receiver, the median of `--repeats` runs each.

Also the receiving end the line measurement (`pdd.lab.netns.transfer`) runs on host b.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

KEY = b"k" * 32
PAGE = 16  # tokens a page, on both ends
# Qwen2.5-0.5B's KV: 24 layers, 2 KV heads of 64 (14 query heads over 896); a small MLP
# (the KV does not depend on it) keeps the build and the prefill short
REALISTIC = {"layers": 24, "hidden": 896, "heads": 14, "kv_heads": 2, "intermediate": 512}
SHAPES = ("tiny", "realistic")


@dataclass(frozen=True)
class KVModel:
    """The model whose KV the whole KV path carries: `model_dir` ("": the default tiny
    model, built once under PDD_HOME) and the engines' `dtype`, in both processes."""

    shape: str = "tiny"
    model_dir: str = ""
    dtype: str = "float32"


TINY = KVModel()


def kv_model(shape: str, tmp: Path, prompt_tokens: int) -> KVModel:
    """`shape`'s model: the tiny one, or a realistic-page checkpoint built into `tmp`."""
    if shape == "tiny":
        return TINY
    from pdd.model.tiny import make_tiny

    out = make_tiny(tmp / "realistic", **REALISTIC, max_position=max(4096, prompt_tokens + 64))
    return KVModel("realistic", str(out), "bfloat16")


def bench_prompt(tokens: int) -> list[int]:
    """The benchmark's prompt: random token IDs, the same in every process."""
    import random

    rng = random.Random(0)
    return [rng.randrange(16, 4000) for _ in range(tokens)]


def engine_for(pages: int, model: KVModel = TINY) -> Any:
    """`model`'s embedded engine, of `pages` 16-token pages."""
    from pdd.engine.engine import Engine
    from pdd.engine_port import EngineConfig
    from pdd.model.store import resolve_model

    return Engine(resolve_model(model.model_dir), EngineConfig(page_size=PAGE, num_pages=pages, dtype=model.dtype))


def prefilled(prompt_tokens: int, pages: int = 8, model: KVModel = TINY) -> tuple[Any, list[int]]:
    """`model`'s engine and a prompt of random token IDs whose KV it holds (request
    "kv"), with `pages` pages to spare."""
    from pdd.sampling import SamplingParams

    engine = engine_for(prompt_tokens // PAGE + pages, model)
    prompt = bench_prompt(prompt_tokens)
    seq = engine.add_request("kv", prompt, SamplingParams(max_tokens=1), hold=True)
    while seq.num_computed < len(prompt):
        engine.step()
    return engine, prompt


def _receive(
    kind: str, frames: int, frame_bytes: int, ns: str | None, host: str, kv: tuple[KVModel, int], ready, result
) -> None:
    """A process that takes connections on `host` (in namespace `ns`) until `frames`
    frames of `frame_bytes` are in, and reports the MB/s it received them at, from the
    first frame on (the handshake is not the rate). `raw`: plain TCP read into one
    preallocated buffer (`recv_into`), what the kernel hands one process; `auth` and
    `plain`: pdd's frames, with and without a key; `kv`: authenticated frames of a
    prompt's KV (`kv`: the model, the prompt's tokens), each decoded and imported as MD
    does; `order`: which channel each frame came on ("u"rgent, "b"ackground), in order of arrival."""
    if ns:
        from pdd.lab.netns.lab import enter

        enter(ns)
    if kind == "raw":
        _receive_raw(frames * frame_bytes, host, ready, result)
    else:
        asyncio.run(_receive_frames(kind, frames, frame_bytes, host, kv, ready, result))


def _receive_raw(total: int, host: str, ready, result) -> None:
    listen = socket.create_server((host, 0))
    ready.put(listen.getsockname()[1])
    conn, _ = listen.accept()
    buf = memoryview(bytearray(4 << 20))
    got = first = conn.recv_into(buf)
    began = time.monotonic()
    while got < total:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    result.put((got - first) / (time.monotonic() - began) / 1e6)
    conn.close()


async def _receive_frames(
    kind: str, frames: int, frame_bytes: int, host: str, kv: tuple[KVModel, int], ready, result
) -> None:
    from pdd.transfer.wire import serve, server_handshake

    done, count, got, began, open_conns = asyncio.Event(), [0], [0], [0.0], [0]
    land = _importer(*kv) if kind == "kv" else None
    order: list[str] = []  # `order`: each frame's channel, "u" or "b", in order of arrival

    async def framed(conn) -> None:
        open_conns[0] += 1
        try:
            channel = (await server_handshake(conn)).get("channel", "")[:1]
            while True:  # until the sender closes its end
                frame = await conn.next_frame()
                if land is not None:
                    land(frame)
                order.append(channel)
                count[0] += 1
                if count[0] == 1:
                    began[0] = time.monotonic()
                else:
                    got[0] += len(frame.payload)
                if count[0] == frames:
                    done.set()
        finally:
            open_conns[0] -= 1

    server = await serve(framed, host, 0, None if kind == "plain" else KEY)
    ready.put(server.sockets[0].getsockname()[1])
    await done.wait()
    result.put("".join(order) if kind == "order" else got[0] / (time.monotonic() - began[0]) / 1e6)
    server.close()
    for _ in range(1000):  # the sender closes its connections: their handlers end
        if not open_conns[0]:
            break
        await asyncio.sleep(0.01)


def _importer(model: KVModel, prompt_tokens: int) -> Callable[[Any], None]:
    """What MD does with the KV frames of `prompt_tokens` prompts, as a function of each
    frame: decode it, put its request's chunks back together (`Reassembly`), import each
    whole chunk into the request's reservation, and once all are in, abort it (freeing its pages)."""
    import torch

    from pdd.kv import codec
    from pdd.kv.reassembly import Reassembly
    from pdd.sampling import SamplingParams
    from pdd.transfer import messages as m

    torch.set_num_threads(1)  # (one core a process, as the frame layer: two of torch's threads each ran at 0.17x)
    engine = engine_for(2 * (prompt_tokens // PAGE + 8), model)
    prompt, arriving = bench_prompt(prompt_tokens), {}

    def land(frame: Any) -> None:
        layer, data = m.decode_kv(frame)
        if layer.rid not in arriving:
            engine.reserve(layer.rid, prompt, SamplingParams(max_tokens=1), use_cache=False)
            arriving[layer.rid] = Reassembly(0, prompt_tokens)
        kv = arriving[layer.rid]
        for whole in kv.add(codec.decode(data)):
            engine.import_kv(layer.rid, whole)
        if kv.complete:
            engine.abort(layer.rid)
            del arriving[layer.rid]

    return land


class Receiver:
    """`_receive` in a process of its own, stopped on the way out."""

    def __init__(
        self,
        kind: str,
        frames: int,
        frame_bytes: int,
        ns: str | None = None,
        host: str = "127.0.0.1",
        kv: tuple[KVModel, int] = (TINY, 0),
    ):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._ready, self._result = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(
            target=_receive, args=(kind, frames, frame_bytes, ns, host, kv, self._ready, self._result)
        )

    def __enter__(self) -> Receiver:
        self._proc.start()
        self.port = int(self._get(self._ready, 120))
        return self

    def mb_per_s(self) -> float:
        return float(self._get(self._result, 300))

    def order(self) -> str:
        return str(self._get(self._result, 300))

    def _get(self, q: Any, timeout: float) -> Any:
        """What the process puts on `q`; an error at once if it ends without (a crash, a kill)."""
        import queue

        deadline = time.monotonic() + timeout
        while True:
            try:
                return q.get(timeout=1)
            except queue.Empty:
                if not self._proc.is_alive() and q.empty():  # (what it put before it ended is read first)
                    raise RuntimeError(f"the receiving process ended (exit code {self._proc.exitcode})") from None
                if time.monotonic() > deadline:
                    raise

    def __exit__(self, *_exc: object) -> None:
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


class KVSender:
    """P's side of the whole KV path on `model`: a prompt prefilled once, its KV exported
    afresh for every prompt sent and sent as P sends it (`export_frames`: a `chunk_tokens`
    chunk's layers a frame, up to `KV_FRAME_BYTES`, each encoded into parts)."""

    def __init__(self, model: KVModel, prompt_tokens: int, chunk_tokens: int):
        import torch

        torch.set_num_threads(1)  # (see `_importer`)
        self.model, self.prompt_tokens, self.chunk_tokens = model, prompt_tokens, chunk_tokens
        self.engine, self.prompt = prefilled(prompt_tokens, model=model)
        self.bytes_per_token = self.engine.pool.bytes_per_token()
        cfg = self.engine.model_cfg
        self.geometry = f"{cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim}"
        self._sent = 0

    def frames(self) -> list[list[Any]]:
        """A prompt's KV frames' payloads (each a list of parts), as P sends them to a fresh request."""
        from pdd.instance.prefill_kv import export_frames
        from pdd.kv import codec
        from pdd.transfer import messages as m

        self._sent += 1
        blob = self.engine.export_kv("kv", 0, len(self.prompt))
        return [m.kv_payload(f"r{self._sent}", codec.encode_parts(f)) for f in export_frames(blob, self.chunk_tokens)]

    def label(self) -> str:
        what = "tiny model" if self.model.shape == "tiny" else "realistic pages (Qwen2.5-0.5B's KV, random weights)"
        return (
            f"whole KV path, {what}: {self.model.dtype}, {self.geometry}, {PAGE}-token pages, "
            f"{self.bytes_per_token:,} B a token, {self.chunk_tokens}-token chunks"
        )


def _loopback_mb_per_s(kind: str, mbytes: int, frame_bytes: int, kv: KVSender | None = None) -> float:
    """MB/s at the receiver of `kind`'s frames (see `_receive`) on loopback. `kv`: prompts'
    KV, exported from an engine and sent as P sends it (`KVSender`), `mbytes` of it."""
    from pdd.transfer.messages import Hello, to_dict
    from pdd.transfer.wire import MsgType, connect, payload_len

    frames = max(2, mbytes * 1_000_000 // frame_bytes)
    if kv is not None:
        one = kv.frames()
        prompts = max(2, mbytes * 1_000_000 // sum(map(payload_len, one)))
        frames = prompts * len(one)
    blob = b"\x01" * frame_bytes

    def send_raw(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for _ in range(frames):
                sock.sendall(blob)

    async def send(port: int) -> None:
        hello = Hello("prefill", "bench", channel="urgent")
        conn, _ = await connect("127.0.0.1", port, None if kind == "plain" else KEY, lambda v: to_dict(hello, v))
        if kv is None:
            for _ in range(frames):
                await conn.send(MsgType.KV_LAYER, blob)
        else:  # the next prompt's export on a thread while this one's frames go, as P's copy thread does
            loop = asyncio.get_running_loop()
            with ThreadPoolExecutor(1) as exporter:
                upcoming = loop.run_in_executor(exporter, kv.frames)
                for i in range(prompts):
                    payloads = await upcoming
                    if i + 1 < prompts:
                        upcoming = loop.run_in_executor(exporter, kv.frames)
                    for payload in payloads:
                        await conn.send(MsgType.KV_LAYER, payload)
        conn.close()
        await conn.wait_closed()

    model = (kv.model, kv.prompt_tokens) if kv is not None else (TINY, 0)
    with Receiver(kind, frames, frame_bytes, kv=model) as far:
        if kind == "raw":
            send_raw(far.port)
        else:
            asyncio.run(send(far.port))
        return far.mb_per_s()


FRAME_ROWS = {"raw": "raw TCP (recv_into)", "auth": "pdd frames, authenticated", "plain": "pdd frames, no key"}


def loopback(args: argparse.Namespace) -> int:
    """Every row once a run, in turn (so a machine busy for a while slows each row alike),
    `--repeats` runs; each row's median, against raw TCP's."""
    frame_bytes = args.frame_kib * 1024
    labels: dict[str, str] = dict(FRAME_ROWS)
    bytes_per_token: dict[str, int] = {}
    senders: dict[str, KVSender] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in SHAPES if args.model_shape == "both" else (args.model_shape,):
            sender = KVSender(kv_model(shape, Path(tmp), args.prompt_tokens), args.prompt_tokens, args.kv_chunk_tokens)
            key = "kv" if shape == "tiny" else f"kv_{shape}"  # ("kv": the tiny model's, as before)
            labels[key], bytes_per_token[key], senders[key] = sender.label(), sender.bytes_per_token, sender
        runs: dict[str, list[float]] = {key: [] for key in labels}
        for _ in range(args.repeats):
            for key in labels:
                kind, kv = ("kv", senders[key]) if key in senders else (key, None)
                runs[key].append(_loopback_mb_per_s(kind, args.mbytes, frame_bytes, kv))
    rates = {key: statistics.median(r) for key, r in runs.items()}
    title = (
        f"The frame layer on loopback, two processes ({args.mbytes} MB of {args.frame_kib} KiB frames; "
        f"the whole KV path: {args.prompt_tokens}-token prompts' KV, exported and sent as P sends it, "
        f"{args.kv_chunk_tokens}-token chunks, their layers a frame (authenticated), decoded, put together and "
        f"imported as MD does; the median of {args.repeats} runs)"
    )
    table = Table(title=title)
    for col in ("", "MB/s", "x raw TCP", "each run: MB/s (x its raw TCP)"):
        table.add_column(col, justify="right")
    for key, label in labels.items():
        each = " / ".join(f"{r:.0f} ({r / raw:.2f})" for r, raw in zip(runs[key], runs["raw"], strict=True))
        table.add_row(label, f"{rates[key]:.0f}", f"{rates[key] / rates['raw']:.2f}", each)
    Console().print(table)
    if args.out:
        out = {
            "loopback_mb_s": rates,
            "runs_mb_s": runs,
            "runs_x_raw": {key: [r / raw for r, raw in zip(rs, runs["raw"], strict=True)] for key, rs in runs.items()},
            "labels": labels,
            "kv_bytes_per_token": bytes_per_token,
            "frame_kib": args.frame_kib,
            "prompt_tokens": args.prompt_tokens,
            "kv_chunk_tokens": args.kv_chunk_tokens,
        }
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0
