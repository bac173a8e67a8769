"""The main decode role (MD): the remote datacenter's decode capacity.

It receives the KV delta its reservation asked for and either decodes at once (P -> MD)
or, behind a relay (P -> RLD -> MD), waits for the relay's handoff.
"""

from __future__ import annotations

from pdd.instance.receiver import DecodeSide


class MainRole(DecodeSide):
    pass
