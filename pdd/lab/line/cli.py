"""`pdd line`: a userspace TCP relay that behaves like a long line between sites."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable
from typing import Any

from pdd.addresses import parse_addr
from pdd.lab.line.emulated import JITTER_DISTS, LineSettings
from pdd.lab.line.relay import LineRelay, Route
from pdd.lab.line.run import run_line


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


def add_parser(sub: Any) -> None:
    """Register `pdd line` on the top-level sub-command parsers."""
    p = sub.add_parser(
        "line",
        help="run the line emulator (a TCP relay with bandwidth, delay, jitter and faults)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "--route", action="append", required=True, type=_arg(Route.parse),
        metavar="LISTEN_HOST:PORT=TARGET_HOST:PORT", help="relay a local port to a target (repeatable)",
    )  # fmt: skip
    defaults = LineSettings()
    p.add_argument("--bandwidth-mbps", type=float, default=defaults.bandwidth_mbps, help="per direction, shared")
    p.add_argument("--delay-ms", type=float, default=defaults.delay_ms, help="one-way delay")
    p.add_argument("--jitter-ms", type=float, default=defaults.jitter_ms, help="bound of the one-way jitter")
    p.add_argument("--jitter-dist", choices=JITTER_DISTS, default=defaults.jitter_dist)
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed of the jitter")
    p.add_argument("--admin", type=_arg(parse_addr), metavar="HOST:PORT", help="serve the HTTP admin API here")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        settings = LineSettings(args.bandwidth_mbps, args.delay_ms, args.jitter_ms, args.jitter_dist, args.seed)
    except ValueError as err:
        print(f"line: {err}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve_until_signal(args.route, settings, args.admin))
    except OSError as err:
        print(f"line: {err}", file=sys.stderr)
        return 1
    return 0


async def _serve_until_signal(routes: list[Route], settings: LineSettings, admin: tuple[str, int] | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def announce(relay: LineRelay, admin_url: str | None) -> None:
        for route, port in zip(relay.routes, relay.listen_ports, strict=True):
            print(f"line: {route.listen_host}:{port} -> {route.target_host}:{route.target_port}")
        if admin_url:
            print(f"line admin: {admin_url}")
        sys.stdout.flush()

    await run_line(routes, settings, admin, announce, stop)
