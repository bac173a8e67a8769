"""`pdd bench engine`: raw engine throughput, then the same model through the HTTP API.

Numbers are printed, never asserted: this machine is shared and noisy, so compare
runs side by side rather than against fixed thresholds. torch is imported when the
benchmark runs, not when `pdd bench` parses its options.
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

import httpx
from rich.console import Console
from rich.table import Table

from pdd.engines.port import EnginePort, engine_names
from pdd.lab.bench import options
from pdd.lab.bench.sse import chunks
from pdd.lab.deploy import PDD_COMMAND, STOP_GRACE_S, free_port, start, stop_group, wait_http


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.model_dir(p)
    options.threads(p)
    options.out(p)
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement; the median is reported")
    p.add_argument("--engine", choices=engine_names(), default="embedded", help="engine backend")
    p.add_argument("--skip-http", action="store_true", help="measure the engine only")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N: for the engine and the served instance")


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(16, 4000) for _ in range(n)]


def engine_numbers(model_dir: str, repeats: int, backend: str = "embedded", device: str = "cpu") -> dict[str, float]:
    """Prefill and decode throughput of one engine, through the engine port (any backend)."""
    from pdd.engines.port import EngineConfig, open_engine

    config = EngineConfig(
        page_size=16, num_pages=4096, max_batch_tokens=2048, max_running=64, device=device, backend=backend
    )
    engine = open_engine(model_dir, config)
    try:
        return asyncio.run(_engine_numbers(engine, repeats))
    finally:
        engine.close()


async def _engine_numbers(engine: EnginePort, repeats: int) -> dict[str, float]:
    from pdd.sampling.params import SamplingParams

    rng = random.Random(0)
    counter = iter(range(1 << 30))

    async def run(prompt: list[int], max_tokens: int) -> list[float]:
        """When each output token came (perf_counter seconds)."""
        times = []
        async for out in engine.generate(
            f"b{next(counter)}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        ):
            if out.token is not None:
                times.append(time.perf_counter())
        return times

    async def prefill_seconds(prompt: list[int]) -> float:
        t = time.perf_counter()
        await run(prompt, 1)
        return time.perf_counter() - t

    async def decode_seconds(prompts: list[list[int]], steps: int) -> float:
        """From the batch's last first token to its last token: decode steps only."""
        times = await asyncio.gather(*(run(p, steps + 1) for p in prompts))
        return max(t[-1] for t in times) - max(t[0] for t in times)

    out: dict[str, float] = {}
    for n in (512, 2048):
        await prefill_seconds(_prompt(rng, n))  # warm-up
        seconds = [await prefill_seconds(_prompt(rng, n)) for _ in range(repeats)]  # fresh prompts: no cache hit
        out[f"prefill_{n}_tok_s"] = n / statistics.median(seconds)
    steps = 64
    for batch in (1, 8, 32):
        await decode_seconds([_prompt(rng, 128) for _ in range(batch)], steps)  # warm-up
        seconds = [await decode_seconds([_prompt(rng, 128) for _ in range(batch)], steps) for _ in range(repeats)]
        out[f"decode_batch{batch}_tok_s"] = batch * steps / statistics.median(seconds)
    return out


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0, ttft, n = time.perf_counter(), None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for _, chunk in chunks(r):
            ids = chunk["choices"][0].get("token_ids", [])
            if ids and ttft is None:
                ttft = time.perf_counter() - t0
            n += len(ids)
    return ttft or float("nan"), n


async def _http_numbers(url: str, repeats: int) -> dict[str, float]:
    rng = random.Random(1)
    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=120) as client:
        await _stream(client, url, _prompt(rng, 500), 64)  # warm-up
        ttfts = [(await _stream(client, url, _prompt(rng, 500), 64))[0] for _ in range(repeats)]
        out["http_ttft_500_ms"] = statistics.median(ttfts) * 1000
        for prompt_len in (32, 500):  # short prompts measure decode; long ones add 8 prefills
            rates = []
            for _ in range(repeats):
                t = time.perf_counter()
                results = await asyncio.gather(*(_stream(client, url, _prompt(rng, prompt_len), 64) for _ in range(8)))
                rates.append(sum(n for _, n in results) / (time.perf_counter() - t))
            out[f"http_8x64_prompt{prompt_len}_out_tok_s"] = statistics.median(rates)
    return out


def http_numbers(model_dir: str, repeats: int, threads: int = 1, device: str = "cpu") -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = ["serve", "--model", model_dir, "--port", str(port), "--served-model-name", "bench"]
    proc = start([*PDD_COMMAND, *serve, "--num-pages", "4096", "--threads", str(threads), "--device", device])
    try:
        wait_http(f"{url}/health", proc, 60)
        return asyncio.run(_http_numbers(url, repeats))
    finally:
        stop_group(proc, STOP_GRACE_S)


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from pdd.model.tiny import make_tiny

            model_dir = str(make_tiny(Path(tmp) / "tiny"))
        results = engine_numbers(model_dir, args.repeats, args.engine, args.device)
        if not args.skip_http:
            results.update(http_numbers(model_dir, args.repeats, args.threads, args.device))
    table = Table(title=f"pdd bench engine ({Path(model_dir).name}, {args.device}, {args.threads} torch thread(s))")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for k, v in results.items():
        table.add_row(k, f"{v:,.1f}")
    console.print(table)
    if getattr(args, "out", None):
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0
