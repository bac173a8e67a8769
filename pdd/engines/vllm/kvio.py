"""KV between pdd's blobs and vLLM's workers: split by rank on the way in, gathered on the
way out, in slices through each worker's staging region.

Each worker holds a contiguous slice of the KV heads, from `head_start` on (rank r of
w: heads [r * H / w, (r + 1) * H / w)); past H ranks, consecutive ranks hold the same
head (vLLM replicates it), and an MLA cache's one latent "head" is whole on every rank.
Under pipeline parallelism each stage's workers hold its consecutive layers, from
`layer_start` on: a write gives each stage its layers, a read asks each stage for its
part of the layers asked, and the KV is in (or out) only once every stage's part is.
Under decode context parallelism each rank holds the tokens vLLM's rule gives it
(`split`): a write sends each rank its tokens, a read gathers them back in token order.
A blob (`pdd.kv.codec.KVBlob`, all heads) is cut into token slices that fit one staging
slot (`pdd.engines.vllm.staging`); each slice of a rank's heads is copied into a free
slot of that rank's region, converted to the cache's dtype on the way (an fp8 one only
ever arrives as itself, `check_import`), and the worker is asked to write it into the
blocks; an export asks the first rank holding each slice of heads (rank 0 alone for a
latent) to read each token slice into a slot, and copies it out into the blob. The
slices of one request are in flight together, as many as a region has slots; the
copies on this side run off the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from pdd.engines.port import RequestError
from pdd.engines.vllm.split import TokenSplit
from pdd.engines.vllm.staging import Region
from pdd.kv import codec, continuation
from pdd.kv.blocks import HASH_BLOCK, PrefixHashes, block_hashes
from pdd.kv.slots import Slots
from pdd.policy.transfer import kv_chunks
from pdd.tasks import settle


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
    region: Region = field(repr=False)  # its staging region
    slots: Slots = field(repr=False)  # which of the region's slots are free
    layer_start: int = 0  # the model's index of its first layer (its pipeline stage's)
    split: TokenSplit = TokenSplit()  # the tokens it holds (decode context parallelism)

    @property
    def holds(self) -> range:
        """The model's layers this worker holds."""
        return range(self.layer_start, self.layer_start + self.layers)

    @property
    def sides(self) -> int:
        return 1 if self.latent else 2

    def slice_tokens(self, layers: int) -> int:
        """Tokens of this rank's KV of `layers` layers one staging slot holds."""
        per_token = self.sides * layers * self.heads * self.head_dim * codec.ALL_DTYPES[self.dtype].itemsize
        if per_token > self.region.slot_bytes:
            raise ValueError(f"one token's KV ({per_token} bytes) exceeds a staging slot")
        return self.region.slot_bytes // per_token

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
            Region.attach(msg["fds"][0], msg["slot_bytes"], msg["slots"]),
            Slots(msg["slots"]),
            msg["layer_start"],
            TokenSplit(*msg["dcp"]),
        )


class WorkerKV:
    """Requests to the workers, each answered by sequence number on a bridge thread."""

    def __init__(self) -> None:
        # the copies between blobs and staging slots, off the event loop
        self._copies = ThreadPoolExecutor(2, thread_name_prefix="pdd-kv-stage")
        self.workers: dict[int, WorkerInfo] = {}
        self._seq = itertools.count()
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}

    @property
    def ranks(self) -> list[WorkerInfo]:
        return [self.workers[r] for r in sorted(self.workers)]

    @property
    def readers(self) -> list[WorkerInfo]:
        """The first rank holding each slice of heads of each stage's layers and each
        share of the tokens: what an export reads (a replica once)."""
        first: dict[tuple[int, int, int], WorkerInfo] = {}
        for w in self.ranks:
            first.setdefault((w.layer_start, w.head_start, w.split.rank), w)
        return [first[k] for k in sorted(first)]

    @property
    def total_heads(self) -> int:
        return sum(w.heads for w in self.readers if w.layer_start == 0 and w.split.rank == 0)

    @property
    def num_layers(self) -> int:
        """The model's layers, over every stage."""
        return max(w.holds.stop for w in self.ranks)

    @property
    def scales(self) -> tuple[float, ...]:
        """An fp8 cache's K and V scale of every layer of the model, stage after stage."""
        stages = {w.layer_start: w.scales for w in self.ranks}
        return tuple(s for start in sorted(stages) for s in stages[start])

    def check_stages(self) -> None:
        """Refuse stages whose layers do not tile the model's, one after another."""
        held = sorted({(w.layer_start, w.layers) for w in self.ranks})
        if any(a + n != b for (a, n), (b, _) in zip(held, held[1:], strict=False)) or held[0][0] != 0:
            raise RuntimeError(f"pdd's KV connector cannot carry pipeline stages holding layers {held}")

    @property
    def bytes_per_token(self) -> int:
        """One token's KV over all layers and all heads, as an export carries it (replicas once)."""
        w = self.ranks[0]
        sides = 1 if w.latent else 2
        return sides * self.num_layers * self.total_heads * w.head_dim * codec.ALL_DTYPES[w.dtype].itemsize

    def answer(self, header: dict[str, Any]) -> None:
        """A worker's reply (bridge thread)."""
        seq = header.get("seq")
        pending = self._waiting.pop(seq, None) if isinstance(seq, int) else None
        if pending is None:
            return
        loop, fut = pending
        error = RuntimeError(f"vLLM worker: {header.get('error')}") if header["op"] == "failed" else None
        loop.call_soon_threadsafe(settle, fut, None, error)

    def close(self) -> None:
        self._copies.shutdown(wait=False, cancel_futures=True)

    def fail_all(self, error: Exception) -> None:
        for seq in list(self._waiting):
            loop, fut = self._waiting.pop(seq)
            loop.call_soon_threadsafe(settle, fut, None, error)

    async def _slice(self, worker: WorkerInfo, header: dict[str, Any], fill: Any = None, empty: Any = None) -> None:
        """One slice through a staging slot of `worker`'s: `fill(slot)` copies it in (an
        import), the worker is asked (`header`), `empty(slot)` copies it out (an export).
        The slot is given back only once the worker has answered, even if this is
        cancelled meanwhile: it may still be copying from or into it."""
        loop = asyncio.get_running_loop()
        slot = await worker.slots.take()
        first, last = header.get("layers", (0, worker.layers))
        shape = (
            worker.sides,
            last - first,
            len(worker.split.positions(header["token_start"], header["token_end"])),
            worker.heads,
            worker.head_dim,
        )
        staged = worker.region.slot(slot, codec.ALL_DTYPES[worker.dtype], shape)
        answered: asyncio.Future[None] | None = None
        try:
            if fill is not None:
                await loop.run_in_executor(self._copies, fill, staged)
            seq = next(self._seq)
            answered = loop.create_future()
            self._waiting[seq] = (loop, answered)
            worker.channel.send({**header, "seq": seq, "slot": slot, "heads": worker.heads})
            await asyncio.shield(answered)
            if empty is not None:
                await loop.run_in_executor(self._copies, empty, staged)
        finally:
            if answered is None or answered.done():
                worker.slots.give(slot)
            else:
                answered.add_done_callback(lambda _: worker.slots.give(slot))

    @staticmethod
    def _header(op: str, blocks: list[int], block_size: int, start: int, end: int, head_dim: int) -> dict[str, Any]:
        """A slice's request: tokens [start, end) and only the blocks that hold them."""
        first, last = start // block_size, -(-end // block_size)
        return {
            "op": op,
            "blocks": blocks[first:last],
            "base": first * block_size,
            "token_start": start,
            "token_end": end,
            "head_dim": head_dim,
        }

    async def write(self, blocks: list[int], blob: codec.KVBlob) -> None:
        """Lay `blob` (all layers) into `blocks` on every worker, slice by slice: each
        its stage's layers, its heads and its tokens."""
        h = blob.header
        sides = [blob.k, blob.v][: h.sides]
        sends = []
        for w in self.ranks:
            for a, b in kv_chunks(h.token_start, h.token_end, w.slice_tokens(w.layers)):

                def fill(staged: torch.Tensor, w: WorkerInfo = w, a: int = a, b: int = b) -> None:
                    tokens = w.split.index(a, b, h.token_start)
                    for side, x in enumerate(sides):
                        part = x[w.layer_start : w.holds.stop, :, w.head_start : w.head_start + w.heads]
                        staged[side].copy_(part[:, tokens])

                header = self._header("write", blocks, w.block_size, a, b, h.head_dim)
                sends.append(self._slice(w, header, fill=fill))
        await asyncio.gather(*sends)

    async def read(
        self,
        blocks: list[int],
        tokens: list[int],
        start: int,
        end: int,
        layers: range | None = None,
        after: tuple[int, int] | None = None,
    ) -> codec.KVBlob:
        """Tokens [start, end) of the request in `blocks` (whose tokens are `tokens`), all
        layers or `layers` (the model's indices); `after` (layer, step): once each worker
        has computed that layer of that step (a streamed prefill's, read while the step
        goes on). Done once every stage's, rank's and token share's part is in."""
        first = self.ranks[0]
        layers = layers or range(self.num_layers)
        dtype = codec.ALL_DTYPES[first.dtype]
        out = torch.empty(first.sides, len(layers), end - start, self.total_heads, first.head_dim, dtype=dtype)
        reads = []
        for w in self.readers:
            mine = range(max(layers.start, w.layer_start), min(layers.stop, w.holds.stop))
            if not mine:
                continue
            extra: dict[str, Any] = {"layers": [mine.start - w.layer_start, mine.stop - w.layer_start]}
            if after is not None:
                extra["after"] = [after[0] - w.layer_start, after[1]]
            for a, b in kv_chunks(start, end, w.slice_tokens(len(mine))):

                def empty(staged: torch.Tensor, w: WorkerInfo = w, a: int = a, b: int = b, mine: range = mine) -> None:
                    at = w.split.index(a, b, start)
                    heads = slice(w.head_start, w.head_start + w.heads)
                    out[:, mine.start - layers.start : mine.stop - layers.start, at, heads] = staged

                header = {**self._header("read", blocks, w.block_size, a, b, w.head_dim), **extra}
                reads.append(self._slice(w, header, empty=empty))
        await asyncio.gather(*reads)
        header_out = codec.KVHeader(
            num_layers=self.num_layers,
            layer_start=layers.start,
            layer_end=layers.stop,
            kv_heads=self.total_heads,
            head_dim=first.head_dim,
            dtype=first.dtype,
            page_size=first.block_size,
            token_start=start,
            token_end=end,
            block_size=HASH_BLOCK,
            block_hashes=block_hashes(tokens[:end], HASH_BLOCK),
            latent=first.latent,
            scales=list(self.scales[2 * layers.start : 2 * layers.stop]),
        )
        return codec.KVBlob(header_out, out[0], out[0][..., :0] if first.latent else out[1])

    def check_import(
        self, blob: codec.KVBlob, prompt: PrefixHashes | list[int], computed: int, prompt_len: int
    ) -> None:
        first = self.ranks[0]
        raw = first.dtype if first.dtype in codec.RAW_DTYPES else None
        cache = continuation.CacheForm(first.latent, raw, self.scales)
        why = continuation.check_continuation(
            blob.header, (self.num_layers, self.total_heads, first.head_dim), prompt, computed, prompt_len, cache
        )
        if why:
            raise RequestError(why)
