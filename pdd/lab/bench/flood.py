"""`pdd bench flood`: everything at once, and every answer accounted for.

A flood sends `--requests` requests at the same instant, each a distinct prompt (no
prefix is shared, so every one costs its full KV), half streamed and half not. Under
load a server may refuse a request up front (429 or 503, with Retry-After), but one it
takes must complete: this counts every outcome — whole answers, refusals, and
everything else (a 5xx, an error event in a stream, a short answer, a reset) — and
exits 1 if anything falls in that last column.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from rich.console import Console
from rich.table import Table

from pdd.lab.bench import options
from pdd.lab.bench.sse import chunks_of

REFUSED = (429, 503)
DEFAULT_VOCAB = 4096  # a server that does not say its vocabulary: the tiny model's


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.server(p)
    options.client(p)
    p.add_argument("--requests", type=int, default=100, help="requests sent at once (default 100)")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="tokens per prompt (default 1000)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default 32)")
    p.add_argument("--stream-share", type=float, default=0.5, help="share of requests streamed (default 0.5)")


@dataclass
class FloodOutcome:
    sent: int
    wall_s: float
    whole: int = 0  # 200, every token there
    refused: int = 0  # 429 / 503 with Retry-After
    other: list[str] = field(default_factory=list)  # what went wrong, one line per request
    statuses: Counter = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not self.other and self.whole + self.refused == self.sent


def _prompt(i: int, tokens: int, vocab: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(1, vocab) for _ in range(tokens)]


async def _one(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int, stream: bool
) -> tuple[int | str, str | None]:
    """(HTTP status or "error", None when whole / refused properly, else what was wrong)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            raw = await r.aread()
    except httpx.HTTPError as e:
        return "error", f"{type(e).__name__}: {e}"
    if r.status_code in REFUSED:
        after = r.headers.get("retry-after", "")
        return r.status_code, None if after.isdigit() and int(after) >= 1 else f"{r.status_code} without Retry-After"
    if r.status_code != 200:
        return r.status_code, f"{r.status_code}: {raw[:200].decode(errors='replace')}"
    ids: list[int] = []
    finish: str | None = None
    try:
        if stream:
            for _, chunk in chunks_of(raw.decode()):
                if "error" in chunk:
                    return 200, f"error event: {chunk['error'].get('message', '')[:160]}"
                choice = chunk["choices"][0]
                ids += choice.get("token_ids") or []
                finish = choice.get("finish_reason") or finish
        else:
            choice = json.loads(raw)["choices"][0]
            ids, finish = choice["token_ids"], choice["finish_reason"]
    except (ValueError, KeyError, IndexError) as e:
        return 200, f"unreadable answer: {e}"
    if len(ids) != max_tokens or finish != "length":
        return 200, f"short answer: {len(ids)} of {max_tokens} tokens, finish {finish}"
    return 200, None


async def flood(
    url: str,
    requests: int,
    prompt_tokens: int = 1000,
    max_tokens: int = 32,
    stream_share: float = 0.5,
    model: str | None = None,
    vocab: int | None = None,
    timeout_s: float = 600.0,
    seed: int = 0,
) -> FloodOutcome:
    """Send `requests` at once and sort every answer (`FloodOutcome`). Prompt token IDs
    are drawn below `vocab` (default: the served model's, from /v1/models)."""
    limits = httpx.Limits(max_connections=requests + 8, max_keepalive_connections=requests + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=False) as client:
        served = (await client.get(f"{url}/v1/models")).json()["data"][0]
        model = model or served["id"]
        vocab = vocab or int(served.get("vocab_size") or DEFAULT_VOCAB)
        if vocab < 2:
            raise ValueError(f"a vocabulary of {vocab} token IDs cannot make distinct prompts")
        started = time.monotonic()
        streamed = round(requests * stream_share)
        results = await asyncio.gather(
            *(
                _one(client, url, model, _prompt(seed * 1_000_003 + i, prompt_tokens, vocab), max_tokens, i < streamed)
                for i in range(requests)
            )
        )
        out = FloodOutcome(requests, time.monotonic() - started)
    for status, wrong in results:
        out.statuses[str(status)] += 1
        if wrong is not None:
            out.other.append(wrong)
        elif status == 200:
            out.whole += 1
        else:
            out.refused += 1
    return out


def run(args: argparse.Namespace) -> int:
    try:
        out = asyncio.run(
            flood(
                args.url,
                args.requests,
                args.prompt_tokens,
                args.max_tokens,
                args.stream_share,
                args.model,
                args.vocab_size,
                args.timeout_s,
                args.seed,
            )
        )
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise SystemExit(f"pdd bench flood: cannot flood {args.url}: {type(e).__name__}: {e}") from None
    table = Table(
        title=f"flood: {out.sent} requests at once ({args.prompt_tokens}-token prompts, {args.max_tokens} tokens each)"
    )
    for col in ("sent", "200 whole", "429/503 + Retry-After", "other", "wall s"):
        table.add_column(col, justify="right")
    table.add_row(str(out.sent), str(out.whole), str(out.refused), str(len(out.other)), f"{out.wall_s:.1f}")
    Console().print(table)
    print("statuses:", dict(out.statuses))
    for what, n in Counter(out.other).most_common(5):
        print(f"  {n} x {what}")
    return 0 if out.ok else 1
