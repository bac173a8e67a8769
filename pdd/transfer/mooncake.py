"""KV inside a site through the Mooncake Transfer Engine (`[line] intra_kv`).

Between two instances of one datacenter, P writes each KV frame's bytes straight into a
region the receiving instance registered with its transfer engine (RDMA where the
machine has a device, TCP otherwise), and sends on its authenticated KV connection only
where they are (`KVPlaced`: the slot, the length and a GMAC of the bytes under a key of
the connection's session). The engine's own data path authenticates nothing, so the
receiver copies the bytes out of its slot and checks them against that tag before it
reads them; addresses and sessions are only
ever learnt over pdd's authenticated connections (`KVRegionAsk`, `KVRegion`).

Each KV connection gets a region of its own on the receiver (`SLOTS` slots of
`SLOT_BYTES`), and the sender a region the same size, registered too (RDMA reads from
registered memory only): a frame goes through the slot of the same number on both
sides, which the sender takes until the receiver says it is free again (`KVSlotFree`).
Nothing here runs unless configured; the package (`pdd-serving[mooncake]`) is imported on first
use, and where it is missing or the engine cannot start, `Unavailable` says why.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)
# A frame larger than a slot goes over the connection itself. P's KV frames are at most
# `prefill_kv.KV_FRAME_BYTES` (1 MiB) and their headers: more slots of less, in the same
# 32 MiB, keep more frames in flight (`pdd bench transfer --loopback --intra mooncake`).
SLOT_BYTES = 2 << 20
SLOTS = 16
POLL_S = 50e-6  # how often the writer thread looks whether its writes are done (a sleep: no spinning)


class Unavailable(RuntimeError):
    """The transfer engine cannot run here (the package, its libraries, or its start)."""


class TimedOut(ConnectionError):
    """The engine stopped waiting for a write it may still finish: neither end's slot of
    it may be written again."""


@dataclass(frozen=True)
class RemoteRegion:
    """A receiver's region, as its `KVRegion` said."""

    session: str
    address: int
    slot_bytes: int
    slots: int


class Endpoint:
    """This process's transfer engine: started once, registering regions on demand."""

    def __init__(self, host: str) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # (read when the module loads: glog's INFO lines otherwise)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise Unavailable(f"the Mooncake Transfer Engine is not installed (pdd-serving[mooncake]): {e}") from None
        self.protocol = "rdma" if _rdma_devices() else "tcp"
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", self.protocol, "")
        if rc != 0:
            raise Unavailable(f"the Mooncake Transfer Engine did not start on {host} over {self.protocol} ({rc})")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        # the threads that copy frames into our slots and tag them, while the engine writes others
        self.stager = ThreadPoolExecutor(2, thread_name_prefix="pdd-mooncake-stage")
        # the one thread that submits writes to the engine and sees them done (its own waits spin a core)
        self._writes: queue.SimpleQueue[_Write] = queue.SimpleQueue()
        threading.Thread(target=self._write_all, name="pdd-mooncake", daemon=True).start()
        self._regions: list[torch.Tensor] = []  # kept alive while registered

    def region(self, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS) -> torch.Tensor:
        """A new registered region of `slots` x `slot_bytes`, as a flat uint8 tensor."""
        buf = torch.zeros(slot_bytes * slots, dtype=torch.uint8)
        rc = self._engine.register_memory(buf.data_ptr(), buf.numel())
        if rc != 0:
            raise Unavailable(f"the transfer engine refused to register {buf.numel()} bytes ({rc})")
        self._regions.append(buf)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self._engine.unregister_memory(buf.data_ptr())
        self._regions = [r for r in self._regions if r is not buf]

    def write(self, local: torch.Tensor, remote: RemoteRegion, slot: int, nbytes: int) -> Future[None]:
        """Bytes [0, nbytes) of `local` (in a registered region) into slot `slot` of
        `remote`, queued for the writer thread; the future fails with ConnectionError if
        the engine did."""
        done: Future[None] = Future()
        dst = remote.address + slot * remote.slot_bytes
        self._writes.put(_Write(local.data_ptr(), remote.session, dst, nbytes, done))
        return done

    def _write_all(self) -> None:
        """The writer thread: each queued write submitted at once (many in flight), and each
        one's status looked at every `POLL_S` until it is done. The engine's own waits
        (`batch_transfer_sync_write`, `get_batch_transfer_status`) spin on its status, a
        core's worth of CPU taken from the processes around it for as long as a write lasts."""
        flight: list[tuple[int, _Write]] = []
        while True:
            if not flight:
                self._submit(self._writes.get(), flight)
            while True:
                try:
                    self._submit(self._writes.get_nowait(), flight)
                except queue.Empty:
                    break
            flight = [(batch, w) for batch, w in flight if not self._ended(batch, w)]
            if flight:
                time.sleep(POLL_S)

    def _submit(self, w: _Write, flight: list[tuple[int, _Write]]) -> None:
        batch = self._engine.transfer_submit_write(w.session, w.src, w.dst, w.nbytes)
        if batch < 0:
            w.done.set_exception(ConnectionError(f"the transfer engine could not write to {w.session} ({batch})"))
        else:
            flight.append((batch, w))

    def _ended(self, batch: int, w: _Write) -> bool:
        """Whether a submitted write is over: done, failed, or out of time (its future says which)."""
        status = self._engine.transfer_check_status(batch)
        if status == 0:
            return False
        if status == 1:
            w.done.set_result(None)
        elif status == -2:
            w.done.set_exception(TimedOut(f"the transfer engine's write to {w.session} timed out"))
        else:  # -1: failed
            w.done.set_exception(ConnectionError(f"the transfer engine's write to {w.session} failed ({status})"))
        return True


@dataclass(frozen=True)
class _Write:
    src: int
    session: str
    dst: int
    nbytes: int
    done: Future[None]


_endpoint: Endpoint | None = None


def endpoint(host: str) -> Endpoint:
    """The process's one endpoint (Unavailable if it cannot start; asked again next time)."""
    global _endpoint
    if _endpoint is None:
        _endpoint = Endpoint(host)
        log.info(
            "KV inside the site: Mooncake Transfer Engine over %s, session %s", _endpoint.protocol, _endpoint.session
        )
    return _endpoint


def local_host(host: str) -> str:
    """The address the engine listens on: the instance's own, or loopback where it binds all."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else socket.gethostbyname(host)


def _rdma_devices() -> list[str]:
    try:
        return os.listdir("/sys/class/infiniband")
    except OSError:
        return []
