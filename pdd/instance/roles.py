"""Which class plays each role: the one place that knows them all (the entry point
wires the chosen one into the node)."""

from __future__ import annotations

from pdd.instance.host import Host, Role
from pdd.instance.main_decode import MainRole
from pdd.instance.prefill import PrefillRole
from pdd.instance.relay import RelayRole
from pdd.instance.standalone import StandaloneRole
from pdd.names import RoleName

ROLE_CLASSES: dict[str, type] = {
    RoleName.STANDALONE: StandaloneRole,
    RoleName.PREFILL: PrefillRole,
    RoleName.RELAY: RelayRole,
    RoleName.MAIN: MainRole,
}


def make_role(host: Host) -> Role:
    return ROLE_CLASSES[host.spec.role](host)
