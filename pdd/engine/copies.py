"""KV imports and exports of the embedded engine, beside its steps.

A 64K-token import of a large model's KV is gigabytes: copied on the engine thread, it
would hold every running stream for its whole length. So the engine only checks and
claims an import or export on its thread (`Engine.claim_import`, `Engine.claim_export`,
which give a `Copy`), and the copy itself runs here, on a thread of its own, slice by
slice (`SLICE_BYTES` of KV at most), while the engine steps: large tensor copies release
the GIL, so on a CPU the copy and the forward pass run on cores of their own.

What keeps the two threads apart:
* a copy touches only its sequence's pages, which no step reads or writes while it
  runs: an import's sequence is reserved (and a `start` that comes before its copies
  end is deferred until they do, `Engine.copied`), an export's is held;
* `lock` is held for one slice at a time; a sequence dropped while its copies run is
  cancelled under it (`Engine._drop`), so the engine thread waits at most one slice and
  the copy never writes a page after it is freed; an import cancelled part way counts
  only the tokens its finished slices wrote (`Sequence.copied_end`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdd.engine.sequence import Sequence
from pdd.engine_port import RequestError

log = logging.getLogger(__name__)
SLICE_BYTES = 4 << 20  # KV one slice copies: what a dropped sequence's cancel waits for at most


@dataclass(eq=False)
class Copy:
    """One claimed import or export: `slices`, run in order, each moving tokens [a, b) of
    the claimed range; `end` is the token each slice has reached (for an import's
    `copied_end`)."""

    seq: Sequence
    importing: bool
    slices: list[tuple[int, int, Callable[[], None]]]
    result: Any = None  # an export's blob, filled by its slices
    done: threading.Event = field(default_factory=threading.Event)


def token_slices(start: int, end: int, bytes_per_token: int) -> list[tuple[int, int]]:
    step = max(1, SLICE_BYTES // max(1, bytes_per_token))
    return [(a, min(a + step, end)) for a in range(start, end, step)]


class Copies:
    """The copy thread: claimed copies, one slice at a time, in the order they were claimed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Copy, Callable[[BaseException | None], None]] | None] = queue.SimpleQueue()
        self.slices_done = 0  # (how many ran: what a test sees interleave with the steps)
        self._thread = threading.Thread(target=self._run, name="pdd-kv-copy", daemon=True)
        self._thread.start()

    async def run(self, copy: Copy, ended: Callable[[], None]) -> Any:
        """Run `copy` on the copy thread; its result once its last slice is in place.
        `ended` is called on the copy thread as it ends, before the result is given."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            ended()
            loop.call_soon_threadsafe(_settle, fut, copy.result, error)

        self._jobs.put((copy, settle))
        return await asyncio.shield(fut)  # (a cancelled caller leaves the copy to the engine's cancel)

    def cancel(self, seq: Sequence) -> None:
        """The engine thread, dropping `seq`: no slice of its runs after this returns."""
        with self.lock:
            seq.copy_cancelled = True

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            copy, settle = item
            error: BaseException | None = None
            try:
                for _, end, run in copy.slices:
                    with self.lock:
                        if copy.seq.copy_cancelled:
                            raise RequestError(f"request {copy.seq.rid!r} ended while its KV was being copied")
                        run()
                        if copy.importing:
                            copy.seq.copied_end = end
                        self.slices_done += 1
            except Exception as e:  # reported to the caller, never kills the copy thread
                error = e
            copy.done.set()
            settle(error)


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def import_slices(
    pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
) -> Callable[[int, int], Callable[[], None]]:
    """A slice writer: tokens [a, b) of a blob whose first token is `start` into `slots`
    (the blob's, in order), every layer of the pool's `pool_k` / `pool_v` ([layers, slots, heads, dim])."""

    def writer(a: int, b: int) -> Callable[[], None]:
        def run() -> None:
            at = slots[a - start : b - start]
            for i in range(pool_k.shape[0]):
                pool_k[i][at] = k[i, a - start : b - start].to(pool_k.device, pool_k.dtype)
                pool_v[i][at] = v[i, a - start : b - start].to(pool_v.device, pool_v.dtype)

        return run

    return writer
