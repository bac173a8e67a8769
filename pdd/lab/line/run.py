"""A line, its routes and (optionally) its admin API, run together until told to stop:
what `pdd line` runs, and what tests run in their own event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import asdict

from pdd.lab.line.admin import AdminServer, admin_app
from pdd.lab.line.emulated import EmulatedLine, LineSettings
from pdd.lab.line.relay import LineRelay, Route

ReadyCallback = Callable[[LineRelay, str | None], None]


async def run_line(
    routes: Sequence[Route],
    settings: LineSettings,
    admin_addr: tuple[str, int] | None = None,
    ready_cb: ReadyCallback | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run a line with its routes (and admin API) until `stop` is set or the task is cancelled.

    `ready_cb(relay, admin_url)` is called once everything listens; the relay gives
    the bound ports and the line for in-process fault injection.
    """
    relay = LineRelay(EmulatedLine(**asdict(settings)), routes)
    await relay.start()
    admin: AdminServer | None = None
    try:
        if admin_addr is not None:
            admin = AdminServer(admin_app(relay), *admin_addr)
            await admin.start()
        if ready_cb is not None:
            ready_cb(relay, admin.url if admin else None)
        await (stop or asyncio.Event()).wait()
    finally:
        if admin is not None:
            await admin.stop()
        await relay.stop()
