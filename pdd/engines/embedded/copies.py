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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdd.engines.embedded import page_rows
from pdd.engines.embedded.kv_pool import KVPool
from pdd.engines.embedded.sequence import Sequence
from pdd.engines.port import RequestError
from pdd.kv import codec
from pdd.kv.copy_stream import CopyStream, rest, yield_cpu
from pdd.policy.transfer import kv_chunks
from pdd.tasks import settle

log = logging.getLogger(__name__)
SLICE_BYTES = 4 << 20  # KV one slice copies: what a dropped sequence's cancel waits for at most


@dataclass(eq=False)
class Copy:
    """One claimed import or export: `slices`, run in order, each moving tokens [a, b) of
    the claimed range."""

    seq: Sequence
    importing: bool
    slices: list[tuple[int, int, Callable[[], None]]]
    result: Any = None  # an export's blob, filled by its slices

    def advance(self, end: int, run: Callable[[], None]) -> None:
        """Run the slice that ends at token `end`: an import's tokens are in place up to it."""
        run()
        if self.importing:
            self.seq.copied_end = end

    def run_here(self) -> Any:
        """Every slice, on the calling thread (an engine without a copy thread); the result."""
        for _, end, run in self.slices:
            self.advance(end, run)
        return self.result


def token_slices(start: int, end: int, bytes_per_token: int) -> list[tuple[int, int]]:
    """[start, end) in slices of at most SLICE_BYTES (one token at least)."""
    return kv_chunks(start, end, max(1, SLICE_BYTES // max(1, bytes_per_token)))


class Copies:
    """The copy thread: claimed copies, one slice at a time, in the order they were claimed."""

    def __init__(self, busy: Callable[[], bool] = lambda: False) -> None:
        self.busy = busy  # whether the engine has streams running (a slice then leaves it room)
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

        def finished(error: BaseException | None) -> None:
            ended()
            loop.call_soon_threadsafe(settle, fut, copy.result, error)

        self._jobs.put((copy, finished))
        return await asyncio.shield(fut)  # (a cancelled caller leaves the copy to the engine's cancel)

    def cancel(self, seq: Sequence) -> None:
        """The engine thread, dropping `seq`: no slice of its runs after this returns."""
        with self.lock:
            seq.copy_cancelled = True

    def close(self) -> None:
        """Stop the copy thread once the copies already claimed are done."""
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        yield_cpu()
        while (item := self._jobs.get()) is not None:
            copy, finished = item
            error: BaseException | None = None
            try:
                for _, end, run in copy.slices:
                    began = time.perf_counter()
                    with self.lock:
                        if copy.seq.copy_cancelled:
                            raise RequestError(f"request {copy.seq.rid!r} ended while its KV was being copied")
                        copy.advance(end, run)
                        self.slices_done += 1
                    if self.busy():
                        rest(time.perf_counter() - began)
            except Exception as e:  # reported to the caller, never kills the copy thread
                error = e
            finished(error)


def import_copy(pool: KVPool, seq: Sequence, blob: codec.KVBlob, stream: CopyStream) -> Copy:
    """The slices that write `blob` (tokens [token_start, token_end) of `seq`, its layers)
    into the sequence's pages; on CUDA each goes through page-locked memory and the copy stream."""
    h = blob.header
    start = h.token_start
    layers = slice(h.layer_start, h.layer_end)
    pool_k, pool_v = pool.k[layers], pool.v[layers]
    per_token = 2 * pool_k.shape[0] * pool_k[0, 0].numel() * pool.dtype.itemsize

    def writer(a: int, b: int) -> Callable[[], None]:
        def run() -> None:
            k, v = blob.k[:, a - start : b - start], blob.v[:, a - start : b - start]
            with stream.copying():
                if stream.cuda:  # the slice into page-locked memory (in the pool's dtype), then across
                    staged = stream.pinned(2 * k.numel() * pool.dtype.itemsize).view(pool.dtype).view(2, *k.shape)
                    staged[0].copy_(k)
                    staged[1].copy_(v)
                    k, v = staged.to(pool.k.device, non_blocking=True)
                    at = pool.slots(seq.pages, a, b).to(pool.k.device)
                    pool_k[:, at] = k  # (every layer in one operation: one hand-off of the GIL)
                    pool_v[:, at] = v
                else:  # host memory: whole pages a row at a time
                    page_rows.put(pool_k, seq.pages, pool.page_size, a, k.to(pool.dtype))
                    page_rows.put(pool_v, seq.pages, pool.page_size, a, v.to(pool.dtype))

        return run

    return Copy(seq, True, [(a, b, writer(a, b)) for a, b in token_slices(start, h.token_end, per_token)])


def export_copy(pool: KVPool, seq: Sequence, header: codec.KVHeader, stream: CopyStream) -> Copy:
    """The slices that gather tokens [token_start, token_end) of `seq` (the header's layers)
    into a blob on the CPU, its result; on CUDA through the copy stream into page-locked memory."""
    start, end = header.token_start, header.token_end
    slots = pool.slots(seq.pages, start, end).to(pool.k.device)
    layers = range(header.layer_start, header.layer_end)
    pool_k, pool_v = pool.k[header.layer_start : header.layer_end], pool.v[header.layer_start : header.layer_end]
    shape = (len(layers), end - start, header.kv_heads, header.head_dim)
    k, v = (torch.empty(shape, dtype=pool.dtype) for _ in range(2))
    per_token = 2 * len(layers) * header.kv_heads * header.head_dim * pool.dtype.itemsize

    def reader(a: int, b: int) -> Callable[[], None]:
        def run() -> None:
            at, n = slots[a - start : b - start], b - a
            out_k, out_v = k[:, a - start : b - start], v[:, a - start : b - start]
            if stream.cuda:
                staged = stream.pinned(2 * out_k.numel() * pool.dtype.itemsize).view(pool.dtype)
                out_k, out_v = staged.view(2, len(layers), n, *shape[2:])
            with stream.copying():
                if stream.cuda:  # (gathered on the device, then across)
                    out_k.copy_(pool_k[:, at], non_blocking=True)
                    out_v.copy_(pool_v[:, at], non_blocking=True)
                else:
                    page_rows.gather(out_k, pool_k, at)
                    page_rows.gather(out_v, pool_v, at)
            if stream.cuda:  # (the stream is done: the page-locked slice is the blob's now)
                k[:, a - start : b - start] = out_k
                v[:, a - start : b - start] = out_v

        return run

    slices = [(a, b, reader(a, b)) for a, b in token_slices(start, end, per_token)]
    return Copy(seq, False, slices, result=codec.KVBlob(header, k, v))
