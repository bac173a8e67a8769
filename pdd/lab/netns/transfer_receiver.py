"""The receiving end of `pdd bench transfer`: a process of its own that takes frames (or
raw TCP) and reports the rate it received them at and what that cost its CPU.

Shared by the loopback rows (`pdd.lab.netns.transfer_loopback`) and the line
measurement (`pdd.lab.netns.transfer`), which runs it on host b.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdd.heap import freeze_startup_heap

KEY = b"k" * 32
PAGE = 16  # tokens a page, on both ends


@dataclass(frozen=True)
class KVModel:
    """The model whose KV the whole KV path carries: `model_dir` ("": the default tiny
    model, built once under PDD_HOME) and the engines' `dtype`, in both processes."""

    shape: str = "tiny"
    model_dir: str = ""
    dtype: str = "float32"


TINY = KVModel()


def bench_prompt(tokens: int) -> list[int]:
    """The benchmark's prompt: random token IDs, the same in every process."""
    import random

    rng = random.Random(0)
    return [rng.randrange(16, 4000) for _ in range(tokens)]


def engine_for(pages: int, model: KVModel = TINY) -> Any:
    """`model`'s embedded engine, of `pages` 16-token pages."""
    from pdd.engines.embedded.engine import Engine
    from pdd.engines.port import EngineConfig
    from pdd.model.store import resolve_model

    return Engine(resolve_model(model.model_dir), EngineConfig(page_size=PAGE, num_pages=pages, dtype=model.dtype))


@dataclass(frozen=True)
class Received:
    """What a receiving process measured, from its first frame on (the handshake and the
    first frame are not the rate): MB/s, and its CPU seconds (every thread) a GB."""

    mb_per_s: float
    cpu_s_per_gb: float


def rate(got_bytes: int, began: float, cpu_began: float) -> Received:
    """`got_bytes` since `began` (monotonic) and `cpu_began` (this process's CPU time)."""
    seconds, cpu_s = time.monotonic() - began, time.process_time() - cpu_began
    return Received(got_bytes / seconds / 1e6, cpu_s / max(got_bytes, 1) * 1e9)


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
    began, cpu_began = time.monotonic(), time.process_time()
    while got < total:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    result.put(rate(got - first, began, cpu_began))
    conn.close()


async def _receive_frames(
    kind: str, frames: int, frame_bytes: int, host: str, kv: tuple[KVModel, int], ready, result
) -> None:
    from pdd.transfer.wire import serve, server_handshake

    done, count, got, began, open_conns = asyncio.Event(), [0], [0], [0.0, 0.0], [0]
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
                    began[:] = time.monotonic(), time.process_time()
                else:
                    got[0] += len(frame.payload)
                if count[0] == frames:
                    done.set()
        finally:
            open_conns[0] -= 1

    server = await serve(framed, host, 0, None if kind == "plain" else KEY)
    ready.put(server.sockets[0].getsockname()[1])
    await done.wait()
    result.put("".join(order) if kind == "order" else rate(got[0], *began))
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
    from pdd.sampling.params import SamplingParams
    from pdd.transfer import messages as m

    torch.set_num_threads(1)  # (one core a process, as the frame layer: two of torch's threads each ran at 0.17x)
    engine = engine_for(2 * (prompt_tokens // PAGE + 8), model)
    prompt, arriving = bench_prompt(prompt_tokens), {}
    freeze_startup_heap()  # (as a server does once it is up)

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

    def received(self) -> Received:
        got = self._get(self._result, 300)
        assert isinstance(got, Received)
        return got

    def mb_per_s(self) -> float:
        return self.received().mb_per_s

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
