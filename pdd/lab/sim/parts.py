"""What `pdd.lab.sim.cluster.Cluster` provides to its halves (`PrefillPaths`, `RelayPaths`,
`Reservations`): declared once here, so each half is checked against the same
signatures the cluster implements, and defines none of them itself."""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, TypeAlias

import simpy

if TYPE_CHECKING:
    from pdd.lab.sim.cluster import DeploymentSpec
    from pdd.lab.sim.instance import Instance
    from pdd.lab.sim.link import SharedLink
    from pdd.lab.sim.sequence import SimSeq
    from pdd.lab.sim.tcp import TcpLink
    from pdd.lab.sim.workload import SimSession
    from pdd.policy.transfer import LineMeter
    from pdd.record import RequestRecord

# A simpy process body (what `Environment.process` runs) that returns nothing.
Proc: TypeAlias = Generator[simpy.Event, object, None]


class ClusterParts:
    """The cluster's state and helpers its halves use; Cluster defines them."""

    env: simpy.Environment
    spec: DeploymentSpec
    instances: dict[str, Instance]
    wan: SharedLink | TcpLink | None

    if TYPE_CHECKING:  # provided by Cluster

        def link(self, a: Instance, b: Instance) -> SharedLink | TcpLink: ...

        def line_meter(self, p: Instance, peer: Instance) -> LineMeter: ...

        def send(
            self, a: Instance, b: Instance, rec: RequestRecord, tokens: tuple[int, int], priority: int
        ) -> Proc: ...

        def _keys(self, s: SimSession, tokens: int) -> list: ...

        def _fits(self, inst: Instance, seq: SimSeq, rec: RequestRecord) -> bool: ...

        def _until_finished(self, inst: Instance, seq: SimSeq, submit: bool = True) -> simpy.Event: ...
