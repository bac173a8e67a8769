"""The standalone role (colocated mode): one instance prefills and decodes a request."""

from __future__ import annotations

from typing import Any

from pdd.instance.host import Host, WholeRequests
from pdd.transfer import messages as m
from pdd.transfer import wire
from pdd.transfer.wire import FramedConnection


class StandaloneRole:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.whole = WholeRequests(host)

    async def on_router(self, router_id: str, body: Any) -> None:
        if isinstance(body, m.Submit):
            self.whole.submit(router_id, body)
        elif isinstance(body, m.Abort):
            self.whole.abort(body.rid)
        else:
            self.host.to_router(
                router_id,
                m.Error(f"a standalone instance does not take {type(body).__name__}", getattr(body, "rid", None)),
            )

    async def on_peer(self, conn: FramedConnection, name: str, frame: wire.Frame) -> None:
        await self.host.send(conn, m.Error("a standalone instance takes no peer traffic"))  # none talks to it

    def peer_lost(self, name: str) -> None:
        pass

    def router_lost(self, router_id: str) -> None:
        self.whole.router_lost(router_id)

    def held(self) -> int:
        return len(self.whole.jobs)

    def close(self) -> None:
        pass
