"""A line, its routes and (optionally) its admin API, run together until told to stop:
what `pdd wan` runs, and what tests run in their own event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import asdict

from pdd.lab.wan.admin import AdminServer, admin_app
from pdd.lab.wan.line import LinkSettings, WanLine
from pdd.lab.wan.relay import Route, WanRelay

ReadyCallback = Callable[[WanRelay, str | None], None]


async def run_wan(
    routes: Sequence[Route],
    settings: LinkSettings,
    admin_addr: tuple[str, int] | None = None,
    ready_cb: ReadyCallback | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run a line with its routes (and admin API) until `stop` is set or the task is cancelled.

    `ready_cb(relay, admin_url)` is called once everything listens; the relay gives
    the bound ports and the line for in-process fault injection.
    """
    relay = WanRelay(WanLine(**asdict(settings)), routes)
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
