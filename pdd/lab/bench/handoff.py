"""`pdd bench handoff`: the spec's handoff microbenchmark, at this model's and line's scale.

PDD_SPEC item 2: for a 100-token handoff, shipping those tokens' KV over the line took
185 ms on average (512.6 ms at worst) plus 24.5 ms of device copy, while recomputing
them on MD by one extend pass took 305 ms on average, 321.4 ms at worst, 4.8 ms std:
slightly slower on average, but stable and immune to the line.

Here, on this machine: the KV of the handed-over tokens crosses an in-process `pdd
line` emulator (the `paper` scenario's line by default) as the authenticated KV_LAYER frames P
sends, then is decoded and imported ("copy"); and the same tokens are recomputed by one
extend step on an engine that holds the prompt's KV, alone and in one step with a batch
of decoding sequences (whose step it stalls). Numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pdd.engines.port import EnginePort, StepOutput
from pdd.kv.codec import KVBlob
from pdd.lab.bench import options
from pdd.lab.line import EmulatedLine, LineRelay, Route
from pdd.lab.workload.scenarios import SCENARIOS
from pdd.transfer import messages as m
from pdd.transfer import wire

KEY = wire.connection_key("pdd bench handoff", "line")


def add_arguments(p: argparse.ArgumentParser) -> None:
    line = SCENARIOS["paper"]
    options.model_dir(p)
    options.threads(p)
    options.out(p)
    p.add_argument("--trials", type=int, default=20, help="handoffs measured each way (default 20)")
    p.add_argument("--handoff-tokens", type=int, default=100, help="tokens handed over (default 100, as the spec)")
    p.add_argument("--context-tokens", type=int, default=2000, help="prompt before them (default 2000)")
    p.add_argument("--batch", type=int, default=16, help="decoding sequences beside the extend (default 16)")
    p.add_argument("--bandwidth-mbps", type=float, default=line.bandwidth_mbps)
    p.add_argument("--delay-ms", type=float, default=line.delay_ms)
    p.add_argument("--jitter-ms", type=float, default=line.jitter_ms)


def _stats(seconds: list[float]) -> dict[str, float]:
    ms = [1000 * s for s in seconds]
    return {"mean_ms": statistics.mean(ms), "max_ms": max(ms), "std_ms": statistics.pstdev(ms)}


async def _ship(payloads: list[bytes], line: EmulatedLine, trials: int) -> list[float]:
    """Seconds from the first KV byte leaving until the last frame is read at the far end."""
    arrived: asyncio.Queue[float] = asyncio.Queue()

    async def sink(conn: wire.FramedConnection) -> None:
        await wire.server_handshake(conn)  # as every instance does: full-size frames only after it
        while True:
            for _ in payloads:
                await conn.recv()
            arrived.put_nowait(time.perf_counter())

    server = await wire.serve(sink, "127.0.0.1", 0, KEY)
    relay = LineRelay(line, [Route("127.0.0.1", 0, "127.0.0.1", server.sockets[0].getsockname()[1])])
    await relay.start()
    conn = await wire.open_connection("127.0.0.1", relay.listen_ports[0], KEY)
    await wire.client_handshake(conn, {"role": "prefill", "name": "bench"})
    try:
        times = []
        for _ in range(trials):
            start = time.perf_counter()
            for payload in payloads:
                await conn.send(wire.MsgType.KV_LAYER, payload)
            times.append(await arrived.get() - start)
            await asyncio.sleep(0.05)  # each trial starts on an idle line
        return times
    finally:
        conn.close()
        await relay.stop()
        server.close()


def measure(model_dir: str, args: argparse.Namespace) -> dict:
    from pdd.engines.port import EngineConfig, open_engine

    config = EngineConfig(
        num_pages=8192,
        max_batch_tokens=args.context_tokens + args.handoff_tokens + 64,
        backend=getattr(args, "engine", "embedded"),
    )
    engine = open_engine(model_dir, config)
    try:
        return asyncio.run(_measure(engine, args))
    finally:
        engine.close()


async def _drain(stream: AsyncIterator[StepOutput]) -> list[int]:
    return [out.token async for out in stream if out.token is not None]


async def _measure(engine: EnginePort, args: argparse.Namespace) -> dict:
    """Everything through the engine port, so any backend is measured alike."""
    from pdd.sampling.params import SamplingParams

    n, k = args.context_tokens, args.handoff_tokens
    rng = random.Random(0)
    prompt = [rng.randrange(16, 4000) for _ in range(n)]
    tokens = await _drain(engine.generate("relay", prompt, SamplingParams(max_tokens=k, ignore_eos=True)))
    # their KV, held for export: what the relay holds when it hands over
    await _drain(engine.generate("kv", prompt + tokens, SamplingParams(max_tokens=1), hold=True))

    wire_bytes, ship, copy = await _ship_and_copy(engine, args, prompt, tokens)
    prompt_kv = await engine.export_kv("kv", 0, n)
    await engine.release("kv")
    alone, batched, plain = await _recompute(engine, args, prompt, tokens, prompt_kv, rng)
    return {
        "handoff_tokens": k,
        "context_tokens": n,
        "batch": args.batch,
        "line": {"bandwidth_mbps": args.bandwidth_mbps, "delay_ms": args.delay_ms, "jitter_ms": args.jitter_ms},
        "ship": {"bytes": wire_bytes, **_stats(ship)},
        "copy": _stats(copy),
        "recompute_alone": _stats(alone),
        "recompute_in_batch": _stats(batched),
        "decode_step_in_batch": _stats(plain),
    }


async def _ship_and_copy(
    engine: EnginePort, args: argparse.Namespace, prompt: list[int], tokens: list[int]
) -> tuple[int, list[float], list[float]]:
    """1. Ship the handed-over tokens' KV: the frames P would send, through the line, then
    import them: (the wire's bytes, each trial's shipping seconds, each one's import)."""
    from pdd.kv import codec
    from pdd.sampling.params import SamplingParams

    n, k = args.context_tokens, args.handoff_tokens
    encoded = [codec.encode(layer) for layer in codec.split_layers(await engine.export_kv("kv", n, n + k))]
    payloads = [wire.pack_with_header(m.to_dict(m.KVLayer("bench")), e) for e in encoded]
    wire_bytes = sum(len(p) + wire.HEADER.size + wire.GMAC_TAG_SIZE for p in payloads)  # (a session's frames)
    line = EmulatedLine(args.bandwidth_mbps, args.delay_ms, args.jitter_ms, seed=None)
    ship = await _ship(payloads, line, args.trials)
    head = (prompt + tokens)[: k + 1]  # a same-sized range at the start, to import into a fresh reservation
    head_blob = [codec.encode(layer) for layer in codec.split_layers(await engine.export_kv("kv", 0, k))]
    copy = []
    for _ in range(args.trials):
        await engine.reserve("imp", head, SamplingParams(max_tokens=1), use_cache=False)
        start = time.perf_counter()
        await engine.import_kv("imp", codec.join_layers([codec.decode(b) for b in head_blob]))
        copy.append(time.perf_counter() - start)
        await engine.release("imp")
    return wire_bytes, ship, copy


async def _recompute(
    engine: EnginePort,
    args: argparse.Namespace,
    prompt: list[int],
    tokens: list[int],
    prompt_kv: KVBlob,
    rng: random.Random,
) -> tuple[list[float], list[float], list[float]]:
    """2. Recompute the tokens on MD: one extend over the prompt's KV, alone and beside
    decoding sequences: (alone, in the batch, the batch's decode steps), seconds each."""
    from pdd.sampling.params import SamplingParams

    k = args.handoff_tokens

    async def extend_s() -> float:
        """From handing MD the tokens to its next token: the extend's step."""
        await engine.reserve("md", prompt, SamplingParams(max_tokens=k + 1, ignore_eos=True), use_cache=False)
        await engine.import_kv("md", prompt_kv)
        stream = engine.watch("md")
        try:
            start = time.perf_counter()
            await engine.start("md", tokens)
            async for out in stream:
                if out.token is not None:
                    return time.perf_counter() - start
            raise RuntimeError("the extend produced no token")
        finally:
            stream.close()
            engine.abort("md")

    alone = [await extend_s() for _ in range(args.trials)]
    gaps: list[float] = []  # between the decoding batch's tokens: one decode step each

    async def decoder(i: int) -> None:
        last = None
        async for _ in engine.generate(
            f"b{i}",
            [rng.randrange(16, 4000) for _ in range(200)],
            SamplingParams(max_tokens=engine.max_context - 200, ignore_eos=True),
        ):
            now = time.perf_counter()
            if i == 0 and last is not None:
                gaps.append(now - last)
            last = now

    decoders = [asyncio.ensure_future(decoder(i)) for i in range(args.batch)]
    try:
        while len(gaps) < 3:  # every decoder prefilled and decoding
            await asyncio.sleep(0.05)
            for task in decoders:
                if task.done():
                    task.result()  # a decoder that failed says why
        batched, plain = [], []
        for _ in range(args.trials):
            before = len(gaps)
            batched.append(await extend_s())
            plain.extend(gaps[max(0, before - 3) : before])
    finally:
        for task in decoders:
            task.cancel()
        await asyncio.gather(*decoders, return_exceptions=True)
    return alone, batched, plain


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from pdd.model.tiny import make_tiny

            model_dir = str(make_tiny(Path(tmp) / "tiny"))
        r = measure(model_dir, args)
    table = Table(
        title=f"pdd bench handoff: {r['handoff_tokens']} tokens after {r['context_tokens']}, "
        f"line {args.bandwidth_mbps:g} Mbit/s, {args.delay_ms:g} ms +- {args.jitter_ms:g} ms"
    )
    for column in ("", "mean (ms)", "max (ms)", "std (ms)"):
        table.add_column(column, justify="right" if column else "left")
    rows = [
        (f"ship their KV over the line ({r['ship']['bytes']:,} bytes)", r["ship"]),
        ("  + decode and import it", r["copy"]),
        ("recompute by extend, alone", r["recompute_alone"]),
        (f"recompute by extend, with {r['batch']} decodes in the step", r["recompute_in_batch"]),
        ("  (that decode step without the extend)", r["decode_step_in_batch"]),
    ]
    for label, s in rows:
        table.add_row(label, f"{s['mean_ms']:.1f}", f"{s['max_ms']:.1f}", f"{s['std_ms']:.1f}")
    Console().print(table)
    if getattr(args, "out", None):
        Path(args.out).write_text(json.dumps(r, indent=2) + "\n")
    return 0
