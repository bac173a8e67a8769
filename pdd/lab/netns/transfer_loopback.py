"""`pdd bench transfer --loopback`: the frame layer alone, between two processes on this machine.

Rows: raw TCP (a `recv_into` loop into one buffer), pdd's frames with and without
authentication (`--frame-kib` frames after the handshake, as a KV connection sends them),
and the whole KV path (a prompt's KV exported and sent as P sends it, one layer of one
`--kv-chunk-tokens` chunk a frame, its parts framed and authenticated without a copy;
decoded, put back together and imported chunk by chunk as MD does) on each `--model-shape`: the default tiny model
(fp32, 4 layers: 4 KiB of KV a token), and realistic pages, a checkpoint of random weights
with Qwen2.5-0.5B's KV geometry (24 layers x 2 KV heads x 64, bf16: 12 KiB a token) in
16-token pages. MB/s at the receiver, the median of `--repeats` runs each, and what a
GB cost each end's CPU (every thread of its process): the rate each end could keep on a
core of its own, where both ends here share two cores (the bound on a busy machine too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pdd.heap import freeze_startup_heap
from pdd.lab.netns.transfer_receiver import KEY, PAGE, TINY, KVModel, Receiver, bench_prompt, engine_for

# Qwen2.5-0.5B's KV: 24 layers, 2 KV heads of 64 (14 query heads over 896); a small MLP
# (the KV does not depend on it) keeps the build and the prefill short
REALISTIC = {"layers": 24, "hidden": 896, "heads": 14, "kv_heads": 2, "intermediate": 512}
SHAPES = ("tiny", "realistic")


def kv_model(shape: str, tmp: Path, prompt_tokens: int) -> KVModel:
    """`shape`'s model: the tiny one, or a realistic-page checkpoint built into `tmp`."""
    if shape == "tiny":
        return TINY
    from pdd.model.tiny import make_tiny

    out = make_tiny(tmp / "realistic", **REALISTIC, max_position=max(4096, prompt_tokens + 64))
    return KVModel("realistic", str(out), "bfloat16")


def prefilled(prompt_tokens: int, pages: int = 8, model: KVModel = TINY) -> tuple[Any, list[int]]:
    """`model`'s engine and a prompt of random token IDs whose KV it holds (request
    "kv"), with `pages` pages to spare."""
    from pdd.sampling.params import SamplingParams

    engine = engine_for(prompt_tokens // PAGE + pages, model)
    prompt = bench_prompt(prompt_tokens)
    seq = engine.add_request("kv", prompt, SamplingParams(max_tokens=1), hold=True)
    while seq.num_computed < len(prompt):
        engine.step()
    return engine, prompt


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
        freeze_startup_heap()  # (as a server does once it is up)

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


@dataclass(frozen=True)
class Run:
    """One row's run: MB/s at the receiver, and each end's CPU seconds a GB."""

    mb_per_s: float
    sender_cpu_s_per_gb: float
    receiver_cpu_s_per_gb: float

    @property
    def core_gb_per_s(self) -> float:
        """The rate with a core for each end: the costlier end's."""
        return 1 / max(self.sender_cpu_s_per_gb, self.receiver_cpu_s_per_gb, 1e-9)


def _loopback_run(kind: str, mbytes: int, frame_bytes: int, kv: KVSender | None = None) -> Run:
    """`kind`'s frames (see `transfer_receiver._receive`) on loopback. `kv`: prompts'
    KV, exported from an engine and sent as P sends it (`KVSender`), `mbytes` of it."""
    from pdd.transfer.messages import Hello, to_dict
    from pdd.transfer.wire import MsgType, connect, payload_len

    frames = max(2, mbytes * 1_000_000 // frame_bytes)
    sent_bytes = frames * frame_bytes
    if kv is not None:
        one = kv.frames()
        prompts = max(2, mbytes * 1_000_000 // sum(map(payload_len, one)))
        frames, sent_bytes = prompts * len(one), prompts * sum(map(payload_len, one))
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
        cpu_began = time.process_time()
        if kind == "raw":
            send_raw(far.port)
        else:
            asyncio.run(send(far.port))
        sender_cpu_s = time.process_time() - cpu_began
        got = far.received()
    return Run(got.mb_per_s, sender_cpu_s / sent_bytes * 1e9, got.cpu_s_per_gb)


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
        runs: dict[str, list[Run]] = {key: [] for key in labels}
        for _ in range(args.repeats):
            for key in labels:
                kind, kv = ("kv", senders[key]) if key in senders else (key, None)
                runs[key].append(_loopback_run(kind, args.mbytes, frame_bytes, kv))
    _print_table(args, labels, runs)
    if args.out:
        args.out.write_text(json.dumps(_report(args, labels, runs, bytes_per_token), indent=2) + "\n")
    return 0


def _median(runs: list[Run], of: str) -> float:
    return statistics.median(getattr(r, of) for r in runs)


def _print_table(args: argparse.Namespace, labels: dict[str, str], runs: dict[str, list[Run]]) -> None:
    raw = _median(runs["raw"], "mb_per_s")
    title = (
        f"The frame layer on loopback, two processes ({args.mbytes} MB of {args.frame_kib} KiB frames; "
        f"the whole KV path: {args.prompt_tokens}-token prompts' KV, exported and sent as P sends it, "
        f"{args.kv_chunk_tokens}-token chunks, their layers a frame (authenticated), decoded, put together and "
        f"imported as MD does; the median of {args.repeats} runs; CPU: each end's process, every thread)"
    )
    table = Table(title=title)
    for col in ("", "MB/s", "x raw TCP", "each run: MB/s (x its raw TCP)", "CPU s/GB: sender / receiver",
                "GB/s, a core an end"):  # fmt: skip
        table.add_column(col, justify="right")
    for key, label in labels.items():
        rs = runs[key]
        pairs = zip(rs, runs["raw"], strict=True)
        each = " / ".join(f"{r.mb_per_s:.0f} ({r.mb_per_s / w.mb_per_s:.2f})" for r, w in pairs)
        cpu = f"{_median(rs, 'sender_cpu_s_per_gb'):.3f} / {_median(rs, 'receiver_cpu_s_per_gb'):.3f}"
        mb = _median(rs, "mb_per_s")
        table.add_row(label, f"{mb:.0f}", f"{mb / raw:.2f}", each, cpu, f"{_median(rs, 'core_gb_per_s'):.2f}")
    Console().print(table)


def _report(
    args: argparse.Namespace, labels: dict[str, str], runs: dict[str, list[Run]], bytes_per_token: dict[str, int]
) -> dict[str, Any]:
    """The run as JSON: rates, each run against its raw TCP, each end's CPU."""
    raw = runs["raw"]
    x_raw = {key: [r.mb_per_s / w.mb_per_s for r, w in zip(rs, raw, strict=True)] for key, rs in runs.items()}
    return {
        "loopback_mb_s": {key: _median(rs, "mb_per_s") for key, rs in runs.items()},
        "runs_mb_s": {key: [r.mb_per_s for r in rs] for key, rs in runs.items()},
        "runs_x_raw": x_raw,
        "cpu_s_per_gb": {
            key: {"sender": [r.sender_cpu_s_per_gb for r in rs], "receiver": [r.receiver_cpu_s_per_gb for r in rs]}
            for key, rs in runs.items()
        },
        "core_gb_per_s": {key: _median(rs, "core_gb_per_s") for key, rs in runs.items()},
        "labels": labels,
        "kv_bytes_per_token": bytes_per_token,
        "frame_kib": args.frame_kib,
        "prompt_tokens": args.prompt_tokens,
        "kv_chunk_tokens": args.kv_chunk_tokens,
    }
