"""The instances a router drives: those in its config, those that joined since, less
those that were drained and left (PDD_SPEC item 7: decoupled lifecycles).

An instance joins by registering (`pdd serve --join` posts its spec to the router's
admin route); the router connects to it, health-checks it by heartbeats, and tells
every instance where it is (a `Member` frame), since P and the relays must reach a
decode instance their own config may not list. A drain is two-phase, so no request
is refused in between: the router first stops planning work onto the instance, then
sends it DRAIN; the instance finishes what it holds and exits, and only then does the
router forget it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdd.config import ROLES, Deployment, InstanceSpec, groups
from pdd.names import RoleName
from pdd.router.client import InstanceClient, InstanceDown
from pdd.tasks import Tasks
from pdd.transfer import messages as m
from pdd.transfer.tls import client_context

log = logging.getLogger(__name__)


class MembershipError(ValueError):
    """A join or drain that cannot be done (an unknown name, a name taken elsewhere)."""


def member(spec: InstanceSpec) -> m.Member:
    return m.Member(spec.name, RoleName(spec.role), spec.dc, spec.host, spec.kv_port, dict(spec.advertise))


class Membership:
    def __init__(
        self, dep: Deployment, key: bytes, router_id: str, on_result: Callable[[m.Result], None] | None = None
    ) -> None:
        self.dep = dep
        self._on_result = on_result
        self._key, self._router_id = key, router_id
        self._tls = client_context(dep.tls)
        self.clients: dict[str, InstanceClient] = {}
        self.joined = 0
        self.left = 0
        self._tasks = Tasks()
        for spec in dep.instances:
            self._add(spec)

    def _add(self, spec: InstanceSpec) -> InstanceClient:
        client = InstanceClient(
            spec,
            *self.dep.address(spec, self.dep.router.dc),
            self._key,
            self._router_id,
            self.dep.liveness,
            roster=self.roster,
            on_left=self._on_left,
            tls=self._tls,
            on_result=self._on_result,
            on_member=self._heard_of,
        )
        self.clients[spec.name] = client
        self._count_group(spec.group)
        return client

    def _count_group(self, group: str) -> None:
        """A group's ranks take work once all of them are members, and together: a group
        joins whole (a mixture-of-experts group's ranks step in lockstep)."""
        if not group:
            return
        ranks = [c for c in self.clients.values() if c.spec.group == group]
        short = bool(ranks) and len(ranks) < ranks[0].spec.engine.vllm.get(groups.SIZE, 1)
        for c in ranks:
            c.group_short = short

    def roster(self) -> list[m.Member]:
        return [member(c.spec) for c in self.clients.values()]

    def join(self, spec: InstanceSpec) -> bool:
        """Add a registering instance and connect to it; False if it is known already at
        that address (a restarted instance registering again)."""
        known = self.clients.get(spec.name)
        if known is not None:
            if member(known.spec) != member(spec):
                raise MembershipError(f"an instance named {spec.name!r} is already part of the deployment elsewhere")
            known.draining = False
            return False
        if spec.role not in (RoleName.PREFILL, RoleName.RELAY, RoleName.MAIN, RoleName.STANDALONE):
            raise MembershipError(f"unknown role {spec.role!r}")
        self.dep.address(spec, self.dep.router.dc)  # reachable from here, or ConfigError
        client = self._add(spec)
        client.start()
        self.joined += 1
        self._broadcast(member(spec))
        log.info("instance %s (%s, datacenter %s) joined", spec.name, spec.role, spec.dc)
        return True

    def _heard_of(self, body: m.Member) -> None:
        """An instance told of a member: one that joined through another router of the
        deployment (or before this one started) joins here too; one known here already, at
        the same address, changes nothing."""
        if body.name in self.clients or body.role not in ROLES:
            return
        spec = InstanceSpec(
            body.name,
            body.role,
            body.dc,
            body.host,
            kv_port=body.kv_port,
            advertise=dict(body.advertise),
            engine=self.dep.engine,
        )
        try:
            self.join(spec)
        except (MembershipError, ValueError) as e:  # (ConfigError: unreachable from this router's site)
            log.warning("not adding %s, which an instance told of: %s", body.name, e)

    def group_of(self, name: str) -> list[InstanceClient]:
        """The members `name` names: that instance, or every rank of that data-parallel
        group (`pdd.config.groups`), which join and leave whole."""
        if name in self.clients:
            return [self.clients[name]]
        ranks = [c for c in self.clients.values() if c.spec.group == name]
        if not ranks:
            raise MembershipError(f"no instance or group named {name!r}; have {sorted(self.clients)}")
        return ranks

    def groups(self) -> dict[str, list[str]]:
        """Each data-parallel group's ranks (member names), in rank order."""
        out: dict[str, list[str]] = {}
        for c in self.clients.values():
            if c.spec.group:
                out.setdefault(c.spec.group, []).append(c.name)
        return {g: sorted(names) for g, names in out.items()}

    async def drain(self, name: str) -> None:
        """No new work for `name` (an instance, or a group's every rank) from now on; then
        tell each to finish and leave."""
        clients = self.group_of(name)
        for client in clients:  # (no rank takes new work while another still may)
            client.draining = True
        for client in clients:
            try:
                await client.send(m.Drain())
            except InstanceDown:  # gone already: nothing left to finish there
                self._on_left(client)
            log.info("draining instance %s", client.name)

    def _on_left(self, client: InstanceClient) -> None:
        if self.clients.get(client.name) is not client:
            return
        del self.clients[client.name]
        self.left += 1
        self._count_group(client.spec.group)
        self._tasks.spawn(client.stop())
        log.info("instance %s left the deployment", client.name)

    def _broadcast(self, body: m.Member) -> None:
        for c in self.clients.values():
            if c.healthy and c.name != body.name:
                self._tasks.spawn(self._send(c, body))

    @staticmethod
    async def _send(c: InstanceClient, body: m.Member) -> None:
        try:
            await c.send(body)
        except InstanceDown:
            pass  # it hears the whole roster when it reconnects

    def stats(self) -> dict[str, int]:
        return {"joined": self.joined, "left": self.left, "draining": sum(c.draining for c in self.clients.values())}
