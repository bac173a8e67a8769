"""What a role needs from the instance that hosts it, and what every role shares.

The node (`pdd.instance.node`) accepts connections and dispatches frames to its role;
the roles (prefill, relay, main, standalone) own the requests. Roles see their node
only through `Node`, so neither imports the other: the instance's entry point wires
a role (`pdd.instance.roles`) into a node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

from pdd.config import Deployment, InstanceSpec
from pdd.engines.port import EnginePort, StepOutput
from pdd.transfer import messages as m
from pdd.transfer import wire
from pdd.transfer.wire import FramedConnection

MAX_TOMBSTONES = 4096


class Tombstones:
    """Recently ended request ids, so a request that arrives after its abort never runs."""

    def __init__(self, limit: int = MAX_TOMBSTONES) -> None:
        self._ids: dict[str, None] = {}
        self._limit = limit
        self.count = 0  # requests ever added (an abort that reached this instance is visible in its stats)

    def add(self, rid: str) -> None:
        self.count += rid not in self._ids
        self._ids[rid] = None
        while len(self._ids) > self._limit:
            del self._ids[next(iter(self._ids))]

    def __contains__(self, rid: str) -> bool:
        return rid in self._ids


class Node(Protocol):
    spec: InstanceSpec
    dep: Deployment  # (replaced as members join: read it at use)
    engine: EnginePort
    key: bytes  # for the framed connections this instance opens
    aborted: Tombstones

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task: ...

    async def send(self, conn: FramedConnection, body: m.Message) -> bool:
        """Send, or log why not (False): a peer that went away is its reader's business."""

    def to_router(self, router_id: str, body: m.ToRouter) -> None:
        """Queue a body for one router, in order; dropped if that router is gone."""

    def full(self) -> bool:
        """Whether a new request would take this instance past `max_requests`."""

    def took(self) -> None:
        """A role took a request (the node keeps the high-water mark)."""


class Role(Protocol):
    async def on_router(self, router_id: str, body: m.FromRouter) -> None:
        """A body from a router (SUBMIT, ABORT, a takeover HANDOFF)."""

    def held(self) -> int:
        """Requests this instance holds now (what `max_requests` bounds)."""

    async def on_peer(self, conn: FramedConnection, name: str, frame: wire.Frame) -> None:
        """A frame from another instance that connected here."""

    def peer_lost(self, name: str) -> None:
        """A connection from another instance (by its name) is gone."""

    def router_reached(self) -> None:
        """A router connected: the deployment is up, and a role that sends to other
        instances opens its connections to them now (`PeerPool.warm`)."""

    def router_lost(self, router_id: str) -> None:
        """A router is gone: nobody will read its requests' tokens."""

    def close(self) -> None:
        """The instance stops: close what the role opened."""


def tokens_of(rid: str, out: StepOutput) -> m.Tokens:
    tokens, logprobs = (
        ([], None) if out.token is None else ([out.token], None if out.logprob is None else [out.logprob])
    )
    position = max(out.position, 0)
    return m.Tokens(
        rid,
        position,
        tokens,
        out.finish_reason,
        out.cached_tokens,
        logprobs=logprobs,
        prompt_logprobs=out.prompt_logprobs if position == 0 and tokens else None,
    )


class PeerBusy(RuntimeError):
    """A peer refused the request for now: it holds all it may (its reservation's `busy`).
    The client may come back later: the router answers 429, not 500."""


def not_taken(node: Node, router_id: str, body: m.FromRouter) -> None:
    """Tell the router this instance's role takes no `body` (what the node does not
    answer itself, and the role has no use for)."""
    rid = getattr(body, "rid", None)
    node.to_router(router_id, m.Error(f"a {node.spec.role} instance does not take {type(body).__name__}", rid))


async def report_failure(node: Node, router_id: str, rid: str, error: BaseException) -> None:
    """Tell the router a request failed here; the instance keeps serving. A peer that
    was lost or timed out is the deployment's failure, not the request's (503); a peer
    that was full, a reason to come back later (429)."""
    lost = isinstance(error, (ConnectionError, asyncio.TimeoutError))
    busy = isinstance(error, PeerBusy)
    node.to_router(router_id, m.Error(f"{type(error).__name__}: {error}", rid, lost=lost, busy=busy))
