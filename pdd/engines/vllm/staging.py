"""The staging region: memory that a pdd instance and one vLLM worker both map, through
which KV crosses between them with one copy on each side and no socket in between.

Each worker makes its own region at start (`Region.create`: an anonymous memory file,
`memfd_create`, so no /dev/shm size limit applies and nothing is left on disk), pins it
for the device where it has CUDA (`cudaHostRegister`: the copy stream reads and writes
it asynchronously), and hands its descriptor to the instance over the bridge (SCM_RIGHTS
on the authenticated Unix socket), which maps the same pages (`Region.attach`).

The region is cut into `slots` equal slots of `slot_bytes`; a slice of one request's KV
fills one slot. The instance owns the slots (`pdd.kv.slots.Slots`): it takes a free one, fills it (an
import) or names it in a read (an export), and gives it back when the worker has
answered, so a slot is never written by both sides at once. Bridge messages carry only
the slot's number and the slice's shape.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

SLOT_BYTES = 4 << 20  # one slice of one request's KV on one worker: what a copy holds the cache for at most
SLOTS = 8  # slices in flight per worker (the region: 32 MiB)


class Region:
    """One mapping of a staging region, as a flat uint8 tensor cut into slots."""

    def __init__(self, fd: int, slot_bytes: int, slots: int) -> None:
        self.fd, self.slot_bytes, self.slots = fd, slot_bytes, slots
        self._map = mmap.mmap(fd, slot_bytes * slots)
        self.flat = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def create(cls, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS) -> Region:
        """A new region (the worker's side), its descriptor kept open to be handed over."""
        fd = os.memfd_create("pdd-kv-staging", os.MFD_CLOEXEC)
        os.ftruncate(fd, slot_bytes * slots)
        return cls(fd, slot_bytes, slots)

    @classmethod
    def attach(cls, fd: int, slot_bytes: int, slots: int) -> Region:
        """The instance's mapping of a region a worker handed over (its descriptor closed once mapped)."""
        if os.fstat(fd).st_size != slot_bytes * slots:
            os.close(fd)
            raise ValueError(f"staging region of {os.fstat(fd).st_size} bytes, not {slots} x {slot_bytes}")
        try:
            return cls(fd, slot_bytes, slots)
        finally:
            os.close(fd)

    def slot(self, index: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Slot `index` seen as a tensor of `dtype` and `shape` (which must fit in it)."""
        if not 0 <= index < self.slots:
            raise ValueError(f"staging slot {index} is not one of {self.slots}")
        n = dtype.itemsize * math.prod(shape)
        if n > self.slot_bytes:
            raise ValueError(f"{shape} of {dtype} does not fit a staging slot of {self.slot_bytes} bytes")
        start = index * self.slot_bytes
        return self.flat[start : start + n].view(dtype).view(shape)

    def pin(self) -> None:
        """Page-lock the region for CUDA's asynchronous copies (the worker's side, on a GPU)."""
        err = torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(), self.flat.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of pdd's KV staging region failed ({err})")
