"""`pdd bench sampling`: what the sampler's extras cost a decode step.

A batch of `--batch` requests decodes on the embedded engine (through the engine port,
as a server runs it), greedy and plain, then
with each extra on every request: raw logprobs (the chosen token's, and with 5 or 20
top tokens), the penalties (repetition, frequency, presence) and a logit bias, and a
seeded draw with min-p, and a JSON Schema guide. For each: the median step time, and
what the extra adds a token (the step's difference over the batch); and the step the
others see with a guide on one request alone. Printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from rich.console import Console
from rich.table import Table

from pdd.lab.bench import options


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.model_dir(p)
    options.threads(p)
    options.out(p)
    p.add_argument("--batch", type=int, default=16, help="requests decoding together (default 16)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="each request's prompt (default 256)")
    p.add_argument("--steps", type=int, default=48, help="decode steps measured for each (default 48)")


EXTRAS: dict[str, dict] = {
    "plain (greedy)": {},
    "logprobs, chosen token": {"logprobs": 0},
    "logprobs, top 5": {"logprobs": 5},
    "logprobs, top 20": {"logprobs": 20},
    "penalties and logit bias": {
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
        "logit_bias": ((7, 2.0),),
    },
    "seeded draw (top-p 0.95)": {"temperature": 1.0, "top_p": 0.95, "seed": 1},
    "seeded draw with min-p": {"temperature": 1.0, "top_p": 0.95, "seed": 1, "min_p": 0.05},
    "JSON Schema guide": {"guide": ("json_schema", '{"type": "array", "items": {"type": "integer"}}')},
}


async def _step_ms(engine, extra: dict, args: argparse.Namespace, tag: str, only_one: bool = False) -> float:
    """The median gap (ms) between a request's tokens while `--batch` requests with
    `extra` decode together (one token a step each: the decode step's time). `only_one`:
    the extra on the first request alone, the gaps of the others (what it costs them)."""
    from pdd.sampling.params import SamplingParams

    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True, **extra)
    plain = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True)

    async def one(i: int) -> list[float]:
        prompt = [rng.randrange(16, 4000) for _ in range(args.prompt_tokens)]
        times = []
        async for out in engine.generate(f"{tag}{i}", prompt, plain if only_one and i else params):
            if out.token is not None:
                times.append(time.perf_counter())
        return [b - a for a, b in zip(times[2:], times[3:], strict=False)]  # (past the prefill's)

    gaps = await asyncio.gather(*(one(i) for i in range(args.batch)))
    return 1000 * statistics.median(g for request in gaps[1 if only_one else 0 :] for g in request)


def run(args: argparse.Namespace) -> int:
    from pdd.engines.port import EngineConfig, open_engine
    from pdd.model.store import resolve_model

    pages = args.batch * ((args.prompt_tokens + args.steps + 2) // 16 + 2) + 8
    config = EngineConfig(page_size=16, num_pages=pages, max_running=args.batch, max_batch_tokens=4096)
    engine = open_engine(resolve_model(args.model or ""), config, args.threads)
    try:
        ms = asyncio.run(_all(engine, args))
    finally:
        engine.close()
    plain = ms["plain (greedy)"]
    title = (
        f"A decode step of {args.batch} requests with the sampler's extras on every one "
        f"({args.threads} thread(s), the median gap between a request's tokens)"
    )
    table = Table(title=title)
    for col in ("extra", "step ms", "added a token, µs", "x plain"):
        table.add_column(col, justify="right")
    for name, value in ms.items():
        table.add_row(name, f"{value:.2f}", f"{1000 * (value - plain) / args.batch:.0f}", f"{value / plain:.2f}")
    Console().print(table)
    if args.out:
        args.out.write_text(json.dumps({"batch": args.batch, "step_ms": ms}, indent=2) + "\n")
    return 0


async def _all(engine, args: argparse.Namespace) -> dict[str, float]:
    await _step_ms(engine, {}, args, "warm")
    ms = {name: await _step_ms(engine, extra, args, f"r{n}-") for n, (name, extra) in enumerate(EXTRAS.items())}
    guide = EXTRAS["JSON Schema guide"]
    ms["JSON Schema guide on one request: the others' step"] = await _step_ms(engine, guide, args, "one-", True)
    return ms
