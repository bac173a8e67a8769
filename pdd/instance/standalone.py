"""The standalone role (colocated mode): one instance prefills and decodes a request."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pdd.transfer import messages as m

if TYPE_CHECKING:
    from pdd.engine_port import StepOutput
    from pdd.instance.node import Node


def tokens_of(rid: str, out: StepOutput) -> m.Tokens:
    return m.Tokens(rid, max(out.position, 0), [] if out.token is None else [out.token], out.finish_reason,
                    out.cached_tokens)


async def report_failure(node: Node, router_id: str, rid: str, error: BaseException) -> None:
    """Tell the router a request failed here; the instance keeps serving. A peer that
    was lost or timed out is the deployment's failure, not the request's (503)."""
    lost = isinstance(error, (ConnectionError, asyncio.TimeoutError))
    node.to_router(router_id, m.Error(f"{type(error).__name__}: {error}", rid, lost=lost))


class WholeRequests:
    """Requests this instance prefills and decodes itself: every request of a standalone
    instance, and the anomaly filter's requests on a relay."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.jobs: dict[str, tuple[str, asyncio.Task]] = {}  # rid -> (router id, its task)

    def submit(self, router_id: str, s: m.Submit) -> None:
        if s.rid not in self.node.aborted and s.rid not in self.jobs:
            self.jobs[s.rid] = (router_id, self.node.spawn(self._run(router_id, s)))
            self.node.took()

    def abort(self, rid: str) -> None:
        self.node.aborted.add(rid)
        if rid in self.jobs:
            self.node.engine.abort(rid)

    async def _run(self, router_id: str, s: m.Submit) -> None:
        try:
            async for out in self.node.engine.generate(s.rid, s.prompt, s.params):
                if out.finish_reason != "abort":
                    self.node.to_router(router_id, tokens_of(s.rid, out))
        except Exception as e:
            await report_failure(self.node, router_id, s.rid, e)
        finally:
            self.jobs.pop(s.rid, None)

    def router_lost(self, router_id: str) -> None:
        for rid, (owner, task) in list(self.jobs.items()):
            if owner == router_id:  # nobody will read these tokens: stop computing them
                self.node.aborted.add(rid)
                task.cancel()


class StandaloneRole:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.whole = WholeRequests(node)

    async def on_router(self, router_id: str, body: Any) -> None:
        if isinstance(body, m.Submit):
            self.whole.submit(router_id, body)
        elif isinstance(body, m.Abort):
            self.whole.abort(body.rid)
        else:
            self.node.to_router(router_id, m.Error(f"a standalone instance does not take {type(body).__name__}",
                                                   getattr(body, "rid", None)))

    async def on_peer(self, conn, name, frame) -> None:  # no instance talks to a standalone one
        await self.node.send(conn, m.Error("a standalone instance takes no peer traffic"))

    def peer_lost(self, name: str) -> None:
        pass

    def router_lost(self, router_id: str) -> None:
        self.whole.router_lost(router_id)

    def held(self) -> int:
        return len(self.whole.jobs)
