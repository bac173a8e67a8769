"""KV frames placed by a transfer engine inside a datacenter (`[link] intra_kv`), both ends.

The sender (`Placements`, in P's `PeerPool`) asks each KV connection's receiver, once,
for a region (KV_REGION_ASK); from then on a KV frame's payload is written into a slot
of that region by the transfer engine (`pdd.transfer.mooncake`), and only a KV_PLACED
saying where, how long and its SHA-256 goes on the connection, in the frame's place, so
everything the connection carries stays in order. The receiver (`Regions`, in the node)
copies the slot out, checks the digest, frees the slot (KV_SLOT_FREE) and hands the
bytes on as the KV_LAYER frame they are: the roles never know how KV came. Where the
engine cannot run, or the receiver says it cannot, KV stays on the connection ("auto",
said once a peer), or the instance does not start ("mooncake", `check_start`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdd.config import InstanceSpec
from pdd.kv.slots import Slots
from pdd.transfer import messages as m
from pdd.transfer import mooncake
from pdd.transfer.wire import Frame, FramedConnection, MsgType

log = logging.getLogger(__name__)
REGION_TIMEOUT_S = 5.0  # a receiver that does not answer KV_REGION_ASK (an older release) is sent frames


def check_start(spec: InstanceSpec, intra_kv: str) -> None:
    """An instance configured for "mooncake" by name does not start without it."""
    if intra_kv == "mooncake":
        try:
            mooncake.endpoint(mooncake.local_host(spec.host))
        except mooncake.Unavailable as e:
            raise RuntimeError(f'[link] intra_kv = "mooncake": {e}') from None


@dataclass(eq=False)
class Placement:
    """One KV connection's way through the transfer engine: the receiver's region and ours."""

    endpoint: mooncake.Endpoint
    remote: mooncake.RemoteRegion
    local: torch.Tensor
    slots: Slots = field(init=False)

    def __post_init__(self) -> None:
        self.slots = Slots(self.remote.slots)

    async def place(self, payload: bytes) -> m.KVPlaced:
        """Write `payload` into a free slot of the receiver's (through ours, which the engine
        reads from); the slot stays taken until the receiver frees it."""
        slot = await self.slots.take()
        try:
            digest = await asyncio.to_thread(self._write, slot, payload)
        except BaseException:
            self.slots.give(slot)
            raise
        return m.KVPlaced(slot, len(payload), digest)

    def _write(self, slot: int, payload: bytes) -> str:
        size = self.remote.slot_bytes
        local = self.local[slot * size : slot * size + len(payload)]
        local.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.endpoint.write_sync(local, self.remote, slot, len(payload))
        return hashlib.sha256(payload).hexdigest()


class Placements:
    """The sender's side: a Placement per KV connection to a peer of this datacenter, or None."""

    def __init__(self, spec: InstanceSpec, local: Callable[[str], bool], mode: Callable[[], str]) -> None:
        self._spec, self._local, self._mode = spec, local, mode
        self._by_conn: dict[FramedConnection, Placement | None] = {}
        self._asked: dict[FramedConnection, asyncio.Future[m.KVRegion]] = {}
        self._said: set[str] = set()  # peers told about once

    async def of(self, name: str, conn: FramedConnection) -> Placement | None:
        if self._mode() == "tcp" or not self._local(name):
            return None
        if conn not in self._by_conn:
            self._by_conn[conn] = await self._negotiate(name, conn)
        return self._by_conn[conn]

    async def _negotiate(self, name: str, conn: FramedConnection) -> Placement | None:
        try:
            endpoint = mooncake.endpoint(mooncake.local_host(self._spec.host))
            fut = self._asked[conn] = asyncio.get_running_loop().create_future()
            await m.send(conn, m.KVRegionAsk("mooncake"))
            region = await asyncio.wait_for(fut, REGION_TIMEOUT_S)
            if region.error:
                raise mooncake.Unavailable(f"{name} says: {region.error}")
            remote = mooncake.RemoteRegion(region.session, region.address, region.slot_bytes, region.slots)
            placement = Placement(endpoint, remote, endpoint.region(remote.slot_bytes, remote.slots))
        except (mooncake.Unavailable, TimeoutError) as e:
            why = "no answer to KV_REGION_ASK" if isinstance(e, TimeoutError) else str(e)
            if name not in self._said:
                self._said.add(name)
                log.warning("KV to %s in this datacenter goes over TCP, not the transfer engine: %s", name, why)
            return None
        finally:
            self._asked.pop(conn, None)
        if name not in self._said:
            self._said.add(name)
            log.info("KV to %s goes through the transfer engine (%s)", name, endpoint.protocol)
        return placement

    def answer(self, conn: FramedConnection, body: Any) -> bool:
        """Take the transfer engine's replies on `conn`; whether `body` was one."""
        if isinstance(body, m.KVRegion):
            fut = self._asked.get(conn)
            if fut is not None and not fut.done():
                fut.set_result(body)
            return True
        if isinstance(body, m.KVSlotFree):
            placement = self._by_conn.get(conn)
            if placement is not None and body.slot < placement.slots.count:
                placement.slots.give(body.slot)
            return True
        return False

    def forget(self, conn: FramedConnection) -> None:
        placement = self._by_conn.pop(conn, None)
        if placement is not None:
            placement.endpoint.release(placement.local)


class Regions:
    """The receiver's side: a registered region per KV connection that asked for one."""

    def __init__(self, spec: InstanceSpec) -> None:
        self._spec = spec
        self._by_conn: dict[FramedConnection, tuple[mooncake.Endpoint, torch.Tensor]] = {}
        self.placed = {"frames": 0, "bytes": 0}  # KV frames that came through the transfer engine

    async def on_frame(self, conn: FramedConnection, frame: Frame) -> Frame | None:
        """A frame of a peer's connection as the role should see it: KV_REGION_ASK is
        answered here (None), KV_PLACED becomes the KV_LAYER frame it stands for."""
        if frame.type == MsgType.KV_REGION_ASK:
            m.decode(frame)
            await m.send(conn, self._offer(conn))
            return None
        if frame.type != MsgType.KV_PLACED:
            return frame
        placed = m.decode(frame)
        got = self._by_conn.get(conn)
        if got is None:
            raise m.BadMessage("KV_PLACED on a connection that has no region")
        _, region = got
        size = region.numel() // mooncake.SLOTS
        if placed.slot >= mooncake.SLOTS or placed.nbytes > size:
            raise m.BadMessage(f"KV_PLACED slot {placed.slot} of {placed.nbytes} bytes is outside the region")
        data = bytes(region[placed.slot * size : placed.slot * size + placed.nbytes].numpy())  # (copied out first)
        await m.send(conn, m.KVSlotFree(placed.slot))
        if hashlib.sha256(data).hexdigest() != placed.sha256:
            raise m.BadMessage(f"KV placed in slot {placed.slot} does not match its SHA-256")
        self.placed["frames"] += 1
        self.placed["bytes"] += len(data)
        return Frame(MsgType.KV_LAYER, frame.seq, data, frame.version)

    def _offer(self, conn: FramedConnection) -> m.KVRegion:
        try:
            endpoint = mooncake.endpoint(mooncake.local_host(self._spec.host))
            if conn not in self._by_conn:
                self._by_conn[conn] = (endpoint, endpoint.region())
        except mooncake.Unavailable as e:
            return m.KVRegion(error=str(e))
        endpoint, region = self._by_conn[conn]
        return m.KVRegion(endpoint.session, region.data_ptr(), region.numel() // mooncake.SLOTS, mooncake.SLOTS)

    def forget(self, conn: FramedConnection) -> None:
        got = self._by_conn.pop(conn, None)
        if got is not None:
            got[0].release(got[1])
