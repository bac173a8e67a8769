"""Which class plays each role: the one place that knows them all (the entry point
wires the chosen one into the node)."""

from __future__ import annotations

from pdd.instance.main_decode import MainRole
from pdd.instance.prefill import PrefillRole
from pdd.instance.relay import RelayRole
from pdd.instance.role import Node, Role
from pdd.instance.standalone import StandaloneRole
from pdd.names import RoleName

ROLE_CLASSES: dict[str, type] = {
    RoleName.STANDALONE: StandaloneRole,
    RoleName.PREFILL: PrefillRole,
    RoleName.RELAY: RelayRole,
    RoleName.MAIN: MainRole,
}


def make_role(node: Node) -> Role:
    return ROLE_CLASSES[node.spec.role](node)
