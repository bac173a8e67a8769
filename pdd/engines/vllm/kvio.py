"""KV between pdd's blobs and vLLM's workers: split by tensor-parallel rank on the way in,
gathered on the way out.

Each worker holds a contiguous slice of the KV heads (rank r of w: heads
[r * H / w, (r + 1) * H / w)); a blob (`pdd.kv.codec.KVBlob`, all heads, any dtype)
is converted to the cache's dtype and sent to each worker as its slice, and an export
asks every worker for its slice of the same tokens and stacks them back.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from pdd.engine_port import RequestError
from pdd.kv import codec
from pdd.kv.blocks import HASH_BLOCK, block_hashes


@dataclass
class WorkerInfo:
    channel: Any  # pdd.engines.vllm.bridge.Channel
    rank: int
    heads: int  # this rank's heads
    layers: int
    head_dim: int
    block_size: int
    dtype: str


class WorkerKV:
    """Requests to the workers, each answered by sequence number on a bridge thread."""

    def __init__(self) -> None:
        self.workers: dict[int, WorkerInfo] = {}
        self._seq = itertools.count()
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}

    @property
    def ranks(self) -> list[WorkerInfo]:
        return [self.workers[r] for r in sorted(self.workers)]

    @property
    def total_heads(self) -> int:
        return sum(w.heads for w in self.workers.values())

    def answer(self, header: dict[str, Any], payload: bytes) -> None:
        """A worker's reply (bridge thread)."""
        seq = header.get("seq")
        pending = self._waiting.pop(seq, None) if isinstance(seq, int) else None
        if pending is None:
            return
        loop, fut = pending
        error = RuntimeError(f"vLLM worker: {header.get('error')}") if header["op"] == "failed" else None
        loop.call_soon_threadsafe(_settle, fut, payload, error)

    def fail_all(self, error: Exception) -> None:
        for seq in list(self._waiting):
            loop, fut = self._waiting.pop(seq)
            loop.call_soon_threadsafe(_settle, fut, b"", error)

    async def _ask(self, worker: WorkerInfo, header: dict[str, Any], payload: bytes = b"") -> bytes:
        seq = next(self._seq)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiting[seq] = (loop, fut)
        await asyncio.to_thread(worker.channel.send, {**header, "seq": seq}, payload)
        return await fut

    async def write(self, blocks: list[int], blob: codec.KVBlob) -> None:
        """Lay `blob` (all layers) into `blocks` on every worker."""
        h = blob.header
        first = self.ranks[0]
        dtype = codec.DTYPES[first.dtype]
        k, v = blob.k.to(dtype), blob.v.to(dtype)
        sends, start = [], 0
        for w in self.ranks:
            part = torch.stack([k[:, :, start : start + w.heads], v[:, :, start : start + w.heads]]).contiguous()
            start += w.heads
            header = {
                "op": "write",
                "blocks": blocks,
                "token_start": h.token_start,
                "token_end": h.token_end,
                "heads": w.heads,
                "head_dim": h.head_dim,
                "dtype": w.dtype,
            }
            sends.append(self._ask(w, header, part.view(torch.uint8).numpy().tobytes()))
        await asyncio.gather(*sends)

    async def read(self, blocks: list[int], tokens: list[int], start: int, end: int) -> codec.KVBlob:
        """Tokens [start, end) of the request in `blocks` (whose tokens are `tokens`), all layers."""
        header = {"op": "read", "blocks": blocks, "token_start": start, "token_end": end}
        parts = await asyncio.gather(*(self._ask(w, header) for w in self.ranks))
        ks, vs = [], []
        for w, raw in zip(self.ranks, parts, strict=True):
            flat = torch.frombuffer(bytearray(raw), dtype=codec.DTYPES[w.dtype])
            kv = flat.view(2, w.layers, end - start, w.heads, w.head_dim)
            ks.append(kv[0])
            vs.append(kv[1])
        first = self.ranks[0]
        header_out = codec.KVHeader(
            num_layers=first.layers,
            layer_start=0,
            layer_end=first.layers,
            kv_heads=self.total_heads,
            head_dim=first.head_dim,
            dtype=first.dtype,
            page_size=first.block_size,
            token_start=start,
            token_end=end,
            block_size=HASH_BLOCK,
            block_hashes=block_hashes(tokens[:end], HASH_BLOCK),
        )
        return codec.KVBlob(header_out, torch.cat(ks, dim=2), torch.cat(vs, dim=2))

    def check_import(self, blob: codec.KVBlob, tokens: list[int], computed: int, prompt_len: int) -> None:
        first = self.ranks[0]
        why = codec.check_continuation(
            blob.header, (first.layers, self.total_heads, first.head_dim), tokens, computed, prompt_len
        )
        if why:
            raise RequestError(why)


def _settle(fut: asyncio.Future, payload: bytes, error: Exception | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(payload)
