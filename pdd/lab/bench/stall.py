"""`pdd bench stall`: whether the streams decoding on MD wait while a long request's KV lands on it.

N streams decode on one engine (`--engine embedded|vllm`, through the engine port, as an
instance drives it); then, `--trials` times, a cold request of `--import-tokens` prompt
tokens is reserved and its KV imported through the engine's real import path (synthetic
values in the model's shape: what is measured is where the bytes go, not what they say).
The streams' inter-token latencies are split into those whose gap overlaps an import
and those that overlap a window as long, half a second later, with none (a gap that
overlaps a window is likely a long one, so both sides are taken alike). The default
model is the tiny model's code with a realistic KV per token (24 layers of two 64-wide
KV heads, as Qwen2.5-0.5B: 24 KiB a token in fp32) and little compute, the case where
a copy is longest beside a step. Numbers are printed, never asserted; the last line is the verdict's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pdd.lab.bench import options


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.model_dir(p)
    options.threads(p)
    options.out(p)
    p.add_argument("--engine", choices=("embedded", "vllm"), default="embedded", help="MD's engine (default embedded)")
    p.add_argument("--streams", type=int, default=8, help="streams decoding throughout (default 8)")
    p.add_argument("--import-tokens", type=int, default=8192, help="the imported request's prompt (default 8192)")
    p.add_argument("--trials", type=int, default=5, help="imports measured (default 5)")
    p.add_argument("--layers", type=int, default=24, help="the default model's layers (default 24)")
    p.add_argument("--device", default="cpu", help="MD's device: cpu, cuda, cuda:N (default cpu)")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _itl(gaps: list[float]) -> dict[str, float]:
    ms = [1000 * g for g in gaps]
    top = max(ms, default=float("nan"))
    return {"count": len(ms), "p50_ms": _pct(ms, 0.5), "p99_ms": _pct(ms, 0.99), "max_ms": top}


def _synthetic_blob(model_dir: str, prompt: list[int], dtype: str) -> Any:
    """KV for every token of `prompt` in the model's shape (random values), as P would send it."""
    import torch

    from pdd.kv import codec
    from pdd.kv.blocks import HASH_BLOCK, block_hashes
    from pdd.model.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    shape = (cfg.num_layers, len(prompt), cfg.num_kv_heads, cfg.head_dim)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(shape, generator=gen).to(codec.DTYPES[dtype]) for _ in range(2))
    header = codec.KVHeader(
        num_layers=cfg.num_layers,
        layer_start=0,
        layer_end=cfg.num_layers,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=dtype,
        page_size=16,
        token_start=0,
        token_end=len(prompt),
        block_size=HASH_BLOCK,
        block_hashes=block_hashes(prompt, HASH_BLOCK),
    )
    return codec.KVBlob(header, k, v)


async def _measure(engine: Any, model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    from pdd.sampling.params import SamplingParams

    rng = random.Random(0)
    arrivals: list[list[float]] = [[] for _ in range(args.streams)]

    async def stream(i: int) -> None:
        prompt = [rng.randrange(16, 4000) for _ in range(64)]
        params = SamplingParams(max_tokens=engine.max_context - 64, ignore_eos=True)
        async for out in engine.generate(f"s{i}", prompt, params):
            if out.token is not None:
                arrivals[i].append(time.perf_counter())

    tasks = [asyncio.ensure_future(stream(i)) for i in range(args.streams)]
    windows: list[tuple[float, float]] = []  # each import's
    controls: list[tuple[float, float]] = []  # as long, with no import: the same measure without one
    try:
        while min(len(a) for a in arrivals) < 5:  # every stream prefilled and decoding
            await asyncio.sleep(0.05)
            for task in tasks:
                if task.done():
                    task.result()
        prompt = [rng.randrange(16, 4000) for _ in range(args.import_tokens)]
        blob = _synthetic_blob(model_dir, prompt, "float32")
        nbytes = blob.k.numel() * blob.k.element_size() * 2
        for t in range(args.trials):
            rid = f"import{t}"
            await engine.reserve(rid, prompt, SamplingParams(max_tokens=1), use_cache=False)
            began = time.perf_counter()
            await engine.import_kv(rid, blob)
            windows.append((began, time.perf_counter()))
            await engine.release(rid)
            await asyncio.sleep(0.5)  # the streams settle
            began = time.perf_counter()
            await asyncio.sleep(windows[-1][1] - windows[-1][0])
            controls.append((began, time.perf_counter()))
            await asyncio.sleep(0.5)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # a gap counts for a window it overlaps: longer gaps overlap more often, so the gaps
    # without an import are taken the same way, over windows as long with none
    without, during = [], []
    for times in arrivals:
        for a, b in zip(times, times[1:], strict=False):
            if any(a < end and b > start for start, end in windows):
                during.append(b - a)
            elif any(a < end and b > start for start, end in controls):
                without.append(b - a)
    import_s = [end - start for start, end in windows]
    return {
        "engine": args.engine,
        "streams": args.streams,
        "import_tokens": args.import_tokens,
        "import_bytes": nbytes,
        "import_ms": {"median": 1000 * statistics.median(import_s), "max": 1000 * max(import_s)},
        "import_mb_s": nbytes / statistics.median(import_s) / 1e6,
        "itl_without": _itl(without),
        "itl_during": _itl(during),
    }


def measure(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    from pdd.engines.port import EngineConfig, open_engine

    page = 32 if args.engine == "vllm" else 16  # (vLLM's CPU attention takes multiples of 32)
    pages = (args.import_tokens + 4096) // page + args.streams * 8
    config = EngineConfig(
        page_size=page,
        num_pages=pages,
        max_batch_tokens=2048,
        backend=args.engine,
        device=getattr(args, "device", "cpu"),
    )
    engine = open_engine(model_dir, config, args.threads)
    try:
        return asyncio.run(_measure(engine, model_dir, args))
    finally:
        engine.close()


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from pdd.model.tiny import make_tiny

            model_dir = str(make_tiny(Path(tmp) / "stall", layers=args.layers, max_position=args.import_tokens + 4096))
        r = measure(model_dir, args)
    title = (
        f"pdd bench stall ({r['engine']}): {r['streams']} streams decoding while {r['import_tokens']} tokens' KV "
        f"({r['import_bytes'] / 1e6:.0f} MB) lands, {args.trials} times"
    )
    table = Table(title=title)
    for column in ("inter-token latency", "samples", "p50 ms", "p99 ms", "max ms"):
        table.add_column(column, justify="right")
    for label, key in (("without an import", "itl_without"), ("during an import", "itl_during")):
        s = r[key]
        table.add_row(label, str(s["count"]), f"{s['p50_ms']:.1f}", f"{s['p99_ms']:.1f}", f"{s['max_ms']:.1f}")
    Console().print(table)
    imp = r["import_ms"]
    print(f"import: {imp['median']:.0f} ms median, {imp['max']:.0f} ms max, {r['import_mb_s']:.0f} MB/s")
    base = r["itl_without"]["p99_ms"]
    print(
        f"stall: ITL p99 during import / without = {r['itl_during']['p99_ms'] / base:.2f}; "
        f"max during import / p99 without = {r['itl_during']['max_ms'] / base:.2f}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=2) + "\n")
    return 0
