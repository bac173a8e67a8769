"""The device side of a KV copy made beside the forward passes (both engines' copy threads).

On CUDA a copy thread must not queue its copies on the stream the model computes on (the
next step would wait behind them), and must not touch a block before the steps that
wrote or read it are done. So each copy runs on a stream of its own (`CopyStream.copying`),
which first waits for the event the model's thread records after each step (`mark_step`),
and the copy thread, never the model's, waits for the copy's own event before it reports
the copy done. Host memory on the other side is page-locked (`pinned`), so the transfers
are asynchronous DMA. On a CPU all of this is nothing: the copy thread copies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)
COPY_NICE = 10  # a copy thread's nice value: under the model thread's where cores are short
# While streams step, a copy thread rests after each slice so that it copies this share of
# the time at most: on a CPU a copy and a step share cores and the memory bus (a GPU's
# copy engines do not, and there the rest costs the copy little)
COPY_SHARE = 0.5


def yield_cpu() -> None:
    """The calling (copy) thread gives way to the model's where both want a core (Linux: a
    thread's own nice value; elsewhere nothing): a copy may take longer, a step may not."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COPY_NICE)
    except (AttributeError, OSError) as e:
        log.debug("the copy thread keeps its priority: %s", e)


def rest(copied_s: float) -> None:
    """After a slice that took `copied_s`, while streams step: keep to COPY_SHARE."""
    time.sleep(copied_s * (1 / COPY_SHARE - 1))


class CopyStream:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.step_event = torch.cuda.Event() if self.cuda else None
        self._pinned = torch.empty(0, dtype=torch.uint8)

    def mark_step(self) -> None:
        """The model's thread, after (or before) each step: how far its stream has come."""
        if self.step_event is not None:
            self.step_event.record(torch.cuda.current_stream(self.device))

    @contextlib.contextmanager
    def copying(self, after: Any = None) -> Iterator[None]:
        """Copies issued inside run on the copy stream after the last marked step (and after
        the event `after`, where given: a layer of the step under way), and are complete
        (this thread waited for them) when the block exits."""
        if self.stream is None:
            yield
            return
        assert self.step_event is not None
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.step_event)
            if after is not None:
                self.stream.wait_event(after)
            yield
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()

    def to_host(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None] | None]:
        """Copies of `tensors` in host memory, made from the model's thread right after it
        computed them, without waiting: on CUDA they are queued on the copy stream behind
        what the model's stream has queued so far, into page-locked memory, and the
        returned wait (for another thread) returns once they are there; on a CPU they are
        plain copies, there at once (no wait)."""
        if self.stream is None:
            return [t.clone() for t in tensors], None
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(computed)
            out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
            done = torch.cuda.Event()
            done.record(self.stream)
        for t in tensors:  # (the model's allocator must not reuse them before the copy ran)
            t.record_stream(self.stream)
        return out, done.synchronize

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A page-locked host buffer of at least `nbytes`, reused by the next call (one copy
        thread uses it, one slice at a time); plain memory on a CPU, where nothing is pinned."""
        if self._pinned.numel() < nbytes:
            self._pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        return self._pinned[:nbytes]
