"""KV between pdd's blobs and vLLM's workers: split by tensor-parallel rank on the way in,
gathered on the way out.

Each worker holds a contiguous slice of the KV heads, from `head_start` on (rank r of
w: heads [r * H / w, (r + 1) * H / w)); past H ranks, consecutive ranks hold the same
head (vLLM replicates it), and an MLA cache's one latent "head" is whole on every rank.
A blob (`pdd.kv.codec.KVBlob`, all heads) is converted to the cache's dtype (an fp8
one only ever arrives as itself, `check_import`) and sent to each worker as its slice;
an export asks the first rank holding each slice for it (rank 0 alone for a latent)
and stacks them back.
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
    head_start: int  # the first of them among the model's
    layers: int
    head_dim: int  # K's and V's width each, or the latent's
    block_size: int
    dtype: str  # a `pdd.kv.codec` dtype name: the values', fp8 included
    latent: bool  # MLA: K is the latent, there is no V
    scales: tuple[float, ...]  # an fp8 cache's K and V scale of every layer

    @classmethod
    def from_layout(cls, channel: Any, msg: dict[str, Any]) -> WorkerInfo:
        """From the worker's "layout" message (`worker_side.WorkerSide.register_kv_caches`)."""
        return cls(
            channel,
            msg["rank"],
            msg["heads"],
            msg["head_start"],
            msg["layers"],
            msg["head_dim"],
            msg["block_size"],
            msg["dtype"],
            msg["latent"],
            tuple(msg["scales"]),
        )


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
    def readers(self) -> list[WorkerInfo]:
        """The first rank holding each slice of heads, in head order: what an export reads."""
        first: dict[int, WorkerInfo] = {}
        for w in self.ranks:
            first.setdefault(w.head_start, w)
        return [first[h] for h in sorted(first)]

    @property
    def total_heads(self) -> int:
        return sum(w.heads for w in self.readers)

    @property
    def bytes_per_token(self) -> int:
        """One token's KV over all layers and all heads, as an export carries it (replicas once)."""
        w = self.ranks[0]
        sides = 1 if w.latent else 2
        return sides * w.layers * self.total_heads * w.head_dim * codec.ALL_DTYPES[w.dtype].itemsize

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
        dtype = codec.ALL_DTYPES[first.dtype]
        sides = [blob.k.to(dtype), blob.v.to(dtype)][: h.sides]
        sends = []
        for w in self.ranks:
            part = torch.stack([x[:, :, w.head_start : w.head_start + w.heads] for x in sides]).contiguous()
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
        readers = self.readers
        parts = await asyncio.gather(*(self._ask(w, header) for w in readers))
        sides = []
        for w, raw in zip(readers, parts, strict=True):
            flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(codec.ALL_DTYPES[w.dtype])
            sides.append(flat.view(-1, w.layers, end - start, w.heads, w.head_dim))
        first = self.ranks[0]
        kv = torch.cat(sides, dim=3)
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
            latent=first.latent,
            scales=list(first.scales),
        )
        return codec.KVBlob(header_out, kv[0], kv[0][..., :0] if first.latent else kv[1])

    def check_import(self, blob: codec.KVBlob, tokens: list[int], computed: int, prompt_len: int) -> None:
        first = self.ranks[0]
        raw = first.dtype if first.dtype in codec.RAW_DTYPES else None
        cache = codec.CacheForm(first.latent, raw, first.scales)
        why = codec.check_continuation(
            blob.header, (first.layers, self.total_heads, first.head_dim), tokens, computed, prompt_len, cache
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
