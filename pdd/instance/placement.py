"""KV frames placed by a transfer engine inside a datacenter (`[line] intra_kv`), both ends.

The sender (`Placements`, in P's `PeerPool`) asks each KV connection's receiver, once,
for a region (KV_REGION_ASK); from then on a KV frame's payload is written into a slot
of that region by the transfer engine (`pdd.transfer.mooncake`), and only a KV_PLACED
saying where, how long and its tag goes on the connection, in the frame's place, so
everything the connection carries stays in order. The receiver (`Regions`, in the node)
copies the slot out, checks the tag (a GMAC under a key derived from the connection's
session key: nothing written into the region by anyone else passes), frees the slot
(KV_SLOT_FREE) and hands the
bytes on as the KV_LAYER frame they are: the roles never know how KV came. Where the
engine cannot run, or the receiver says it cannot, KV stays on the connection ("auto",
said once a peer), or the instance does not start ("mooncake", `check_start`).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import crc32c
import numpy as np
import torch

from pdd.config import InstanceSpec
from pdd.kv.slots import Slots
from pdd.transfer import messages as m
from pdd.transfer import mooncake
from pdd.transfer.wire import Frame, FramedConnection, MsgType, Payload, parts_of, payload_len
from pdd.transfer.wire.frame import gmac

log = logging.getLogger(__name__)
PLACED_LABEL = b"kv placed"  # the tags' key, from the connection's session key of P's direction
REGION_TIMEOUT_S = 5.0  # a receiver that does not answer KV_REGION_ASK (an older release) is sent frames


def check_start(spec: InstanceSpec, intra_kv: str) -> None:
    """An instance configured for "mooncake" by name does not start without it."""
    if intra_kv == "mooncake":
        try:
            mooncake.endpoint(mooncake.local_host(spec.host))
        except mooncake.Unavailable as e:
            raise RuntimeError(f'[line] intra_kv = "mooncake": {e}') from None


@dataclass(eq=False)
class _Placing:
    """One frame on its way through the engine: its slot, its number (its tag's nonce), and
    once placed, the KV_PLACED that stands for it (None: it goes over the connection itself)."""

    n: int
    slot: int
    payload: Payload
    ended: bool = False
    body: m.KVPlaced | None = None


@dataclass(eq=False)
class Placement:
    """One KV connection's way through the transfer engine: the receiver's region and ours.

    Frames are placed several at a time (as many as there are slots): each is copied into
    our slot and tagged on a stager thread, written by the engine's writer thread, and then
    posted, in the order the frames came, from the event loop's one callback a frame; anything
    else the connection carries waits behind them (`flush`)."""

    endpoint: mooncake.Endpoint
    remote: mooncake.RemoteRegion
    local: torch.Tensor
    slots: Slots = field(init=False)
    key: bytes | None = None  # the tags' (the connection's, from its sending session key)
    placed: int = 0  # frames placed so far: each one's number is its tag's nonce
    retired: int = 0  # slots of writes the engine timed out, never written again
    _order: collections.deque[_Placing] = field(default_factory=collections.deque)  # not yet posted, in order
    _posted: asyncio.Event = field(default_factory=asyncio.Event)  # set while nothing waits to be posted

    def __post_init__(self) -> None:
        self.slots = Slots(self.remote.slots)
        self._posted.set()

    @classmethod
    def from_offer(cls, endpoint: mooncake.Endpoint, offer: m.KVRegion, conn: FramedConnection) -> Placement:
        """The way through the region a receiver offered on `conn` (a region of ours the
        same size registered for it; the tags' key from the connection's session)."""
        remote = mooncake.RemoteRegion(offer.session, offer.address, offer.slot_bytes, offer.slots)
        local = endpoint.region(remote.slot_bytes, remote.slots)
        return cls(endpoint, remote, local, key=conn.subkey(PLACED_LABEL, sending=True))

    async def send(self, conn: FramedConnection, payload: Payload) -> None:
        """Place `payload` (a KV_LAYER frame's) and post its KV_PLACED in turn; returns once
        it has a slot (so a sender keeps at most `slots` frames in flight). Should the
        engine fail, the frame itself is posted in its place: nothing is lost. A frame
        larger than a slot goes over the connection in its turn (placed, it would run into
        the next slot), and so does every frame once each slot is retired: a write the
        engine timed out may still land, so its slot is never written again."""
        try:
            slot = await self.slots.take() if payload_len(payload) <= self.remote.slot_bytes else None
        except mooncake.TimedOut:  # (every slot is retired)
            slot = None
        if slot is None:
            self._order.append(_Placing(0, -1, payload, ended=True))
            self._post(conn)
            return
        self.placed += 1
        placing = _Placing(self.placed, slot, payload)
        self._order.append(placing)
        self._posted.clear()
        self.endpoint.stager.submit(self._place, asyncio.get_running_loop(), conn, placing)

    async def flush(self) -> None:
        """Wait until every frame placed so far is posted (before anything else is sent)."""
        await self._posted.wait()

    def _place(self, loop: asyncio.AbstractEventLoop, conn: FramedConnection, placing: _Placing) -> None:
        """On a stager thread: the frame into our slot, tagged, and its write queued; the
        loop hears when it is over."""
        try:
            vouched = self._stage(placing.slot, placing.n, placing.payload)
            size, length = self.remote.slot_bytes, payload_len(placing.payload)
            local = self.local[placing.slot * size : placing.slot * size + length]
            write = self.endpoint.write(local, self.remote, placing.slot, length)
        except Exception as e:  # (nothing is lost: the frame goes over the connection)
            _call(loop, self._ended, conn, placing, None, e)
            return
        body = m.KVPlaced(placing.slot, length, placing.n, vouched)
        write.add_done_callback(lambda w: _call(loop, self._ended, conn, placing, body, w.exception()))

    def _ended(
        self, conn: FramedConnection, placing: _Placing, body: m.KVPlaced | None, error: BaseException | None
    ) -> None:
        """On the loop: a frame is placed (or failed to be); every frame ended at the head of
        the order is posted."""
        if error is not None:
            log.warning("the transfer engine failed (%s): this KV frame goes over the connection", error)
            if isinstance(error, mooncake.TimedOut):
                self.retired += 1
                log.warning("slot %d is retired (%d of %d)", placing.slot, self.retired, self.slots.count)
                if self.retired == self.slots.count:
                    self.slots.close(error)
            else:
                self.slots.give(placing.slot)
            body = None
        placing.ended, placing.body = True, body
        self._post(conn)

    def _post(self, conn: FramedConnection) -> None:
        """Post every frame ended at the head of the order, in order."""
        while self._order and self._order[0].ended:
            head = self._order.popleft()
            if head.body is None:
                conn.post(MsgType.KV_LAYER, head.payload)
            else:
                conn.post(MsgType.KV_PLACED, m.encode_body(head.body, conn.version))
        if not self._order:
            self._posted.set()

    def _stage(self, slot: int, n: int, payload: Payload) -> str:
        """The payload's parts into our slot (the engine writes from registered memory), and
        the tag of what the slot holds."""
        at = slot * self.remote.slot_bytes
        start = at
        for part in parts_of(payload):
            self.local[at : at + len(part)].numpy()[:] = np.frombuffer(part, dtype=np.uint8)
            at += len(part)
        return tag(self.key, n, self.local[start:at].numpy().data)


def _call(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    """`fn(*args)` on `loop`, from another thread; nothing if the loop has closed meanwhile."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # (the loop is closed: the connection, and its frames, are gone)
        pass


def tag(key: bytes | None, n: int, data: bytes | bytearray | memoryview) -> str:
    """What vouches for placed bytes: their GMAC under the connection's key (nonce `n`,
    never reused under it), or their CRC32C where the connection has no key."""
    if key is None:
        return f"{crc32c.crc32c(data):08x}"
    return gmac(key, n, data).hex()


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
            placement = Placement.from_offer(endpoint, region, conn)
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

    def answer(self, conn: FramedConnection, body: m.BetweenInstances) -> bool:
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
            placement.slots.close(ConnectionError("the KV connection closed"))
            placement.endpoint.release(placement.local)


@dataclass(eq=False)
class _Region:
    """What one KV connection's receiver keeps: its registered region and the tags' key."""

    endpoint: mooncake.Endpoint
    buf: torch.Tensor
    key: bytes | None
    last: int = 0  # the number of the last frame placed in it


class Regions:
    """The receiver's side: a registered region per KV connection that asked for one."""

    def __init__(self, spec: InstanceSpec) -> None:
        self._spec = spec
        self._by_conn: dict[FramedConnection, _Region] = {}
        self.placed = {"frames": 0, "bytes": 0}  # KV frames that came through the transfer engine

    async def on_frame(self, conn: FramedConnection, frame: Frame) -> Frame | None:
        """A frame of a peer's connection as the role should see it: KV_REGION_ASK is
        answered here (None), KV_PLACED becomes the KV_LAYER frame it stands for."""
        if frame.type == MsgType.KV_REGION_ASK:
            m.decode_as(frame, m.KVRegionAsk)
            await m.send(conn, self._offer(conn))
            return None
        if frame.type != MsgType.KV_PLACED:
            return frame
        placed = m.decode_as(frame, m.KVPlaced)
        region = self._by_conn.get(conn)
        if region is None:
            raise m.BadMessage("KV_PLACED on a connection that has no region")
        size = mooncake.SLOT_BYTES
        if placed.slot >= mooncake.SLOTS or placed.nbytes > size:
            raise m.BadMessage(f"KV_PLACED slot {placed.slot} of {placed.nbytes} bytes is outside the region")
        # copied out first (nobody can change what was checked), into a buffer of its own that the KV's
        # decode views in place: an immutable copy would be copied once more to be read as tensors
        data = bytearray(region.buf[placed.slot * size : placed.slot * size + placed.nbytes].numpy())
        await m.send(conn, m.KVSlotFree(placed.slot))
        if placed.n <= region.last or not hmac.compare_digest(tag(region.key, placed.n, data), placed.tag):
            raise m.BadMessage(f"KV placed in slot {placed.slot} does not match its tag")
        region.last = placed.n
        self.placed["frames"] += 1
        self.placed["bytes"] += len(data)
        return Frame(MsgType.KV_LAYER, frame.seq, data, frame.version)

    def _offer(self, conn: FramedConnection) -> m.KVRegion:
        try:
            endpoint = mooncake.endpoint(mooncake.local_host(self._spec.host))
            if conn not in self._by_conn:
                key = conn.subkey(PLACED_LABEL, sending=False)
                self._by_conn[conn] = _Region(endpoint, endpoint.region(mooncake.SLOT_BYTES, mooncake.SLOTS), key)
        except mooncake.Unavailable as e:
            return m.KVRegion(error=str(e))
        region = self._by_conn[conn]
        return m.KVRegion(region.endpoint.session, region.buf.data_ptr(), mooncake.SLOT_BYTES, mooncake.SLOTS)

    def forget(self, conn: FramedConnection) -> None:
        region = self._by_conn.pop(conn, None)
        if region is not None:
            region.endpoint.release(region.buf)
