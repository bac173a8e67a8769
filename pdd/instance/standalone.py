"""The standalone role (colocated mode): one instance prefills and decodes a request."""

from __future__ import annotations

import asyncio
from typing import assert_never

from pdd.instance.role import Node, not_taken, report_failure, tokens_of
from pdd.transfer import messages as m
from pdd.transfer import wire
from pdd.transfer.wire import FramedConnection


class StandaloneRole:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.jobs: dict[str, tuple[str, asyncio.Task]] = {}  # rid -> (router id, its task)

    async def on_router(self, router_id: str, body: m.FromRouter) -> None:
        match body:
            case m.Submit():
                if body.rid not in self.node.aborted and body.rid not in self.jobs:
                    self.jobs[body.rid] = (router_id, self.node.spawn(self._run(router_id, body)))
                    self.node.took()
            case m.Abort():
                self.node.aborted.add(body.rid)
                if body.rid in self.jobs:
                    self.node.engine.abort(body.rid)
            case m.Handoff() | m.CacheUpdate() | m.Member() | m.Drain():
                not_taken(self.node, router_id, body)
            case _:
                assert_never(body)

    async def _run(self, router_id: str, s: m.Submit) -> None:
        try:
            async for out in self.node.engine.generate(s.rid, s.prompt, s.params):
                if out.finish_reason != "abort":
                    self.node.to_router(router_id, tokens_of(s.rid, out))
        except Exception as e:
            await report_failure(self.node, router_id, s.rid, e)
        finally:
            self.jobs.pop(s.rid, None)

    async def on_peer(self, conn: FramedConnection, name: str, frame: wire.Frame) -> None:
        await self.node.send(conn, m.Error("a standalone instance takes no peer traffic"))  # none talks to it

    def peer_lost(self, name: str) -> None:
        pass

    def router_reached(self) -> None:
        pass

    def router_lost(self, router_id: str) -> None:
        for rid, (owner, task) in list(self.jobs.items()):
            if owner == router_id:  # nobody will read these tokens: stop computing them
                self.node.aborted.add(rid)
                task.cancel()

    def held(self) -> int:
        return len(self.jobs)

    def close(self) -> None:
        pass
